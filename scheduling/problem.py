"""One cycle's problem: capacities, targets, demand classes and the filtered candidate pairs.

Pending jobs with identical demands form a `DemandClass`; nodes with identical free capacity form
a shape `Target`. Filters run once per (class, target) pair instead of per (job, node), which is
what keeps 5,000 jobs x 1,213 nodes cheap. Rejections are counted per plugin (weighted by how
many nodes or instances a target stands for) for the explanations.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import (
    WHOLE_GPU_MILLI, JobDemand, Policy, PolicyWeights, Snapshot, WorkloadClass,
)
from scheduling.quota import QuotaLedger
from scheduling.plugins import FilterContext, FilterPlugin, first_rejection, resolve_filters, resolve_scores
from scheduling.targets import (
    Pricing, Target, build_offer_targets, build_shape_targets, offer_group_caps, priority_weight,
)

# Cheapest offer variants kept per class: the rest are dominated for any realistic quota.
OFFERS_PER_CLASS = 4


@dataclass(slots=True)
class Candidate:
    target: int  # index into Problem.targets
    part: PartDemand
    money: float  # dollars for the whole job at this target (all its nodes)
    hourly: float
    # Fragmentation measure (GPUs) the part's CPU adds on a node of this shape after its whole
    # GPUs are gone: charged per node-part by every method (offers: 0).
    host_cost: float = 0.0
    # The part's whole cost change alone on an untouched node of the shape (fragmentation of its
    # GPUs and CPU, and CPU/memory stranding): only orders greedy's candidates.
    fit_cost: float = 0.0
    # The stranding part of fit_cost (alpha x stranded GPUs added), for greedy to update it.
    strand_cost: float = 0.0


@dataclass(slots=True)
class DemandClass:
    index: int
    demand: JobDemand  # the first member; all members share every field but job_id/submitted_at
    job_ids: list[str]
    waiting_cost: float  # objective cost of leaving one member unplaced
    candidates: list[Candidate] = field(default_factory=list)
    # plugin name -> number of nodes / offers it rejected (weighted by target size)
    rejections: Counter = field(default_factory=Counter)
    offer_rejections: list[tuple[str, str]] = field(default_factory=list)  # (target text, plugin)
    invalid: str = ""

    @property
    def size(self) -> int:
        return len(self.job_ids)


# Above this many classes, jobs that differ only in identity and expected duration share a class:
# the MILP prices it at its mean duration and mapping gives the longest members the cheapest
# hours. With duration in the key 5,000 Alibaba jobs made 342 classes instead of 116 and the MILP
# 3x bigger; below the threshold classes stay exact (the optimality-gap instances).
MERGE_DURATIONS_ABOVE = 150
_KEY_FIELDS = tuple(f.name for f in dataclasses.fields(JobDemand)
                    if f.name not in ("job_id", "tenant", "submitted_at", "expected_duration_hours"))


def class_fields(job: JobDemand) -> tuple:
    """Every demand field but the job's identity, team, submission time and expected duration: two
    jobs of one team with the same fields can take each other's placement."""
    return tuple(getattr(job, name) for name in _KEY_FIELDS)


def _class_key(job: JobDemand, tenant_group: dict[str, str]) -> tuple:
    """Everything that decides where a job may go and what it costs per hour; the team only as far as
    it changes that (`tenant_groups`)."""
    return (tenant_group.get(job.tenant, job.tenant),) + class_fields(job)


