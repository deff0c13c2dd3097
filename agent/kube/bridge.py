"""The Kubernetes bridge: every GPU node of one cluster becomes a node of one WhaleZen pool.

One process per cluster (`python -m agent kubernetes ...`, docs/kubernetes.md). For each GPU node the
device plugin advertises it runs the node agent's own loop (agent/loop.py: registration with the pool's
join token, heartbeats, the assignment list, the status outbox, epochs, fencing), with two parts swapped:
the GPUs come from the node object (`KubeNodeBackend`, count-only: the device plugin picks which GPUs a
Pod gets) and jobs run as Pods (`PodRunner`). So the broker places jobs on Kubernetes nodes exactly as on
agent nodes, in the same global decision.

Every `refresh_seconds` the bridge lists the nodes and every pod it may see: new GPU nodes get an agent,
nodes that went away stop theirs (the broker then marks them lost), and each node's GPUs that other pods
hold are reported as held outside, so the broker counts them as taken. Pods carrying this broker's label
that no agent supervises (their job was cancelled while the bridge was down, or they belong to a node
registration that is gone) are deleted: the reconciler, as for cloud instances.
"""
from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.backends.base import GpuBackend
from agent.jobs import Assignment
from agent.kube.cluster import Cluster, ClusterConfig, PodWatch
from agent.kube.inventory import (ASSIGNMENT_LABEL, GpuNode, foreign_gpus_by_node, gpu_node, is_ours,
                                  selector_matches, untolerated_taints)
from agent.kube.runner import PodRunner
from agent.kube.telemetry import DcgmReading, dcgm_by_node
from agent.loop import Agent, AgentConfig, RegistrationRefused
from agent.model import GpuInfo, GpuReading, Health, MigMode, NodeInventory
from agent.state import JobRecord

log = logging.getLogger(__name__)

RUNTIME_NAME = "kubernetes"  # what the node reports as its container runtime: image jobs may come here
SHARING_LABEL = ("whalezen.io/gpu-sharing", "none")  # scheduling/plugins.py WHOLE_GPUS_LABEL
VISIBILITY_LABEL = "whalezen.io/pod-visibility"
# The node labels passed on to the broker (jobs' node selectors can ask for them); the rest stay in the cluster.
FORWARDED_LABELS = ("nvidia.com/gpu.product", "nvidia.com/gpu.memory", "nvidia.com/gpu.count",
                    "nvidia.com/gpu.family", "nvidia.com/mig.strategy", "kubernetes.io/hostname",
                    "topology.kubernetes.io/region", "topology.kubernetes.io/zone",
                    "node.kubernetes.io/instance-type")
# A node's fabric as the cluster's admin labels it (`kubectl label node n1 whalezen.io/fabric=infiniband`),
# passed on as the broker's `fabric` label: multi-node gangs go only to nodes on a fast fabric (scheduling's
# NO_FAST_FABRIC), and nothing a device plugin or GFD sets says which fabric a node is on.
FABRIC_NODE_LABEL = "whalezen.io/fabric"


@dataclass
class NodeView:
    """The latest of one node, shared by its backend (GPUs and readings) and its runner (Pod pinning)."""

    node: GpuNode
    held_outside: int = 0  # GPUs other pods hold on it
    telemetry: tuple[DcgmReading, ...] = ()  # from the site's Prometheus, in the exporter's GPU order


