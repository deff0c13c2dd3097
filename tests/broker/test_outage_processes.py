"""Issue 8 item 6 with real processes: the broker (web server + Celery worker with beat) is killed
for longer than the heartbeat-loss limit while a real agent runs a job, then restarted. The node is
never marked LOST, the job is started exactly once and finishes SUCCEEDED.

PostgreSQL and Redis like tests/broker/test_worker_faults.py (whose helpers this reuses); the limits
are made short through the environment so the test takes about a minute.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from django.db import connection

from broker.inventory.models import Node, NodeState
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import Allocation, Job, JobEvent
from broker.jobs.states import JobState
from broker.ops.web import web_command

from .test_api_tenancy import submit
from .test_worker_faults import ROOT, PrivateRedis, free_port, this_test_database_url, wait_until, with_real_services

LOST_AFTER_S = 4
RETRY_CAP_S = 10
OUTAGE_S = 12  # three times the LOST limit
JOB_SECONDS = 40  # long enough to outlive the outage and the whole grace after it


def start_group(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A process in its own process group, so killing the group leaves nothing of it behind."""
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any status: the web server is up
    except OSError:
        return False


class Broker:
    """The web server and a worker with its beat, as `serve` runs them (own process groups)."""

    def __init__(self, env: dict, tmp_path: Path, port: int):
        self.env, self.tmp_path, self.port = env, tmp_path, port
        self.processes: list[subprocess.Popen] = []

    def start(self, round_: int) -> None:
        web = web_command(host="127.0.0.1", port=self.port)
        worker = [sys.executable, "-m", "celery", "-A", "broker", "worker", "--pool", "solo", "-n",
                  f"outage{round_}@%h", "--loglevel", "INFO", "-B", "-s", str(self.tmp_path / f"beat-{round_}")]
        self.processes = [start_group(web, self.env, self.tmp_path / "web.log"),
                          start_group(worker, self.env, self.tmp_path / "worker.log")]
        wait_until(lambda: answers(f"http://127.0.0.1:{self.port}/healthz"), 60, "the web server to answer")

    def kill(self) -> None:
        for process in self.processes:
            kill_group(process)


@with_real_services
def test_a_broker_outage_longer_than_the_lost_limit_restarts_no_job(acme, tmp_path):
    for node in acme.nodes:  # the seeded simulated nodes have no agent: only the real agent's node counts
        Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE)
    redis = PrivateRedis(tmp_path)
    redis.start()
    port = free_port()
    env = {**os.environ, "DATABASE_URL": this_test_database_url(), "REDIS_URL": redis.url,
           "WHALEZEN_QUEUE": f"outage-{os.getpid()}", "WHALEZEN_VAR_DIR": str(tmp_path), "PORT": str(port),
           "WHALEZEN_PUBLIC_URL": f"http://127.0.0.1:{port}", "WHALEZEN_CYCLE_SECONDS": "1",
           "WHALEZEN_AGENT_HEARTBEAT_SECONDS": "1", "WHALEZEN_NODE_LOST_AFTER_SECONDS": str(LOST_AFTER_S),
           "WHALEZEN_LOST_SWEEP_SECONDS": "1", "WHALEZEN_AGENT_RETRY_CAP_SECONDS": str(RETRY_CAP_S)}
    join = tmp_path / "join-token"
    join.write_text(pool_join_token_issue(pool=acme.pool))
    join.chmod(0o600)
    starts = tmp_path / "starts.log"  # every start of the job's process appends its pid here
    job = submit(acme, name="survivor", resources={"gpus": 1}, command=[
        sys.executable, "-c", f"import os, time; open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
                              f"time.sleep({JOB_SECONDS})"])
    broker = Broker(env, tmp_path, port)
    agent = None
    try:
        broker.start(0)
        agent = start_group([sys.executable, "-m", "agent", "--server", f"http://127.0.0.1:{port}",
                             "--fake-gpus", "2xA100-80GB-SXM", "--name", "outage-node",
                             "--state-dir", str(tmp_path / "agent"), "--join-token-file", str(join),
                             "--job-user", "self", "--stop-grace-seconds", "2"], env, tmp_path / "agent.log")
        wait_until(lambda: Job.objects.get(pk=job.pk).state == JobState.RUNNING, 60, "the job to run")
        node = Node.objects.get(name="outage-node")

        broker.kill()  # web server and worker (with beat) SIGKILLed; the agent and its job live on
        time.sleep(OUTAGE_S)
        broker.start(1)
        back = time.monotonic()
        states = set()
        # Watch the node for the whole grace after the return and beyond: it must stay ONLINE.
        while time.monotonic() - back < LOST_AFTER_S + RETRY_CAP_S + 2 * LOST_AFTER_S:
            states.add(Node.objects.get(pk=node.pk).state)
            time.sleep(0.3)
        assert states == {NodeState.ONLINE}
        wait_until(lambda: Job.objects.get(pk=job.pk).state in (JobState.SUCCEEDED, JobState.FAILED), 60,
                   "the job to finish")
    finally:
        if agent is not None:
            kill_group(agent, signal.SIGTERM)
        broker.kill()
        redis.stop()
        connection.close()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert not JobEvent.objects.filter(job=job, reason_code="NODE_LOST").exists()
    assert Allocation.objects.filter(job=job).count() == 1
    assert JobEvent.objects.filter(job=job, kind="agent", reason_code="AGENT_RUNNING").count() == 1
    assert len(starts.read_text().splitlines()) == 1, "the job's process started more than once"
    # An outage shorter than the agents' fence-after (900 s) stops nothing on the agent's side either.
    assert not JobEvent.objects.filter(job=job, data__reason="fenced").exists()
    agent_log = (tmp_path / "agent.log").read_text()
    assert "no call from this agent for 900 s (--fence-after-seconds)" in agent_log  # what it ran with
    assert "cannot run twice" not in agent_log  # and it never fenced


