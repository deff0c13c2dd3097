"""A two-node job end to end, as a user meets it: `make run`, two real node agents of a pool with a
fast fabric (the demo's on-prem nodes have none), the HTTP API, and examples/gang_rendezvous.py
finding its peer over TCP on loopback through MASTER_ADDR/MASTER_PORT/WHALEZEN_NODE_RANK.

1. Both ranks check in with each other and exit 0: the job SUCCEEDS.
2. Rank 1 reaches rank 0, then exits 3: the job FAILS, its events name rank 1, and rank 0's process
   (which would wait for rank 1 until its 600 s timeout) is stopped by its agent.
One agent advertises its address, the other is known by the address its registration came from;
both are 127.0.0.1 here.
3. A Kubernetes Pod manifest with an image runs in a real podman container on one of those nodes
   (tests/podman.py: a busybox image built here; the agents get its CONTAINERS_CONF).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.podman import find_podman, podman_or_skip

from .service import ROOT, Service, backends, call, commands_with, free_port, kill_leftovers, shared_tmp_dir, wait_for
from .test_serve import wait_state

pytestmark = pytest.mark.slow
NODES = ("gang-node-0", "gang-node-1")
RENDEZVOUS = ROOT / "examples" / "gang_rendezvous.py"


@pytest.fixture(scope="module")
def served():
    """`make run`, and two agents with one fake L4 each in a pool `gangs` labelled fabric=infiniband."""
    var_dir = shared_tmp_dir() / "var"
    podman, _ = find_podman()
    podman_env = podman.env if podman else {}  # no podman here: the image test skips, the others run
    with backends(var_dir, **podman_env) as env:
        service = Service(var_dir, free_port(), env)
        agents: list[subprocess.Popen] = []
        try:
            service.start()
            join = subprocess.run([sys.executable, "manage.py", "issue_join_token", "--tenant", "acme", "--pool",
                                   "gangs", "--create"], cwd=ROOT, env=service.env, check=True,
                                  capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[-1]
            token_file = var_dir / "gangs-join-token"
            token_file.write_text(join)
            for i, name in enumerate(NODES):
                agents.append(gang_agent(var_dir, name, service.base, token_file,
                                         ["--advertise-address", "127.0.0.1"] if i == 0 else [], podman_env))
            token = service.token("acme")
            wait_for(lambda: {n["name"] for n in call(f"{service.base}/api/v1/nodes/?page_size=200", token)["results"]
                              if n["state"] == "ONLINE"} >= set(NODES), 60, "the gang nodes to register")
            yield service, var_dir
        finally:
            for agent in agents:
                agent.terminate()
            for agent in agents:
                try:
                    agent.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    agent.kill()
            if service.process is not None and service.process.poll() is None:
                service.stop(signal.SIGTERM)
            kill_leftovers(var_dir, "gang_rendezvous.py")


def gang_agent(var_dir: Path, name: str, server: str, token_file: Path, extra: list[str],
               extra_env: dict[str, str]) -> subprocess.Popen:
    state = var_dir / "gang-agents" / name
    state.parent.mkdir(parents=True, exist_ok=True)
    log = (var_dir / f"{name}.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL", "DJANGO"))}
    env.update(extra_env)
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "--server", server, "--join-token-file", str(token_file), "--name", name,
         "--fake-gpus", "1xL4", "--label", "fabric=infiniband", "--state-dir", str(state),
         "--work-dir", str(state.parent / f"{name}-jobs"), "--heartbeat-seconds", "1", "--stop-grace-seconds", "2",
         *extra],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def gang_spec(name: str, *args: str) -> dict:
    return {"name": name, "resources": {"gpus": 1, "nodes": 2, "gpu_models": ["L4"]},
            "placement": {"providers": ["onprem"]},
            "command": ["/usr/bin/python3", str(RENDEZVOUS), "--timeout", "600", *args]}


def events(service: Service, token: str, job_id: int) -> list[dict]:
    return call(f"{service.base}/api/v1/jobs/{job_id}/events/?page_size=200", token)["results"]


def part_logs(service: Service, token: str, var_dir: Path, job_id: int) -> dict[str, str]:
    """node name -> the job's output there (<work dir>/<allocation id>/job.log), for each part its
    agent reported started (a finished job lists no allocations any more; its events name them)."""
    logs = {}
    for event in events(service, token, job_id):
        if event["reason_code"] == "AGENT_RUNNING" and event.get("data", {}).get("allocation"):
            node, allocation = event["data"]["node"], event["data"]["allocation"]
            found = list(var_dir.glob(f"gang-agents/{node}-jobs/{allocation}/job.log"))
            logs[node] = found[0].read_text(errors="replace") if found else ""
    return logs


def test_two_ranks_find_each_other_and_the_job_succeeds(served):
    service, var_dir = served
    token = service.token("acme")
    job = call(f"{service.base}/api/v1/jobs/", token, gang_spec("rendezvous"))
    done = wait_state(service, token, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=60)
    logs = part_logs(service, token, var_dir, job["id"])
    assert done["state"] == "SUCCEEDED", (done, logs)
    assert set(logs) == set(NODES)  # one part on each node
    text = "\n".join(logs.values())
    assert "rank 0: heard from rank 1" in text and "rank 0: all 2 ranks checked in" in text, logs
    assert "rank 1: heard 'rank 0'" in text, logs
    master = 10000 + done["id"] % 20000  # broker/agents/gang.py: the job's MASTER_PORT
    assert f"master 127.0.0.1:{master}" in text, logs


def test_a_failing_rank_fails_the_job_and_stops_the_other(served):
    service, var_dir = served
    token = service.token("acme")
    tag = f"gang-fail-{uuid.uuid4().hex[:8]}"  # in rank 0's command line: how its process is found
    job = call(f"{service.base}/api/v1/jobs/", token, gang_spec("rank-fails", "--fail-rank", "1", "--tag", tag))
    done = wait_state(service, token, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=60)
    logs = part_logs(service, token, var_dir, job["id"])
    assert done["state"] == "FAILED", (done, logs)
    (failed,) = [e for e in events(service, token, job["id"]) if e["reason_code"] == "JOB_FAILED"]
    assert failed["message"].startswith("rank 1 of 2 on gang-node-") and "exited with code 3" in failed["message"]
    # Rank 0 was running (rank 1 reached it first) and is stopped, not left waiting for rank 1.
    wait_for(lambda: not commands_with(tag), 30, "rank 0's process to be stopped")
    text = "\n".join(logs.values())
    assert "rank 1: reached rank 0" in text and "all 2 ranks checked in" not in text, logs


CHECK_SCRIPT = """\
import os, pathlib
rank, nodes = os.environ["SKYPILOT_NODE_RANK"], os.environ["SKYPILOT_NUM_NODES"]
assert nodes == "2" and len(os.environ["SKYPILOT_NODE_IPS"].splitlines()) == 2, dict(os.environ)
print(f"rank {rank} in {os.getcwd()}: {pathlib.Path('data.txt').read_text().strip()}")
"""


def test_a_skypilot_task_with_a_local_workdir_submitted_by_the_cli_runs_in_it_on_every_node(served, tmp_path):
    """The user's folder goes up with `whalezen submit`; each node's process fetches it before setup,
    and setup and run run inside it with SkyPilot's variables set."""
    service, var_dir = served
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "check.py").write_text(CHECK_SCRIPT)
    (tmp_path / "code" / "data.txt").write_text("from the workdir\n")
    (tmp_path / "task.yaml").write_text(
        "name: workdir-task\nnum_nodes: 2\nresources: {accelerators: L4:1, infra: onprem}\n"
        "workdir: ./code\nsetup: test -f check.py\nrun: /usr/bin/python3 check.py\n")
    env = {**os.environ, "WHALEZEN_URL": service.base, "WHALEZEN_TOKEN": service.token("acme"),
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    cli = Path(sys.executable).with_name("whalezen")
    done = subprocess.run([str(cli), "submit", "task.yaml"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.strip())
    token = service.token("acme")
    finished = wait_state(service, token, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=90)
    logs = part_logs(service, token, var_dir, job_id)
    assert finished["state"] == "SUCCEEDED", (finished, logs)
    text = "\n".join(logs.values())
    assert "rank 0 in " in text and "rank 1 in " in text and "sky_workdir: from the workdir" in text, logs
    assert finished["spec"]["files"][0]["source"].startswith("upload:")


def test_a_kubernetes_pod_with_an_image_runs_in_a_real_container(served):
    podman = podman_or_skip()
    service, var_dir = served
    token = service.token("acme")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "in-a-container"},
           "spec": {"restartPolicy": "Never", "nodeSelector": {"fabric": "infiniband"},
                    "containers": [{"name": "main", "image": podman.image, "command": ["/bin/sh", "-c"],
                                    "args": ["echo GPUs $CUDA_VISIBLE_DEVICES uid $(id -u) on $(ls / | tr '\\n' ' ')"],
                                    "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    job = call(f"{service.base}/api/v1/jobs/", token, pod)
    assert job["spec"]["image"] == podman.image
    done = wait_state(service, token, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=90)
    logs = part_logs(service, token, var_dir, job["id"])
    assert done["state"] == "SUCCEEDED", (done, logs)
    ((node, text),) = logs.items()
    assert node in NODES and "GPUs 0 uid " in text, logs
    root = text.split(" on ", 1)[1].split()
    assert "bin" in root and "usr" not in root, logs  # the image's filesystem, not the host's