class KubeNodeBackend(GpuBackend):
    """A Kubernetes node's GPUs as the device plugin advertises them: a count, a product, a memory size."""

    name = "kubernetes"

    def __init__(self, view: NodeView, busy: Callable[[], set[int]], *, context: str) -> None:
        self.view = view
        self.busy = busy
        self.context = context
        self._inventory: NodeInventory | None = None

    def start(self) -> None:
        self.inventory()

    def inventory(self) -> NodeInventory:
        if self._inventory is None:
            node = self.view.node
            gpus = tuple(GpuInfo(index=i, uuid=None, name=node.product or None, memory_total_mb=node.memory_mib,
                                 pci_bus_id=None, power_limit_w=None, mig_mode=MigMode.UNSUPPORTED, mig_pending=None)
                         for i in range(node.gpu_count))
            self._inventory = NodeInventory(
                hostname=node.hostname, driver_version=None, cuda_driver_version=None, cpu_count=node.cpu_milli // 1000,
                memory_mb=node.memory_mb, gpus=gpus, topology=(), pcie_common_ancestor=(), p2p_nvlink=(), p2p_read=(),
                backend=f"kubernetes:{self.context}/{node.name}")
        return self._inventory

    def sample(self) -> tuple[GpuReading, ...]:
        node = self.view.node
        problems = [] if node.ready else ["the Kubernetes node is not Ready"]
        if not node.schedulable:
            problems.append("the Kubernetes node is cordoned")
        # Which indices stand for the GPUs other pods hold does not matter (the device plugin picks): take
        # the highest ones the broker's own jobs do not use.
        busy = self.busy()
        free = [i for i in range(node.gpu_count) if i not in busy]
        outside = set(sorted(free, reverse=True)[:self.view.held_outside])
        return tuple(self._reading(i, node, problems, held_outside=i in outside) for i in range(node.gpu_count))

    def _reading(self, index: int, node: GpuNode, problems: list[str], *, held_outside: bool) -> GpuReading:
        dcgm = self.view.telemetry[index] if index < len(self.view.telemetry) else DcgmReading()
        health, reasons = (Health.FAILED, tuple(problems)) if problems else dcgm.health
        return GpuReading(
            index=index, uuid=None, utilization_pct=dcgm.utilization_pct, memory_utilization_pct=None,
            memory_used_mb=dcgm.memory_used_mb, memory_total_mb=node.memory_mib, temperature_c=dcgm.temperature_c,
            power_w=dcgm.power_w, power_limit_w=None, ecc_corrected=None, ecc_uncorrected=None, retired_pages=None,
            remapped_rows_pending=None, remapped_rows_failed=None, xid_errors=(dcgm.xid,) if dcgm.xid else (),
            mig_mode=MigMode.UNSUPPORTED, lost=False, health=health, health_reasons=reasons,
            held_outside=held_outside)


@dataclass(frozen=True)
class _KubeRuntime:
    """What the agent loop reads of a container runtime: the kubelet runs every job in its image."""

    name: str = RUNTIME_NAME
    path: str = "kubelet"
    gpu_mode: str = "device plugin"


class KubeAgent(Agent):
    """The node agent's loop for one Kubernetes node. A job is reported running once its Pod runs."""

    def __init__(self, config: AgentConfig, backend: KubeNodeBackend, runner: PodRunner, **kwargs: Any) -> None:
        super().__init__(replace(config, container_runtimes="none"), backend, **kwargs)
        self.runner = runner  # type: ignore[assignment]  # the interface JobRunner has, for Pods
        self.runner.prepare()
        self.runtimes = (_KubeRuntime(),)  # type: ignore[assignment]
        self._held_back: dict[str, dict[str, Any]] = {}  # "running" reports waiting for the Pod to run

    def start(self) -> None:
        """What the node agent's start does that applies here: the GPUs, then adopting or writing off
        what a previous run left (no job user, spot watcher or metrics port: the cluster has its own)."""
        if self._started:
            return
        self.backend.start()
        self._fence_orphans()
        self._started = True

    def _queue(self, assignment_id: str, job_id: str, epoch: int, state: str, exit_code: int | None,
               message: str, *, reason: str, pid: int | None = None, extra: dict[str, Any] | None = None) -> None:
        if state == "running" and reason == "started" and not self.runner.started(assignment_id):
            self._held_back[assignment_id] = {"job_id": job_id, "epoch": epoch}
            self.store.save_state(self.state)  # the job's record: a restart adopts its Pod
            return
        if state != "running" and assignment_id in self._held_back:
            held = self._held_back.pop(assignment_id)
            if state not in ("refused",) and (exit_code is not None or state == "exited"):
                # It ran and ended between two looks: "running" first, so the broker sees both steps.
                super()._queue(assignment_id, held["job_id"], held["epoch"], "running", None,
                               "its Pod ran", reason="started", pid=0)
        super()._queue(assignment_id, job_id, epoch, state, exit_code, message, reason=reason, pid=pid, extra=extra)

    def step(self) -> float:
        for assignment_id in [a for a in self._held_back if self.runner.started(a)]:
            held = self._held_back.pop(assignment_id)
            job = self.runner.running[assignment_id]
            super()._queue(assignment_id, held["job_id"], held["epoch"], "running", None,
                           f"its Pod {job.pod} runs", reason="started", pid=0)
        return super().step()

    def _record_exit(self, exit_: Any) -> None:
        if exit_.state == "refused":  # given back unscheduled: the record must not look like it ran
            self.notices.forget(exit_.assignment_id)
            record = self.state.jobs.get(exit_.assignment_id)
            if record is not None:
                record.state = "refused"
            self._queue(exit_.assignment_id, exit_.job_id, exit_.epoch, "refused", None, exit_.message,
                        reason=exit_.reason)
            return
        super()._record_exit(exit_)

    def _fence_orphans(self) -> None:
        """A restarted bridge adopts the Pods of the jobs its records say were running; a record whose
        Pod is gone is reported failed, as a node agent reports a job whose process it lost."""
        for record in list(self.state.jobs.values()):
            if record.state != "running":
                continue
            assignment = _stub_assignment(record)
            if self.runner.adopt(assignment) is not None:
                continue
            record.state = "failed"
            self._queue(record.assignment_id, record.job_id, record.epoch, "failed", None,
                        "the bridge restarted while the job ran, and its Pod is gone", reason="agent_crashed")
        self.store.save_state(self.state)



