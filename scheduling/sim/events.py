"""Discrete-event simulator for a mixed fleet: on-prem nodes plus cloud instances rented on demand.

Events, in the order they are handled at equal times: job completions first (they free GPUs),
then arrivals, then a scheduling cycle.  A cycle runs every ``cycle_s`` seconds while anything
is pending and asks the policy for actions:

* ``Start(job, node, gpus)``: run on an existing node (on-prem, or a rented instance's free GPUs);
* ``Launch(offer, jobs)``: rent a new instance, the jobs start when it has booted (``boot_s``);
* ``Stop(job)``: preempt or migrate a running job: it loses the work since its last checkpoint
  (checkpoints every ``checkpoint_s`` of run time) and pays ``restart_s`` when it starts again;
  it goes back to pending (a migration is a Stop plus a Start in the same cycle).

A rented instance is billed from launch until it is released, which happens at the end of any
cycle or completion that leaves it empty.  On-prem GPUs are billed at their internal rate per
GPU-hour used.  A job runs ``work_s / speed(model)`` seconds (``work_s`` measured on the
reference GPU, speed 1.0).  Everything is deterministic for a given input.
"""

from __future__ import annotations

import heapq

import numpy as np
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence


@dataclass(frozen=True, slots=True)
class SimJob:
    id: str
    submit_s: float
    gpus: int
    work_s: float  # run time on the reference GPU (speed 1.0)
    allowed_models: tuple[str, ...] = ()  # empty: any
    checkpointable: bool = True
    tenant: str = ""
    spot_ok: bool = False  # may run on spot (interruptible) capacity


@dataclass(frozen=True, slots=True)
class SimNode:
    id: str
    model: str
    gpus: int
    price_per_gpu_hour: float  # internal rate (on-prem)
    provider: str = "onprem"


@dataclass(frozen=True, slots=True)
class SimOffer:
    id: str
    provider: str
    region: str
    zone: str
    instance_type: str
    model: str
    gpus: int
    price_per_hour: float  # on demand, per instance
    spot_price_per_hour: float | None = None
    vcpus: int = 0
    memory_gib: float = 0.0


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    node_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Launch:
    offer_id: str
    job_ids: tuple[str, ...]
    # GPUs of the new instance for each job; None: packed from GPU 0 in job order
    gpus: tuple[tuple[int, ...], ...] | None = None
    spot: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    job_id: str
    # True: a planned move that checkpoints first (no work lost, only the restart cost);
    # False: preemption or failure, work since the last periodic checkpoint is lost.
    checkpoint: bool = False


Action = Start | Launch | Stop


@dataclass(eq=False)
class NodeRun:
    """A node as the simulator tracks it: on-prem, or a rented instance."""

    node: SimNode
    free: list[bool]
    offer: SimOffer | None = None
    launched_s: float = 0.0
    ready_s: float = 0.0
    jobs: set[str] = field(default_factory=set)
    idle_since: float | None = None  # rented instance with no job since then
    spot: bool = False

    @property
    def price_per_hour(self) -> float:
        """What the instance costs per hour while rented (0 for on-prem nodes)."""
        if self.offer is None:
            return 0.0
        if self.spot and self.offer.spot_price_per_hour is not None:
            return self.offer.spot_price_per_hour
        return self.offer.price_per_hour

    @property
    def free_gpus(self) -> list[int]:
        return [i for i, f in enumerate(self.free) if f]


@dataclass(eq=False)  # identity: the pending list removes this very run
class JobRun:
    job: SimJob
    done_work_s: float = 0.0  # committed work (at the last checkpoint or stop)
    start_s: float | None = None  # current run's start (after boot and restart)
    first_start_s: float | None = None
    node_id: str | None = None
    gpus: tuple[int, ...] = ()
    speed: float = 1.0
    epoch: int = 0  # bumps on every stop so stale completion events are ignored
    finish_s: float | None = None
    restarts: int = 0
    held_since: float | None = None  # when the current run took its GPUs (before boot and restart)


