"""bench/service.py (issue 12's whole-service benchmark): a --quick run gives the promised JSON shape, and
each repetition of the cycle starts from the state the seeding left. No timing is asserted."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import service

ROOT = Path(__file__).resolve().parents[2]


def write_nodes(tmp: Path, count: int = 6) -> Path:
    path = tmp / "nodes.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        for i in range(count):
            w.writerow([f"node-{i}", 64000, 262144, [8, 2, 4][i % 3], ["G2", "T4", "V100M32"][i % 3]])
    return path


def test_every_alibaba_model_maps_to_a_catalogue_model():
    from broker.inventory.gpu_catalog import DEFAULT_GPU_MODELS

    names = {m[0] for m in DEFAULT_GPU_MODELS}
    with open(service.NODES_CSV, newline="") as f:
        models = {r["model"] for r in csv.DictReader(f)} if service.NODES_CSV.exists() else {"G2", "T4"}
    assert models <= set(service.MODEL_MAP)
    assert set(service.MODEL_MAP.values()) <= names


def test_pod_spec_asks_for_a_share_or_whole_gpus(tmp_path):
    from scheduling.sim.cluster import TaskSpec

    share = service.pod_spec(0, TaskSpec("p", 6000, 12288, 1, 460, None), 1.0)
    whole = service.pod_spec(1, TaskSpec("q", 8000, 0, 2, 1000, None), 2.0)
    assert share["resources"] == {"cpu": 6.0, "gpu_fraction": 0.46, "memory_gb": 12.0}
    assert whole["resources"] == {"cpu": 8.0, "gpus": 2}  # no memory asked when the pod lists none


@pytest.mark.django_db
def test_a_reset_brings_back_the_seeded_state_so_every_repetition_places_the_same(tmp_path):
    from broker.jobs.models import Allocation, Job, JobEvent
    from broker.jobs.states import JobState

    seeded = service.seed_cluster(write_nodes(tmp_path))
    service.submit_jobs(seeded, service.sample_pods(24, seed=3), 0)
    events = JobEvent.objects.count()
    baseline = service.Baseline()
    placed = []
    for _ in range(2):
        baseline.reset()
        _, phases, source, outcome = service._timed_cycle(seeded["teams"][0])
        assert outcome.placed and Allocation.objects.exists()
        assert set(phases) == set(service.PHASES) and source
        placed.append(sorted(outcome.placed))
    assert placed[0] == placed[1]
    baseline.reset()
    assert not Allocation.objects.exists() and JobEvent.objects.count() == events
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}


def test_quick_run_prints_issue_12s_json_shape(tmp_path):
    nodes = write_nodes(tmp_path)
    done = subprocess.run([sys.executable, "-m", "bench.service", "--quick", "--json", "--db", "sqlite",
                           "--parts", "cycle,reads", "--nodes", str(nodes)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == {"cycle", "submissions", "reads", "agent"}
    fresh = [c for c in result["cycle"] if c["scenario"] == "fresh"]
    full = [c for c in result["cycle"] if c["scenario"] != "fresh"]
    assert [c["pending"] for c in fresh] == [20, 40]
    for c in fresh:
        assert c["db"] == "sqlite" and c["nodes"] == 6 and c["runs"] == 2
        assert c["median_s"] > 0 and c["idle_median_s"] > 0
    for c in result["cycle"]:
        assert set(c["phases"]) == {"snapshot", "solve", "commit", "reasons"}
    # the idle cycle on the full cluster: at most --saturated (10 with --quick) pending, timed 5 times
    assert len(full) == 1 and full[0]["pending"] <= 10 and full[0]["runs"] == 5 and full[0]["idle_median_s"] > 0
    assert {r["page"] for r in result["reads"]} == {"first", "state=FAILED", "page=5"}
    for r in result["reads"]:
        assert r["db"] == "sqlite" and r["jobs"] == 500 and r["errors"] == 0 and r["p99_ms"] > 0


def test_the_services_processes_are_found_by_parentage_whatever_they_call_themselves():
    """gunicorn renames its processes (setproctitle), so the bench finds a server's processes by parentage:
    a grandchild with nothing in its argv or environment to say whose it is is found, this process is not."""
    from bench.procs import process_role, process_tree

    grandchild = "import time; time.sleep(30)"  # no var dir, no marker anywhere in its argv or environment
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time;"
                               f"subprocess.Popen([sys.executable, '-c', {grandchild!r}], env={{}}); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        tree = process_tree([parent.pid])
        while len(tree) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            tree = process_tree([parent.pid])
        assert parent.pid in tree and len(tree) == 2, tree
        assert os.getpid() not in tree
    finally:
        for pid in process_tree([parent.pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=10)
    assert process_role(["gunicorn: worker [broker.wsgi:application]"]) == "web"
    assert process_role(["/venv/bin/python", "-m", "celery", "-A", "broker", "beat"]) == "beat"
    assert process_role(["/venv/bin/python", "-m", "celery", "-A", "broker", "worker"]) == "worker"


def test_cpu_per_request_divides_each_process_roles_cpu_by_the_answers():
    spent = service.cpu_spent({1: ("web", 2.0), 2: ("worker", 1.0)},
                              {1: ("web", 4.0), 2: ("worker", 1.5), 3: ("python", 0.25)})
    assert spent == {"web": 2.0, "worker": 0.5, "python": 0.25}
    out = service.cpu_per_request(spent, 0.5, 500, 10.0)
    assert out["cpu_ms_per_request"] == 5.5 and out["cpu_ms_per_request_by_process"]["web"] == 4.0
    assert out["generator_cpu_ms_per_request"] == 1.0 and out["service_cores"] == 0.28 and out["web_cores"] == 0.2
