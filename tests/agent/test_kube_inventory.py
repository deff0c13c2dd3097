"""The Kubernetes bridge's pure parts: GPU nodes from GFD labels, free GPUs with others' pods, the Pod spec."""
from __future__ import annotations

import base64

from agent.jobs import Assignment
from agent.kube.inventory import foreign_gpus_by_node, gpu_node, pod_gpu_request, quantity_bytes, untolerated_taints
from agent.kube.pods import CHECKPOINT_ANNOTATION, env_secret, gang_service, job_env, pod_manifest, pod_name


def node(name="gpu-a", *, gpus="8", product="NVIDIA-H100-80GB-HBM3", ready="True", unschedulable=False, **labels):
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": f"{name}.dc1", "nvidia.com/gpu.product": product,
                                                   "nvidia.com/gpu.memory": "81559", **labels}},
            "spec": {"unschedulable": unschedulable,
                     "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"nvidia.com/gpu": gpus, "cpu": "95500m", "memory": "1056Gi"},
                       "conditions": [{"type": "Ready", "status": ready}]}}


def pod(name, node_name, gpus, *, phase="Running", ours=False, init_gpus=None):
    spec = {"nodeName": node_name, "containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if init_gpus is not None:
        spec["initContainers"] = [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": str(init_gpus)}}}]
    labels = {"whalezen.io/broker": "wz"} if ours else {}
    return {"metadata": {"name": name, "labels": labels}, "spec": spec, "status": {"phase": phase}}


def test_a_gpu_node_is_read_from_the_device_plugin_and_gfd_labels():
    n = gpu_node(node())
    assert (n.name, n.hostname, n.gpu_count, n.product, n.memory_mib) == ("gpu-a", "gpu-a.dc1", 8, "NVIDIA-H100-80GB-HBM3",
                                                                          81559)
    assert (n.cpu_milli, n.memory_mb, n.ready, n.schedulable) == (95500, 1056 * 1024, True, True)
    assert n.taints == ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},)
    assert gpu_node(node(gpus="0")) is None and gpu_node({"metadata": {"name": "cpu"}, "status": {}}) is None
    assert not gpu_node(node(ready="False")).ready and not gpu_node(node(unschedulable=True)).schedulable
    assert quantity_bytes("64G") == 64 * 10**9 and quantity_bytes("junk") == 0


def test_free_gpus_count_every_unfinished_pod_that_is_not_ours():
    pods = [pod("theirs", "gpu-a", 2), pod("done", "gpu-a", 4, phase="Succeeded"), pod("mine", "gpu-a", 4, ours=True),
            pod("pending-bound", "gpu-b", 1, phase="Pending"), pod("unbound", "", 3, phase="Pending"),
            pod("init-heavy", "gpu-b", 1, init_gpus=3)]
    assert foreign_gpus_by_node(pods, "wz") == {"gpu-a": 2, "gpu-b": 1 + 3}
    # Another broker's pods are someone else's too.
    assert foreign_gpus_by_node(pods, "other-broker") == {"gpu-a": 6, "gpu-b": 4}
    assert pod_gpu_request(pod("x", "n", 0)) == 0


def assignment(**extra) -> Assignment:
    raw = {"id": "17", "job_id": "5", "epoch": 3, "gpu_indices": [0, 1], "command": ["python", "train.py"],
           "env": {"LR": "0.1", "CUDA_VISIBLE_DEVICES": "7", "API_KEY": "s3cret"}, "image": "nvcr.io/nvidia/pytorch:24.01-py3",
           "checkpoint_uri": "s3://ckpt/5", "restore_from": ""}
    raw.update(extra)
    return Assignment.from_json(raw)


