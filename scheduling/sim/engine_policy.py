"""``whalezen`` in the cost week: the core engine (`scheduling.engine.schedule`) driving the fleet.

Each cycle turns the simulator's state into a :class:`scheduling.model.Snapshot` (on-prem nodes
and already rented instances as nodes, running jobs as allocations, the catalog as offers, GPU
speeds as CU ratings, every pending job with its remaining work as expected duration), calls the
engine and turns the plan back into simulator actions: placements on nodes become starts,
placements on launches become instance launches, migrations become stop + start, preemptions
become stops.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from scheduling.model import (
    CloudOffer, GpuModelInfo, GpuState, JobDemand, NodeState, Plan, Policy, PolicyWeights,
    RunningAllocation, Snapshot,
)
from scheduling.sim.events import Action, Launch, Simulator, Start, Stop

BIG_CPU = 1_000_000  # the cost week models GPUs only; CPU and memory never bind
BIG_MEM = 10_000_000
GPU_MEMORY_MB = 32_768


def build_snapshot(sim: Simulator, weights: PolicyWeights, launchable: int, sunk: bool = True) -> Snapshot:
    nodes = []
    for nid, run in sorted(sim.nodes.items()):
        gpus = tuple(GpuState(i, f"{nid}-gpu{i}", run.node.model, GPU_MEMORY_MB,
                              GPU_MEMORY_MB if free else 0, milli_used=0 if free else 1000)
                     for i, free in enumerate(run.free))
        nodes.append(NodeState(nid, nid, gpus, BIG_CPU, BIG_MEM, BIG_CPU, BIG_MEM,
                               provider=run.node.provider,
                               # a rented instance is paid whether its free GPUs are used or not
                               price_per_gpu_hour=0.0 if (sunk and run.offer is not None)
                               else run.node.price_per_gpu_hour))
    running = []
    for r in sim.running:
        ran = max(0.0, sim.now - (r.start_s or sim.now))
        running.append(RunningAllocation(
            r.job.id, r.node_id or "", r.gpus, preemptible=r.job.checkpointable,
            checkpointable=r.job.checkpointable, run_seconds=ran,
            checkpoint_age_s=ran % sim.checkpoint_s, restart_cost_s=sim.restart_s))
    pending = tuple(JobDemand(
        r.job.id, tenant=r.job.tenant, gpus=r.job.gpus, allowed_models=r.job.allowed_models,
        spot="allowed" if r.job.spot_ok else "never", preemptible=r.job.checkpointable,
        expected_duration_hours=max(r.job.work_s - r.done_work_s, 60.0) / 3600.0,
        submitted_at=r.job.submit_s) for r in sim.pending)
    offers = tuple(CloudOffer(o.id, o.provider, o.region, o.zone, o.instance_type, o.model, o.gpus,
                              GPU_MEMORY_MB, o.price_per_hour, o.spot_price_per_hour, launchable,
                              vcpus=o.vcpus, memory_mb=int(o.memory_gib * 1024))
                   for o in sim.offers)
    models = tuple(GpuModelInfo(m, cu_rating=s) for m, s in sorted(sim.speeds.items()))
    return Snapshot(now=sim.now, nodes=tuple(nodes), pending=pending, running=tuple(running),
                    offers=offers, gpu_models=models, weights=weights)


def plan_to_actions(plan: Plan) -> list[Action]:
    actions: list[Action] = []
    for p in plan.preemptions:
        actions.append(Stop(p.victim_job_id))
    for m in plan.migrations:
        actions.append(Stop(m.job_id))
        if m.to.node_id is not None:
            actions.append(Start(m.job_id, m.to.node_id, tuple(m.to.gpu_indices)))
    launched: dict[tuple[str, int], list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for pl in plan.placements:
        part = pl.parts[0]
        if part.node_id is not None:
            actions.append(Start(pl.job_id, part.node_id, tuple(part.gpu_indices)))
        elif part.launch_id is not None:
            launched[(part.launch_id, part.instance)].append((pl.job_id, tuple(part.gpu_indices)))
    launch_of = {launch.launch_id: launch for launch in plan.launches}
    for (launch_id, _instance), jobs in sorted(launched.items()):
        la = launch_of[launch_id]
        actions.append(Launch(la.offer_id, tuple(j for j, _ in jobs), tuple(g for _, g in jobs), spot=la.spot))
    return actions


class EnginePolicy:
    name = "whalezen"

    def __init__(self, policy: Policy | None = None, weights: PolicyWeights | None = None,
                 launchable: int = 64, sunk: bool = False, idle_release_s: float = 0.0,
                 consolidate: bool = True, schedule: Callable[[Snapshot, Policy | None], Plan] | None = None) -> None:
        if schedule is None:
            from scheduling.engine import schedule as engine_schedule
            schedule = engine_schedule
        self.schedule = schedule
        self.policy = policy
        self.weights = weights or PolicyWeights()
        self.launchable = launchable
        self.sunk = sunk
        self.idle_release_s = idle_release_s
        self.consolidate = consolidate
        self.moves = 0
        self.methods: dict[str, int] = defaultdict(int)
        self.cycle_seconds: list[float] = []

    def decide(self, sim: Simulator) -> list[Action]:
        if not sim.pending:
            if not self.consolidate:
                return []
            moves = consolidation_moves(sim, [])
            self.moves += len(moves) // 2
            return moves
        plan = self.schedule(build_snapshot(sim, self.weights, self.launchable, self.sunk), self.policy)
        self.methods[plan.solver.method] += 1
        self.cycle_seconds.append(plan.solver.solve_seconds)
        actions = plan_to_actions(plan)
        if self.consolidate:
            extra = consolidation_moves(sim, actions)
            self.moves += len(extra) // 2
            actions += extra
        return actions


def consolidation_moves(sim: Simulator, actions: list[Action], max_moves: int = 8,
                        min_run_s: float = 600.0, min_remaining_s: float = 1800.0) -> list[Action]:
    """Karpenter-style consolidation after the engine's placements: empty the least used rented
    instances when every job on them fits on free on-prem GPUs or on free GPUs of instances that
    stay, and the instance costs more per hour than the moved jobs will cost where they land;
    each job moves with a checkpoint (no work lost, the restart cost paid).  A job moves only if
    it has run ``min_run_s`` and has ``min_remaining_s`` of work left (a short job just finishes).
    Returns the extra Stop/Start actions; the emptied instance is then released.
    """
    taken: dict[str, set[int]] = defaultdict(set)
    for a in actions:
        if isinstance(a, Start):
            taken[a.node_id].update(a.gpus)
    by_id = {r.job.id: r for r in sim.running}
    rented = [(nid, run) for nid, run in sim.nodes.items() if run.offer is not None and run.jobs
              and run.ready_s <= sim.now]
    rented.sort(key=lambda it: (len(it[1].jobs) / max(it[1].node.gpus, 1), it[0]))
    draining: set[str] = set()
    moves: list[Action] = []

    def free_on(nid: str) -> list[int]:
        return [g for g in sim.nodes[nid].free_gpus if g not in taken[nid]]

    for nid, run in rented:
        jobs = [by_id[j] for j in sorted(run.jobs) if j in by_id]
        if len(moves) // 2 + len(jobs) > max_moves or not jobs:
            continue
        if any(sim.now - (r.start_s or sim.now) < min_run_s for r in jobs):
            continue
        if any((r.job.work_s - r.done_work_s) / max(r.speed, 1e-9) - (sim.now - (r.start_s or sim.now))
               < min_remaining_s for r in jobs):
            continue
        plan: list[tuple[str, str, tuple[int, ...]]] = []
        trial = defaultdict(set)
        for r in sorted(jobs, key=lambda r: -r.job.gpus):
            dest = None
            # on-prem first (cheapest), then fuller instances that are not being drained
            order = sorted((d for d in sim.nodes if d != nid and d not in draining),
                           key=lambda d: (sim.nodes[d].offer is not None, len(free_on(d)), d))
            for d in order:
                node = sim.nodes[d]
                if r.job.allowed_models and node.node.model not in r.job.allowed_models:
                    continue
                free = [g for g in free_on(d) if g not in trial[d]]
                if len(free) >= r.job.gpus:
                    dest = (d, tuple(free[: r.job.gpus]))
                    break
            if dest is None:
                break
            trial[dest[0]].update(dest[1])
            plan.append((r.job.id, dest[0], dest[1]))
        if len(plan) != len(jobs):
            continue
        # worth it only if the instance's hourly price exceeds what the jobs cost where they land
        # (on-prem at its internal rate; free GPUs of instances that stay are already paid)
        added = sum(len(g) * sim.nodes[d].node.price_per_gpu_hour for _, d, g in plan
                    if sim.nodes[d].offer is None)
        if run.price_per_hour <= added:
            continue
        draining.add(nid)
        for jid, d, gpus in plan:
            taken[d].update(gpus)
            moves.append(Stop(jid, checkpoint=True))
            moves.append(Start(jid, d, gpus))
    return moves
