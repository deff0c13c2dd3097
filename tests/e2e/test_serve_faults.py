"""`serve` supervises what it starts, with real processes: beat SIGKILLed -> /healthz says the scheduler
is stale while it is down, serve restarts it (and says so) and a job submitted meanwhile is placed;
worker SIGKILLed -> restarted, no job lost, none placed twice; SIGTERM -> no process left.

One service for the whole module (the CI budget is tight), on PostgreSQL and Redis when the suite
has them; no demo agents: placing a job on the seeded nodes is what scheduling means here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from .service import ROOT, Service, backends, call, free_port, health, kill_leftovers, processes_of, wait_for

pytestmark = pytest.mark.slow
PLACED_OR_LATER = {"PLACED", "STARTING", "RUNNING", "SUCCEEDED"}  # on a seeded node, or a cloud-sim one that ran it
RESTART_DELAY_S = 8  # long enough to see /healthz report the stale scheduler (3 cycles of 1 s)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    var_dir = tmp_path_factory.mktemp("serve-faults") / "var"
    # A lease left by a killed worker is taken over at once on the same machine; a short expiry as a backstop.
    with backends(var_dir, WHALEZEN_CYCLE_LEASE_SECONDS="10") as env:
        yield from _service(var_dir, env)


def _service(var_dir, env):
    manage = [sys.executable, "manage.py"]
    subprocess.run(manage + ["migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True, timeout=180)
    seeded = subprocess.run(manage + ["seed_demo"], cwd=ROOT, env=env, check=True, timeout=120,
                            capture_output=True, text=True).stdout
    port = free_port()
    svc = Service(var_dir, port, env, argv=manage + ["serve", "--port", str(port), "--no-agents",
                                                      "--restart-delay", str(RESTART_DELAY_S)])
    svc.start()
    svc.acme = next(line.split()[2] for line in seeded.splitlines() if line.startswith("TOKEN acme "))
    wait_for(lambda: (h := health(svc.base)) and h[0] == 200 and h[1]["checks"]["scheduler"].startswith("ok"),
             90, "the scheduler sweep to run")
    yield svc
    if svc.process.poll() is None:
        svc.stop()
    kill_leftovers(var_dir)


def submit(svc: Service, name: str) -> dict:
    return call(f"{svc.base}/api/v1/jobs/", svc.acme, {"name": name, "resources": {"gpus": 1, "gpu_models": ["T4"]},
                                                     "command": ["/bin/true"]})


def state(svc: Service, job: dict) -> str:
    return call(f"{svc.base}/api/v1/jobs/{job['id']}/", svc.acme)["state"]


def events(svc: Service, job: dict, code: str) -> list[dict]:
    return [e for e in call(f"{svc.base}/api/v1/jobs/{job['id']}/events/", svc.acme)["results"]
            if e["reason_code"] == code]


def test_killed_beat_is_restarted_healthz_says_so_meanwhile_and_scheduling_resumes(service):
    beat = service.children()["beat"]
    os.kill(beat, signal.SIGKILL)
    job = submit(service, "after-beat-kill")
    stale = wait_for(lambda: (h := health(service.base)) and h[0] == 503 and h[1], RESTART_DELAY_S + 5,
                     "/healthz to report the stale scheduler", interval=0.3)
    assert stale["checks"]["scheduler"].startswith("stale: last run"), stale
    # serve notices at once and restarts beat after its delay; the job may be placed before that (its
    # submission enqueues a cycle itself), so wait for the new beat rather than infer it.
    wait_for(lambda: service.children()["beat"] != beat, RESTART_DELAY_S + 30, "serve to start a new beat")
    log = service.log()
    assert f"beat (pid {beat}) killed by SIGKILL" in log and f"restarting in {RESTART_DELAY_S} s" in log
    wait_for(lambda: state(service, job) in PLACED_OR_LATER, 90, "the job submitted while beat was down to be placed")
    wait_for(lambda: (h := health(service.base)) and h[0] == 200, 60, "/healthz to be healthy again")
    assert (service.var_dir / "logs" / "serve.log").read_text().count(f"beat (pid {beat}) killed by SIGKILL") == 1


def test_killed_worker_is_restarted_and_no_job_is_lost_or_placed_twice(service):
    before = [submit(service, f"before-{i}") for i in range(2)]
    wait_for(lambda: all(state(service, j) in PLACED_OR_LATER for j in before), 90, "jobs to be placed")
    worker = service.children()["worker"]
    os.kill(worker, signal.SIGKILL)
    during = [submit(service, f"while-worker-down-{i}") for i in range(3)]
    wait_for(lambda: all(state(service, j) in PLACED_OR_LATER for j in during), 120,
             "jobs submitted while the worker was down to be placed")
    assert f"worker (pid {worker}) killed by SIGKILL" in service.log()
    assert service.children()["worker"] != worker
    for job in before + during:
        assert len(events(service, job, "PLACED")) == 1, f"job {job['name']} placed once"
        started = [e for e in events(service, job, "AGENT_RUNNING") if "started pid" in e["message"]]
        assert len(started) <= 1, f"job {job['name']} started at most once: {started}"


def test_sigterm_stops_every_process_serve_started(service):
    pids = service.children()
    assert service.stop(signal.SIGTERM) == 0, service.log()[-3000:]
    assert not processes_of(service.var_dir), "no web, worker or beat outlives the service"
    assert all(name in service.log() for name in ("beat stopped", "worker stopped", "web stopped")), pids