def tenant_groups(snapshot: Snapshot, quota: QuotaLedger | None) -> dict[str, str]:
    """Teams whose jobs may share demand classes: team -> group. A team's jobs go where another team's
    identical jobs go, at the same price, when neither has a GPU/CU quota, budget or owner budget here,
    no quota of owned capacity is in force (fair share and borrowing then differ per team), and both
    may use the same pools. Such teams share one group, so 5,000 jobs of four teams on one shared
    cluster make the classes one team's would (315 -> 106 on bench.service's Alibaba cycle: the
    filters, prices and the MILP are per class). Any other team is a group of its own. Each job keeps
    its team: the book charges, explains and preempts per job."""
    teams = {job.tenant for job in snapshot.pending}
    if quota is not None and quota.active:
        return {team: team for team in teams}
    budgets = {b.tenant: b for b in snapshot.tenants}
    # Each distinct access list once (most nodes of a pool share one); empty = every team.
    access_lists = sorted({node.tenants for node in snapshot.nodes} | {offer.tenants for offer in snapshot.offers})
    groups = {}
    for team in teams:
        budget = budgets.get(team)
        limited = budget is not None and (budget.gpu_quota is not None or budget.cu_quota is not None
                                          or budget.remaining_budget is not None or bool(budget.owners))
        if limited:
            groups[team] = team
        else:
            # A slug has no ":", so a group never equals a team of its own.
            groups[team] = "access:" + "".join("1" if not allowed or team in allowed else "0" for allowed in access_lists)
    return groups


def scaled_weights(weights: PolicyWeights, policy: Policy) -> dict[str, float]:
    scores = resolve_scores(policy.scores)
    return {
        "money": weights.money * scores.get("money", 0.0),
        "fragmentation": weights.fragmentation * scores.get("fragmentation", 0.0)
        * weights.fragmentation_dollars_per_gpu,
        "waiting": weights.waiting * scores.get("waiting", 0.0) * weights.waiting_dollars_per_job,
    }


def workload_classes(snapshot: Snapshot) -> tuple[WorkloadClass, ...]:
    if snapshot.workload:
        return snapshot.workload
    counts: Counter = Counter()
    for job in snapshot.pending:
        milli = min(job.gpu_milli, WHOLE_GPU_MILLI) if job.gpus or job.compute_units else 0
        counts[(max(job.gpus, 0), milli, job.cpu_milli, job.allowed_models)] += 1
    return tuple(WorkloadClass(gpus=g, gpu_milli=m, weight=float(n), cpu_milli=c, gpu_models=models)
                 for (g, m, c, models), n in sorted(counts.items()))


@dataclass
class Problem:
    snapshot: Snapshot
    policy: Policy
    pricing: Pricing
    capacities: list[NodeCapacity]
    targets: list[Target]
    classes: list[DemandClass]
    ctx: FilterContext
    weights: dict[str, float]
    reference_hours: float
    plugins: tuple[FilterPlugin, ...]

    def job(self, job_id: str) -> JobDemand:
        return self.jobs_by_id[job_id]

    def __post_init__(self) -> None:
        self.jobs_by_id = {job.job_id: job for job in self.snapshot.pending}
        self.class_of = {job_id: c.index for c in self.classes for job_id in c.job_ids}

    @cached_property
    def workload(self):  # -> fragmentation.Workload | None
        """The task mix the fragmentation and stranding measures are taken against (once per cycle:
        re-deriving it per scored node cost more than the scoring)."""
        from scheduling.patterns import to_workload

        return to_workload(workload_classes(self.snapshot), self.homes)

    @cached_property
    def homes(self):  # -> fragmentation.ScarceHomes | None
        """Task classes whose homes are scarce on this snapshot's nodes (`fragmentation.scarce_homes`),
        from the snapshot's whole task mix (`task_mix`, else the workload's or the pending jobs'
        classes); None when nothing is scarce."""
        from scheduling import fragmentation as fgd

        classes = self.snapshot.task_mix or workload_classes(self.snapshot)
        nodes = [(len(n.gpus), n.cpu_milli, n.memory_mb, n.gpus[0].model) for n in self.snapshot.nodes if n.gpus]
        homes = fgd.scarce_homes(((c.cpu_milli, c.memory_mb, c.gpu_milli, c.gpus, frozenset(c.gpu_models), c.weight)
                                  for c in classes), nodes)
        return homes if len(homes.weight) else None

    @cached_property
    def group_caps(self) -> list[tuple[int, tuple[str, ...]]]:
        """(remaining launches, offer ids) per capped offer group: the MILPs' shared-cap rows."""
        return offer_group_caps(self.snapshot.offers, self.snapshot.launch_limit_of())


