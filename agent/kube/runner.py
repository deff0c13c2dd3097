"""Runs a node's assignments as Pods: the agent loop's job runner for one Kubernetes node.

It has the interface the agent loop (agent/loop.py) drives `agent.jobs.JobRunner` through (start, stop,
poll, request_checkpoint, running, busy_gpus...), so registration, heartbeats, the outbox, epochs and
fencing are the agent's own, unchanged. What differs:
- start creates the Pod and its env Secret; the job counts as started once the Pod's phase is Running
  (`started`), which the bridge's agent waits for before it reports "running";
- poll reads the Pod from the bridge's watch: a terminated container is the job's exit (code, log tail,
  and the checkpoint notice the job left as its termination message); a Pod kube-scheduler cannot place
  is given back ("refused", with the scheduler's own message) and deleted; an image that cannot be pulled
  fails the job; a Pod deleted by someone else fails it;
- stop deletes the Pod with the grace period (the kubelet sends SIGTERM, then SIGKILL);
- a checkpoint request is written into the Pod's annotation, which the job reads as a file;
- the bridge shutting down leaves Pods running: its next start adopts them (`adopt`).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.jobs import Assignment, JobExit, JobStartError
from agent.kube.cluster import Cluster, PodWatch
from agent.kube.inventory import GpuNode
from agent.kube.pods import (CHECKPOINT_ANNOTATION, CONTAINER_NAME, env_secret, gang_service, pod_manifest,
                             pod_name)
from agent.checkpoint.checkpointer import NOTICE_LOG_PREFIX
from agent.notices import NOTICE_FILE

log = logging.getLogger(__name__)

# Waiting reasons of a container that mean it will never start by itself.
IMAGE_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CONFIG_FAILURES = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
CONFIG_FAILURE_GRACE_S = 60.0  # the env Secret is created just after the Pod: give the kubelet time to see it
# How often a running Pod's log is read for the checkpoint helper's notice line: soon after a checkpoint
# request (the broker waits on it to move or preempt the job), rarely otherwise (periodic checkpoints).
NOTICE_SCAN_REQUESTED_S = 2.0
NOTICE_SCAN_IDLE_S = 60.0
NOTICE_LOG_BYTES = 64 * 1024


@dataclass
class PodJob:
    """One assignment's Pod, in the shape the agent loop reads (`assignment`, `pid`, `stop_reason`...)."""

    assignment: Assignment
    pod: str
    started_at: float
    stop_reason: str | None = None
    stop_code: str | None = None
    checkpoint_requests: list[str] = field(default_factory=list)
    container: str | None = None
    seen_running: bool = False
    missing_since: float | None = None
    notice_scanned_at: float = 0.0
    notice_line: str = ""  # the last notice line passed on

    @property
    def pid(self) -> int:
        return 0  # no process on this host: the heartbeat and reports carry 0


