"""``whalezen`` in the cost week: the core engine (`scheduling.engine.schedule`) driving the fleet.

Each cycle turns the simulator's state into a :class:`scheduling.model.Snapshot` (on-prem nodes
and already rented instances as nodes, running jobs as allocations, the catalog as offers, GPU
speeds as CU ratings, every pending job with its remaining work as expected duration), calls the
engine and turns the plan back into simulator actions: placements on nodes become starts,
placements on launches become instance launches, migrations (defragmentation, and the engine's
consolidation of under-used rented instances) become a checkpointed stop + start, preemptions
become stops (a reclaim preemption, which returns a team's nominal quota, checkpoints first:
the broker checkpoints then stops it). Whether a cycle runs at all is the broker's rule
(`scheduling.moves.cycle_wanted`).

Shared capacity (issue 11): `quotas` are passed as `Snapshot.quotas` every cycle, and `usage`, when
given, is called with the simulator each cycle for `Snapshot.usage` (the teams' decayed GPU-hours;
bench.fairshare keeps them). Without either the snapshot is what it always was.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from scheduling.model import (
    CloudOffer, GpuModelInfo, GpuState, JobDemand, NodeState, Plan, Policy, PolicyWeights, QuotaShare,
    RunningAllocation, Snapshot, TeamUsage,
)
from scheduling.moves import MoveRules, cycle_wanted
from scheduling.sim.events import Action, Launch, Simulator, Start, Stop

BIG_CPU = 1_000_000  # the cost week models GPUs only; CPU and memory never bind
BIG_MEM = 10_000_000
GPU_MEMORY_MB = 32_768


def build_snapshot(sim: Simulator, weights: PolicyWeights, launchable: int, sunk: bool = True,
                   quotas: Sequence[QuotaShare] = (), usage: Sequence[TeamUsage] = ()) -> Snapshot:
    nodes = []
    for nid, run in sorted(sim.nodes.items()):
        gpus = tuple(GpuState(i, f"{nid}-gpu{i}", run.node.model, GPU_MEMORY_MB,
                              GPU_MEMORY_MB if free else 0, milli_used=0 if free else 1000)
                     for i, free in enumerate(run.free))
        nodes.append(NodeState(nid, nid, gpus, BIG_CPU, BIG_MEM, BIG_CPU, BIG_MEM,
                               provider=run.node.provider, rented=run.offer is not None,
                               # a rented instance is paid whether its free GPUs are used or not
                               price_per_gpu_hour=0.0 if (sunk and run.offer is not None)
                               else run.node.price_per_gpu_hour))
    running = []
    for r in sim.running:
        ran = max(0.0, sim.now - (r.start_s or sim.now))
        running.append(RunningAllocation(
            r.job.id, r.node_id or "", r.gpus, tenant=r.job.tenant, preemptible=r.job.checkpointable,
            checkpointable=r.job.checkpointable, run_seconds=ran,
            checkpoint_age_s=ran % sim.checkpoint_s, restart_cost_s=sim.restart_s,
            # the work left at this run's start: the engine subtracts what it has run since
            demand=_demand(r, max(r.job.work_s - r.done_work_s, 0.0))))
    pending = tuple(_demand(r, max(r.job.work_s - r.done_work_s, 60.0)) for r in sim.pending)
    offers = tuple(CloudOffer(o.id, o.provider, o.region, o.zone, o.instance_type, o.model, o.gpus,
                              GPU_MEMORY_MB, o.price_per_hour, o.spot_price_per_hour, launchable,
                              vcpus=o.vcpus, memory_mb=int(o.memory_gib * 1024))
                   for o in sim.offers)
    models = tuple(GpuModelInfo(m, cu_rating=s) for m, s in sorted(sim.speeds.items()))
    return Snapshot(now=sim.now, nodes=tuple(nodes), pending=pending, running=tuple(running),
                    offers=offers, gpu_models=models, weights=weights, quotas=tuple(quotas), usage=tuple(usage))


def _demand(run, work_s: float) -> JobDemand:
    job = run.job
    return JobDemand(job.id, tenant=job.tenant, gpus=job.gpus, allowed_models=job.allowed_models,
                     spot="allowed" if job.spot_ok else "never", preemptible=job.checkpointable,
                     expected_duration_hours=work_s / 3600.0, submitted_at=job.submit_s)


def plan_to_actions(plan: Plan) -> list[Action]:
    actions: list[Action] = []
    for p in plan.preemptions:  # a reclaim checkpoints first; a priority preemption loses work
        actions.append(Stop(p.victim_job_id, checkpoint=p.cause == "reclaim"))
    for m in plan.migrations:  # planned moves: checkpoint first, only the restart is lost
        actions.append(Stop(m.job_id, checkpoint=True))
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
                 schedule: Callable[[Snapshot, Policy | None], Plan] | None = None,
                 rules: MoveRules | None = None, quotas: Sequence[QuotaShare] = (),
                 usage: Callable[[Simulator], Sequence[TeamUsage]] | None = None) -> None:
        if schedule is None:
            from scheduling.engine import schedule as engine_schedule
            schedule = engine_schedule
        self.schedule = schedule
        self.policy = policy
        self.rules = rules or MoveRules()
        self.last_cycle_s: float | None = None
        self.weights = weights or PolicyWeights()
        self.launchable = launchable
        self.sunk = sunk
        self.idle_release_s = idle_release_s
        self.moves = 0
        self.methods: dict[str, int] = defaultdict(int)
        self.cycle_seconds: list[float] = []
        self.quotas = tuple(quotas)
        self.usage = usage
        self.preemptions: dict[str, int] = defaultdict(int)  # by cause
        self.last_plan: Plan | None = None

    def decide(self, sim: Simulator) -> list[Action]:
        running_on_rented = any(sim.nodes[r.node_id].offer is not None for r in sim.running
                                if r.node_id in sim.nodes)
        since = None if self.last_cycle_s is None else sim.now - self.last_cycle_s
        if not cycle_wanted(pending=bool(sim.pending), running_on_rented=running_on_rented,
                            seconds_since_last_cycle=since, rules=self.rules, policy=self.policy or Policy()):
            return []
        self.last_cycle_s = sim.now
        usage = tuple(self.usage(sim)) if self.usage is not None else ()
        snapshot = build_snapshot(sim, self.weights, self.launchable, self.sunk, self.quotas, usage)
        plan = self.schedule(snapshot, self.policy)
        self.last_plan = plan
        for p in plan.preemptions:
            self.preemptions[p.cause] += 1
        self.methods[plan.solver.method] += 1
        self.cycle_seconds.append(plan.solver.solve_seconds)
        self.moves += len(plan.migrations)
        return plan_to_actions(plan)