class FleetView(Protocol):
    now: float
    pending: Sequence[JobRun]
    running: Sequence[JobRun]
    nodes: Mapping[str, NodeRun]
    offers: Sequence[SimOffer]
    speeds: Mapping[str, float]


class FleetPolicy(Protocol):
    name: str

    def decide(self, view: "Simulator") -> list[Action]: ...


def idle_release_of(policy: object) -> float:
    """Seconds a policy keeps an empty rented instance for reuse (0: release at once)."""
    return float(getattr(policy, "idle_release_s", 0.0))


@dataclass
class SimResult:
    dollars: float
    onprem_dollars: float
    cloud_dollars: float
    jct_s: list[float]
    queue_s: list[float]
    unfinished: int
    launches: int
    restarts: int
    cycles: int
    interruptions: int = 0


class Simulator:
    def __init__(self, jobs: Sequence[SimJob], nodes: Sequence[SimNode], offers: Sequence[SimOffer],
                 speeds: Mapping[str, float], cycle_s: float = 120.0, boot_s: float = 180.0,
                 checkpoint_s: float = 1800.0, restart_s: float = 120.0, horizon_s: float | None = None,
                 spot_mtti_s: float = 24 * 3600.0, seed: int = 0) -> None:
        self.jobs = {j.id: JobRun(j) for j in jobs}
        self.nodes: dict[str, NodeRun] = {n.id: NodeRun(n, [True] * n.gpus) for n in nodes}
        self.offers = list(offers)
        self.offer_by_id = {o.id: o for o in offers}
        self.speeds = dict(speeds)
        self.cycle_s, self.boot_s = cycle_s, boot_s
        self.checkpoint_s, self.restart_s = checkpoint_s, restart_s
        self.horizon_s = horizon_s
        # spot instances are interrupted after an exponential time with this mean (seeded)
        self.spot_mtti_s = spot_mtti_s
        self._rng = np.random.default_rng(seed)
        self.interruptions = 0
        self.now = 0.0
        self.pending: list[JobRun] = []
        self.cloud_dollars = 0.0
        self.onprem_dollars = 0.0
        self.launches = 0
        self.cycles = 0
        self._instances = 0
        self._events: list[tuple[float, int, int, str, int]] = []  # time, kind, seq, job, epoch
        self._seq = 0
        self.log: list[tuple[float, str, str]] = []  # (time, event, job) for tests and debugging
        # Every GPU hold that ended, in the order they ended: (job, node, rented, gpus, from_s, to_s);
        # holds still open at the end of a run are added by the result (to its time).
        self.holds: list[tuple[str, str, bool, int, float, float]] = []

    @property
    def running(self) -> list[JobRun]:
        return [r for r in self.jobs.values() if r.node_id is not None and r.finish_s is None]

    def speed(self, model: str) -> float:
        return self.speeds.get(model, 1.0)

    # ------------------------------------------------------------------------------------ events

    COMPLETE, INTERRUPT, ARRIVE, CYCLE = 0, 1, 2, 3

    def _push(self, t: float, kind: int, job: str = "", epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, job, epoch))

    def run(self, policy: FleetPolicy) -> SimResult:
        for r in sorted(self.jobs.values(), key=lambda r: (r.job.submit_s, r.job.id)):
            self._push(r.job.submit_s, self.ARRIVE, r.job.id)
        cycle_due: float | None = None
        self.grace = idle_release_of(policy)
        # optional: called after each cycle's actions are applied (benchmarks sample state there)
        after_cycle = getattr(policy, "after_cycle", None)
        while self._events:
            t, kind, _, job_id, epoch = heapq.heappop(self._events)
            if self.horizon_s is not None and t > self.horizon_s:
                break
            self.now = t
            if kind == self.COMPLETE:
                r = self.jobs[job_id]
                if r.epoch == epoch and r.finish_s is None:
                    self._complete(r)
            elif kind == self.INTERRUPT:
                self._interrupt(job_id)
            elif kind == self.ARRIVE:
                self.pending.append(self.jobs[job_id])
                self.log.append((t, "arrive", job_id))
                self._release_empty()
            else:
                cycle_due = None
                self.cycles += 1
                self._apply(policy.decide(self))
                self._release_empty()
                if after_cycle is not None:
                    after_cycle(self)
            rented = any(run.offer is not None for run in self.nodes.values())
            if (self.pending or rented) and cycle_due is None:
                # align cycles to the grid so every policy sees the same decision times
                cycle_due = (int(self.now // self.cycle_s) + 1) * self.cycle_s
                self._push(cycle_due, self.CYCLE)
        return self._result()

    def _complete(self, r: JobRun) -> None:
        r.finish_s = self.now
        r.done_work_s = r.job.work_s
        self._bill_onprem(r)
        node = self.nodes[r.node_id]  # type: ignore[index]
        self._end_hold(r, node)
        for g in r.gpus:
            node.free[g] = True
        node.jobs.discard(r.job.id)
        self.log.append((self.now, "complete", r.job.id))
        self._release_empty()

    def _end_hold(self, r: JobRun, node: NodeRun) -> None:
        start = self.now if r.held_since is None else r.held_since
        self.holds.append((r.job.id, node.node.id, node.offer is not None, len(r.gpus), start, self.now))
        r.held_since = None

    def _bill_onprem(self, r: JobRun) -> None:
        node = self.nodes[r.node_id]  # type: ignore[index]
        if node.offer is None and r.start_s is not None:
            hours = max(0.0, self.now - r.start_s) / 3600.0
            self.onprem_dollars += hours * len(r.gpus) * node.node.price_per_gpu_hour

    def _release_empty(self) -> None:
        """Release rented instances empty for longer than the policy's grace (billed to then)."""
        for nid, run in list(self.nodes.items()):
            if run.offer is None:
                continue
            if run.jobs:
                run.idle_since = None
                continue
            if run.idle_since is None:
                run.idle_since = self.now
            until = run.idle_since + getattr(self, "grace", 0.0)
            if until <= self.now:
                del self.nodes[nid]
                self.cloud_dollars += (until - run.launched_s) / 3600.0 * run.price_per_hour
                self.log.append((until, "release", nid))

    # ----------------------------------------------------------------------------------- actions

    def _apply(self, actions: Sequence[Action]) -> None:
        for a in actions:  # stops first: a migration frees its source before its target is used
            if isinstance(a, Stop):
                self._stop(self.jobs[a.job_id], a.checkpoint)
        for a in actions:
            if isinstance(a, Start):
                self._start(self.jobs[a.job_id], a.node_id, a.gpus)
            elif isinstance(a, Launch):
                nid = self._launch(self.offer_by_id[a.offer_id], a.spot)
                g = 0
                for k, jid in enumerate(a.job_ids):
                    n = self.jobs[jid].job.gpus
                    gpus = a.gpus[k] if a.gpus is not None else tuple(range(g, g + n))
                    self._start(self.jobs[jid], nid, gpus)
                    g += n

    def _launch(self, offer: SimOffer, spot: bool = False) -> str:
        spot = spot and offer.spot_price_per_hour is not None
        self._instances += 1
        self.launches += 1
        nid = f"{offer.id}#{self._instances}"
        price = offer.spot_price_per_hour if spot else offer.price_per_hour
        node = SimNode(nid, offer.model, offer.gpus, price / max(offer.gpus, 1), offer.provider)  # type: ignore[operator]
        self.nodes[nid] = NodeRun(node, [True] * offer.gpus, offer, self.now, self.now + self.boot_s, spot=spot)
        if spot:
            self._push(self.now + float(self._rng.exponential(self.spot_mtti_s)), self.INTERRUPT, nid)
        self.log.append((self.now, "launch", nid))
        return nid

    def _interrupt(self, nid: str) -> None:
        """The cloud takes a spot instance back: its jobs stop (losing work since their last
        checkpoint) and go back to pending; the instance is billed until now."""
        run = self.nodes.get(nid)
        if run is None:
            return  # already released
        self.interruptions += 1
        for jid in sorted(run.jobs):
            self._stop(self.jobs[jid], checkpoint=False)
        del self.nodes[nid]
        self.cloud_dollars += (self.now - run.launched_s) / 3600.0 * run.price_per_hour
        self.log.append((self.now, "interrupt", nid))

    def _start(self, r: JobRun, node_id: str, gpus: tuple[int, ...]) -> None:
        node = self.nodes[node_id]
        if r not in self.pending:
            raise ValueError(f"{r.job.id} is not pending")
        if len(gpus) != r.job.gpus or any(not node.free[g] for g in gpus):
            raise ValueError(f"{r.job.id}: GPUs {gpus} of {node_id} are not free or not {r.job.gpus}")
        if r.job.allowed_models and node.node.model not in r.job.allowed_models:
            raise ValueError(f"{r.job.id} may not run on {node.node.model}")
        self.pending.remove(r)
        for g in gpus:
            node.free[g] = False
        node.jobs.add(r.job.id)
        r.held_since = self.now
        begin = max(self.now, node.ready_s) + (self.restart_s if r.restarts else 0.0)
        r.node_id, r.gpus, r.speed = node_id, gpus, self.speed(node.node.model)
        r.start_s = begin
        if r.first_start_s is None:
            r.first_start_s = begin
        remaining = (r.job.work_s - r.done_work_s) / r.speed
        self._push(begin + remaining, self.COMPLETE, r.job.id, r.epoch)
        self.log.append((self.now, "start", r.job.id))

    def _stop(self, r: JobRun, checkpoint: bool = False) -> None:
        if r.node_id is None or r.finish_s is not None:
            raise ValueError(f"{r.job.id} is not running")
        ran = max(0.0, self.now - (r.start_s or self.now)) * r.speed
        if r.job.checkpointable and checkpoint:
            pass  # checkpointed on request just before stopping
        elif r.job.checkpointable:  # keep the work up to the last checkpoint
            ran = (ran // self.checkpoint_s) * self.checkpoint_s
        else:
            ran = 0.0
        self._bill_onprem(r)
        r.done_work_s = min(r.job.work_s, r.done_work_s + ran)
        node = self.nodes[r.node_id]
        self._end_hold(r, node)
        for g in r.gpus:
            node.free[g] = True
        node.jobs.discard(r.job.id)
        r.node_id, r.gpus, r.start_s = None, (), None
        r.epoch += 1
        r.restarts += 1
        self.pending.append(r)
        self.log.append((self.now, "stop", r.job.id))

    # ------------------------------------------------------------------------------------ result

    def _result(self) -> SimResult:
        for r in self.running:  # bill what is still running at the horizon
            self._bill_onprem(r)
            if r.held_since is not None:
                node = self.nodes[r.node_id]  # type: ignore[index]
                self.holds.append((r.job.id, node.node.id, node.offer is not None, len(r.gpus),
                                   r.held_since, self.now))
        for run in list(self.nodes.values()):
            if run.offer is not None:
                end = self.now if run.idle_since is None else min(self.now, run.idle_since + self.grace)
                self.cloud_dollars += (end - run.launched_s) / 3600.0 * run.price_per_hour
        done = [r for r in self.jobs.values() if r.finish_s is not None]
        return SimResult(
            dollars=self.cloud_dollars + self.onprem_dollars, onprem_dollars=self.onprem_dollars,
            cloud_dollars=self.cloud_dollars,
            jct_s=[r.finish_s - r.job.submit_s for r in done],  # type: ignore[operator]
            queue_s=[r.first_start_s - r.job.submit_s for r in done],  # type: ignore[operator]
            unfinished=len(self.jobs) - len(done), launches=self.launches,
            restarts=sum(r.restarts for r in self.jobs.values()), cycles=self.cycles,
            interruptions=self.interruptions)
