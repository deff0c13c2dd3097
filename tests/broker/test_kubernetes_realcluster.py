"""The bridge's scenarios against a real Kubernetes cluster: `pytest -m realcluster` with a kubeconfig.

Deselected unless WHALEZEN_TEST_KUBECONFIG is set (tests/kube_emulator.py), so `make test` never needs a
cluster. To run:

    WHALEZEN_TEST_KUBECONFIG=~/.kube/config WHALEZEN_TEST_KUBE_CONTEXT=my-gpu-cluster \\
    WHALEZEN_TEST_KUBE_NAMESPACE=whalezen-test .venv/bin/python -m pytest -m realcluster \\
        tests/broker/test_kubernetes_realcluster.py

The namespace must exist and the kubeconfig's user needs the permissions docs/kubernetes.md lists. The cluster's
real kube-scheduler, kubelet and device plugin do what the emulator's tests play by hand. At least one node
needs a free GPU; `WHALEZEN_TEST_KUBE_IMAGE` (default busybox:1.36) must be pullable there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.kube.bridge import Bridge, BridgeConfig
from agent.kube.cluster import ClusterConfig
from agent.kube.inventory import gpu_node
from broker.inventory.models import Node, Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run

from .test_api_tenancy import submit

pytestmark = pytest.mark.realcluster
IMAGE = os.environ.get("WHALEZEN_TEST_KUBE_IMAGE", "busybox:1.36")


@pytest.fixture
def real_bridge(live_server, acme, tmp_path, settings):
    kubeconfig = os.environ["WHALEZEN_TEST_KUBECONFIG"]  # without it these tests are deselected
    settings.WHALEZEN_AGENT_HEARTBEAT_RATE = settings.WHALEZEN_AGENT_ASSIGNMENTS_RATE = "100000/min"
    Node.objects.filter(pool=acme.pool).delete()
    pool = Pool.objects.create(tenant=acme.tenant, name="real-k8s", kind=PoolKind.KUBERNETES)
    config = BridgeConfig(
        server_url=live_server.url, join_token=pool_join_token_issue(pool=pool),
        cluster=ClusterConfig(kubeconfig=str(Path(kubeconfig).expanduser()),
                              context=os.environ.get("WHALEZEN_TEST_KUBE_CONTEXT") or None,
                              namespace=os.environ.get("WHALEZEN_TEST_KUBE_NAMESPACE", "default"),
                              broker_id=f"wz-test-{os.getpid()}"),
        state_dir=tmp_path / "bridge", refresh_seconds=5.0, heartbeat_seconds=1.0, stop_grace_s=5.0)
    bridge = Bridge(config)
    bridge.watch.start()
    assert bridge.watch.wait_listed(30)
    yield bridge, pool
    bridge.shutdown()


def pump(bridge: Bridge, until, *, what: str, limit_s: float = 300.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        bridge.step()
        value = until()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"gave up waiting for {what}")


def state_of(job) -> str:
    job.refresh_from_db()
    return job.state


def test_the_clusters_gpu_nodes_register(real_bridge):
    bridge, pool = real_bridge
    expected = {n.name for n in (gpu_node(raw) for raw in bridge.cluster.list_nodes()) if n is not None}
    assert expected, "the cluster has no node with nvidia.com/gpu allocatable"
    registered = pump(bridge, lambda: (names := set(Node.objects.filter(pool=pool).values_list("name", flat=True)))
                      >= expected and names, what="every GPU node to register")
    assert registered == expected


def test_a_job_runs_as_a_pod_and_its_output_comes_back(real_bridge, acme):
    bridge, pool = real_bridge
    pump(bridge, lambda: Node.objects.filter(pool=pool).exists(), what="a node to register")
    job = submit(acme, resources={"gpus": 1}, image=IMAGE, command=["sh", "-c", "echo hello from $WHALEZEN_JOB_ID"])
    pump(bridge, lambda: scheduling_cycle_run(tenant=acme.tenant) and state_of(job) != JobState.PENDING,
         what="the job to be placed")
    pump(bridge, lambda: state_of(job) in (JobState.SUCCEEDED, JobState.FAILED), what="the job to end")
    assert job.state == JobState.SUCCEEDED, job.pending_reason
    assert f"hello from {job.pk}" in job.events.get(reason_code="AGENT_EXITED").data["output_tail"]


def test_cancel_deletes_the_pod(real_bridge, acme):
    bridge, pool = real_bridge
    pump(bridge, lambda: Node.objects.filter(pool=pool).exists(), what="a node to register")
    job = submit(acme, resources={"gpus": 1}, image=IMAGE, command=["sleep", "600"])
    pump(bridge, lambda: scheduling_cycle_run(tenant=acme.tenant) and state_of(job) == JobState.RUNNING,
         what="the job to run")
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code in (200, 202)
    pod = f"wz-{job.pk}-"
    pump(bridge, lambda: not [n for n in bridge.watch.names() if n.startswith(pod)], what="the Pod to be deleted")
    assert state_of(job) == JobState.CANCELLED
