"""Filter plugins: each rejects a (job, target) pair for one documented reason, or lets it pass.

As in the Kubernetes scheduling framework, a policy names the filters it runs (`Policy.filters`)
and the solver only sees the candidates that pass all of them. A rejection carries the reason
code; `phrase()` turns "how many candidates this plugin rejected" into the words of the pending
message, e.g. "9 have no GPU with >= 40 GB free".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from scheduling.capacity import PartDemand
from scheduling.model import WHOLE_GPU_MILLI, JobDemand, ReasonCode, TenantBudget
from scheduling.quota import QuotaLedger, quota_governed
from scheduling.targets import Pricing, Target


@dataclass(frozen=True, slots=True)
class FilterContext:
    pricing: Pricing
    tenants: Mapping[str, TenantBudget]
    # Teams' quotas of owned capacity as the cycle (or its phase) starts; None = no quotas.
    quota: QuotaLedger | None = None
    # The cycle's first phase admits only what fits in unused nominal quotas; `borrowing` False
    # keeps every team within its nominal (strict quotas).
    nominal_only: bool = False
    borrowing: bool = True


Check = Callable[[JobDemand, PartDemand, Target, FilterContext], bool]
Phrase = Callable[[JobDemand, int], str]


@dataclass(frozen=True, slots=True)
class FilterPlugin:
    name: str
    code: ReasonCode
    passes: Check
    phrase: Phrase


def _gb(mb: int) -> str:
    return f"{mb / 1024:g} GB"


def _usable_gpus(job: JobDemand, part: PartDemand, target: Target) -> list[int]:
    """Positions of healthy GPUs of an allowed model with enough free memory."""
    cap = target.rep
    return [
        p for p, gpu in enumerate(cap.node.gpus)
        if gpu.healthy and (not part.allowed_models or gpu.model in part.allowed_models)
        and cap.free_memory[p] >= part.min_gpu_memory_mb
    ]


def _free_enough(part: PartDemand, target: Target, positions: list[int]) -> list[int]:
    need = part.milli if part.fractional else WHOLE_GPU_MILLI
    return [p for p in positions if target.rep.free_milli[p] >= need]


def _node_ready(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    if not target.rep.schedulable:
        return False
    return part.gpus == 0 or any(g.healthy for g in target.node.gpus)


def _provider_region(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    node = target.node
    return (not job.providers or node.provider in job.providers) and (not job.regions or node.region in job.regions)


def _node_selector(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    labels = target.node.labels
    return all(labels.get(key) == value for key, value in job.node_selector)


def _container_runtime(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return not job.needs_container or bool(target.node.container_runtimes)


# A node whose GPUs are handed out whole by someone else (a Kubernetes device plugin) carries this label:
# a share placed there would take a whole GPU behind the broker's back.
WHOLE_GPUS_LABEL = ("whalezen.io/gpu-sharing", "none")


def _gpu_sharing(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return not job.is_fractional or target.node.labels.get(WHOLE_GPUS_LABEL[0]) != WHOLE_GPUS_LABEL[1]


def _gpu_model(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    if part.gpus == 0 or not part.allowed_models:
        return True
    return any(g.healthy and g.model in part.allowed_models for g in target.node.gpus)


def _gpu_memory(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return part.gpus == 0 or part.min_gpu_memory_mb <= 0 or bool(_usable_gpus(job, part, target))


def _gpu_count(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    if part.gpus == 0:
        return True
    return len(_free_enough(part, target, _usable_gpus(job, part, target))) >= part.gpus


def _topology(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    if part.gpus <= 1 or not part.nvlink:
        return True
    islands: dict[int, int] = {}
    for p in _free_enough(part, target, _usable_gpus(job, part, target)):
        island = target.node.gpus[p].nvlink_island
        if island is not None:
            islands[island] = islands.get(island, 0) + 1
    return any(n >= part.gpus for n in islands.values())


def _fast_fabric(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return job.nodes <= 1 or target.node.fast_fabric


def _cpu_memory(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return part.cpu_milli <= target.rep.free_cpu and part.memory_mb <= target.rep.free_mem


def _spot_policy(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    # Spot is a cloud purchase option; owned nodes are acceptable under every spot policy.
    if target.kind != "offer":
        return True
    return not (job.spot == "never" and target.spot) and not (job.spot == "required" and not target.spot)


def _price_ceiling(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return job.max_price_per_hour is None or ctx.pricing.hourly_price(job, target) <= job.max_price_per_hour + 1e-9


def _offer_quota(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    return target.kind != "offer" or target.count >= max(1, job.nodes)


def _remaining_quota(job: JobDemand, model: str, ctx: FilterContext) -> tuple[bool, bool]:
    budget = ctx.tenants.get(job.tenant)
    if budget is None:
        return True, True
    gpu_ok = budget.gpu_quota is None or (
        budget.gpus_in_use + ctx.pricing.gpu_share(job, model) <= budget.gpu_quota + 1e-9)
    cu_ok = budget.cu_quota is None or (
        budget.cu_in_use + ctx.pricing.compute_units(job, model) <= budget.cu_quota + 1e-9)
    return gpu_ok, cu_ok


def _tenant_quota(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    gpu_ok, cu_ok = _remaining_quota(job, target.gpu_model, ctx)
    return gpu_ok and cu_ok


def _pool_access(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    allowed = target.offer.tenants if target.offer is not None else target.node.tenants
    return not allowed or job.tenant in allowed


def owned(target: Target) -> bool:
    """Capacity quotas govern: an existing shared node the platform owns (not a rented instance, not a
    launch, not a team's private pool: `quota.quota_governed`)."""
    return target.kind == "node" and quota_governed(target.node)


def _team_quota(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    if ctx.nominal_only and target.kind == "node" and target.node.rented:
        # The nominal phase places on owned capacity only. A free GPU of a running instance took a
        # team's job there while other teams borrowed its share, and the share never came back
        # (bench.fairshare: a 358-cycle regain); the borrowing phase still uses such GPUs.
        return False
    if ctx.quota is None or not owned(target):
        return True
    return ctx.quota.admits(job, target.gpu_model, ctx.pricing.gpu_share(job, target.gpu_model),
                            nominal_only=ctx.nominal_only, borrowing=ctx.borrowing)


def _tenant_budget(job: JobDemand, part: PartDemand, target: Target, ctx: FilterContext) -> bool:
    """What the placement would spend fits in the team's remaining budget and in its owner's own."""
    budget = ctx.tenants.get(job.tenant)
    if budget is None:
        return True
    owner = budget.owner_budget(job.owner)
    if budget.remaining_budget is None and owner is None:
        return True
    money = ctx.pricing.money(job, target)
    return ((budget.remaining_budget is None or money <= budget.remaining_budget + 1e-9)
            and (owner is None or money <= owner.remaining_budget + 1e-9))


def _gpus_phrase(job: JobDemand, n: int) -> str:
    if job.gpu_milli < WHOLE_GPU_MILLI and job.gpus <= 1:
        return f"{n} have no GPU with {job.gpu_milli / WHOLE_GPU_MILLI:g} of a GPU free"
    if job.gpus_by_model and job.compute_units is None:
        nodes = max(1, job.nodes)
        wanted = ", ".join(f"{model}:{count // nodes}" for model, count in job.gpus_by_model)
        return f"{n} have fewer free GPUs per node than any alternative needs ({wanted})"
    # `gpus` counts every node's GPUs together; the phrase is about one node.
    wanted = job.gpus // max(1, job.nodes) if job.compute_units is None else f"{job.compute_units:g} CU of"
    return f"{n} have fewer than {wanted} free GPUs per node"


FILTERS: dict[str, FilterPlugin] = {plugin.name: plugin for plugin in (
    FilterPlugin("node_ready", ReasonCode.NODE_NOT_READY, _node_ready,
                 lambda job, n: f"{n} are not ready or have no healthy GPU"),
    FilterPlugin("provider_region", ReasonCode.PROVIDER_REGION, _provider_region,
                 lambda job, n: f"{n} are outside providers {list(job.providers) or 'any'} "
                                f"/ regions {list(job.regions) or 'any'}"),
    FilterPlugin("node_selector", ReasonCode.NODE_SELECTOR, _node_selector,
                 lambda job, n: f"{n} lack the labels "
                                f"{', '.join(f'{k}={v}' for k, v in job.node_selector)}"),
    FilterPlugin("container_runtime", ReasonCode.NO_CONTAINER_RUNTIME, _container_runtime,
                 lambda job, n: f"{n} have no container runtime (podman, docker or apptainer) for the "
                                "job's image"),
    FilterPlugin("gpu_sharing", ReasonCode.NO_GPU_SHARING, _gpu_sharing,
                 lambda job, n: f"{n} hand out whole GPUs only (Kubernetes), not {job.gpu_milli / 1000:g} of one"),
    FilterPlugin("gpu_model", ReasonCode.NO_GPU_MODEL, _gpu_model,
                 lambda job, n: f"{n} have no {'|'.join(job.allowed_models)} GPU"),
    FilterPlugin("gpu_memory", ReasonCode.INSUFFICIENT_GPU_MEMORY, _gpu_memory,
                 lambda job, n: f"{n} have no GPU with >= {_gb(job.min_gpu_memory_mb)} free"),
    FilterPlugin("gpu_count", ReasonCode.INSUFFICIENT_GPUS, _gpu_count, _gpus_phrase),
    FilterPlugin("topology", ReasonCode.NO_NVLINK_ISLAND, _topology,
                 lambda job, n: f"{n} lack a free NVLink island of {job.gpus // max(1, job.nodes)}"),
    FilterPlugin("fast_fabric", ReasonCode.NO_FAST_FABRIC, _fast_fabric,
                 lambda job, n: f"{n} have no fast fabric for a {job.nodes}-node job"),
    FilterPlugin("cpu_memory", ReasonCode.INSUFFICIENT_CPU_MEMORY, _cpu_memory,
                 lambda job, n: f"{n} lack {job.cpu_milli / 1000:g} CPU / {_gb(job.memory_mb)} RAM free"),
    FilterPlugin("spot_policy", ReasonCode.SPOT_POLICY, _spot_policy,
                 lambda job, n: f"{n} {'are spot' if job.spot == 'never' else 'are on-demand'} "
                                f"(spot={job.spot})"),
    FilterPlugin("price_ceiling", ReasonCode.PRICE_CEILING, _price_ceiling,
                 lambda job, n: f"{n} cost more than ${job.max_price_per_hour or 0:g}/h"),
    FilterPlugin("offer_quota", ReasonCode.OFFER_QUOTA, _offer_quota,
                 lambda job, n: f"{n} offers have launch quota 0"),
    FilterPlugin("tenant_quota", ReasonCode.QUOTA_EXCEEDED, _tenant_quota,
                 lambda job, n: f"{n} would exceed tenant {job.tenant}'s GPU/CU quota"),
    FilterPlugin("pool_access", ReasonCode.NO_POOL_ACCESS, _pool_access,
                 lambda job, n: f"{n} are in pools team {job.tenant} has no access to"),
    FilterPlugin("team_quota", ReasonCode.NOMINAL_QUOTA_USED, _team_quota,
                 lambda job, n: f"{n} would take team {job.tenant} past its quota of owned GPUs"),
    FilterPlugin("tenant_budget", ReasonCode.BUDGET_EXCEEDED, _tenant_budget,
                 lambda job, n: f"{n} cost more than tenant {job.tenant}'s remaining budget"
                                + (f" or user {job.owner}'s" if job.owner else "")),
)}


def resolve_filters(names: tuple[str, ...]) -> tuple[FilterPlugin, ...]:
    unknown = [name for name in names if name not in FILTERS]
    if unknown:
        raise KeyError(f"unknown filter plugins {unknown}; known: {sorted(FILTERS)}")
    return tuple(FILTERS[name] for name in names)


def first_rejection(plugins: tuple[FilterPlugin, ...], job: JobDemand, part: PartDemand | None,
                    target: Target, ctx: FilterContext) -> FilterPlugin | None:
    """The first plugin (in policy order) that rejects the pair, or None when all pass."""
    if part is None:
        return None
    for plugin in plugins:
        if not plugin.passes(job, part, target, ctx):
            return plugin
    return None


# Score terms by name: what each prices, and the `PolicyWeights` fields that scale it. The MILP,
# greedy and `objective.evaluate` read them through `problem.scaled_weights`; a policy lists names
# and weights (`Policy.scores`), and a name missing from the policy weighs 0.
SCORE_TERMS: dict[str, str] = {
    "money": "dollars for the run on the chosen GPUs, launch overhead and idle instance GPUs (PolicyWeights.money)",
    "fragmentation": "FGD increase of owned nodes, in GPUs x fragmentation_dollars_per_gpu "
                     "(PolicyWeights.fragmentation)",
    "waiting": "per job left pending: waiting_dollars_per_job x priority_step_factor^rank x (0.1 + GPUs) "
               "(PolicyWeights.waiting)",
}


def resolve_scores(scores: Mapping[str, float]) -> dict[str, float]:
    unknown = [name for name in scores if name not in SCORE_TERMS]
    if unknown:
        raise KeyError(f"unknown score terms {unknown}; known: {sorted(SCORE_TERMS)}")
    return {name: float(scores.get(name, 0.0)) for name in SCORE_TERMS}