def test_the_pod_is_pinned_by_affinity_asks_for_whole_gpus_and_keeps_secrets_out_of_its_spec():
    a = assignment()
    manifest = pod_manifest(a, node=gpu_node(node()), namespace="ml", broker_id="wz", node_id="42",
                            default_image="python:3.11-slim", tolerations=[{"key": "dedicated", "operator": "Exists"}])
    spec, container = manifest["spec"], manifest["spec"]["containers"][0]
    assert manifest["metadata"]["name"] == pod_name(a) == "wz-5-17" and manifest["metadata"]["namespace"] == "ml"
    assert manifest["metadata"]["labels"]["whalezen.io/broker"] == "wz"
    assert manifest["metadata"]["labels"]["whalezen.io/job"] == "5"
    assert "nodeName" not in spec  # kube-scheduler still binds it
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-a.dc1"]},
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"}}
    assert container["image"] == "nvcr.io/nvidia/pytorch:24.01-py3" and container["command"] == ["python", "train.py"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {"key": "dedicated", "operator": "Exists"} in spec["tolerations"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert "s3cret" not in repr(manifest) and "env" not in container
    assert container["envFrom"] == [{"secretRef": {"name": "wz-5-17"}}]
    assert manifest["metadata"]["annotations"] == {CHECKPOINT_ANNOTATION: ""}

    secret = env_secret(a, namespace="ml", broker_id="wz", node_id="42",
                        owner={"metadata": {"name": "wz-5-17", "uid": "u-1"}})
    env = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert env["API_KEY"] == "s3cret" and env["LR"] == "0.1" and env["WHALEZEN_JOB_ID"] == "5"
    assert env["WHALEZEN_CHECKPOINT_URI"] == "s3://ckpt/5" and env["WHALEZEN_RESTORE_FROM"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin says which GPUs; the job cannot pick others
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # deleted with its Pod


def test_a_shell_command_and_a_job_without_an_image():
    a = assignment(command="echo hi && sleep 1", image=None)
    manifest = pod_manifest(a, node=gpu_node(node(product="")), namespace="ml", broker_id="wz", node_id=None,
                            default_image="python:3.11-slim")
    container = manifest["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c", "echo hi && sleep 1"]
    assert container["image"] == "python:3.11-slim"
    terms = manifest["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [e["key"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]] == ["kubernetes.io/hostname"]
    long = assignment(id="9" * 80)
    assert len(pod_name(long)) <= 63 and pod_name(long) != pod_name(assignment(id="9" * 81))


def test_a_multi_node_job_gets_stable_dns_names_for_its_peers_and_rank_0_a_headless_service():
    gang = {"rank": 1, "node_addresses": ["10.0.0.1", "10.0.0.2"], "gpus_per_node": 8, "master_port": 29500}
    rank1 = assignment(gang=gang)
    manifest = pod_manifest(rank1, node=gpu_node(node()), namespace="ml", broker_id="wz", node_id="42",
                            default_image="python:3.11-slim")
    assert (manifest["spec"]["hostname"], manifest["spec"]["subdomain"]) == ("wz-5-r1", "wz-5")
    env = job_env(rank1, node_id="42", namespace="ml")
    # The bridge's address is no Pod's: the peers are the Pods' DNS names under the job's headless Service.
    assert env["MASTER_ADDR"] == "wz-5-r0.wz-5.ml.svc"
    assert env["WHALEZEN_NODE_IPS"] == "wz-5-r0.wz-5.ml.svc\nwz-5-r1.wz-5.ml.svc"
    assert env["WHALEZEN_NODE_RANK"] == "1" and env["MASTER_PORT"] == "29500"
    assert gang_service(rank1, namespace="ml", broker_id="wz", owner={"metadata": {"name": "p"}}) is None
    rank0 = assignment(gang={**gang, "rank": 0})
    service = gang_service(rank0, namespace="ml", broker_id="wz", owner={"metadata": {"name": "wz-5-17", "uid": "u"}})
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"whalezen.io/job": "5"}
    assert service["metadata"]["ownerReferences"][0]["uid"] == "u"
    single = assignment(gang={**gang, "rank": 0, "node_addresses": ["10.0.0.1"]})
    assert "hostname" not in pod_manifest(single, node=gpu_node(node()), namespace="ml", broker_id="wz",
                                          node_id=None, default_image="x")["spec"]
    assert job_env(single, node_id=None, namespace="ml")["MASTER_ADDR"] == "127.0.0.1"  # its own Pod


def test_a_node_tainted_beyond_what_the_pool_tolerates_is_left_out():
    tainted = gpu_node({**node(), "spec": {"taints": [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},  # every Pod of ours tolerates it
        {"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
        {"key": "prefer-not", "value": "x", "effect": "PreferNoSchedule"}]}})
    assert untolerated_taints(tainted, []) == ["dedicated=inference:NoSchedule"]
    assert untolerated_taints(tainted, [{"key": "dedicated", "operator": "Equal", "value": "inference",
                                         "effect": "NoSchedule"}]) == []
    assert untolerated_taints(tainted, [{"key": "dedicated", "operator": "Exists"}]) == []
    assert untolerated_taints(tainted, [{"key": "dedicated", "operator": "Equal", "value": "training"}]) != []
    assert untolerated_taints(tainted, [{"operator": "Exists"}]) == []  # tolerates everything
