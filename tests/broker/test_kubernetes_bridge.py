"""The Kubernetes bridge (agent/kube/) between a live broker and an emulated Kubernetes API server.

The broker is pytest-django's `live_server` (real HTTP); the cluster is `tests/kube_emulator.py` (a real HTTP
server the official client talks to); the bridge runs in the test thread, stepped until what a user would see
happens. The tests play kube-scheduler and the kubelet (bind a Pod, set its phase and exit code).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from agent.kube.bridge import Bridge, BridgeConfig
from agent.backends.fake import FakeBackend
from agent.checkpoint import Checkpointer
from agent.kube.cluster import ClusterConfig
from agent.kube.pods import CHECKPOINT_ANNOTATION
from agent.metrics import GpuCollector, MetricsServer
from broker.jobs import checkpoints
from broker.jobs.models import Checkpoint
from broker.jobs.services import GpuRequest, allocation_commit
from broker.inventory.models import Gpu, Node, Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run
from tests.kube_emulator import PODS, references  # its fixtures (emulated_cluster...) are a plugin: pyproject.toml

from .test_agent_api import API, agent_client, register_body
from .test_api_tenancy import submit
from .test_checkpoints import root, verify_queue  # noqa: F401  (fixtures)
from .test_prometheus_scrape import running_prometheus, wait_for_series

REPO = Path(__file__).resolve().parents[2]
NS = "ml"
IMAGE = "nvcr.io/nvidia/pytorch:24.01-py3"
SECRETS = references.resource(group="", version="v1", plural="secrets")
SERVICES = references.resource(group="", version="v1", plural="services")


@pytest.fixture(autouse=True)
def _quick_heartbeats(settings):
    """The bridge is stepped every 50 ms here: lift the per-node limits a real node's 5 s heartbeat never meets."""
    settings.WHALEZEN_AGENT_HEARTBEAT_RATE = settings.WHALEZEN_AGENT_ASSIGNMENTS_RATE = "100000/min"
    settings.WHALEZEN_AGENT_STATUS_RATE = "100000/min"


@pytest.fixture
def kube_pool(acme):
    """A Kubernetes pool as acme's only capacity (its simulated on-prem nodes are removed)."""
    Node.objects.filter(pool=acme.pool).delete()
    pool = Pool.objects.create(tenant=acme.tenant, name="k8s", kind=PoolKind.KUBERNETES, region="dc1",
                               provider_config={"namespace": NS})  # as kubernetes_pool_add stores it
    return pool, pool_join_token_issue(pool=pool)


def make_bridge(url: str, cluster, token: str, tmp_path: Path, *, context: str = "emulated",
                bridge_id: str = "acme-k8s", labels: dict[str, str] | None = None) -> Bridge:
    kubeconfig = cluster.write_kubeconfig(tmp_path / f"{context}.kubeconfig", context=context, namespace=NS)
    config = BridgeConfig(server_url=url, join_token=token,
                          cluster=ClusterConfig(kubeconfig=str(kubeconfig), context=context, namespace=NS,
                                                broker_id=bridge_id),
                          state_dir=tmp_path / f"bridge-{context}", refresh_seconds=0.0, heartbeat_seconds=0.05,
                          stop_grace_s=1.0, tick_seconds=0.05, labels=labels or {})
    bridge = Bridge(config)
    bridge.watch.start()
    assert bridge.watch.wait_listed(5)
    return bridge


def registered_bridge(url: str, cluster, token: str, tmp_path: Path, pool: Pool) -> Bridge:
    bridge = make_bridge(url, cluster, token, tmp_path)
    pump(bridge, lambda: Node.objects.filter(pool=pool).exists(), what="the node to register")
    return bridge


def run_pod(bridge: Bridge, cluster, job, node: str = "h100-a") -> str:
    """Play kube-scheduler and the kubelet for the job's Pod until the broker sees the job running."""
    name = pump(bridge, lambda: next((p for p in our_pods(cluster)
                                      if p["metadata"]["labels"]["whalezen.io/job"] == str(job.pk)), None),
                what="the job's Pod")["metadata"]["name"]
    cluster.bind(NS, name, node)
    cluster.set_phase(NS, name, "Running")
    pump(bridge, lambda: state_of(job) == JobState.RUNNING, what="the job to run")
    return name


