"""The service's own reliability parts: /healthz notices stale sweeps, `serve`'s supervisor restarts
and stops real processes, demo nodes stay demo nodes whatever registration does to their labels, and
a restarted serve terminates `local` agents that no record knows."""
from __future__ import annotations

import io
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.core.management import call_command
from django.utils import timezone

from broker.api import health
from broker.inventory.models import Node, Pool, PoolKind
from broker.ops.demo_agents import demo_nodes
from broker.ops.models import PeriodicRun
from broker.ops.services import local_instances_recover, periodic_run_record
from broker.ops.supervisor import Backoff, ChildSpec, Supervisor, stop_leftovers
from broker.tenancy.models import ApiToken
from providers.base import InstanceState, ProvisionRequest
from providers.local.processes import is_alive

SCHEDULE = {"scheduling-sweep": {"task": "scheduler.sweep", "schedule": 5.0},
            "agents-mark-lost": {"task": "agents.mark_lost", "schedule": timedelta(seconds=10)}}


@pytest.fixture
def beat_schedule(settings):
    settings.CELERY_BEAT_SCHEDULE = SCHEDULE


@pytest.fixture
def frozen_clock(monkeypatch):
    """/healthz's clock stopped, so an age it prints is the one the test set (a loaded machine took over
    half a second between setting a run 31 s ago and the request, and the page said 32)."""
    now = timezone.now()
    monkeypatch.setattr(health, "timezone", SimpleNamespace(now=lambda: now))


def started_ago(monkeypatch, seconds: float) -> None:
    monkeypatch.setattr(health, "PROCESS_STARTED_AT", health.timezone.now() - timedelta(seconds=seconds))


def ran_ago(task: str, seconds: float) -> None:
    PeriodicRun.objects.update_or_create(name=task, defaults={
        "last_run_at": health.timezone.now() - timedelta(seconds=seconds)})


# -- /healthz ------------------------------------------------------------------------------------------
def test_a_service_that_just_started_is_healthy_before_any_sweep_ran(client, db, beat_schedule, monkeypatch):
    started_ago(monkeypatch, 2)
    resp = client.get("/healthz")
    assert resp.status_code == 200, resp.json()
    assert resp.json()["checks"]["scheduler"].startswith("starting")


def test_sweeps_that_never_ran_make_healthz_unhealthy_after_three_periods(client, db, beat_schedule, monkeypatch):
    started_ago(monkeypatch, 40)
    body = client.get("/healthz")
    assert body.status_code == 503
    checks = body.json()["checks"]
    assert body.json()["status"] == "error" and checks["database"] == "ok"
    assert checks["scheduler"].startswith("stale: no run") and checks["lost_nodes"].startswith("stale: no run")


def test_a_stale_scheduler_is_named_with_its_age_and_period(client, db, beat_schedule, monkeypatch, frozen_clock):
    started_ago(monkeypatch, 3600)
    ran_ago("scheduler.sweep", 47)
    ran_ago("agents.mark_lost", 4)
    resp = client.get("/healthz")
    assert resp.status_code == 503
    assert resp.json()["checks"] == {"database": "ok", "scheduler": "stale: last run 47 s ago (period 5 s)",
                                     "lost_nodes": "ok: last run 4 s ago (period 10 s)"}


def test_a_stale_lost_node_sweep_alone_is_unhealthy(client, db, beat_schedule, monkeypatch, frozen_clock):
    started_ago(monkeypatch, 3600)
    ran_ago("scheduler.sweep", 1)
    ran_ago("agents.mark_lost", 31)
    resp = client.get("/healthz")
    assert resp.status_code == 503 and resp.json()["checks"]["lost_nodes"].startswith("stale: last run 31 s ago")
    assert resp.json()["checks"]["scheduler"].startswith("ok")


def test_an_old_record_from_before_a_restart_gets_the_startup_grace(client, db, beat_schedule, monkeypatch):
    started_ago(monkeypatch, 3)
    ran_ago("scheduler.sweep", 86400)
    ran_ago("agents.mark_lost", 86400)
    assert client.get("/healthz").status_code == 200


def test_the_real_periodic_tasks_record_their_runs_and_healthz_is_cheap(client, db, beat_schedule, monkeypatch,
                                                                       django_assert_max_num_queries):
    from broker.agents.tasks import mark_lost_nodes
    from broker.scheduler.tasks import scheduling_sweep

    started_ago(monkeypatch, 3600)
    assert client.get("/healthz").status_code == 503
    scheduling_sweep()
    mark_lost_nodes()
    with django_assert_max_num_queries(1):
        resp = client.get("/healthz")
    assert resp.status_code == 200 and resp.json()["status"] == "ok", resp.json()
    assert set(PeriodicRun.objects.values_list("name", flat=True)) == {"scheduler.sweep", "agents.mark_lost"}


