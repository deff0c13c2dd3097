"""Local provider: real child processes (a tiny sleeping Python stand-in for the agent, via the
injectable command), state files that survive a restart, and the cloud simulation."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Sequence

import pytest

from providers.base import ErrorKind, InstanceState, ProviderError, ProvisionRequest
from providers.local import CloudSimulation, LocalProvider, LocalShape, agent_command
from providers.local.processes import is_alive
from providers.reconcile import KnownInstance, reconcile
from tests.providers.conftest import BROKER_ID, make_request

# Stands in for `python -m agent ...`: records its argv, its stdin's first line, the token
# variable of its environment and its CPU niceness, then idles until killed.
STAND_IN = ("import json, os, sys, time; open(sys.argv[1], 'w').write(json.dumps("
            "{'argv': sys.argv[2:], 'stdin': sys.stdin.readline(), 'env_token': os.environ.get('WHALEZEN_JOIN_TOKEN'),"
            " 'env': sorted(os.environ), 'nice': os.nice(0)})); time.sleep(300)")


def stand_in(argv_dir: Path):
    real = agent_command(sys.executable, "/agent-state")

    def build(request: ProvisionRequest, name: str, shape: LocalShape, metadata_url: str | None = None) -> Sequence[str]:
        return [sys.executable, "-c", STAND_IN, str(argv_dir / f"{name}.json"),
                *real(request, name, shape, metadata_url=metadata_url)[1:]]

    return build


@pytest.fixture
def make_local(tmp_path: Path):
    made: list[LocalProvider] = []

    def make(**kwargs) -> LocalProvider:
        kwargs.setdefault("command_factory", stand_in(tmp_path))
        provider = LocalProvider(broker_id=BROKER_ID, state_dir=tmp_path / "state", stop_timeout_s=2.0, **kwargs)
        made.append(provider)
        return provider

    yield make
    for provider in made:  # never leave a process behind
        for info in provider.list_owned():
            provider.terminate(info.ref)


def local_request(instance_type: str = "local-8xA100-80GB-SXM", **kwargs) -> ProvisionRequest:
    return make_request(provider="local", instance_type=instance_type, zone="local-a", region="local", **kwargs)


def pid_of(provider: LocalProvider, instance_id: str) -> tuple[int, int | None]:
    record = json.loads((provider.state_dir / "instances" / f"{instance_id}.json").read_text())
    return record["pid"], record["pid_start"]


def wait_for(path: Path) -> str:
    deadline = time.monotonic() + 30  # only stops a broken test; two Python starts on a loaded machine
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return path.read_text()


def test_provision_starts_agent_with_fake_gpus(make_local, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WHALEZEN_JOIN_TOKEN", "a-token-the-broker-process-happens-to-have")
    # The broker's own secrets: an agent passes its environment on to jobs, so it must not get them.
    monkeypatch.setenv("DJANGO_SECRET_KEY", "broker-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    monkeypatch.setenv("WHALEZEN_AGENT_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("CONTAINERS_CONF", "/etc/whalezen/containers.conf")  # how this host's podman runs images
    provider = make_local()
    request = local_request()
    info = provider.provision(request)
    assert info.state is InstanceState.RUNNING and info.request_key == request.request_key
    started = json.loads(wait_for(tmp_path / f"{request.node_name}.json"))
    assert started["argv"][:-1] == [
        "-m", "agent", "--server", "http://broker.test:8000", "--fake-gpus", "8xA100-80GB-SXM",
        "--name", request.node_name, "--join-token", "-", "--state-dir", f"/agent-state/{request.node_name}",
        "--spot-notice", "local", "--metadata-url"]
    # Its own metadata endpoint: loopback only, under a path nobody can guess.
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/[0-9a-f]{48}", started["argv"][-1])
    # On stdin: neither `ps` (argv) nor /proc/<pid>/environ, which a job could read, holds it.
    assert started["stdin"] == "join-secret-123\n"
    assert started["env_token"] is None
    assert {"PATH", "WHALEZEN_AGENT_LOG_LEVEL", "CONTAINERS_CONF"} <= set(started["env"])
    assert not {"DJANGO_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"} & set(started["env"])
    assert is_alive(*pid_of(provider, info.ref.instance_id))


@pytest.mark.parametrize("nice", [None, 0, 3])
def test_simulated_instances_yield_the_cpu_to_the_broker(make_local, tmp_path: Path, nice: int | None) -> None:
    # They run on the broker's machine, which a rented instance does not: by default 10 steps nicer
    # than the broker (at most 19), so a burst of instance starts and their jobs leave it its cores.
    provider = make_local() if nice is None else make_local(nice=nice)
    request = local_request()
    provider.provision(request)
    started = json.loads(wait_for(tmp_path / f"{request.node_name}.json"))
    assert started["nice"] == min(19, os.nice(0) + (10 if nice is None else nice))


def test_same_key_same_process_even_after_restart(make_local) -> None:
    first = make_local()
    request = local_request()
    info = first.provision(request)
    assert first.provision(request).ref == info.ref
    restarted = make_local()  # the broker restarted: a new provider over the same state dir
    assert restarted.provision(request).ref == info.ref
    assert [i.ref for i in restarted.list_owned()] == [info.ref]
    pid = pid_of(restarted, info.ref.instance_id)
    assert restarted.terminate(info.ref).state is InstanceState.TERMINATED
    assert not is_alive(*pid)
    assert restarted.describe(info.ref).state is InstanceState.TERMINATED


def test_launch_latency_reports_pending_first(make_local) -> None:
    now = [1000.0]
    provider = make_local(simulation=CloudSimulation(launch_latency_s=30), clock=lambda: now[0])
    info = provider.provision(local_request("local-4xT4"))
    assert info.state is InstanceState.PENDING
    now[0] += 31
    assert provider.describe(info.ref).state is InstanceState.RUNNING


def test_forced_and_random_capacity_errors(make_local) -> None:
    forced = make_local(simulation=CloudSimulation(forced_capacity_errors=frozenset({("local-a", "local-4xT4")})))
    with pytest.raises(ProviderError) as caught:
        forced.provision(local_request("local-4xT4"))
    assert caught.value.kind is ErrorKind.CAPACITY and caught.value.retry_elsewhere
    assert forced.provision(local_request("local-1xL4")).state is InstanceState.RUNNING

    def outcomes(seed: int) -> list[bool]:
        sim = make_local(simulation=CloudSimulation(capacity_error_probability=0.5, seed=seed))
        return [sim._simulated_capacity_error("local-a", "local-4xT4") for _ in range(32)]

    assert outcomes(7) == outcomes(7)  # seeded: repeatable
    assert True in outcomes(7) and False in outcomes(7)
    assert outcomes(7) != outcomes(8)


def test_spot_interruptions_hit_only_spot_instances(make_local) -> None:
    provider = make_local(simulation=CloudSimulation(spot_interruption_probability=1.0))
    spot = provider.provision(local_request("local-1xL4", spot=True, allocation_id="a-spot"))
    steady = provider.provision(local_request("local-1xL4", allocation_id="a-steady"))
    interrupted = provider.tick()
    assert [i.ref for i in interrupted] == [spot.ref]
    assert provider.describe(spot.ref).state is InstanceState.TERMINATED
    assert provider.describe(spot.ref).state_reason == "spot-interruption"
    assert provider.describe(steady.ref).state is InstanceState.RUNNING


def test_agent_that_exits_is_reported_gone(make_local) -> None:
    provider = make_local(command_factory=lambda request, name, shape: [sys.executable, "-c", "pass"])
    info = provider.provision(local_request("local-1xL4"))
    deadline = time.monotonic() + 10
    while provider.describe(info.ref).state is not InstanceState.TERMINATED:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert provider.describe(info.ref).state_reason == "process-exited"


def test_unknown_shape_is_a_bad_request(make_local) -> None:
    with pytest.raises(ProviderError) as caught:
        make_local().provision(local_request("local-64xB200"))
    assert caught.value.kind is ErrorKind.BAD_REQUEST


def test_offers_list_every_shape_per_zone(make_local) -> None:
    provider = make_local(zones=["local-a", "local-b"])
    offers = provider.list_offers()
    assert len(offers) == 2 * len(provider.shapes)
    assert {(o.zone, o.gpu_model, o.gpu_count) for o in offers} >= {("local-b", "A100-80GB", 8), ("local-a", "T4", 4)}


def test_reconciler_stops_orphaned_local_agent(make_local) -> None:
    provider = make_local()
    kept = provider.provision(local_request("local-1xL4", allocation_id="kept"))
    orphan = provider.provision(local_request("local-1xL4", allocation_id="orphan"))
    orphan_pid = pid_of(provider, orphan.ref.instance_id)
    known = [KnownInstance(provider="local", request_key=kept.request_key, provider_instance_id=kept.ref.instance_id)]
    report = reconcile({"local": provider}, known, orphan_grace=timedelta(seconds=0),
                       clock=lambda: datetime.now(timezone.utc) + timedelta(seconds=1))
    assert [i.ref for i in report.orphans_terminating] == [orphan.ref]
    assert report.orphans_terminating[0].state is InstanceState.TERMINATED
    assert not is_alive(*orphan_pid)
    assert provider.describe(kept.ref).state is InstanceState.RUNNING
