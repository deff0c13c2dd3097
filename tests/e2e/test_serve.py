"""`make run` end to end, started and stopped as a user does, three times in one var dir:

1. `make run`; a job runs on a demo node; SIGTERM to the whole group while busy -> no process left.
2. `make run` again: the same token works, the demo nodes are ONLINE with fresh heartbeats, a T4 job
   runs on an on-prem T4 node and sees exactly its GPUs; an L4 job (only the simulated cloud has L4)
   runs on a cloud-sim instance; then `serve` is SIGKILLed, and its agents outlive it.
3. `make run` again: it stops the previous run's demo agents, keeps the cloud-sim instance whose
   record is live (its job runs on, once); SIGTERM to make alone stops serve too, and no process
   of any run is left.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import urllib.error
import urllib.request
from datetime import datetime

import pytest

from .service import (Service, backends, call, commands_with, free_port, kill_leftovers, processes_of, shared_tmp_dir,
                      wait_for)

ACME_DEMO_NODES = {"acme-a100-0", "acme-a100-1", "acme-t4-0", "acme-t4-1"}


def jobs_url(svc: Service) -> str:
    return f"{svc.base}/api/v1/jobs/"


def job(svc: Service, token: str, job_id: int) -> dict:
    return call(f"{jobs_url(svc)}{job_id}/", token)


def events(svc: Service, token: str, job_id: int, code: str) -> list[dict]:
    return [e for e in call(f"{jobs_url(svc)}{job_id}/events/", token)["results"] if e["reason_code"] == code]


def anonymous_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def demo_nodes_online(svc: Service, token: str) -> None:
    """Every acme demo node ONLINE with a heartbeat from this run's agents."""
    def fresh() -> set[str]:
        nodes = call(f"{svc.base}/api/v1/nodes/", token)["results"]
        return {n["name"] for n in nodes if n["state"] == "ONLINE" and n["last_heartbeat_at"]
                and datetime.fromisoformat(n["last_heartbeat_at"].replace("Z", "+00:00")).timestamp() > svc.started_at}

    wait_for(lambda: fresh() >= ACME_DEMO_NODES, 120, "the demo nodes to heartbeat")


def wait_state(svc: Service, token: str, job_id: int, states: set[str], timeout: float = 120) -> dict:
    return wait_for(lambda: (j := job(svc, token, job_id))["state"] in states and j, timeout,
                    f"job {job_id} to reach {sorted(states)}")


@pytest.mark.slow
def test_make_run_twice_and_after_a_sigkill_gives_the_same_working_demo(tmp_path):
    """The embedded defaults as on a clean clone, or PostgreSQL and Redis when the suite has them."""
    var_dir = tmp_path / "var"
    with backends(var_dir) as env:
        _make_run_three_times(var_dir, env)


def _make_run_three_times(var_dir, env) -> None:
    port = free_port()
    marker = f"wz-e2e-{os.getpid()}-{port}"  # in every job's command line: found even without our env
    services: list[Service] = []
    cleanups = []
    try:
        # 1. First run, stopped with SIGTERM while a job runs and more are queued.
        first = Service(var_dir, port, env).start()
        services.append(first)
        token = first.token("acme")
        demo_nodes_online(first, token)
        # Off the API, an anonymous caller's 404 is the product's small page, not Django's debug page
        # (which lists every URL pattern of the service).
        status, body = anonymous_get(f"{first.base}/console/no-such-page/")
        assert status == 404 and len(body) < 2000 and b"URLconf" not in body, body[:300]
        long = call(jobs_url(first), token, {"name": "long", "resources": {"gpus": 1, "gpu_models": ["T4"]},
                                             "command": ["/bin/sh", "-c", f"sleep 600; : {marker}"]})
        wait_state(first, token, long["id"], {"RUNNING"})
        for i in range(3):
            call(jobs_url(first), token, {"name": f"queued-{i}", "resources": {"gpus": 1},
                                          "command": ["/bin/sh", "-c", f"sleep 600; : {marker}"]})
        first.stop(signal.SIGTERM)
        assert not processes_of(var_dir, marker), "SIGTERM stopped every process of the first run"

        # 2. Second run: the same demo, working.
        second = Service(var_dir, port, env).start()
        services.append(second)
        assert second.token("acme") == token, "the demo token survives a restart"
        assert "7 demo node agents started" in second.log()
        demo_nodes_online(second, token)
        # The first run's jobs were stopped with it and are placed again now; a T4 job submitted in
        # the same cycle would be weighed together with them (and a 4xT4 cloud instance can win).
        wait_for(lambda: not call(f"{jobs_url(second)}?state=PENDING", token)["results"], 120,
                 "the first run's jobs to be placed again")
        out_dir = shared_tmp_dir()  # the job runs as an unprivileged user: it cannot write to tmp_path
        cleanups.append(lambda: shutil.rmtree(out_dir, ignore_errors=True))
        out_file = out_dir / "cuda-visible-devices.txt"
        t4 = call(jobs_url(second), token, {
            "name": "t4", "resources": {"gpus": 2, "gpu_models": ["T4"]},
            "command": ["/bin/sh", "-c", f'printf %s "$CUDA_VISIBLE_DEVICES" > {out_file}']})
        final = wait_state(second, token, t4["id"], {"SUCCEEDED", "FAILED"})
        assert final["state"] == "SUCCEEDED", call(f"{jobs_url(second)}{t4['id']}/events/", token)
        placed = events(second, token, t4["id"], "PLACED")
        assert len(placed) == 1 and placed[0]["message"].startswith("Placed on acme-t4-"), placed
        gpus = placed[0]["data"]["placements"][0]["gpus"]
        assert out_file.read_text() == ",".join(map(str, gpus)), "the job saw exactly its GPUs"

        l4 = call(jobs_url(second), token, {"name": "l4", "resources": {"gpus": 1, "gpu_models": ["L4"]},
                                            "command": ["/bin/sh", "-c", f"sleep 600; : {marker}-l4"]})
        wait_state(second, token, l4["id"], {"RUNNING"})
        os.kill(second.serve_pid(), signal.SIGKILL)
        second.process.wait(timeout=60)
        assert processes_of(var_dir), "agents outlive a SIGKILLed serve: the next run must deal with them"

        # 3. Third run: the leftovers are stopped or adopted; the job on the adopted instance runs on, once.
        third = Service(var_dir, port, env).start()
        services.append(third)
        log = third.log()
        assert log.count("left by a previous run") == 7, log
        kept = [int(n) for n in re.findall(r"(\d+) running instance\(s\) kept", log)]
        assert kept and kept[0] >= 1, log
        demo_nodes_online(third, token)
        assert job(third, token, l4["id"])["state"] == "RUNNING"
        assert len(events(third, token, l4["id"], "PLACED")) == 1, "not placed again"
        copies = [argv for argv in commands_with(f"{marker}-l4") if argv[0] == "/bin/sh"]
        assert len(copies) == 1, f"exactly one copy of the job runs: {copies}"
        third.stop(signal.SIGTERM, group=False)  # to make alone: it does not forward it, serve must notice
        wait_for(lambda: not processes_of(var_dir, marker), 90, "every process of every run to stop")
        assert "SIGTERM received: stopping" in third.log()
    finally:
        for svc in services:
            if svc.process is not None and svc.process.poll() is None:
                svc.stop(signal.SIGTERM)
        kill_leftovers(var_dir, marker)
        for cleanup in cleanups:
            cleanup()
