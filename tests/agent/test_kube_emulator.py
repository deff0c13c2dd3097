"""The official kubernetes client works against tests/kube_emulator.py the way the bridge uses it."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.kube_emulator import EmulatedCluster
from tests.kube_emulator import write_kubeconfig


def core(cluster: EmulatedCluster, tmp_path: Path, context: str = "emulated") -> client.CoreV1Api:
    path = cluster.write_kubeconfig(tmp_path / "kubeconfig", context=context)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path), context=context))


def job_pod(name: str, broker: str = "x") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"whalezen.io/broker": broker}),
        spec=client.V1PodSpec(restart_policy="Never", containers=[client.V1Container(
            name="job", image="busybox", resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}))]))


def test_nodes_carry_gpu_labels_and_allocatable(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    emulated_cluster.add_node("gpu-1", gpus=8, taints=["nvidia.com/gpu=present:NoSchedule"])
    emulated_cluster.add_node("cpu-1", ready=False)
    nodes = {n.metadata.name: n for n in core(emulated_cluster, tmp_path).list_node().items}
    gpu = nodes["gpu-1"]
    assert gpu.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert gpu.metadata.labels["nvidia.com/gpu.memory"] == "81559"
    assert gpu.metadata.labels["nvidia.com/gpu.count"] == "8"
    assert gpu.status.allocatable["nvidia.com/gpu"] == "8"
    assert gpu.spec.taints[0].key == "nvidia.com/gpu" and gpu.spec.taints[0].effect == "NoSchedule"
    assert "nvidia.com/gpu" not in nodes["cpu-1"].status.allocatable
    assert [c.status for c in nodes["cpu-1"].status.conditions if c.type == "Ready"] == ["False"]


def test_lists_are_empty_before_any_object_and_version_answers(emulated_cluster: EmulatedCluster,
                                                               tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    assert v1.list_pod_for_all_namespaces().items == []
    assert v1.list_node().items == []
    assert client.VersionApi(v1.api_client).get_code().major == "1"


def test_create_sets_namespace_phase_and_versions(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    created = v1.create_namespaced_pod("team-a", job_pod("j1"))
    assert created.metadata.namespace == "team-a"
    assert created.status.phase == "Pending"
    assert created.metadata.resource_version and created.metadata.uid
    emulated_cluster.add_pod("other", namespace="team-b", node_name="gpu-1", gpus=2)
    names = sorted(p.metadata.name for p in v1.list_pod_for_all_namespaces().items)
    assert names == ["j1", "other"]
    assert [p.metadata.name for p in v1.list_namespaced_pod("team-a").items] == ["j1"]
    with pytest.raises(ApiException) as conflict:
        v1.create_namespaced_pod("team-a", job_pod("j1"))
    assert conflict.value.status == 409
    with pytest.raises(ApiException) as missing:
        v1.read_namespaced_pod("nope", "team-a")
    assert missing.value.status == 404


def test_selectors_filter_lists(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("mine", broker="x"))
    v1.create_namespaced_pod("default", job_pod("theirs", broker="y"))
    emulated_cluster.add_pod("running", node_name="gpu-1", labels={"whalezen.io/broker": "x"})
    emulated_cluster.add_pod("done", node_name="gpu-1", phase="Succeeded")

    def names(**kw: Any) -> list[str]:
        return sorted(p.metadata.name for p in v1.list_pod_for_all_namespaces(**kw).items)

    assert names(label_selector="whalezen.io/broker=x") == ["mine", "running"]
    assert names(label_selector="whalezen.io/broker in (x,y),whalezen.io/broker!=x") == ["theirs"]
    assert names(field_selector="spec.nodeName=gpu-1,status.phase!=Succeeded") == ["running"]


def test_watch_sees_add_modify_delete_and_ends_on_timeout(emulated_cluster: EmulatedCluster,
                                                          tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("j1"))
    v1.create_namespaced_pod("default", job_pod("other-broker", broker="y"))
    seen: list[tuple[str, str, str | None, str]] = []
    started = time.monotonic()

    def act() -> None:  # plays scheduler + kubelet + bridge while the watch is open
        time.sleep(0.2)
        emulated_cluster.bind("default", "j1", "gpu-1")
        emulated_cluster.set_phase("default", "j1", "Running")
        emulated_cluster.set_phase("default", "j1", "Failed", exit_code=3)
        emulated_cluster.set_phase("default", "other-broker", "Running")
        v1.delete_namespaced_pod("j1", "default")

    actor = threading.Thread(target=act)
    actor.start()
    for event in watch.Watch().stream(v1.list_namespaced_pod, "default", label_selector="whalezen.io/broker=x",
                                      timeout_seconds=2, _request_timeout=5):
        pod = event["object"]
        seen.append((event["type"], pod.metadata.name, pod.spec.node_name, pod.status.phase))
    actor.join()
    elapsed = time.monotonic() - started
    assert seen == [("ADDED", "j1", None, "Pending"), ("MODIFIED", "j1", "gpu-1", "Pending"),
                    ("MODIFIED", "j1", "gpu-1", "Running"), ("MODIFIED", "j1", "gpu-1", "Failed"),
                    ("DELETED", "j1", "gpu-1", "Failed")]
    assert 1.8 < elapsed < 4


def test_kubelet_states_reach_the_client(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("j1"))
    emulated_cluster.bind("default", "j1", "gpu-1")
    emulated_cluster.set_phase("default", "j1", "Failed", exit_code=137, reason="OOMKilled")
    pod = v1.read_namespaced_pod("j1", "default")
    terminated = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, terminated.exit_code, terminated.reason) == ("Failed", 137, "OOMKilled")
    assert [c.status for c in pod.status.conditions if c.type == "PodScheduled"] == ["True"]


def test_watch_from_resource_version_replays_only_later_changes(emulated_cluster: EmulatedCluster,
                                                                tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("old"))
    listed = v1.list_namespaced_pod("default")
    emulated_cluster.add_pod("new", labels={"whalezen.io/broker": "x"})
    events = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        v1.list_namespaced_pod, "default", resource_version=listed.metadata.resource_version,
        timeout_seconds=1, _request_timeout=5)]
    assert events == [("ADDED", "new")]


def test_pod_log_honours_tail_lines(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("j1"))
    emulated_cluster.set_log("default", "j1", "one\ntwo\nthree\n")
    assert v1.read_namespaced_pod_log("j1", "default") == "one\ntwo\nthree\n"
    assert v1.read_namespaced_pod_log("j1", "default", tail_lines=2) == "two\nthree\n"


def test_unschedulable_pod_gets_failed_scheduling_event(emulated_cluster: EmulatedCluster,
                                                        tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("j1"))
    emulated_cluster.unschedulable("default", "j1", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    events = v1.list_namespaced_event("default", field_selector="involvedObject.name=j1").items
    assert [(e.reason, e.type) for e in events] == [("FailedScheduling", "Warning")]
    assert "Insufficient nvidia.com/gpu" in events[0].message
    condition = next(c for c in v1.read_namespaced_pod("j1", "default").status.conditions if c.type == "PodScheduled")
    assert (condition.status, condition.reason) == ("False", "Unschedulable")


def test_cluster_wide_pod_list_can_be_forbidden(emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    v1.create_namespaced_pod("default", job_pod("j1"))
    emulated_cluster.forbid_cluster_pod_list()
    with pytest.raises(ApiException) as forbidden:
        v1.list_pod_for_all_namespaces()
    assert forbidden.value.status == 403 and "Forbidden" in str(forbidden.value.body)
    assert [p.metadata.name for p in v1.list_namespaced_pod("default").items] == ["j1"]


def test_patch_merges_annotations_and_bumps_resource_version(emulated_cluster: EmulatedCluster,
                                                            tmp_path: Path) -> None:
    v1 = core(emulated_cluster, tmp_path)
    created = v1.create_namespaced_pod("default", job_pod("j1"))
    v1.patch_namespaced_pod("j1", "default", {"metadata": {"annotations": {"a": "1"}}})
    patched = v1.patch_namespaced_pod("j1", "default", {"metadata": {"annotations": {"b": "2"}}})
    assert patched.metadata.annotations == {"a": "1", "b": "2"}
    assert patched.metadata.labels == {"whalezen.io/broker": "x"}
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    assert emulated_cluster.pod("default", "j1")["metadata"]["annotations"] == {"a": "1", "b": "2"}


def test_two_clusters_are_independent_contexts(emulated_cluster: EmulatedCluster,
                                               second_emulated_cluster: EmulatedCluster, tmp_path: Path) -> None:
    emulated_cluster.add_node("a-node", gpus=1)
    second_emulated_cluster.add_node("b-node", gpus=2)
    path = write_kubeconfig(tmp_path / "kc", {"east": emulated_cluster, "west": second_emulated_cluster})
    for context, expected in (("east", ["a-node"]), ("west", ["b-node"])):
        v1 = client.CoreV1Api(config.new_client_from_config(config_file=str(path), context=context))
        assert [n.metadata.name for n in v1.list_node().items] == expected