def pump(bridges, until, *, what: str, limit_s: float = 20.0):
    bridges = bridges if isinstance(bridges, (list, tuple)) else [bridges]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for bridge in bridges:
            bridge.step()
        value = until()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def state_of(job) -> str:
    job.refresh_from_db()
    return job.state


def our_pods(cluster) -> list[dict]:
    return [p for p in cluster.pods(NS) if (p["metadata"].get("labels") or {}).get("whalezen.io/broker")]


@pytest.fixture
def bridges():
    made: list[Bridge] = []
    yield made
    for bridge in made:
        bridge.shutdown()


def test_gpu_nodes_come_from_labels_and_other_pods_take_gpus(live_server, acme, kube_pool, emulated_cluster,
                                                              tmp_path, bridges, caplog):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    emulated_cluster.add_node("l4-b", gpus=4, product="NVIDIA-L4", memory_mib=23034)
    emulated_cluster.add_node("cpu-c")  # no GPU: not a node of the pool
    emulated_cluster.add_node("inference-d", gpus=8, taints=["dedicated=inference:NoSchedule"])  # not tolerated
    emulated_cluster.add_node("b300-e", gpus=8, product="NVIDIA-B300-SXM6-AC")  # not in the catalogue
    emulated_cluster.add_pod("their-train", namespace="research", node_name="h100-a", gpus=3)
    emulated_cluster.add_pod("their-done", namespace="research", node_name="h100-a", gpus=4, phase="Succeeded")
    bridges.append(bridge := make_bridge(live_server.url, emulated_cluster, token, tmp_path))

    pump(bridge, lambda: Gpu.objects.filter(node__pool=pool, held_outside=True).count() == 3,
         what="the GPUs the foreign pod holds to be reported")
    nodes = {n.name: n for n in Node.objects.filter(pool=pool)}
    assert set(nodes) == {"h100-a", "l4-b", "b300-e"}
    models = {name: sorted({g.model.name if g.model else f"? {g.model_name}" for g in node.gpus.all()})
              for name, node in nodes.items()}
    # GFD's product label, matched to the catalogue; an unknown one is reported, not guessed.
    assert models == {"h100-a": ["H100-80GB"], "l4-b": ["L4"], "b300-e": ["? NVIDIA-B300-SXM6-AC"]}
    assert "GPU model 'NVIDIA-B300-SXM6-AC' is not in the catalogue" in caplog.text
    assert "node inference-d left out: its taints dedicated=inference:NoSchedule are not tolerated" in caplog.text
    assert nodes["h100-a"].gpus.count() == 8 and nodes["h100-a"].labels["whalezen.io/gpu-sharing"] == "none"
    assert nodes["h100-a"].container_runtimes == ["kubernetes"]
    assert not Gpu.objects.filter(node=nodes["l4-b"], held_outside=True).exists()

    # 5 of the 8 H100s are free: a 6-GPU H100 job waits, a 5-GPU one is placed there.
    too_big = submit(acme, resources={"gpus": 6, "gpu_models": ["H100-80GB"]}, image=IMAGE)
    fits = submit(acme, resources={"gpus": 5, "gpu_models": ["H100-80GB"]}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(too_big) == JobState.PENDING and "1 have fewer than 6 free GPUs" in too_big.pending_reason
    assert state_of(fits) == JobState.PLACED
    # A share of a GPU is never placed where the device plugin hands out whole GPUs only.
    share = submit(acme, resources={"gpu_fraction": 0.5}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(share) == JobState.PENDING and share.pending_reason_code == "NO_GPU_SHARING", share.pending_reason


def test_a_job_runs_as_a_pod_pinned_to_its_node_and_follows_its_phases(live_server, acme, kube_pool,
                                                                        emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridges.append(bridge := registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool))
    job = submit(acme, resources={"gpus": 2}, image=IMAGE, command=["python", "train.py"], env={"LR": "0.1"})
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(job) == JobState.PLACED

    pod = pump(bridge, lambda: next(iter(our_pods(emulated_cluster)), None), what="the job's Pod")
    name = pod["metadata"]["name"]
    assert pod["metadata"]["labels"]["whalezen.io/job"] == str(job.pk)
    container = pod["spec"]["containers"][0]
    assert container["image"] == IMAGE and container["command"] == ["python", "train.py"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "kubernetes.io/hostname", "operator": "In", "values": ["h100-a"]} in \
        terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert "nodeName" not in pod["spec"]
    secret = emulated_cluster.get(SECRETS, NS, name)  # the job's env, owned by its Pod
    assert secret is not None and "LR" in secret["data"] and "env" not in container

    # Pending in Kubernetes is not running yet.
    for _ in range(5):
        bridge.step()
    assert state_of(job) in (JobState.PLACED, JobState.STARTING)
    emulated_cluster.bind(NS, name, "h100-a")
    emulated_cluster.set_phase(NS, name, "Running")
    pump(bridge, lambda: state_of(job) == JobState.RUNNING, what="the job to run")

    emulated_cluster.set_log(NS, name, "epoch 1 loss 0.3\nepoch 2 loss 0.1\n")
    emulated_cluster.set_phase(NS, name, "Succeeded", exit_code=0)
    pump(bridge, lambda: state_of(job) == JobState.SUCCEEDED, what="the job to succeed")
    exited = job.events.filter(reason_code="AGENT_EXITED").get()
    assert "epoch 2 loss 0.1" in exited.data["output_tail"]
    pump(bridge, lambda: emulated_cluster.pod(NS, name) is None, what="the finished Pod to be deleted")


def test_a_failing_pod_fails_the_job_with_its_exit_code(live_server, acme, kube_pool, emulated_cluster, tmp_path,
                                                         bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridges.append(bridge := registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool))
    job = submit(acme, resources={"gpus": 1}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    name = run_pod(bridge, emulated_cluster, job)
    emulated_cluster.set_log(NS, name, "Traceback: CUDA out of memory\n")
    emulated_cluster.set_phase(NS, name, "Failed", exit_code=3, reason="Error")
    pump(bridge, lambda: state_of(job) == JobState.FAILED, what="the job to fail")
    assert "exited with code 3" in job.pending_reason or "exited with code 3" in job.events.last().message
    assert "CUDA out of memory" in job.events.get(reason_code="AGENT_FAILED").data["output_tail"]


def test_an_unschedulable_pod_puts_the_job_back_with_the_schedulers_reason(live_server, acme, kube_pool,
                                                                          emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridges.append(bridge := registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool))
    job = submit(acme, resources={"gpus": 4}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    name = pump(bridge, lambda: next(iter(our_pods(emulated_cluster)), None), what="the Pod")["metadata"]["name"]
    emulated_cluster.unschedulable(NS, name, "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    pump(bridge, lambda: state_of(job) == JobState.PENDING, what="the job to go back to the queue")
    event = job.events.filter(reason_code="ASSIGNMENT_REFUSED").last()
    assert "Kubernetes cannot schedule the Pod: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in event.message
    pump(bridge, lambda: emulated_cluster.pod(NS, name) is None, what="the unschedulable Pod to be deleted")


def test_cancel_deletes_the_pod_and_the_reconciler_deletes_pods_no_job_owns(live_server, acme, kube_pool,
                                                                             emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    # Left by an earlier bridge of ours (its job is long gone), and a pod that is not ours at all.
    emulated_cluster.add_pod("wz-999-999", namespace=NS, node_name="h100-a", gpus=1,
                             labels={"whalezen.io/broker": "acme-k8s", "whalezen.io/assignment": "999"})
    emulated_cluster.add_pod("notebook", namespace=NS, node_name="h100-a", gpus=1)
    bridges.append(bridge := make_bridge(live_server.url, emulated_cluster, token, tmp_path))
    pump(bridge, lambda: emulated_cluster.pod(NS, "wz-999-999") is None, what="the orphan Pod to be deleted")
    assert emulated_cluster.pod(NS, "notebook") is not None

    job = submit(acme, resources={"gpus": 1}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    name = run_pod(bridge, emulated_cluster, job)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code in (200, 202)
    pump(bridge, lambda: emulated_cluster.pod(NS, name) is None, what="the cancelled job's Pod to be deleted")
    assert state_of(job) == JobState.CANCELLED


def test_without_permission_to_list_all_pods_only_the_namespace_is_counted(live_server, acme, kube_pool,
                                                                           emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    emulated_cluster.add_pod("elsewhere", namespace="research", node_name="h100-a", gpus=4)
    emulated_cluster.add_pod("here", namespace=NS, node_name="h100-a", gpus=1)
    emulated_cluster.forbid_cluster_pod_list()
    bridges.append(bridge := make_bridge(live_server.url, emulated_cluster, token, tmp_path))
    pump(bridge, lambda: Gpu.objects.filter(node__pool=pool, held_outside=True).count() == 1,
         what="the namespace's pod to be counted")
    assert "forbidden (403)" in bridge.cluster.pod_visibility and "namespace ml only" in bridge.cluster.pod_visibility
    # The admin sees it on the node.
    (node,) = acme.client.get("/api/v1/nodes/").json()["results"]
    assert node["labels"]["whalezen.io/pod-visibility"] == "namespace-only"
    # And in the pool's status, with the namespace it counts; another pool says nothing.
    pools = {p["name"]: p for p in acme.client.get("/api/v1/pools/").json()["results"]}
    (said,) = pools[pool.name]["status"]
    assert "forbids listing pods in all namespaces (403)" in said and f"namespace {NS}" in said
    assert pools["onprem"]["status"] == []
    from agent.kube.bridge import VISIBILITY_LABEL
    from broker.inventory.labels import POD_VISIBILITY_LABEL
    assert VISIBILITY_LABEL == POD_VISIBILITY_LABEL  # the bridge writes the label the API reads


def test_two_clusters_are_pools_of_one_decision(live_server, acme, kube_pool, emulated_cluster,
                                                 second_emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    pool_b = Pool.objects.create(tenant=acme.tenant, name="k8s-b", kind=PoolKind.KUBERNETES, region="dc2")
    token_b = pool_join_token_issue(pool=pool_b)
    emulated_cluster.add_node("h100-a", gpus=8)
    second_emulated_cluster.add_node("l4-b", gpus=4, product="NVIDIA-L4", memory_mib=23034)
    bridges.append(first := make_bridge(live_server.url, emulated_cluster, token, tmp_path))
    bridges.append(second := make_bridge(live_server.url, second_emulated_cluster, token_b, tmp_path, context="b",
                                         bridge_id="acme-k8s-b"))
    pump([first, second], lambda: Node.objects.filter(pool__in=[pool, pool_b]).count() == 2, what="both clusters")
    big = submit(acme, resources={"gpus": 8}, image=IMAGE)  # only the H100 node has 8
    small = submit(acme, resources={"gpus": 2, "gpu_models": ["L4"]}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(big) == JobState.PLACED and state_of(small) == JobState.PLACED
    pump([first, second], lambda: our_pods(emulated_cluster) and our_pods(second_emulated_cluster),
         what="a Pod in each cluster")
    assert our_pods(emulated_cluster)[0]["metadata"]["labels"]["whalezen.io/job"] == str(big.pk)
    assert our_pods(second_emulated_cluster)[0]["metadata"]["labels"]["whalezen.io/job"] == str(small.pk)


def test_a_restarted_bridge_adopts_its_running_pods(live_server, acme, kube_pool, emulated_cluster, tmp_path,
                                                     bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridge = registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool)
    job = submit(acme, resources={"gpus": 1}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    name = run_pod(bridge, emulated_cluster, job)
    bridge.shutdown()  # a bridge upgrade: its Pods keep running
    assert emulated_cluster.pod(NS, name) is not None

    bridges.append(again := make_bridge(live_server.url, emulated_cluster, token, tmp_path))
    for _ in range(10):
        again.step()
    assert state_of(job) == JobState.RUNNING and [p["metadata"]["name"] for p in our_pods(emulated_cluster)] == [name]
    emulated_cluster.set_phase(NS, name, "Succeeded", exit_code=0)
    pump(again, lambda: state_of(job) == JobState.SUCCEEDED, what="the adopted job to finish")


def test_a_checkpointed_job_moves_from_a_kubernetes_node_to_an_agent_node(
        live_server, acme, kube_pool, emulated_cluster, tmp_path, bridges, root, verify_queue, capsys):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridges.append(bridge := registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool))
    kube_node = Node.objects.get(pool=pool)
    body = {**register_body(pool_join_token_issue(pool=acme.pool), name="gpu-node-2"), "container_runtimes": ["podman"]}
    resp = APIClient().post(f"{API}/register", body, format="json")  # an agent node that runs images
    assert resp.status_code == 201, resp.content
    target_token = resp.json()["node_token"]

    job = submit(acme, resources={"gpus": 1}, image=IMAGE, checkpoint={"uri": str(root / "train")})
    allocation_commit(job=job, requests=[GpuRequest(node=kube_node, gpu_indices=(0,))])
    name = run_pod(bridge, emulated_cluster, job)

    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    assert resp.status_code == 202, resp.content
    # The request reaches the Pod as an annotation, which the Pod reads as its request file (downward API).
    request = pump(bridge, lambda: json.loads(emulated_cluster.pod(NS, name)["metadata"]["annotations"].get(
        CHECKPOINT_ANNOTATION) or "null"), what="the checkpoint request")
    assert request["job_id"] == str(job.pk) and request["checkpoint_uri"] == str(root / "train")

    # The job, in its Pod: the helper sees the request, saves, and prints its notice into the Pod's log.
    request_file = tmp_path / "pod-request.json"
    request_file.write_text(json.dumps(request))
    capsys.readouterr()
    saved = Checkpointer(str(root / "train"), env={**secret_env(emulated_cluster, name),
                                                   "WHALEZEN_CHECKPOINT_REQUEST_FILE": str(request_file),
                                                   "WHALEZEN_WORK_DIR": str(tmp_path)}).save(300, b"weights")
    assert saved.request_id == request["request_id"]
    emulated_cluster.set_log(NS, name, "step 299\n" + capsys.readouterr().out + "step 300\n")
    checkpoint = pump(bridge, lambda: Checkpoint.objects.filter(job=job, step=300).first(),
                      what="the checkpoint to be reported")
    checkpoints.checkpoint_verify(checkpoint_id=checkpoint.pk)  # the verify task, run here (verify_queue)

    # Committed: the source is stopped (its Pod deleted), then the job starts on the agent node from it.
    pump(bridge, lambda: emulated_cluster.pod(NS, name) is None, what="the source Pod to be deleted")
    pump(bridge, lambda: state_of(job) == JobState.PLACED, what="the job to be placed on its target")
    (start,) = agent_client(target_token).get(f"{API}/assignments").json()["assignments"]
    assert start["action"] == "start" and start["restore_from"] == saved.uri


def secret_env(cluster, name: str) -> dict[str, str]:
    """The environment the Pod's container gets from its Secret (envFrom)."""
    secret = cluster.get(SECRETS, NS, name)
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_a_node_that_is_not_ready_takes_no_jobs_and_a_pulled_image_failure_or_a_foreign_delete_fails_the_job(
        live_server, acme, kube_pool, emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    bridges.append(bridge := registered_bridge(live_server.url, emulated_cluster, token, tmp_path, pool))

    bad_image = submit(acme, resources={"gpus": 1}, image="registry.example/missing:1")
    deleted = submit(acme, resources={"gpus": 1}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    pods = pump(bridge, lambda: len(our_pods(emulated_cluster)) == 2 and our_pods(emulated_cluster), what="two Pods")
    by_job = {p["metadata"]["labels"]["whalezen.io/job"]: p["metadata"]["name"] for p in pods}
    pulled = by_job[str(bad_image.pk)]
    emulated_cluster.bind(NS, pulled, "h100-a")
    emulated_cluster.patch(PODS, NS, pulled, {"status": {"containerStatuses": [{"name": "job", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.example/missing:1"'}}}]}})
    pump(bridge, lambda: state_of(bad_image) == JobState.FAILED, what="the job whose image cannot be pulled to fail")
    assert "ImagePullBackOff" in bad_image.events.get(reason_code="AGENT_FAILED").message

    gone = run_pod(bridge, emulated_cluster, deleted)
    emulated_cluster.delete(PODS, NS, gone)  # kubectl delete pod, by someone else
    pump(bridge, lambda: state_of(deleted) == JobState.FAILED, what="the job whose Pod was deleted to fail")
    assert "was deleted outside WhaleZen" in deleted.events.get(reason_code="AGENT_FAILED").message

    emulated_cluster.set_node_ready("h100-a", False)
    pump(bridge, lambda: not Gpu.objects.filter(node__pool=pool, health="HEALTHY").exists(),
         what="the GPUs of the NotReady node to be reported failed")
    waiting = submit(acme, resources={"gpus": 1}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(waiting) == JobState.PENDING and waiting.pending_reason_code == "NODE_NOT_READY"


def test_the_bridge_process_registers_stops_cleanly_on_sigterm_and_refuses_a_bad_token(
        live_server, acme, kube_pool, emulated_cluster, tmp_path):
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=8)
    kubeconfig = emulated_cluster.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    token_file = tmp_path / "join-token"
    token_file.write_text(token + "\n")
    state = tmp_path / "state"

    def bridge_argv(join_token_file: Path, state_dir: Path) -> list[str]:
        return [sys.executable, "-m", "agent", "kubernetes", "--server", live_server.url, "--join-token-file",
                str(join_token_file), "--kubeconfig", "env:WZ_TEST_KUBECONFIG", "--namespace", NS,
                "--bridge-id", "acme-k8s", "--state-dir", str(state_dir), "--refresh-seconds", "1"]

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "WZ_TEST_KUBECONFIG": str(kubeconfig)}
    process = subprocess.Popen(bridge_argv(token_file, state), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        # Wait on the bridge's own files, not the database (the server's threads use it meanwhile).
        wait_for(lambda: (state / "nodes" / "h100-a" / "identity.json").exists(), what="the node to register")
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert "Traceback" not in output and "emulated-token" not in output  # the kubeconfig's secrets never logged
    node = Node.objects.get(pool=pool, name="h100-a")
    assert node.gpus.count() == 8 and node.container_runtimes == ["kubernetes"]

    bad = tmp_path / "bad-token"
    bad.write_text("wzj_nope_nope\n")
    refused = subprocess.run(bridge_argv(bad, tmp_path / "other-state"), cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 4, refused.stderr
    assert "registration refused" in refused.stderr and "Traceback" not in refused.stderr


def wait_for(until, *, what: str, limit_s: float = 30.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = until()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (.ci/run installs it)")
def test_gpu_readings_and_xid_health_come_from_the_sites_prometheus(live_server, acme, kube_pool, emulated_cluster,
                                                                     tmp_path, bridges):
    """The cluster's dcgm-exporter (here: our exporter's same names, on fake GPUs, labelled with the node's name)
    scraped by a real Prometheus; the bridge reads the series and the broker's GPUs of the node take them."""
    pool, token = kube_pool
    emulated_cluster.add_node("h100-a", gpus=4)
    exporter_gpus = FakeBackend("4xH100-80GB-SXM", hostname="h100-a")
    exporter_gpus.start()
    collector = GpuCollector("h100-a", exporter_gpus.inventory().gpus)
    collector.update(exporter_gpus.sample())
    exporter = MetricsServer(collector, "127.0.0.1", 0)
    try:
        with running_prometheus(tmp_path, f"""
  - job_name: dcgm
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
""") as prometheus:
            wait_for_series(prometheus, 'DCGM_FI_DEV_GPU_UTIL{Hostname="h100-a"}', 4)
            bridge = make_bridge(live_server.url, emulated_cluster, token, tmp_path)
            bridge.config.prometheus_url = prometheus
            bridges.append(bridge)
            pump(bridge, lambda: Gpu.objects.filter(node__pool=pool, utilization_pct__isnull=False,
                                                    temperature_c__isnull=False).count() == 4,
                 what="the GPUs' readings from Prometheus")

            exporter_gpus.inject_xid(2, 48)  # a double-bit ECC error: fatal
            collector.update(exporter_gpus.sample())
            wait_for_series(prometheus, 'DCGM_FI_DEV_XID_ERRORS{Hostname="h100-a"} == 48', 1)
            failed = pump(bridge, lambda: list(Gpu.objects.filter(node__pool=pool, health="FAILED")),
                          what="the Xid to take one GPU out")
            assert len(failed) == 1
            whole_node = submit(acme, resources={"gpus": 4}, image=IMAGE)
            scheduling_cycle_run(tenant=acme.tenant)
            assert state_of(whole_node) == JobState.PENDING  # 3 healthy GPUs left on the node
    finally:
        exporter.stop()


def gang_pods(bridge: Bridge, cluster, job) -> dict[int, dict]:
    """The job's Pods by rank, once the bridge has made one for each of its two nodes."""
    def made():
        pods = [p for p in our_pods(cluster) if p["metadata"]["labels"]["whalezen.io/job"] == str(job.pk)]
        return len(pods) == 2 and pods
    return {int(secret_env(cluster, p["metadata"]["name"])["WHALEZEN_NODE_RANK"]): p
            for p in pump(bridge, made, what="a Pod for each node of the gang")}


def pinned_host(pod: dict) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (hostname,) = [m["values"] for m in terms["nodeSelectorTerms"][0]["matchExpressions"]
                   if m["key"] == "kubernetes.io/hostname"]
    return hostname[0]


def test_a_two_node_gang_runs_as_one_pod_per_node_that_find_each_other_by_dns_name(
        live_server, acme, kube_pool, emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    # The cluster's admin marks the nodes on an InfiniBand fabric; without a fast fabric no gang goes there.
    for name in ("h100-a", "h100-b"):
        emulated_cluster.add_node(name, gpus=8, labels={"whalezen.io/fabric": "infiniband"})
    bridges.append(bridge := make_bridge(live_server.url, emulated_cluster, token, tmp_path))
    pump(bridge, lambda: Node.objects.filter(pool=pool).count() == 2, what="both nodes to register")
    assert {n.labels.get("fabric") for n in Node.objects.filter(pool=pool)} == {"infiniband"}

    job = submit(acme, resources={"gpus": 4, "nodes": 2}, image=IMAGE, command=["torchrun", "train.py"])
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(job) == JobState.PLACED, job.pending_reason
    pods = gang_pods(bridge, emulated_cluster, job)
    assert {pinned_host(pods[0]), pinned_host(pods[1])} == {"h100-a", "h100-b"}  # one Pod per node

    # Each rank's Pod has a stable DNS name under rank 0's headless Service; the peer variables name them.
    service_name = f"wz-{job.pk}"
    peers = f"wz-{job.pk}-r0.{service_name}.{NS}.svc,wz-{job.pk}-r1.{service_name}.{NS}.svc"
    for rank, pod in pods.items():
        assert pod["spec"]["hostname"] == f"wz-{job.pk}-r{rank}" and pod["spec"]["subdomain"] == service_name
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        env = secret_env(emulated_cluster, pod["metadata"]["name"])
        assert env["WHALEZEN_NUM_NODES"] == "2" and env["WHALEZEN_NUM_GPUS_PER_NODE"] == "4"
        assert env["WHALEZEN_NODE_IPS"].replace("\n", ",") == peers
        assert env["MASTER_ADDR"] == f"wz-{job.pk}-r0.{service_name}.{NS}.svc"
        assert env["MASTER_PORT"] == secret_env(emulated_cluster, pods[0]["metadata"]["name"])["MASTER_PORT"]
    service = emulated_cluster.get(SERVICES, NS, service_name)
    assert service is not None and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"whalezen.io/job": str(job.pk)}
    assert service["metadata"]["ownerReferences"][0]["name"] == pods[0]["metadata"]["name"]

    # The gang runs once both Pods run, and succeeds once both exit 0.
    for rank in (0, 1):
        name = pods[rank]["metadata"]["name"]
        emulated_cluster.bind(NS, name, pinned_host(pods[rank]))
        emulated_cluster.set_phase(NS, name, "Running")
        if rank == 0:
            pump(bridge, lambda: job.events.filter(reason_code="GANG_STARTING").exists(),
                 what="rank 0 to run")
            assert state_of(job) == JobState.STARTING
    pump(bridge, lambda: state_of(job) == JobState.RUNNING, what="the gang to run")
    emulated_cluster.set_phase(NS, pods[0]["metadata"]["name"], "Succeeded", exit_code=0)
    pump(bridge, lambda: emulated_cluster.pod(NS, pods[0]["metadata"]["name"]) is None,
         what="rank 0's Pod to go")
    assert state_of(job) == JobState.RUNNING  # rank 1 still works
    emulated_cluster.set_phase(NS, pods[1]["metadata"]["name"], "Succeeded", exit_code=0)
    pump(bridge, lambda: state_of(job) == JobState.SUCCEEDED, what="the gang to succeed")
    pump(bridge, lambda: not our_pods(emulated_cluster), what="both Pods to be deleted")


def two_node_cluster(url: str, cluster, pool, token: str, tmp_path: Path, bridges: list) -> Bridge:
    """Two 8-GPU nodes whose bridge says they share a fast fabric for every node (--label
    fabric=infiniband), both registered; the bridge is in `bridges` (stopped after the test)."""
    for name in ("h100-a", "h100-b"):
        cluster.add_node(name, gpus=8)
    bridges.append(bridge := make_bridge(url, cluster, token, tmp_path, labels={"fabric": "infiniband"}))
    pump(bridge, lambda: Node.objects.filter(pool=pool).count() == 2, what="both nodes to register")
    return bridge


def test_one_rank_failing_fails_the_gang_and_deletes_the_other_ranks_pod(
        live_server, acme, kube_pool, emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    bridge = two_node_cluster(live_server.url, emulated_cluster, pool, token, tmp_path, bridges)
    job = submit(acme, resources={"gpus": 8, "nodes": 2}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(job) == JobState.PLACED, job.pending_reason
    pods = gang_pods(bridge, emulated_cluster, job)
    for pod in pods.values():
        emulated_cluster.bind(NS, pod["metadata"]["name"], pinned_host(pod))
        emulated_cluster.set_phase(NS, pod["metadata"]["name"], "Running")
    pump(bridge, lambda: state_of(job) == JobState.RUNNING, what="the gang to run")

    failing, survivor = pods[1]["metadata"]["name"], pods[0]["metadata"]["name"]
    emulated_cluster.set_log(NS, failing, "NCCL error: unhandled system error\n")
    emulated_cluster.set_phase(NS, failing, "Failed", exit_code=1, reason="Error")
    pump(bridge, lambda: state_of(job) == JobState.FAILED, what="the gang to fail")
    event = job.events.get(reason_code="JOB_FAILED")
    assert event.message.startswith(f"rank 1 of 2 on {pinned_host(pods[1])} failed: exited with code 1"), \
        event.message
    assert "NCCL error" in job.events.get(reason_code="AGENT_FAILED").data["output_tail"]
    # Rank 0 would wait for its peer until its own timeout: its Pod is deleted instead.
    pump(bridge, lambda: emulated_cluster.pod(NS, survivor) is None,
         what="the surviving rank's Pod to be deleted")
    assert not our_pods(emulated_cluster)


def test_a_gang_given_back_unscheduled_runs_again_under_a_peer_service_its_new_rank_0_owns(
        live_server, acme, kube_pool, emulated_cluster, tmp_path, bridges):
    pool, token = kube_pool
    bridge = two_node_cluster(live_server.url, emulated_cluster, pool, token, tmp_path, bridges)
    job = submit(acme, resources={"gpus": 8, "nodes": 2}, image=IMAGE)
    scheduling_cycle_run(tenant=acme.tenant)
    first = gang_pods(bridge, emulated_cluster, job)
    emulated_cluster.unschedulable(NS, first[1]["metadata"]["name"], "0/2 nodes are available: 1 node(s) had "
                                   "untolerated taint {maintenance: true}.")
    pump(bridge, lambda: state_of(job) == JobState.PENDING, what="the gang to go back to the queue")
    pump(bridge, lambda: not our_pods(emulated_cluster), what="both ranks' Pods to be deleted")
    assert "untolerated taint" in job.pending_reason
    # Kubernetes' garbage collector deletes the Service after its owner, rank 0's first Pod, in its own time:
    # here it has not yet. The next placement's rank 0 must take it over, or the collector takes it later.
    assert emulated_cluster.get(SERVICES, NS, f"wz-{job.pk}") is not None

    scheduling_cycle_run(tenant=acme.tenant)
    assert state_of(job) == JobState.PLACED, job.pending_reason
    again = gang_pods(bridge, emulated_cluster, job)
    assert again[0]["metadata"]["name"] != first[0]["metadata"]["name"]
    owners = emulated_cluster.get(SERVICES, NS, f"wz-{job.pk}")["metadata"]["ownerReferences"]
    assert [owner["name"] for owner in owners] == [again[0]["metadata"]["name"]]
