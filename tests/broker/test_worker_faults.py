"""Real Celery workers on Redis and PostgreSQL: one placing a job, then faults: Redis restarted, a worker killed with
SIGKILL, two workers at once. Postgres is the truth and the sweeps re-drive everything, so no job is
lost and no GPU is booked twice."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from broker.jobs.models import AllocationSlice, Job, JobEvent
from broker.jobs.states import JobState

from .conftest import requires_postgres, requires_redis
from .test_api_tenancy import submit
from bench.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


class PrivateRedis:
    """A redis-server of this test's own, so restarting it disturbs nobody else."""

    def __init__(self, workdir: Path):
        self.port, self.workdir, self.process = free_port(), workdir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: _answers(self.port), 20, "redis to answer")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def start_worker(env: dict, tmp_path: Path, name: str, beat: bool) -> subprocess.Popen:
    argv = [sys.executable, "-m", "celery", "-A", "broker", "worker", "--pool", "solo", "-n", f"{name}@%h",
            "--loglevel", "INFO"]
    if beat:
        argv += ["-B", "-s", str(tmp_path / f"beat-{name}")]
    log = open(tmp_path / f"{name}.log", "ab")
    # Its own process group: `-B` runs beat as a child, which must not outlive a killed worker and
    # go on queuing tasks for the rest of the suite.
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    kill_group(process)  # whatever of its group is left (beat, a stuck child)


def placed(job: Job) -> bool:
    job.refresh_from_db()
    return job.state == JobState.PLACED


def this_test_database_url() -> str:
    """The test database (not the configured one): worker processes must see what the test wrote."""
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


needs_real_services = [requires_postgres, requires_redis, pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow,
                       pytest.mark.django_db(transaction=True)]


def with_real_services(test):
    for mark in reversed(needs_real_services):
        test = mark(test)
    return test


@with_real_services
def test_a_real_celery_worker_places_jobs_through_redis(acme, tmp_path):
    """Submit, then let a separate `celery worker -B` process (Redis broker, same Postgres) place the job."""
    job = submit(acme, resources={"gpus": 2})
    env = {**os.environ, "DATABASE_URL": this_test_database_url(), "WHALEZEN_QUEUE": f"test-{os.getpid()}",
           "WHALEZEN_CYCLE_SECONDS": "1", "WHALEZEN_VAR_DIR": str(tmp_path)}
    worker = start_worker(env, tmp_path, "solo", beat=True)
    try:
        wait_until(lambda: placed(job), 60, "the job to be placed")
    finally:
        stop(worker)
        connection.close()


@with_real_services
def test_no_job_is_lost_across_redis_restarts_killed_and_concurrent_workers(acme, tmp_path):
    redis = PrivateRedis(tmp_path)
    redis.start()
    env = {**os.environ, "REDIS_URL": redis.url, "WHALEZEN_QUEUE": f"faults-{os.getpid()}",
           "DATABASE_URL": this_test_database_url(),
           "WHALEZEN_CYCLE_SECONDS": "1", "WHALEZEN_CYCLE_LEASE_SECONDS": "5", "WHALEZEN_VAR_DIR": str(tmp_path)}
    workers: list[subprocess.Popen] = []
    try:
        first = submit(acme, name="before-restart", resources={"gpus": 1})
        workers.append(start_worker(env, tmp_path, "a", beat=True))
        wait_until(lambda: placed(first), 60, "the first job to be placed")

        redis.stop()  # everything queued in Redis is gone with it
        during = submit(acme, name="while-redis-is-down", resources={"gpus": 1})
        time.sleep(2)
        redis.start()
        wait_until(lambda: placed(during), 90, "a job submitted while Redis was down to be placed")

        kill_group(workers[0])  # mid-whatever: no clean shutdown, lease left held
        workers[0].wait(timeout=20)
        after_kill = submit(acme, name="after-kill", resources={"gpus": 1})
        workers.append(start_worker(env, tmp_path, "b", beat=True))
        workers.append(start_worker(env, tmp_path, "c", beat=False))
        wait_until(lambda: placed(after_kill), 90, "a job to be placed after a worker was killed")

        burst = [submit(acme, name=f"burst-{i}", resources={"gpus": 1}) for i in range(10)]
        wait_until(lambda: all(placed(j) for j in burst), 90, "a burst to be placed by two workers")
    finally:
        for worker in workers:
            stop(worker)
        redis.stop()
        connection.close()
    jobs = Job.objects.filter(tenant=acme.tenant)
    assert jobs.count() == 13 and set(jobs.values_list("state", flat=True)) == {JobState.PLACED}
    for job in jobs:
        assert JobEvent.objects.filter(job=job, kind="state", data__to=JobState.PLACED).count() == 1
    held = [(gpu_id, slot) for gpu_id, mask in AllocationSlice.objects.filter(active=True).values_list("gpu_id", "mask")
            for slot in AllocationSlice.slots_of(mask)]
    assert len(held) == len(set(held)) == 13 * 10, "13 whole GPUs, each slot held once"
