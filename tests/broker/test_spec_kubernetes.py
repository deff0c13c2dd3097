"""Kubernetes Pods, batch/v1 Jobs and Pod templates as job specs: the native spec each must become,
each refused field with its message, and hostile values answered by field, never by a crash."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from broker.inventory.gpu_catalog import DEFAULT_GPU_MODELS
from broker.jobs.formats.common import FormatError, Translation
from broker.jobs.formats.kubernetes import looks_like_kubernetes, translate_kubernetes
from broker.jobs.spec import GpuCatalog, JobSpecSerializer

CATALOG = GpuCatalog([(name, memory, aliases) for name, memory, _, _, aliases in DEFAULT_GPU_MODELS])


def pod(container: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """A minimal GPU Pod; `container` entries and pod `spec` entries replace the defaults."""
    base = {"name": "main", "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "train.py"],
            "resources": {"limits": {"nvidia.com/gpu": 1}}}
    base.update(container or {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"},
            "spec": {"containers": [base], **spec}}


def errors_of(doc: Any) -> dict[str, str]:
    with pytest.raises(FormatError) as caught:
        translate_kubernetes(doc)
    return caught.value.errors


def warned(translation: Translation) -> dict[str, str]:
    return {w.field: w.message for w in translation.warnings}


def demand(spec: dict[str, Any]) -> dict[str, Any]:
    """What the native serializer makes of a translated spec (the lead names a nameless job)."""
    # `format` is how the spec was written: intake keeps it beside the validated fields, not in them.
    body = {"name": "generated", **{k: v for k, v in spec.items() if k != "format"}}
    serializer = JobSpecSerializer(data=body, context={"gpu_catalog": CATALOG})
    assert serializer.is_valid(), serializer.errors
    return serializer.validated_data["_demand"].as_dict()


C0 = "spec.containers[0]"


# -- accepted forms ---------------------------------------------------------------------------------
def test_the_design_notes_pod_on_a_gfd_product_label():
    doc = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "llm-finetune"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "containers": [{
                "name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "command": ["python", "finetune.py"], "args": ["--epochs", "3"],
                "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": "32", "memory": "256Gi"},
                              "requests": {"nvidia.com/gpu": 8, "cpu": "16", "memory": "128Gi"}},
            }],
        },
    }
    translation = translate_kubernetes(doc)
    assert translation.spec == {
        "format": "kubernetes", "name": "llm-finetune", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
        "command": ["python", "finetune.py", "--epochs", "3"],
        "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": "32", "memory": "256Gi"}, "gpu_models": ["H100-80GB"]},
    }
    assert translation.warnings == [] and translation.problems == []
    got = demand(translation.spec)
    assert (got["gpus_per_node"], got["gpu_models"], got["cpu_milli"], got["memory_mb"]) == \
        (8, ["H100-80GB"], 32000, 256 * 1024)


def test_a_pytorch_batch_job_with_torchrun_and_a_product_selector():
    doc = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "resnet50-ddp", "namespace": "vision", "labels": {"team": "vision"}},
        "spec": {
            "backoffLimit": 2, "completions": 1, "parallelism": 1, "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": {"app": "resnet"}},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "pytorch", "image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["torchrun", "--nproc_per_node=4", "train.py"],
                        "args": ["--data", "$(DATA_DIR)", "--batch-size", "256"],
                        "env": [{"name": "DATA_DIR", "value": "/data/imagenet"},
                                {"name": "NCCL_DEBUG", "value": "INFO"}],
                        "resources": {"limits": {"nvidia.com/gpu": "4", "memory": "128Gi"},
                                      "requests": {"nvidia.com/gpu": 4, "cpu": "16", "memory": "64Gi"}},
                    }],
                },
            },
        },
    }
    translation = translate_kubernetes(doc)
    assert translation.spec == {
        "format": "kubernetes", "name": "resnet50-ddp", "image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
        "env": {"DATA_DIR": "/data/imagenet", "NCCL_DEBUG": "INFO"},
        # Kubernetes expands $(VAR) from the container's env in command and args; so do we.
        "command": ["torchrun", "--nproc_per_node=4", "train.py", "--data", "/data/imagenet", "--batch-size", "256"],
        # cpu has only a request: that is the demand; memory's limit wins over its request.
        "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "16", "memory": "128Gi"}, "gpu_models": ["A100-80GB"]},
    }
    assert set(warned(translation)) == {
        "spec.backoffLimit", "spec.ttlSecondsAfterFinished", "metadata.namespace", "metadata.labels",
        "spec.template.metadata.labels", "spec.template.spec.restartPolicy", "spec.template.spec.tolerations",
        "spec.template.spec.containers[0].imagePullPolicy",
    }
    assert "not retry" in warned(translation)["spec.backoffLimit"]
    got = demand(translation.spec)
    assert (got["gpus_per_node"], got["cpu_milli"], got["memory_mb"]) == (4, 16000, 128 * 1024)


def test_a_job_without_a_name_takes_its_templates_name_or_none():
    doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {},
           "spec": {"template": {"metadata": {"name": "inner"}, "spec": pod()["spec"]}}}
    assert translate_kubernetes(doc).spec["name"] == "inner"
    del doc["spec"]["template"]["metadata"]
    assert "name" not in translate_kubernetes(doc).spec  # the caller generates one


def test_generate_name_gives_the_name_without_its_dash():
    doc = pod()
    doc["metadata"] = {"generateName": "sweep-"}
    assert translate_kubernetes(doc).spec["name"] == "sweep"


def test_a_pod_template_kind_and_a_bare_template():
    template = {"metadata": {"name": "from-template"}, "spec": pod()["spec"]}
    kind = translate_kubernetes({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "tpl"},
                                 "template": template})
    assert kind.spec["name"] == "tpl" and kind.spec["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    bare = translate_kubernetes(copy.deepcopy(template))
    assert bare.spec == {"format": "kubernetes", "name": "from-template", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                         "command": ["python", "train.py"], "resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert errors_of({"spec": {"containers": [{"image": "x"}]}}) == {
        "spec.containers[0].resources.limits": "Ask for GPUs with nvidia.com/gpu: WhaleZen runs GPU jobs."}


def test_which_documents_look_like_kubernetes():
    assert looks_like_kubernetes(pod())
    assert looks_like_kubernetes({"apiVersion": "apps/v1", "kind": "Deployment"})  # then refused, by field
    assert looks_like_kubernetes({"metadata": {}, "spec": {"containers": []}})
    assert not looks_like_kubernetes({"name": "x", "command": ["a"], "resources": {"gpus": 1}})
    assert not looks_like_kubernetes({"name": "x", "run": "python t.py", "resources": {"accelerators": "T4"}})
    assert not looks_like_kubernetes(["apiVersion", "kind"])


# -- node selection ---------------------------------------------------------------------------------
def required(*expressions: dict[str, Any], terms: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    terms = terms if terms is not None else [{"matchExpressions": list(expressions)}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


AFF = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"


def test_affinity_in_with_two_products_gives_two_alternative_models():
    doc = pod(affinity=required({"key": "nvidia.com/gpu.product", "operator": "In",
                                 "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"]}))
    spec = translate_kubernetes(doc).spec
    assert spec["resources"]["gpu_models"] == ["H100-80GB", "A100-80GB"]
    assert demand(spec)["gpu_models"] == ["A100-80GB", "H100-80GB"]


def test_several_terms_are_alternatives_of_product_only():
    terms = [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"]}]},
             {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]
    assert translate_kubernetes(pod(affinity=required(terms=terms))).spec["resources"]["gpu_models"] == ["T4", "L4"]
    terms[1]["matchExpressions"][0] = {"key": "team", "operator": "In", "values": ["a"]}
    assert "Several terms (OR)" in errors_of(pod(affinity=required(terms=terms)))[f"{AFF}[1]"]


def test_node_selector_and_affinity_both_hold():
    doc = pod(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
              affinity=required({"key": "nvidia.com/gpu.product", "operator": "In",
                                 "values": ["NVIDIA-H100-80GB-HBM3", "A100-80GB"]}))
    assert translate_kubernetes(doc).spec["resources"]["gpu_models"] == ["A100-80GB"]
    doc["spec"]["nodeSelector"]["nvidia.com/gpu.product"] = "Tesla-T4"
    assert errors_of(doc) == {f"{AFF}[0].matchExpressions[0]":
                              "No GPU model satisfies every nvidia.com/gpu.product requirement."}


@pytest.mark.parametrize("product, model", [
    ("NVIDIA-H100-80GB-HBM3", "H100-80GB"), ("Tesla-T4", "T4"), ("NVIDIA-A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA-H200", "H200-141GB"), ("nvidia-l40s", "L40S"), ("Tesla-T4-SHARED", "T4"), ("A100-80GB", "A100-80GB"),
    ("Tesla-V100-SXM2-16GB", "V100-16GB"),
])
def test_gfd_product_spellings_map_to_catalogue_models(product, model):
    spec = translate_kubernetes(pod(nodeSelector={"nvidia.com/gpu.product": product})).spec
    assert spec["resources"]["gpu_models"] == [model]
    assert demand(spec)["gpu_models"] == [model]


def test_an_unknown_product_lists_the_known_ones():
    message = errors_of(pod(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-B200"}))["spec.nodeSelector"]
    assert message.startswith("Unknown GPU product 'NVIDIA-B200'. Known: H200-141GB, H100-80GB, A100-80GB")
    assert len(message) <= 200


@pytest.mark.parametrize("selector, gb", [
    ({"nvidia.com/gpu.memory": "81920"}, 80),  # GFD's MiB for an 80 GB A100
    ({"nvidia.com/gpu.memory": "81559"}, 79),  # an H100's usable MiB: still every 80 GB model
    ({"nvidia.com/gpu.memory": "512"}, None),  # under 1 GB asks for nothing
])
def test_gpu_memory_label_is_a_minimum_in_whole_gb(selector, gb):
    spec = translate_kubernetes(pod(nodeSelector=selector)).spec
    assert spec["resources"].get("min_gpu_memory_gb") == gb


def test_gpu_memory_affinity_in_takes_the_smallest_and_gt_more_than_the_value():
    memory_in = {"key": "nvidia.com/gpu.memory", "operator": "In", "values": ["81920", "40960"]}
    assert translate_kubernetes(pod(affinity=required(memory_in))).spec["resources"]["min_gpu_memory_gb"] == 40
    memory_gt = {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40960"]}
    spec = translate_kubernetes(pod(affinity=required(memory_gt))).spec
    assert spec["resources"]["min_gpu_memory_gb"] == 41
    memory_lt = {"key": "nvidia.com/gpu.memory", "operator": "Lt", "values": ["40960"]}
    assert "only a number, In or Gt" in errors_of(pod(affinity=required(memory_lt)))[f"{AFF}[0].matchExpressions[0]"]


def test_gpu_count_label_must_equal_the_gpu_limit():
    ok = pod({"resources": {"limits": {"nvidia.com/gpu": 8}}}, nodeSelector={"nvidia.com/gpu.count": "8"})
    assert translate_kubernetes(ok).spec["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    bad = pod({"resources": {"limits": {"nvidia.com/gpu": 4}}}, nodeSelector={"nvidia.com/gpu.count": "8"})
    assert errors_of(bad) == {f"{C0}.resources.limits": "nvidia.com/gpu is 4 but nvidia.com/gpu.count selects "
                              "nodes with 8: WhaleZen reads the count as the job's GPUs; make them equal."}


def test_own_node_labels_region_and_os():
    doc = pod(nodeSelector={"site": "lab-b", "kubernetes.io/os": "linux"},
              affinity=required({"key": "topology.kubernetes.io/region", "operator": "In",
                                 "values": ["eu-west-1", "eu-central-1"]},
                                {"key": "fabric", "operator": "In", "values": ["ib"]}))
    translation = translate_kubernetes(doc)
    assert translation.spec["placement"] == {"node_selector": {"site": "lab-b", "fabric": "ib"},
                                             "regions": ["eu-west-1", "eu-central-1"]}
    assert warned(translation) == {"spec.nodeSelector": "kubernetes.io/os=linux holds on every WhaleZen node."}
    assert demand(translation.spec)["regions"] == ["eu-central-1", "eu-west-1"]


def test_preferred_affinity_is_a_warning():
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]}}]}}
    translation = translate_kubernetes(pod(affinity=affinity))
    assert "placement" not in translation.spec
    assert warned(translation) == {"spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution":
                                   "Ignored for placement: only required node affinity is honoured."}


@pytest.mark.parametrize("expression, message", [
    ({"key": "nvidia.com/gpu.product", "operator": "NotIn", "values": ["Tesla-T4"]}, "only In (and Exists)"),
    ({"key": "nvidia.com/gpu.family", "operator": "In", "values": ["hopper"]}, "WhaleZen reads nvidia.com/gpu.product"),
    ({"key": "site", "operator": "In", "values": ["a", "b"]}, "only equality is supported"),
    ({"key": "site", "operator": "Exists"}, "only equality is supported"),
    ({"key": "kubernetes.io/os", "operator": "In", "values": ["windows"]}, "nodes run Linux"),
    ({"key": "site", "operator": "In", "values": ["not a label!"]}, "Kubernetes label syntax"),
    ({"key": "site", "operator": "Near", "values": ["a"]}, "Must be In, NotIn"),
])
def test_refused_affinity_expressions(expression, message):
    errors = errors_of(pod(affinity=required(expression)))
    assert message in " ".join(errors.values()), errors
    assert all(path.startswith(f"{AFF}[0].matchExpressions[0]") for path in errors)


def test_match_fields_and_pod_affinity_are_refused():
    terms = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
    assert "matchFields (node names) is not supported" in errors_of(pod(affinity=required(terms=terms)))[
        f"{AFF}[0].matchFields"]
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "x"}]}}
    assert errors_of(pod(affinity=anti)) == {
        "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution":
            "Not supported: WhaleZen does not place jobs relative to other pods."}


# -- the container ----------------------------------------------------------------------------------
def test_args_without_command_is_refused_since_the_entrypoint_is_unknown():
    errors = errors_of(pod({"command": None, "args": ["--epochs", "3"]}))
    assert errors == {f"{C0}.args": "args without command is not supported: WhaleZen cannot know the image's "
                                    "ENTRYPOINT; give the whole argv in command."}


def test_an_image_without_command_runs_the_images_own():
    spec = translate_kubernetes(pod({"command": None})).spec
    assert "command" not in spec and spec["image"] == "nvcr.io/nvidia/pytorch:24.05-py3"


def test_variable_references_follow_kubernetes():
    container = {"env": [{"name": "ROOT", "value": "/data"}, {"name": "OUT", "value": "$(ROOT)/out"},
                         {"name": "EMPTY"}],
                 "command": ["sh", "-c", "echo $(OUT) $$(ROOT) $(UNDEFINED) $$HOME"]}
    spec = translate_kubernetes(pod(container)).spec
    assert spec["env"] == {"ROOT": "/data", "OUT": "/data/out", "EMPTY": ""}
    assert spec["command"] == ["sh", "-c", "echo /data/out $(ROOT) $(UNDEFINED) $HOME"]


def test_env_entries():
    duplicate = translate_kubernetes(pod({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}))
    assert duplicate.spec["env"] == {"A": "2"}
    assert "last value wins" in warned(duplicate)[f"{C0}.env[1].name"]
    assert errors_of(pod({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})) == {
        f"{C0}.env[0].valueFrom": "valueFrom (secrets, config maps, fields) is not supported: give the value itself."}
    assert errors_of(pod({"env": [{"name": "PORT", "value": 8080}]})) == {
        f"{C0}.env[0].value": "Must be a string (quote numbers, as Kubernetes requires)."}
    assert errors_of(pod({"env": [{"name": "1BAD", "value": "x"}]})) == {
        f"{C0}.env[0].name": "'1BAD' is not a valid environment variable name."}


# -- resources --------------------------------------------------------------------------------------
@pytest.mark.parametrize("resources, path, message", [
    ({"requests": {"nvidia.com/gpu": 2}}, "requests",
     "nvidia.com/gpu in requests needs the same number in limits, as Kubernetes requires."),
    ({"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}}, "requests",
     "nvidia.com/gpu in requests must equal limits, as Kubernetes requires."),
    ({"limits": {"nvidia.com/gpu": 1, "cpu": "2"}, "requests": {"cpu": "4"}}, "requests",
     "The cpu request must not exceed its limit, as Kubernetes requires."),
    ({"limits": {"cpu": "8"}}, "limits", "Ask for GPUs with nvidia.com/gpu: WhaleZen runs GPU jobs."),
    ({"limits": {"nvidia.com/gpu": 1, "amd.com/gpu": 1}}, "limits",
     "Unsupported resource 'amd.com/gpu': WhaleZen takes nvidia.com/gpu, cpu and memory."),
    ({"limits": {"nvidia.com/gpu": 1, "memory": "lots"}}, "limits", 'memory must look like "32Gi", "512Mi" or "64G".'),
    ({"limits": {"nvidia.com/gpu": 65}}, "limits", "nvidia.com/gpu must be an integer from 1 to 64."),
    ({"limits": {"nvidia.com/gpu": 1}, "claims": [{"name": "gpu"}]}, "claims", "Resource claims are not supported"),
])
def test_refused_resources(resources, path, message):
    errors = errors_of(pod({"resources": resources}))
    assert errors[f"{C0}.resources.{path}"].startswith(message), errors


def test_equal_gpu_requests_in_another_spelling_and_ephemeral_storage():
    translation = translate_kubernetes(pod({"resources": {
        "limits": {"nvidia.com/gpu": 2, "ephemeral-storage": "100Gi"}, "requests": {"nvidia.com/gpu": "2"}}}))
    assert translation.spec["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert warned(translation) == {f"{C0}.resources.limits": "ephemeral-storage is not reserved: the job uses the "
                                                             "node's disk."}


# -- refused and warned fields ----------------------------------------------------------------------
SIDECAR = {"name": "logs", "image": "busybox", "command": ["tail", "-f", "/dev/null"]}


@pytest.mark.parametrize("doc, path, message", [
    (pod(volumes=[{"name": "data", "emptyDir": {}}]), "spec.volumes", "Volumes are not supported"),
    (pod(initContainers=[SIDECAR]), "spec.initContainers", "Init containers are not supported"),
    (pod(securityContext={"runAsUser": 0}), "spec.securityContext", "A securityContext is not supported"),
    (pod({"securityContext": {"privileged": True}}), f"{C0}.securityContext", "A securityContext is not supported"),
    (pod(hostNetwork=True), "spec.hostNetwork", "hostNetwork is not supported"),
    (pod(hostPID=True), "spec.hostPID", "hostPID is not supported"),
    (pod(hostIPC=True), "spec.hostIPC", "hostIPC is not supported"),
    (pod(nodeName="gpu-07"), "spec.nodeName", "Pinning a node by name is not supported"),
    (pod(imagePullSecrets=[{"name": "regcred"}]), "spec.imagePullSecrets", "Registry credentials are not supported"),
    (pod({"ports": [{"containerPort": 8080, "hostPort": 8080}]}), f"{C0}.ports[0].hostPort",
     "hostPort is not supported"),
    (pod({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}), f"{C0}.volumeMounts", "Volumes are not"),
    (pod({"envFrom": [{"secretRef": {"name": "s"}}]}), f"{C0}.envFrom", "envFrom is not supported"),
    (pod({"lifecycle": {"preStop": {"exec": {"command": ["x"]}}}}), f"{C0}.lifecycle", "Lifecycle hooks are not"),
    (pod({"workingDir": "/work"}), f"{C0}.workingDir", "workingDir is not supported: change directory in the"),
    (pod({"image": None}), f"{C0}.image", "The container needs an image."),
    (pod(restartPolicy="Always"), "spec.restartPolicy", "Always is not supported: a WhaleZen job runs once"),
    (pod(frobnicate=True), "spec", "Not supported here: 'frobnicate'."),
    (pod({"gpuMagic": 1}), C0, "Not supported here: 'gpuMagic'."),
    ({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {}}, "kind",
     "Only a v1 Pod, a batch/v1 Job and a v1 PodTemplate can be submitted (not 'Deployment' of 'apps/v1')."),
    ({"apiVersion": "v1", "kind": "Job", "spec": {}}, "apiVersion", "A Job is apiVersion batch/v1."),
    ({"apiVersion": "v1", "kind": "Pod"}, "spec", "A Pod needs its spec."),
])
def test_refused_fields(doc, path, message):
    errors = errors_of(doc)
    assert path in errors and errors[path].startswith(message), errors


def test_one_container_only_even_without_gpus_in_the_sidecar():
    doc = pod()
    doc["spec"]["containers"].append(SIDECAR)
    assert errors_of(doc) == {"spec.containers": "Exactly one container is supported, not 2: do a sidecar's work "
                                                 "in the one container."}


@pytest.mark.parametrize("key, value", [("completions", 4), ("parallelism", 2), ("parallelism", 0),
                                        ("completions", True)])
def test_a_job_is_one_pod(key, value):
    doc = {"apiVersion": "batch/v1", "kind": "Job", "spec": {key: value, "template": {"spec": pod()["spec"]}}}
    assert errors_of(doc)[f"spec.{key}"].startswith("Must be 1: a WhaleZen job is one pod")


def test_a_suspended_job_is_refused():
    doc = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"suspend": True, "template": {"spec": pod()["spec"]}}}
    assert errors_of(doc) == {"spec.suspend": "A suspended Job is not supported: submit it when it should run."}


def test_refused_fields_that_ask_for_nothing_are_accepted():
    doc = pod({"securityContext": {}, "volumeMounts": []}, hostNetwork=False, volumes=[], securityContext={},
              initContainers=None, restartPolicy="Never")
    translation = translate_kubernetes(doc)
    assert translation.warnings == [] and translation.spec["resources"] == {"limits": {"nvidia.com/gpu": 1}}


@pytest.mark.parametrize("doc, path", [
    (pod(terminationGracePeriodSeconds=30), "spec.terminationGracePeriodSeconds"),
    (pod(activeDeadlineSeconds=3600), "spec.activeDeadlineSeconds"),
    (pod(tolerations=[{"operator": "Exists"}]), "spec.tolerations"),
    (pod(runtimeClassName="nvidia"), "spec.runtimeClassName"),
    (pod(serviceAccountName="trainer"), "spec.serviceAccountName"),
    (pod(priorityClassName="team-a-batch"), "spec.priorityClassName"),
    (pod(restartPolicy="OnFailure"), "spec.restartPolicy"),
    (pod({"imagePullPolicy": "Always"}), f"{C0}.imagePullPolicy"),
    (pod({"livenessProbe": {"exec": {"command": ["true"]}}}), f"{C0}.livenessProbe"),
    (pod({"ports": [{"containerPort": 29500}]}), f"{C0}.ports"),
    (pod({"terminationMessagePath": "/dev/termination-log"}), f"{C0}.terminationMessagePath"),
    ({**pod(), "status": {"phase": "Pending"}}, "status"),
    ({**pod(), "metadata": {"name": "x", "annotations": {"a": "b"}, "uid": "123"}}, "metadata.annotations"),
])
def test_fields_that_do_not_change_the_run_are_warned_about(doc, path):
    translation = translate_kubernetes(doc)
    assert path in warned(translation), translation.warnings
    assert translation.spec["resources"]["limits"] == {"nvidia.com/gpu": 1}  # the run itself is unchanged


def test_a_priority_class_named_like_ours_sets_the_priority():
    spec = translate_kubernetes(pod(priorityClassName="high")).spec
    assert spec["priority"] == "high"
    assert demand(spec)  # the native serializer takes it


# -- hostile input ----------------------------------------------------------------------------------
FULL = {
    "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "generateName": "t-"},
    "spec": {"backoffLimit": 0, "completions": 1, "parallelism": 1, "template": {"metadata": {"labels": {"a": "b"}},
             "spec": {
        "restartPolicy": "Never", "priorityClassName": "high", "tolerations": [{}],
        "nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": "1", "team": "v"},
        "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["10000"]},
                {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["eu"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{}]}},
        "containers": [{"name": "t", "image": "img", "command": ["a"], "args": ["b"],
                        "env": [{"name": "X", "value": "1"}],
                        "ports": [{"containerPort": 80}],
                        "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "1", "memory": "1Gi"},
                                      "requests": {"cpu": "500m", "ephemeral-storage": "1Gi"}}}]}}},
}
HOSTILE = [None, 0, -1, 1.5, True, "x", "", [], {}, [[]], [None], {"a": {}}, {"key": 1}, "A" * 10000,
           list(range(5000)), [{}] * 3000, 10**30, 10**5000, float("nan"), "\x00", {"$(X)": "y"}, [1, "a"], {1: 2}]


def _paths(value: Any, path: tuple = ()):
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*path, index))


def test_the_full_manifest_translates():
    spec = translate_kubernetes(FULL).spec
    assert spec["resources"] == {"limits": {"nvidia.com/gpu": 1, "cpu": "1", "memory": "1Gi"},
                                 "gpu_models": ["T4"], "min_gpu_memory_gb": 10}
    assert spec["placement"] == {"node_selector": {"team": "v"}, "regions": ["eu"]}
    assert demand(spec)["gpu_models"] == ["T4"]


def test_any_value_anywhere_is_answered_by_field_never_by_a_crash():
    answered = 0
    for path in _paths(FULL):
        for hostile in HOSTILE:
            doc = copy.deepcopy(FULL)
            if not path:
                doc = hostile
            else:
                target = doc
                for key in path[:-1]:
                    target = target[key]
                target[path[-1]] = hostile
            try:
                translation = translate_kubernetes(doc)
            except FormatError as exc:
                assert exc.errors and all(isinstance(k, str) and isinstance(v, str) and len(v) <= 200
                                          for k, v in exc.errors.items())
                answered += 1
            else:
                assert translation.spec["format"] == "kubernetes"
    assert answered > 500  # most of these replacements are wrong and said so


def test_huge_lists_are_refused_quickly_by_field():
    doc = pod()
    doc["spec"]["containers"] = doc["spec"]["containers"] * 10000
    assert errors_of(doc) == {"spec.containers": "Exactly one container is supported, not 10000: do a sidecar's "
                                                 "work in the one container."}
    many = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["Tesla-T4"] * 1000}
    assert errors_of(pod(affinity=required(many))) == {f"{AFF}[0].matchExpressions[0].values": "At most 32 values."}
    assert errors_of(pod(nodeSelector={f"l{i}": "v" for i in range(1000)})) == {"spec.nodeSelector":
                                                                                "At most 64 labels."}


@pytest.mark.parametrize("doc, errors", [
    ([], {"body": "A Kubernetes manifest must be an object."}),
    ({"apiVersion": ["v1"], "kind": {"Pod": 1}}, {"kind": "Only a v1 Pod, a batch/v1 Job and a v1 PodTemplate can "
                                                          "be submitted."}),
    ({**pod(), "metadata": "train"}, {"metadata": "Must be an object."}),
    (pod({"command": "python train.py"}), {f"{C0}.command": "Must be a list."}),
    (pod({"command": ["python", 3]}), {f"{C0}.command[1]": "Must be a string (quote numbers, as Kubernetes "
                                                          "requires)."}),
    (pod(nodeSelector={"nvidia.com/gpu.product": True}), {"spec.nodeSelector": "'nvidia.com/gpu.product': the value "
                                                          "must be a string (quote it, as Kubernetes requires)."}),
    (pod({"resources": {"limits": {"nvidia.com/gpu": 10**5000}}}),
     {f"{C0}.resources.limits": "nvidia.com/gpu must be an integer from 1 to 64."}),
    (pod({"resources": {"limits": {"nvidia.com/gpu": 1, "memory": 10**5000}}}),
     {f"{C0}.resources.limits": 'Quantities must look like 2, "8", "500m" or "32Gi".'}),
])
def test_wrong_types_are_named_by_field(doc, errors):
    assert errors_of(doc) == errors
