"""The Pod (and its env Secret) that runs one assignment on a Kubernetes node. Pure: dicts out.

How the Pod is pinned, as SkyPilot, dstack and Kueue do it: required node affinity on
`kubernetes.io/hostname` and on the GPU product label, so kube-scheduler still binds the Pod (it keeps
checking resources, taints and the device plugin's count); never `spec.nodeName`, which skips all of that.
`limits` and `requests` of `nvidia.com/gpu` are equal (the device plugin requires it) and whole: the
device plugin picks which GPUs, so the broker's GPU indices are only a count here.

The job's environment (its secrets included) goes into a Secret the Pod reads with `envFrom`, not into
the Pod spec, which everyone who may list Pods in the namespace can read. The Secret is created after
the Pod with the Pod as its owner, so Kubernetes deletes it with the Pod.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.checkpoint.checkpointer import NOTICE_LOG_ENV
from agent.gang import Gang
from agent.jobs import CHECKPOINT_REQUEST_FILE, RESERVED_ENV, Assignment
from agent.kube.inventory import (ASSIGNMENT_LABEL, BROKER_LABEL, GPU_RESOURCE, HOSTNAME_LABEL, JOB_LABEL,
                                  PRODUCT_LABEL, GpuNode)

CONTAINER_NAME = "job"
MANAGED_BY = {"app.kubernetes.io/managed-by": "whalezen"}
# The checkpoint request reaches the job as a file, as on agent nodes: the bridge writes it into this
# annotation, and a downward-API volume shows the annotation as a file the kubelet keeps current (it
# refreshes such files on its sync period, about a minute; a job polls the file between steps).
CHECKPOINT_ANNOTATION = "whalezen.io/checkpoint-request"
REQUEST_DIR = "/var/run/whalezen"
WORK_DIR = "/var/run/whalezen/work"
# What the job's checkpoint helper writes when it has saved (agent/notices.py): the container's
# termination message, so the bridge reads it from the Pod's status when the job exits (4 KiB at most).
NOTICE_FILE = "whalezen-checkpoint-written.json"


def pod_name(assignment: Assignment) -> str:
    """`wz-<job>-<assignment>`: a DNS-1123 label, unique per assignment, so a retried create meets
    409 AlreadyExists instead of making a second Pod."""
    raw = f"wz-{assignment.job_id}-{assignment.id}".lower()
    name = re.sub(r"[^a-z0-9-]", "-", raw).strip("-")
    if len(name) > 63:
        name = name[:54].rstrip("-") + "-" + hashlib.sha256(raw.encode()).hexdigest()[:8]
    return name


def job_env(assignment: Assignment, *, node_id: str | None, namespace: str) -> dict[str, str]:
    """The job's variables: its own, then what the agent sets on any node (the job's ids, checkpoint
    and restore locations, its gang). No CUDA_VISIBLE_DEVICES: the device plugin sets the GPUs."""
    env = {k: v for k, v in assignment.env.items() if k not in RESERVED_ENV}
    env.update({
        "WHALEZEN_JOB_ID": assignment.job_id,
        "WHALEZEN_ASSIGNMENT_ID": assignment.id,
        "WHALEZEN_EPOCH": str(assignment.epoch),
        "WHALEZEN_WORK_DIR": WORK_DIR,
        "WHALEZEN_CHECKPOINT_REQUEST_FILE": f"{REQUEST_DIR}/{CHECKPOINT_REQUEST_FILE}",
        # The bridge shares no file system with the Pod: the helper prints its notice, read from the log.
        NOTICE_LOG_ENV: "1",
    })
    if node_id:
        env["WHALEZEN_NODE_ID"] = node_id
    if assignment.checkpoint_uri:
        env["WHALEZEN_CHECKPOINT_URI"] = assignment.checkpoint_uri
    if assignment.restore_from is not None:
        env["WHALEZEN_RESTORE_FROM"] = assignment.restore_from
    gang = pod_gang(assignment, namespace=namespace)
    if gang is not None:
        env.update(gang.environment())
    return env


def gang_service_name(assignment: Assignment) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"wz-{assignment.job_id}".lower())[:63].strip("-")


def gang_hostname(assignment: Assignment, rank: int) -> str:
    return f"{gang_service_name(assignment)[:55]}-r{rank}"


def pod_gang(assignment: Assignment, *, namespace: str) -> Gang | None:
    """The assignment's gang with its peers' addresses as Kubernetes sees them. A Pod's address is not
    known before it runs, and the broker's node addresses are the bridge's: so each rank's Pod gets a stable
    DNS name, `<hostname>.<headless service>.<namespace>.svc`, which MASTER_ADDR and WHALEZEN_NODE_IPS carry."""
    gang = assignment.gang
    if gang is None:
        return None
    if gang.size == 1:  # a gang of one rendezvous with itself: inside its Pod, not at the bridge's address
        return dataclasses.replace(gang, addresses=("127.0.0.1",))
    service = gang_service_name(assignment)
    return dataclasses.replace(gang, addresses=tuple(f"{gang_hostname(assignment, rank)}.{service}.{namespace}.svc"
                                                     for rank in range(gang.size)))


def gang_service(assignment: Assignment, *, namespace: str, broker_id: str,
                 owner: Mapping[str, Any]) -> dict[str, Any] | None:
    """For a multi-node job, the headless Service that gives its Pods their DNS names (made by rank 0,
    owned by its Pod, so it goes with it); None for a job of one node."""
    gang = assignment.gang
    if gang is None or gang.size <= 1 or gang.rank != 0:
        return None
    metadata = owner.get("metadata") or {}
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": gang_service_name(assignment), "namespace": namespace,
                     "labels": labels_of(assignment, broker_id),
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": metadata.get("name"),
                                          "uid": metadata.get("uid") or "", "blockOwnerDeletion": False}]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,  # peers resolve before they are Ready
                 "selector": {JOB_LABEL: _label_value(assignment.job_id)},
                 "ports": [{"name": "rendezvous", "port": gang.master_port}]},
    }


def _container_command(assignment: Assignment) -> dict[str, Any]:
    if isinstance(assignment.command, str):
        return {"command": ["/bin/sh", "-c", assignment.command]}
    if assignment.command:
        return {"command": list(assignment.command)}
    return {}  # an image job without a command: the image's own entrypoint


def labels_of(assignment: Assignment, broker_id: str) -> dict[str, str]:
    return {**MANAGED_BY, BROKER_LABEL: broker_id, JOB_LABEL: _label_value(assignment.job_id),
            ASSIGNMENT_LABEL: _label_value(assignment.id)}


def _label_value(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)[:63].strip("_.-") or "x"


def pod_manifest(assignment: Assignment, *, node: GpuNode, namespace: str, broker_id: str, node_id: str | None,
                 default_image: str, tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    name = pod_name(assignment)
    gpus = str(len(assignment.gpu_indices))
    match = [{"key": HOSTNAME_LABEL, "operator": "In", "values": [node.hostname]}]
    if node.product:
        match.append({"key": PRODUCT_LABEL, "operator": "In", "values": [node.product]})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": assignment.image or default_image,
        **_container_command(assignment),
        "envFrom": [{"secretRef": {"name": name}}],
        "resources": {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}},
        "volumeMounts": [{"name": "whalezen-request", "mountPath": REQUEST_DIR, "readOnly": True},
                         {"name": "whalezen-work", "mountPath": WORK_DIR}],
        "terminationMessagePath": f"{WORK_DIR}/{NOTICE_FILE}",
        "terminationMessagePolicy": "File",
    }
    gang = assignment.gang
    peers = {"hostname": gang_hostname(assignment, gang.rank), "subdomain": gang_service_name(assignment)} \
        if gang is not None and gang.size > 1 else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels_of(assignment, broker_id),
                     "annotations": {CHECKPOINT_ANNOTATION: ""}},
        "spec": {
            **peers,
            "restartPolicy": "Never",  # a failed job is the broker's to retry elsewhere, not the kubelet's
            "containers": [container],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": match}]}}},
            "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                            *[dict(t) for t in tolerations]],
            "automountServiceAccountToken": False,  # the job gets no credentials to the cluster's API
            "enableServiceLinks": False,
            "volumes": [
                {"name": "whalezen-request", "downwardAPI": {"items": [{
                    "path": CHECKPOINT_REQUEST_FILE,
                    "fieldRef": {"fieldPath": f"metadata.annotations['{CHECKPOINT_ANNOTATION}']"}}]}},
                {"name": "whalezen-work", "emptyDir": {}},
            ],
        },
    }


def env_secret(assignment: Assignment, *, namespace: str, broker_id: str, node_id: str | None,
               owner: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret holding the job's environment, owned by its Pod (`owner`: the created Pod)."""
    metadata = owner.get("metadata") or {}
    env = job_env(assignment, node_id=node_id, namespace=namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": metadata.get("name") or pod_name(assignment), "namespace": namespace,
            "labels": labels_of(assignment, broker_id),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": metadata.get("name"),
                                 "uid": metadata.get("uid") or "", "blockOwnerDeletion": False}],
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in env.items()},
    }