def build_problem(snapshot: Snapshot, policy: Policy, capacities: list[NodeCapacity] | None = None,
                  quota: QuotaLedger | None = None, nominal_only: bool = False) -> Problem:
    """Group, filter and price everything one cycle needs. `capacities` lets a caller pass state
    already changed (preemption and defragmentation what-ifs, the borrowing phase); `quota` the
    teams' usage as it stands then (default: the snapshot's); `nominal_only` admits on owned
    capacity only what fits in unused nominal quotas (the engine's first phase)."""
    pricing = Pricing(snapshot)
    if quota is None and snapshot.quotas:
        quota = QuotaLedger(snapshot)
    if capacities is None:
        capacities = [NodeCapacity(node) for node in sorted(snapshot.nodes, key=lambda n: n.id)]
    targets = build_shape_targets(capacities) + build_offer_targets(
        tuple(sorted(snapshot.offers, key=lambda o: o.id)), snapshot.launch_limit_of())
    ctx = FilterContext(pricing=pricing, tenants={t.tenant: t for t in snapshot.tenants},
                        quota=quota if quota is not None and quota.active else None,
                        nominal_only=nominal_only, borrowing=policy.borrowing)
    plugins = resolve_filters(policy.filters)
    weights = scaled_weights(snapshot.weights, policy)
    durations = [job.expected_duration_hours for job in snapshot.pending] or [1.0]
    reference_hours = min(24.0, max(0.1, statistics.median(durations)))

    members: dict[tuple, list[JobDemand]] = {}
    ordered_jobs = sorted(snapshot.pending, key=lambda j: (j.submitted_at, j.job_id))
    groups = tenant_groups(snapshot, ctx.quota)
    keys = [_class_key(job, groups) for job in ordered_jobs]
    for job, key in zip(ordered_jobs, keys):
        members.setdefault(key + (job.expected_duration_hours,), []).append(job)
    if len(members) > MERGE_DURATIONS_ABOVE:
        members = {}
        for job, key in zip(ordered_jobs, keys):
            members.setdefault(key, []).append(job)
    ranks = {p: r for r, p in enumerate(sorted({job.priority for job in snapshot.pending}))}

    classes: list[DemandClass] = []
    for index, (key, jobs) in enumerate(members.items()):
        mean_hours = sum(j.expected_duration_hours for j in jobs) / len(jobs)
        demand = jobs[0] if len(jobs) == 1 else dataclasses.replace(jobs[0], expected_duration_hours=mean_hours)
        gpu_equivalent = (demand.compute_units if demand.compute_units is not None
                          else demand.gpus * min(demand.gpu_milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI)
        waiting = weights["waiting"] * priority_weight(ranks[demand.priority], snapshot.weights.priority_step_factor)
        if ctx.quota is not None and policy.fair_share:
            # Among borrowers the better-served team waits more cheaply: scaled by 0.5 + F/2, so a
            # team that used nothing (F = 1) keeps the full waiting cost and one far over its share
            # half of it (priority ranks still double it; docs/quotas.md).
            waiting *= 0.5 + 0.5 * ctx.quota.factor.get(demand.tenant, 1.0)
        demand_class = DemandClass(index=index, demand=demand, job_ids=[j.job_id for j in jobs],
                                   waiting_cost=waiting * (0.1 + max(0.0, gpu_equivalent)))
        _fill_candidates(demand_class, targets, pricing, ctx, plugins)
        classes.append(demand_class)
    problem = Problem(snapshot=snapshot, policy=policy, pricing=pricing, capacities=capacities, targets=targets,
                      classes=classes, ctx=ctx, weights=weights, reference_hours=reference_hours, plugins=plugins)
    if weights["fragmentation"] and problem.workload is not None:
        from scheduling.patterns import ShareChoice

        choice = ShareChoice(problem.workload)  # every copy of these capacities (the book's) keeps it
        for cap in [*capacities, *(t.rep for t in targets if t.kind == "node")]:
            cap.share_choice = choice
        _price_host_costs(problem.workload, targets, classes)
    return problem


def _price_host_costs(workload, targets: list[Target], classes: list[DemandClass]) -> None:
    """Fill `Candidate.host_cost` and `fit_cost` for every (class, node shape) pair.

    A part on a node of shape t with free GPUs G and CPU C first takes its whole GPUs (G -> G';
    the pattern term charges frag(G', C) - frag(G, C)). Its host cost is what its CPU adds to the
    fragmentation measure, frag(G', C - cpu) - frag(G', C). Its fit cost (greedy's order) is
    frag(G', C - cpu) - frag(G, C) plus STRANDING_ALPHA x the change of the node's stranded GPUs
    alone on an untouched node. The measure includes the scarce-homes term
    (`patterns.node_cost_batch`), which memory changes too. One vectorised measure call over the
    distinct (shape, whole GPUs taken, CPU, memory) states."""
    import numpy as np

    from scheduling import fragmentation as fgd
    from scheduling.patterns import STRANDING_ALPHA, node_cost_batch, stranding_ratios

    if workload is None:
        return
    cpu_ratio, mem_ratio = stranding_ratios(workload)
    rows: dict[tuple[int, int, int, int, int, int], int] = {}
    pairs: list[tuple[Candidate, tuple, tuple, tuple, tuple]] = []
    for demand_class in classes:
        for candidate in demand_class.candidates:
            target = targets[candidate.target]
            if target.kind != "node":
                continue
            part = candidate.part
            taken = part.gpus if part.gpus and not part.fractional else 0
            # A share's fit cost also sees the GPU it would take (best fit, as the packer does);
            # its host cost does not: the objective charges the GPUs a cycle opens for shares.
            shared = target.rep.choose(part) if part.fractional else None
            share = (shared[0], part.milli) if shared else (-1, 0)
            keys = ((candidate.target, 0, 0, 0, -1, 0), (candidate.target, taken, 0, 0, -1, 0),
                    (candidate.target, taken, part.cpu_milli, part.memory_mb, -1, 0),
                    (candidate.target, taken, part.cpu_milli, part.memory_mb) + share)
            for key in keys:
                rows.setdefault(key, len(rows))
            pairs.append((candidate,) + keys)  # type: ignore[arg-type]
    if not pairs:
        return
    width = max(1, max(len(targets[key[0]].rep.free_milli) for key in rows))
    gpu_free = np.zeros((len(rows), width), dtype=np.int64)
    cpu = np.zeros(len(rows), dtype=np.int64)
    mem = np.zeros(len(rows), dtype=np.int64)
    models = [""] * len(rows)
    for (t, taken, part_cpu, part_mem, share_position, share_milli), row in rows.items():
        cap = targets[t].rep
        vector = list(cap.free_milli)
        whole = [p for p, m in enumerate(vector) if m >= WHOLE_GPU_MILLI and cap.node.gpus[p].healthy]
        for p in whole[:taken]:
            vector[p] = 0
        if share_position >= 0:
            vector[share_position] -= share_milli
        gpu_free[row, : len(vector)] = vector
        cpu[row] = max(0, cap.free_cpu - part_cpu)
        mem[row] = max(0, cap.free_mem - part_mem)
        models[row] = cap.node.gpus[0].model if cap.node.gpus else ""
    frag = node_cost_batch(gpu_free, cpu, models, workload, mem)
    # Stranding before and after each part (GPU totals, CPU, memory), in GPUs.
    strand = np.zeros(len(pairs))
    if STRANDING_ALPHA and (cpu_ratio > 0 or mem_ratio > 0):
        before_g, before_c, before_m, after_g, after_c, after_m = ([] for _ in range(6))
        for candidate, *_ in pairs:
            cap, part = targets[candidate.target].rep, candidate.part
            total = sum(cap.free_milli)
            used = part.gpus * part.milli if part.gpus else 0
            before_g.append([total]), before_c.append(cap.free_cpu), before_m.append(cap.free_mem)
            after_g.append([max(0, total - used)]), after_c.append(max(0, cap.free_cpu - part.cpu_milli))
            after_m.append(max(0, cap.free_mem - part.memory_mb))
        strand = STRANDING_ALPHA * (fgd.stranded_batch(after_g, after_c, cpu_ratio, after_m, mem_ratio)
                                    - fgd.stranded_batch(before_g, before_c, cpu_ratio, before_m, mem_ratio)
                                    ) / WHOLE_GPU_MILLI
    for number, (candidate, untouched, gpus_gone, after, fitted) in enumerate(pairs):
        candidate.host_cost = float(frag[rows[after]] - frag[rows[gpus_gone]])
        candidate.fit_cost = float(frag[rows[fitted]] - frag[rows[untouched]] + strand[number])
        candidate.strand_cost = float(strand[number])


def _invalid_reason(job: JobDemand) -> str:
    if job.nodes < 1:
        return "nodes must be >= 1"
    if job.gpu_milli <= 0 and (job.gpus > 0 or job.compute_units is not None):
        return "gpu_milli must be > 0"
    if job.gpu_milli < WHOLE_GPU_MILLI and (job.gpus > 1 or job.nodes > 1 or job.compute_units is not None):
        return "a GPU fraction is only valid for one GPU on one node"
    if job.compute_units is None and job.gpus % job.nodes:
        return f"{job.gpus} GPUs do not split evenly over {job.nodes} nodes"
    if job.gpus < 0 or (job.compute_units is not None and job.compute_units <= 0):
        return "GPU count / compute units must be positive"
    if job.compute_units is None and job.gpus == 0 and job.nodes > 1:
        return "a CPU-only job runs on one node"
    return ""


def _fill_candidates(demand_class: DemandClass, targets: list[Target], pricing: Pricing,
                     ctx: FilterContext, plugins: tuple[FilterPlugin, ...]) -> None:
    job = demand_class.demand
    demand_class.invalid = _invalid_reason(job)
    if demand_class.invalid:
        return
    per_model: dict[str, tuple] = {}  # GPU model -> (part, GPUs occupied, run hours): once per class
    priced: list[tuple[float, str, int]] = []
    for index, target in enumerate(targets):
        model = target.gpu_model
        if model not in per_model:
            per_model[model] = (pricing.part(job, model), pricing.gpu_share(job, model),
                                pricing.runtime_hours(job, model))
        part, share, hours = per_model[model]
        if part is None:
            if target.kind == "node":
                demand_class.rejections["gpu_count"] += target.count
            continue
        if target.kind == "offer":
            priced.append((share * target.node.price_per_gpu_hour * hours, target.key, index))
            continue
        _consider(demand_class, targets, index, part, share, hours, ctx, plugins)
    # Offers cheapest first, and only until OFFERS_PER_CLASS pass: a dearer variant of the same
    # job only matters when the cheaper ones run out of quota, which that many distinct offers
    # cover. Offers never reached are not filtered (nor counted in explanations: the job had fits).
    passed = 0
    for _, _, index in sorted(priced):
        part, share, hours = per_model[targets[index].gpu_model]
        if _consider(demand_class, targets, index, part, share, hours, ctx, plugins):
            passed += 1
            if passed >= OFFERS_PER_CLASS:
                break


def _consider(demand_class: DemandClass, targets: list[Target], index: int, part: PartDemand, share: float,
              hours: float, ctx: FilterContext, plugins: tuple[FilterPlugin, ...]) -> bool:
    target = targets[index]
    rejected = first_rejection(plugins, demand_class.demand, part, target, ctx)
    if rejected is not None:
        if target.kind == "node":
            demand_class.rejections[rejected.name] += target.count
        else:
            demand_class.offer_rejections.append((target.describe(), rejected.name))
        return False
    hourly = share * target.node.price_per_gpu_hour
    demand_class.candidates.append(Candidate(target=index, part=part, money=hourly * hours, hourly=hourly))
    return True