def copy_log_command(log: Path, seconds: int) -> list[str]:
    """A job that notes each start and end of its process (pid, time) in `log`."""
    return [sys.executable, "-c", (
        "import os, signal, sys, time\n"
        f"log = open({str(log)!r}, 'a')\n"
        "def note(what):\n"
        "    log.write(f'{what} {os.getpid()} {time.time()}\\n'); log.flush()\n"
        "def bye(*_):\n"
        "    note('end'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "note('start')\n"
        f"time.sleep({seconds})\n"
        "note('end')\n")]


@with_real_services
def test_a_job_from_a_lost_node_starts_elsewhere_only_after_its_old_copy_stopped(acme, tmp_path):
    """The node's agent freezes (SIGSTOP: alive, unreachable) with its job running: the node is LOST
    and the job placed on a second node, which gets no `start` until the first agent is back, has
    stopped the old copy and said so. The two copies never overlap."""
    for node in acme.nodes:
        Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE)
    redis = PrivateRedis(tmp_path)
    redis.start()
    port = free_port()
    env = {**os.environ, "DATABASE_URL": this_test_database_url(), "REDIS_URL": redis.url,
           "WHALEZEN_QUEUE": f"fence-{os.getpid()}", "WHALEZEN_VAR_DIR": str(tmp_path), "PORT": str(port),
           "WHALEZEN_PUBLIC_URL": f"http://127.0.0.1:{port}", "WHALEZEN_CYCLE_SECONDS": "1",
           "WHALEZEN_AGENT_HEARTBEAT_SECONDS": "1", "WHALEZEN_NODE_LOST_AFTER_SECONDS": str(LOST_AFTER_S),
           "WHALEZEN_LOST_SWEEP_SECONDS": "1", "WHALEZEN_FENCE_WAIT_SECONDS": "120"}
    join = tmp_path / "join-token"
    join.write_text(pool_join_token_issue(pool=acme.pool))
    join.chmod(0o600)
    copies = tmp_path / "copies.log"
    job = submit(acme, name="fenced", resources={"gpus": 1}, command=copy_log_command(copies, 20))
    broker = Broker(env, tmp_path, port)
    agents: dict[str, subprocess.Popen] = {}

    def start_agent(name: str) -> None:
        agents[name] = start_group([sys.executable, "-m", "agent", "--server", f"http://127.0.0.1:{port}",
                                    "--fake-gpus", "1xA100-80GB-SXM", "--name", name,
                                    "--state-dir", str(tmp_path / name), "--join-token-file", str(join),
                                    "--job-user", "self", "--stop-grace-seconds", "2"], env, tmp_path / f"{name}.log")

    try:
        broker.start(0)
        start_agent("first")
        wait_until(lambda: Job.objects.get(pk=job.pk).state == JobState.RUNNING, 60, "the job to run")
        start_agent("second")
        wait_until(lambda: Node.objects.filter(name="second", state=NodeState.ONLINE).exists(), 30,
                   "the second node to register")
        os.kill(agents["first"].pid, signal.SIGSTOP)  # the agent only: its job process runs on
        wait_until(lambda: Node.objects.get(name="first").state == NodeState.LOST, 30, "the first node to be LOST")
        wait_until(lambda: Allocation.objects.filter(job=job, active=True, node__name="second").exists(), 30,
                   "the job to be placed on the second node")
        time.sleep(6)  # the second node's agent polls its assignments every second meanwhile
        assert len(copies.read_text().splitlines()) == 1, "started on the second node while the first copy ran"
        os.kill(agents["first"].pid, signal.SIGCONT)
        wait_until(lambda: Job.objects.get(pk=job.pk).state in (JobState.SUCCEEDED, JobState.FAILED), 90,
                   "the job to finish on the second node")
    finally:
        for process in agents.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
            kill_group(process, signal.SIGTERM)
        broker.kill()
        redis.stop()
        connection.close()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    notes = [line.split() for line in copies.read_text().splitlines()]
    assert [n[0] for n in notes] == ["start", "end", "start", "end"], notes
    first_end, second_start = float(notes[1][2]), float(notes[2][2])
    assert notes[0][1] == notes[1][1] != notes[2][1] and first_end <= second_start
    second = Allocation.objects.get(job=job, node__name="second")
    assert second.agent_report.state == "exited"