def _stub_assignment(record: JobRecord) -> Assignment:
    """What a record keeps of an assignment, enough to supervise its Pod again (the broker's list does not
    replace a running assignment: agent/loop.py never starts one twice)."""
    return Assignment(id=record.assignment_id, job_id=record.job_id, epoch=record.epoch, action="start",
                      gpu_indices=tuple(record.gpu_indices or ()), gpu_uuids=None, gpu_milli=1000, command=(),
                      env={}, checkpoint_uri=None, checkpoint_request_id=None)


@dataclass
class BridgeConfig:
    server_url: str
    join_token: str | None
    cluster: ClusterConfig
    state_dir: Path
    default_image: str = "python:3.11-slim"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)  # every node's (`--label fabric=infiniband`)
    tolerations: Sequence[Mapping[str, Any]] = ()
    refresh_seconds: float = 15.0
    heartbeat_seconds: float | None = None
    stop_grace_s: float = 30.0
    name_prefix: str = ""  # node names in the pool: PREFIX + the Kubernetes node's name
    prometheus_url: str | None = None  # the site's Prometheus with dcgm-exporter's series (agent/kube/telemetry.py)
    http_timeout_s: float = 10.0
    tick_seconds: float = 0.5


class Bridge:
    def __init__(self, config: BridgeConfig, *, cluster: Cluster | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cluster = cluster or Cluster(config.cluster)
        self.watch = PodWatch(self.cluster)
        self.clock = clock
        self.agents: dict[str, KubeAgent] = {}
        self.views: dict[str, NodeView] = {}
        self.stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._next_refresh = clock()
        self.last_refresh_error: str | None = None
        self._tainted: set[str] = set()  # nodes left out for their taints (logged once)

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        self.watch.start()
        self.watch.wait_listed(15.0)
        try:
            while not self.stopping:
                delay = self.step()
                if not self.stopping:
                    select.select([self._wake_r], [], [], delay)
                    try:
                        while os.read(self._wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
        finally:
            self.shutdown()
        return 0

    def request_stop(self, *_: Any) -> None:
        self.stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def shutdown(self) -> None:
        for agent in self.agents.values():
            agent.shutdown()  # Pods keep running: the runner's stop_all leaves them (PodRunner.stop_all)
        self.agents.clear()
        self.watch.stop()

    # -- one round -------------------------------------------------------------------------------
    def step(self) -> float:
        now = self.clock()
        if now >= self._next_refresh:
            self.refresh()
            self._next_refresh = now + self.config.refresh_seconds
        delay = self.config.tick_seconds
        for name, agent in list(self.agents.items()):
            try:
                delay = min(delay, agent.step())
            except RegistrationRefused:
                raise  # the join token is wrong for every node alike: the bridge exits (code 4)
            except Exception:  # one node's trouble (a refused registration...) must not stop the others
                log.exception("node %s: agent step failed; it is tried again next round", name)
        return max(0.05, delay)

    def refresh(self) -> None:
        """Read the nodes and pods; start agents for new GPU nodes, stop those of nodes gone; count the
        GPUs other pods hold; delete our Pods that no agent supervises."""
        from kubernetes.client import ApiException

        try:
            nodes = [n for n in (gpu_node(raw) for raw in self.cluster.list_nodes()) if n is not None]
            pods = self.cluster.list_pods_everywhere()
        except (ApiException, OSError, Exception) as err:  # the API server down: keep the last view, try again
            self.last_refresh_error = str(err)[:300]
            log.warning("cannot read the cluster (%s); keeping the last view", self.last_refresh_error)
            return
        self.last_refresh_error = None
        nodes = [n for n in nodes if selector_matches(n.labels, self.config.node_selector) and self._schedulable(n)]
        held = foreign_gpus_by_node(pods, self.cluster.config.broker_id)
        telemetry = self._telemetry()
        for node in nodes:
            view = self.views.get(node.name)
            if view is None:
                self.views[node.name] = view = NodeView(node)
                self.agents[node.name] = self._agent_for(view)
                log.info("GPU node %s: %d x %s", node.name, node.gpu_count, node.product or "(no product label)")
            view.node = node
            view.held_outside = min(node.gpu_count, held.get(node.name, 0))
            if telemetry is not None:
                view.telemetry = telemetry.get(node.name, ())
        gone = set(self.views) - {n.name for n in nodes}
        for name in gone:
            log.warning("node %s is gone from the cluster (or lost its GPUs): its agent stops", name)
            self.agents.pop(name).shutdown()
            self.views.pop(name)
        self._reconcile(pods)

    def _schedulable(self, node: GpuNode) -> bool:
        blocking = untolerated_taints(node, self.config.tolerations)
        if not blocking:
            self._tainted.discard(node.name)
            return True
        if node.name not in self._tainted:
            log.warning("node %s left out: its taints %s are not tolerated (add --toleration to use it)", node.name,
                        ", ".join(blocking))
            self._tainted.add(node.name)
        return False

    def _telemetry(self) -> dict[str, tuple[DcgmReading, ...]] | None:
        """The nodes' GPU readings from Prometheus; None (keep the last ones) when it is off or cannot answer."""
        if not self.config.prometheus_url:
            return None
        try:
            return dcgm_by_node(self.config.prometheus_url)
        except (OSError, ValueError) as err:
            log.warning("GPU telemetry from Prometheus at %s: %s", self.config.prometheus_url, err)
            return None

    def _agent_for(self, view: NodeView) -> KubeAgent:
        name = f"{self.config.name_prefix}{view.node.name}"
        state_dir = self.config.state_dir / "nodes" / view.node.name
        runner = PodRunner(cluster=self.cluster, watch=self.watch, node=lambda: view.node, state_dir=state_dir,
                           default_image=self.config.default_image, tolerations=self.config.tolerations,
                           stop_grace_s=self.config.stop_grace_s)
        backend = KubeNodeBackend(view, runner.busy_gpus, context=self.config.cluster.context or "default")
        labels = {**self.config.labels,
                  **{k: v for k, v in view.node.labels.items() if k in FORWARDED_LABELS}}
        if view.node.labels.get(FABRIC_NODE_LABEL):  # the node's own label says more than the bridge's
            labels["fabric"] = view.node.labels[FABRIC_NODE_LABEL]
        labels.update({SHARING_LABEL[0]: SHARING_LABEL[1], "whalezen.io/kubernetes-node": view.node.name[:63],
                       # What an admin sees on the node (its labels): whether other namespaces' pods are counted.
                       VISIBILITY_LABEL: "all-namespaces" if self.cluster.sees_all_pods else "namespace-only"})
        config = AgentConfig(
            server_url=self.config.server_url, join_token=self.config.join_token, name=name, state_dir=state_dir,
            heartbeat_seconds=self.config.heartbeat_seconds, labels=labels, job_user="self",
            work_dir=state_dir.parent.parent / "work" / view.node.name, fence_after_s=0,
            http_timeout_s=self.config.http_timeout_s, tick_seconds=self.config.tick_seconds,
            stop_grace_s=self.config.stop_grace_s)
        agent = KubeAgent(config, backend, runner)
        agent.start()
        return agent

    def _reconcile(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """Delete Pods of this broker in our namespace that no node's agent supervises. A Pod just created
        is always supervised (its runner holds it before the create returns), so nothing young is lost."""
        supervised = {job.pod for agent in self.agents.values() for job in agent.runner.running.values()}
        for pod in pods:
            metadata = pod.get("metadata") or {}
            if (metadata.get("namespace") != self.cluster.namespace or not is_ours(pod, self.cluster.config.broker_id)
                    or metadata.get("name") in supervised or metadata.get("deletionTimestamp")):
                continue
            log.warning("deleting Pod %s (assignment %s): no job of this broker owns it any more", metadata.get("name"),
                        (metadata.get("labels") or {}).get(ASSIGNMENT_LABEL, "?"))
            self.cluster.delete_pod(str(metadata["name"]), grace_seconds=int(self.config.stop_grace_s))