def test_recording_a_run_twice_keeps_one_row(db):
    periodic_run_record(name="scheduler.sweep")
    periodic_run_record(name="scheduler.sweep")
    assert PeriodicRun.objects.filter(name="scheduler.sweep").count() == 1


# -- seed_demo: a durable demo marker, the same tokens -----------------------------------------------
def test_demo_nodes_survive_registration_replacing_their_labels_and_tokens_survive_a_reseed(db, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    first = io.StringIO()
    call_command("seed_demo", stdout=first)
    Node.objects.update(labels={"zone": "a"})  # what an agent's registration may leave: its own labels only
    second = io.StringIO()
    call_command("seed_demo", stdout=second)
    pool = Pool.objects.get(tenant__slug="acme", kind=PoolKind.ONPREM)
    assert demo_nodes(pool) == {"acme-a100-0": "8xA100-80GB-SXM", "acme-a100-1": "8xA100-80GB-SXM",
                                "acme-t4-0": "4xT4", "acme-t4-1": "4xT4"}
    assert first.getvalue() == second.getvalue(), "the same tokens are printed again"
    assert oct((tmp_path / "demo-tokens.json").stat().st_mode & 0o777) == "0o600"

    ApiToken.objects.filter(tenant__slug="acme", name="demo").update(revoked_at=timezone.now())
    third = io.StringIO()
    call_command("seed_demo", stdout=third)
    acme = [line for line in third.getvalue().splitlines() if line.startswith("TOKEN acme ")]
    assert acme and acme[0] not in first.getvalue(), "a revoked demo token is replaced, not printed again"
    assert ApiToken.objects.filter(tenant__slug="acme", name="demo").count() == 1


# -- the supervisor, with real processes ----------------------------------------------------------------
def _spec(tmp_path: Path, name: str, script: str) -> ChildSpec:
    return ChildSpec(name, ["/bin/sh", "-c", script], dict(os.environ), tmp_path / f"{name}.log")


def _poll_until(supervisor: Supervisor, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.poll()
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_child_that_dies_is_restarted_with_growing_backoff_and_logged(tmp_path):
    lines: list[str] = []
    supervisor = Supervisor([_spec(tmp_path, "beat", "sleep 60")], log=lines.append,
                            backoff=Backoff(initial_s=0.3, max_s=0.6, reset_after_s=60))
    supervisor.start()
    child = supervisor.children["beat"]
    try:
        for expected_delay in (0.3, 0.6, 0.6):
            pid = child.process.pid
            os.kill(pid, signal.SIGKILL)
            _poll_until(supervisor, lambda: child.process is not None and child.process.pid != pid, 10)
            assert any(f"beat (pid {pid}) killed by SIGKILL" in line and f"restarting in {expected_delay:g} s" in line
                       for line in lines), lines
        assert child.restarts == 3 and child.process.poll() is None
    finally:
        supervisor.stop(grace_s=2)


def test_a_child_that_needs_another_childs_file_starts_once_it_is_there_without_failing_first(tmp_path):
    # The demo's bridge needs the kubeconfig its cluster writes (a port known only once the cluster runs).
    kubeconfig = tmp_path / "kubeconfig"
    cluster = _spec(tmp_path, "cluster", f"sleep 0.5; echo port > {kubeconfig}; sleep 60")
    bridge = ChildSpec("bridge", ["/bin/sh", "-c", f"cat {kubeconfig} && sleep 60"], dict(os.environ),
                       tmp_path / "bridge.log", after_file=kubeconfig)
    lines: list[str] = []
    supervisor = Supervisor([cluster, bridge], log=lines.append, backoff=Backoff(initial_s=0.1))
    supervisor.start()
    try:
        waiting = supervisor.children["bridge"]
        assert waiting.process is None and f"bridge starts once {kubeconfig} exists" in lines
        _poll_until(supervisor, lambda: waiting.process is not None, 10)
        time.sleep(0.3)
        supervisor.poll()
        assert waiting.process.poll() is None and waiting.restarts == 0
        assert not [line for line in lines if "exited" in line or "restart" in line], lines
    finally:
        supervisor.stop(grace_s=2)
    assert (tmp_path / "bridge.log").read_text().startswith("port")


def test_a_background_child_starts_at_its_niceness_and_keeps_it_when_restarted(tmp_path):
    # serve's worker runs below the web server (WORKER_NICENESS): a restarted worker must not come back at 0.
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    worker = ChildSpec("worker", ["/bin/sh", "-c", "sleep 60"], dict(os.environ), tmp_path / "worker.log", niceness=5)
    web = _spec(tmp_path, "web", "sleep 60")
    supervisor = Supervisor([worker, web], log=lambda line: None, backoff=Backoff(initial_s=0.1))
    supervisor.start()
    child = supervisor.children["worker"]
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.process.pid) == min(19, mine + 5)
        assert os.getpriority(os.PRIO_PROCESS, supervisor.children["web"].process.pid) == mine
        pid = child.process.pid
        os.kill(pid, signal.SIGKILL)
        _poll_until(supervisor, lambda: child.process is not None and child.process.pid != pid, 10)
        assert os.getpriority(os.PRIO_PROCESS, child.process.pid) == min(19, mine + 5)
    finally:
        supervisor.stop(grace_s=2)


def test_serve_runs_the_worker_below_the_web_server(tmp_path):
    from broker.ops.management.commands.serve import Command

    specs = {spec.name: spec for spec in Command()._specs(
        {"host": "127.0.0.1", "port": 8000, "no_worker": False, "no_agents": True}, "http://127.0.0.1:8000", tmp_path)}
    assert specs["web"].niceness == 0 and specs["beat"].niceness == 0
    assert specs["worker"].niceness > 0


def test_stop_reaches_the_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    # A child that ignores SIGTERM and has a grandchild in its group: both must be gone after stop().
    stubborn = _spec(tmp_path, "worker", "trap '' TERM; sleep 300 & sleep 301; wait")
    polite = _spec(tmp_path, "web", "sleep 300")
    state = tmp_path / "children.json"
    lines: list[str] = []
    supervisor = Supervisor([stubborn, polite], log=lines.append, state_file=state)
    supervisor.start()
    pgid = supervisor.children["worker"].process.pid
    time.sleep(0.3)
    started = time.monotonic()
    supervisor.stop(grace_s=1)
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 5  # SIGKILLed members may linger a moment as zombies until init reaps them
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_members(pgid), "no process of its group is left"
    assert any("worker stopped (SIGKILL after 1 s)" in line for line in lines), lines
    assert state.read_text() == "[]"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def test_leftovers_of_a_killed_serve_are_stopped_by_the_next_one(tmp_path):
    """The state file names the previous children; a fresh supervisor's start stops those still alive."""
    import subprocess

    orphan = subprocess.Popen(["sleep", "300"], process_group=0)
    state = tmp_path / "children.json"
    from providers.local.processes import process_start_time

    state.write_text(f'[{{"name": "worker", "pid": {orphan.pid}, "start": {process_start_time(orphan.pid)}}}]')
    lines: list[str] = []
    assert stop_leftovers(state, log=lines.append) == 1
    assert orphan.wait(timeout=10) == -signal.SIGTERM
    assert not state.exists() and "left by a previous serve" in lines[0]


# -- a restarted serve and the `local` provider's leftovers -------------------------------------------
def test_serve_start_terminates_local_agents_no_record_knows_and_keeps_recorded_ones(acme, settings, tmp_path):
    from broker.inventory.models import CloudInstance, InstanceState as RowState
    from broker.provisioning.factory import provider_for_pool

    settings.VAR_DIR = tmp_path
    pool = Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim",
                               max_instances=2)
    provider = provider_for_pool(pool)
    # Stand-ins for the agents a SIGKILLed serve left: long-lived processes in the provider's books.
    provider.command_factory = lambda request, name, shape: [sys.executable, "-c", "import time; time.sleep(300)"]
    shape = next(iter(provider.shapes))

    def launch(key: str):
        return provider.provision(ProvisionRequest(
            request_key=key, allocation_id=key, attempt=1, region=provider.region, zone=provider.zones[0],
            instance_type=shape, agent_server_url="http://127.0.0.1:9", agent_join_token="wzi_x", node_name=key,
            extra_tags=(("whalezen:pool", str(pool.pk)),)))

    orphan, recorded = launch("orphan-key"), launch("recorded-key")
    CloudInstance.objects.create(tenant=acme.tenant, pool=pool, request_key="recorded-key",
                                 provider_id=recorded.ref.instance_id, instance_type=shape,
                                 zone=provider.zones[0], state=RowState.RUNNING, node_name="recorded-key")
    said: list[str] = []
    try:
        local_instances_recover(say=said.append)
        assert provider.describe(orphan.ref).state is InstanceState.TERMINATED
        assert provider.describe(recorded.ref).state is InstanceState.RUNNING
        assert said and "1 orphan(s) terminated" in said[0] and "1 running instance(s) kept" in said[0]
    finally:
        for ref in (orphan.ref, recorded.ref):
            provider.terminate(ref)
    assert not any(is_alive(r.pid, r.pid_start) for r in provider._records())