class PodRunner:
    def __init__(self, *, cluster: Cluster, watch: PodWatch, node: Callable[[], GpuNode], state_dir: Path,
                 default_image: str, tolerations: Sequence[Mapping[str, Any]] = (), stop_grace_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.watch = watch
        self.node = node
        self.jobs_dir = state_dir / "pods"  # notices read back from Pods' termination messages
        self.default_image = default_image
        self.tolerations = tuple(tolerations)
        self.stop_grace_s = stop_grace_s
        self._clock = clock
        self._running: dict[str, PodJob] = {}

    def prepare(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)

    @property
    def running(self) -> Mapping[str, PodJob]:
        return self._running

    def busy_gpus(self) -> set[int]:
        return {i for job in self._running.values() for i in job.assignment.gpu_indices}

    def workdir_of(self, assignment_id: str) -> Path:
        return self.jobs_dir / assignment_id.replace("/", "_")

    def started(self, assignment_id: str) -> bool:
        job = self._running.get(assignment_id)
        return job is not None and job.seen_running

    # -- start, adopt ---------------------------------------------------------------------------
    def start(self, assignment: Assignment, *, node_id: str | None) -> PodJob:
        from kubernetes.client import ApiException

        if assignment.gpu_milli < 1000:
            # The device plugin hands out whole GPUs only: a share would take a whole one behind the
            # broker's back. (The broker does not place shares here; this guards an older broker.)
            raise JobStartError("a Kubernetes node runs whole-GPU jobs only (the device plugin has no GPU shares)")
        if assignment.files:
            # Copying them needs the agent's fetch step inside the Pod (an init container): not built yet.
            raise JobStartError("a Kubernetes node cannot copy a job's files yet (spec.files); put them in the "
                                "image or fetch them in the job's command")
        node = self.node()
        manifest = pod_manifest(assignment, node=node, namespace=self.cluster.namespace,
                                broker_id=self.cluster.config.broker_id, node_id=node_id,
                                default_image=self.default_image, tolerations=self.tolerations)
        try:
            created = self.cluster.create_pod(manifest)
        except ApiException as err:
            if err.status != 409:
                raise JobStartError(f"Kubernetes refused the Pod: {err.status} {err.reason}: {_status_message(err)}") \
                    from None
            created = self.cluster.read_pod(manifest["metadata"]["name"]) or manifest  # an earlier try made it
        namespace, broker_id = self.cluster.namespace, self.cluster.config.broker_id
        service = gang_service(assignment, namespace=namespace, broker_id=broker_id, owner=created)
        try:
            self.cluster.create_secret(env_secret(assignment, namespace=namespace, broker_id=broker_id,
                                                  node_id=node_id, owner=created))
            if service is not None:
                self.cluster.create_service(service)
        except ApiException as err:
            self.cluster.delete_pod(manifest["metadata"]["name"], grace_seconds=0)
            raise JobStartError(f"Kubernetes refused the job's env Secret or peer Service: {err.status} "
                                f"{err.reason}") from None
        self.watch.put(created)
        job = PodJob(assignment, manifest["metadata"]["name"], self._clock())
        self._running[assignment.id] = job
        log.info("assignment %s: Pod %s/%s created for node %s", assignment.id, self.cluster.namespace, job.pod,
                 node.name)
        return job

    def adopt(self, assignment: Assignment) -> PodJob | None:
        """After a bridge restart: take the assignment's Pod back under supervision, if it still exists."""
        name = pod_name(assignment)
        pod = self.watch.get(name) or self.cluster.read_pod(name)
        if pod is None:
            return None
        self.watch.put(pod)
        job = PodJob(assignment, name, self._clock(), seen_running=_phase(pod) != "Pending")
        self._running[assignment.id] = job
        return job

    def clean_container(self, assignment_id: str) -> None:
        """Nothing to clean by id here: a Pod with no supervising record is deleted by the reconciler."""

    # -- checkpoint, stop -----------------------------------------------------------------------
    def request_checkpoint(self, assignment_id: str, *, request_id: str, checkpoint_uri: str | None) -> str | None:
        job = self._running.get(assignment_id)
        if job is None or request_id in job.checkpoint_requests:
            return None
        request = {"request_id": request_id, "assignment_id": assignment_id, "job_id": job.assignment.job_id,
                   "checkpoint_uri": checkpoint_uri or job.assignment.checkpoint_uri, "requested_at": time.time()}
        self.cluster.annotate_pod(job.pod, {CHECKPOINT_ANNOTATION: json.dumps(request)})
        job.checkpoint_requests.append(request_id)
        return "file_only"  # the job sees it as a file (a downward-API volume), not as a signal

    def stop(self, assignment_id: str, *, reason: str, code: str = "requested") -> None:
        job = self._running.get(assignment_id)
        if job is None or job.stop_reason is not None:
            return
        job.stop_reason, job.stop_code = reason, code
        self._delete(job)

    def _delete(self, job: PodJob) -> None:
        try:
            self.cluster.delete_pod(job.pod, grace_seconds=int(self.stop_grace_s))
        except Exception as err:  # the API server away: poll() tries again while the Pod is there
            log.warning("deleting Pod %s failed (%s); trying again", job.pod, err)

    def stop_all(self, *, reason: str, wait: Callable[[float], Any] = time.sleep) -> list[JobExit]:
        """The bridge stopping leaves every Pod running (a bridge upgrade must not kill the jobs): its
        next start adopts them, and the broker's lost-node timeout covers a bridge that never returns."""
        self._running.clear()
        return []

    # -- poll ----------------------------------------------------------------------------------
    def poll(self) -> list[JobExit]:
        exits: list[JobExit] = []
        now = self._clock()
        for assignment_id, job in list(self._running.items()):
            exit_ = self._look(job, now)
            if exit_ is not None:
                del self._running[assignment_id]
                exits.append(exit_)
        return exits

    def _look(self, job: PodJob, now: float) -> JobExit | None:
        a = job.assignment
        pod = self.watch.get(job.pod)
        if pod is None:
            if job.stop_reason is not None:
                return JobExit(a.id, a.job_id, a.epoch, "stopped", None, f"{job.stop_reason} (Pod deleted)",
                               job.stop_code or "requested", a.gpu_indices)
            # The watch may lag a create by a moment; a Pod gone for good is read as gone.
            job.missing_since = job.missing_since or now
            if now - job.missing_since < 5.0 or self.cluster.read_pod(job.pod) is not None:
                return None
            return JobExit(a.id, a.job_id, a.epoch, "failed", None, f"its Pod {job.pod} was deleted outside WhaleZen",
                           "pod_deleted", a.gpu_indices)
        job.missing_since = None
        phase = _phase(pod)
        if phase == "Running" or phase in ("Succeeded", "Failed"):
            job.seen_running = True
        if phase == "Running":
            self._scan_notice(job, now)
        terminated = _container_state(pod, "terminated")
        if phase in ("Succeeded", "Failed") or terminated is not None:
            return self._finished(job, pod, terminated or {})
        if job.stop_reason is not None:
            if not (pod.get("metadata") or {}).get("deletionTimestamp"):
                self._delete(job)  # the delete did not get through (API server away): again
            return None  # deleting: the DELETED event ends it
        unschedulable = _unschedulable(pod)
        if unschedulable is not None:
            message = self.cluster.scheduling_failure(job.pod) or unschedulable
            self.cluster.delete_pod(job.pod, grace_seconds=0)
            return JobExit(a.id, a.job_id, a.epoch, "refused", None,
                           f"Kubernetes cannot schedule the Pod: {message}", "unschedulable", a.gpu_indices)
        waiting = _container_state(pod, "waiting") or {}
        why = str(waiting.get("reason") or "")
        if why in IMAGE_FAILURES or (why in CONFIG_FAILURES and now - job.started_at > CONFIG_FAILURE_GRACE_S):
            self.cluster.delete_pod(job.pod, grace_seconds=0)
            image = a.image or self.default_image
            return JobExit(a.id, a.job_id, a.epoch, "failed", None,
                           f"the container could not start ({why}: {waiting.get('message') or image})", "exit_code",
                           a.gpu_indices)
        return None

    def _finished(self, job: PodJob, pod: Mapping[str, Any], terminated: Mapping[str, Any]) -> JobExit:
        a = job.assignment
        code = terminated.get("exitCode")
        code = int(code) if isinstance(code, int) else (0 if _phase(pod) == "Succeeded" else None)
        self._keep_notice(job, str(terminated.get("message") or ""))
        tail = self.cluster.pod_log_tail(job.pod)
        self.cluster.delete_pod(job.pod, grace_seconds=0)  # done: its GPUs and its Secret go back
        why = str(terminated.get("reason") or "")
        if job.stop_reason is not None:
            return JobExit(a.id, a.job_id, a.epoch, "stopped", code, f"{job.stop_reason} (exit code {code})",
                           job.stop_code or "requested", a.gpu_indices, tail)
        if code == 0:
            return JobExit(a.id, a.job_id, a.epoch, "exited", 0, "exited with code 0", "exit", a.gpu_indices, tail)
        detail = f" ({why})" if why and why not in ("Error", "Completed") else ""
        return JobExit(a.id, a.job_id, a.epoch, "failed", code, f"exited with code {code}{detail}", "exit_code",
                       a.gpu_indices, tail)

    def _scan_notice(self, job: PodJob, now: float) -> None:
        """Read the job's newest checkpoint notice line from its Pod's log (the helper prints one per save,
        agent/checkpoint): the agent loop reports it, and the broker verifies the checkpoint on storage."""
        interval = NOTICE_SCAN_REQUESTED_S if job.checkpoint_requests else NOTICE_SCAN_IDLE_S
        if now - job.notice_scanned_at < interval:
            return
        job.notice_scanned_at = now
        log_text = self.cluster.pod_log_tail(job.pod, lines=500, limit_bytes=NOTICE_LOG_BYTES)
        lines = [line for line in log_text.splitlines() if line.startswith(NOTICE_LOG_PREFIX)]
        if lines and lines[-1] != job.notice_line:
            job.notice_line = lines[-1]
            self._keep_notice(job, lines[-1][len(NOTICE_LOG_PREFIX):])

    def _keep_notice(self, job: PodJob, message: str) -> None:
        """The job's checkpoint notice came back as its termination message: put it where the agent
        loop looks for notices, so its checkpoint is reported before its exit (agent/notices.py checks it)."""
        if not message.strip().startswith("{"):
            return
        folder = self.workdir_of(job.assignment.id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / NOTICE_FILE).write_text(message)


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _container_state(pod: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if isinstance(status, dict) and status.get("name") == CONTAINER_NAME:
            state = (status.get("state") or {}).get(kind)
            return state if isinstance(state, dict) else None
    return None


def _unschedulable(pod: Mapping[str, Any]) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if (isinstance(condition, dict) and condition.get("type") == "PodScheduled"
                and condition.get("status") == "False" and condition.get("reason") == "Unschedulable"):
            return str(condition.get("message") or "no node fits")
    return None


def _status_message(err: Any) -> str:
    try:
        return str(json.loads(err.body).get("message") or "")[:300]
    except (TypeError, ValueError, AttributeError):
        return ""
