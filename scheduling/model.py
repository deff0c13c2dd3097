"""The scheduling library's data model: what a cycle reads (Snapshot) and what it decides (Plan).

Everything here is a frozen dataclass of plain values so that a snapshot built by the broker's
selectors, by the simulator or by a test is the same kind of object, can be compared, and gives
the same plan every time (the engine is deterministic for a given snapshot, seed included).

Units, fixed everywhere so nobody converts twice:
- GPU fractions in thousandths ("milli"): 1000 is a whole GPU, 500 half of one.
- CPU in millicores, memory in MiB ("_mb" fields hold MiB), money in USD, time in seconds except
  ``expected_duration_hours`` and prices, which are per hour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Mapping

WHOLE_GPU_MILLI = 1000

Interconnect = Literal["any", "pcie", "nvlink"]
SpotPolicy = Literal["never", "allowed", "required"]
SolverMethod = Literal["milp", "greedy", "exact"]

# Node states the engine may place work on; anything else (draining, down, cordoned, provisioning)
# is skipped with reason NODE_NOT_READY.
SCHEDULABLE_NODE_STATES: frozenset[str] = frozenset({"ready"})


# --------------------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class GpuState:
    index: int
    uuid: str
    model: str
    memory_mb: int
    free_memory_mb: int
    # GPUs that share an NVLink island (NVSwitch domain or fully linked group) carry the same id;
    # None means the GPU has no NVLink peer.
    nvlink_island: int | None = None
    healthy: bool = True
    # Fraction of this GPU already shared out to running work, in thousandths (0..1000).
    milli_used: int = 0

    @property
    def free_milli(self) -> int:
        return max(0, WHOLE_GPU_MILLI - self.milli_used)


@dataclass(frozen=True, slots=True)
class NodeState:
    id: str
    name: str
    gpus: tuple[GpuState, ...]
    cpu_milli: int
    memory_mb: int
    free_cpu_milli: int
    free_memory_mb: int
    pool: str = "default"
    provider: str = "onprem"
    region: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    state: str = "ready"
    # Internal (on-prem) or already-paid (running cloud instance) price of one GPU-hour.
    price_per_gpu_hour: float = 0.0
    # True when the node sits on a fabric fit for multi-node jobs (InfiniBand, EFA, GPUDirect).
    fast_fabric: bool = False
    # True for a cloud instance rented by the hour (paid whether busy or not; may be emptied and
    # released), False for owned capacity.
    rented: bool = False
    # Teams (tenants) that may run here: the owner of the node's pool and the teams it is shared
    # with. Empty = every team (a snapshot of one team's own nodes, the simulators).
    tenants: tuple[str, ...] = ()
    # Container runtimes on the node (podman, docker, apptainer); a job with an image runs only
    # where there is one.
    container_runtimes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunningAllocation:
    job_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    # Milli taken on each GPU in gpu_indices (1000 = whole GPU).
    gpu_milli: int = WHOLE_GPU_MILLI
    tenant: str = ""
    priority: int = 0
    preemptible: bool = False
    checkpointable: bool = False
    run_seconds: float = 0.0
    # Age of the newest committed checkpoint; None means no checkpoint (all progress is lost).
    checkpoint_age_s: float | None = None
    restart_cost_s: float = 0.0
    cpu_milli: int = 0
    memory_mb: int = 0
    # Demand to place the job again when it is moved (defragmentation); None = not movable.
    demand: "JobDemand | None" = None

    @property
    def lost_work_s(self) -> float:
        """Work thrown away if stopped now: progress since the last committed checkpoint + restart."""
        since_checkpoint = self.run_seconds if self.checkpoint_age_s is None else self.checkpoint_age_s
        return min(since_checkpoint, self.run_seconds) + self.restart_cost_s


@dataclass(frozen=True, slots=True)
class CloudOffer:
    id: str
    provider: str
    region: str
    zone: str
    instance_type: str
    gpu_model: str
    gpu_count: int
    gpu_memory_mb: int
    ondemand_price_per_hour: float
    spot_price_per_hour: float | None = None
    # How many more instances can be launched now under the account's quota / known capacity.
    launchable: int = 0
    nvlink: bool = False
    fast_fabric: bool = False
    vcpus: int = 0
    memory_mb: int = 0
    # Offers of one pool (one account) share its instance cap: `Snapshot.launch_limits` says how
    # many more instances the group may launch, whatever their types. "" = no shared cap.
    launch_group: str = ""
    # Teams that may rent through this offer's account; empty = every team.
    tenants: tuple[str, ...] = ()
    # Container runtimes the account's machine image has (the pool says); empty = none.
    container_runtimes: tuple[str, ...] = ()

    @property
    def has_spot(self) -> bool:
        # Catalog quirk: a spot price at or above on-demand is no spot discount at all.
        return self.spot_price_per_hour is not None and 0 < self.spot_price_per_hour < self.ondemand_price_per_hour


@dataclass(frozen=True, slots=True)
class LaunchLimit:
    """At most `remaining` more instances, all types together, from the offers of `group`.

    A pool's `max_instances` minus its live instances: a hard limit on money. A per-offer
    `launchable` alone let one cycle launch the cap once per instance type (issue 8: 6 of 2).
    """

    group: str
    remaining: int


@dataclass(frozen=True, slots=True)
class JobDemand:
    job_id: str
    tenant: str = ""
    # Whole GPUs wanted (per job, all nodes together); ignored when compute_units is set.
    gpus: int = 1
    # Ask for capacity instead of a count: the engine picks ceil(compute_units / CU rating) GPUs
    # of one model, so a faster model needs fewer GPUs.
    compute_units: float | None = None
    # Share of each GPU (1000 = whole). Below 1000 only valid with gpus == 1 on one node.
    gpu_milli: int = WHOLE_GPU_MILLI
    allowed_models: tuple[str, ...] = ()
    # Alternatives with their own counts, ((model, GPUs for the whole job), ...): SkyPilot's
    # {L4:8, A100-80GB:2}. A model listed here takes its own count instead of `gpus`; `gpus` is
    # then the smallest of them (what explanations and quotas read first).
    gpus_by_model: tuple[tuple[str, int], ...] = ()
    # The job runs a container image: only nodes with a container runtime can take it.
    needs_container: bool = False
    # Node labels a node must carry, ((key, value), ...) (Kubernetes nodeSelector); empty = any node.
    node_selector: tuple[tuple[str, str], ...] = ()
    min_gpu_memory_mb: int = 0
    interconnect: Interconnect = "any"
    nodes: int = 1
    cpu_milli: int = 0
    memory_mb: int = 0
    spot: SpotPolicy = "allowed"
    max_price_per_hour: float | None = None
    priority: int = 0
    preemptible: bool = True
    expected_duration_hours: float = 1.0
    # Empty = any provider / region. On-prem nodes have provider "onprem" unless the snapshot says
    # otherwise.
    providers: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    job_family: str = ""
    # Submission time; older jobs win ties (FIFO within equal priority).
    submitted_at: float = 0.0
    # The job's owner, when they have a budget of their own (TenantBudget.owners); "" otherwise, so jobs
    # of owners without one still share demand classes.
    owner: str = ""

    @property
    def is_fractional(self) -> bool:
        return self.gpu_milli < WHOLE_GPU_MILLI

    def gpu_count_for(self, model: GpuModelInfo | None) -> int:
        """GPUs of `model` this job needs (CU demands convert through the model's CU rating)."""
        if self.gpus <= 0 and self.compute_units is None:
            return 0
        if self.compute_units is None:
            if self.gpus_by_model and model is not None:
                for name, count in self.gpus_by_model:
                    if name == model.name:
                        return count
            return self.gpus
        rating = model.cu_rating if model is not None and model.cu_rating > 0 else 1.0
        count = max(1, math.ceil(self.compute_units / rating - 1e-9))
        # A multi-node CU demand must split evenly over its nodes.
        return self.nodes * math.ceil(count / self.nodes)


@dataclass(frozen=True, slots=True)
class OwnerBudget:
    """One member's own monthly budget inside their team's: what their jobs may still spend this month."""

    owner: str
    remaining_budget: float  # USD
    monthly_budget: float  # USD, for the pending reason's words


@dataclass(frozen=True, slots=True)
class TenantBudget:
    tenant: str
    gpu_quota: float | None = None  # GPUs (fractions count fractionally); None = unlimited
    cu_quota: float | None = None  # compute units; None = unlimited
    gpus_in_use: float = 0.0
    cu_in_use: float = 0.0
    remaining_budget: float | None = None  # USD; None = unlimited
    # Members with a budget of their own; a job (JobDemand.owner) spends from both.
    owners: tuple[OwnerBudget, ...] = ()

    def owner_budget(self, owner: str) -> OwnerBudget | None:
        if not owner:
            return None
        return next((b for b in self.owners if b.owner == owner), None)


# The flavor of a quota in compute units: it counts the CU of every owned GPU a team holds.
CU_FLAVOR = "CU"


@dataclass(frozen=True, slots=True)
class QuotaShare:
    """A team's quota of one flavor of owned capacity, as a Kueue ClusterQueue has per flavor in a
    cohort (scheduling/quota.py has the arithmetic). Quotas govern owned GPUs only: what a team
    rents is bounded by its budget and the cloud pool's instance cap.

    A flavor named by any QuotaShare is managed: a team without a row for it has nominal 0 and no
    borrowing limit (it may use idle capacity, and gives it back when an owner needs it). A flavor
    no row names is not limited by quotas at all (a team's own pool, before any quota is set)."""

    tenant: str
    flavor: str  # a GPU model name, or CU_FLAVOR
    nominal: float  # guaranteed GPUs (or CU) of owned capacity
    borrowing_limit: float | None = None  # most it may use above nominal; None = no limit
    lending_limit: float | None = None  # most of its unused nominal others may borrow; None = all


@dataclass(frozen=True, slots=True)
class TeamUsage:
    """A team's past use of one flavor, in GPU-hours (CU-hours for CU_FLAVOR) decayed with the
    fair-share half-life: the U of Slurm's fair-share factor 2^(-U/S)."""

    tenant: str
    flavor: str
    decayed_hours: float


@dataclass(frozen=True, slots=True)
class GpuModelInfo:
    name: str
    cu_rating: float = 1.0  # dense BF16/FP16 throughput relative to an A100
    memory_mb: int = 0


@dataclass(frozen=True, slots=True)
class Throughputs:
    """Optional measured speed of a job family on a GPU model, relative to CU rating 1.0."""

    speeds: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def speed(self, job_family: str, model: str, default: float) -> float:
        measured = self.speeds.get((job_family, model))
        return measured if measured is not None and measured > 0 else default


@dataclass(frozen=True, slots=True)
class PolicyWeights:
    # Objective = money * $ + fragmentation * (FGD GPU-equivalents * fragmentation_dollars)
    #             + waiting * (priority weight * waiting_dollars_per_job) for unplaced jobs.
    money: float = 1.0
    fragmentation: float = 1.0
    waiting: float = 1.0
    # Dollars one GPU of fragmentation (expected unusable capacity) is worth per cycle.
    fragmentation_dollars_per_gpu: float = 0.5
    # Dollars one job left waiting costs per cycle at priority 0; each priority step doubles it
    # up to a cap, so a higher-priority job is always placed before a lower one if both fit.
    waiting_dollars_per_job: float = 1000.0
    priority_step_factor: float = 2.0
    # Extra price paid for a cloud launch (boot time, data transfer) in hours of the instance price.
    launch_overhead_hours: float = 0.1


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    """One kind of task in the expected workload, for the fragmentation (FGD) measure."""

    gpus: int
    gpu_milli: int = WHOLE_GPU_MILLI
    weight: float = 1.0
    cpu_milli: int = 0
    memory_mb: int = 0
    gpu_models: tuple[str, ...] = ()  # empty = any model


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    nodes: tuple[NodeState, ...] = ()
    pending: tuple[JobDemand, ...] = ()
    running: tuple[RunningAllocation, ...] = ()
    offers: tuple[CloudOffer, ...] = ()
    tenants: tuple[TenantBudget, ...] = ()
    gpu_models: tuple[GpuModelInfo, ...] = ()
    throughputs: Throughputs = field(default_factory=Throughputs)
    weights: PolicyWeights = field(default_factory=PolicyWeights)
    seed: int = 0
    # Expected task mix for the fragmentation term; empty = the pending jobs themselves.
    workload: tuple[WorkloadClass, ...] = ()
    # The whole task mix, rare classes and memory included, for the scarce-homes term
    # (`fragmentation.scarce_homes`); empty = `workload` (or the pending jobs).
    task_mix: tuple[WorkloadClass, ...] = ()
    # Shared instance caps of offer groups (pools); a group not listed has none.
    launch_limits: tuple[LaunchLimit, ...] = ()
    # Teams' quotas of owned capacity and their decayed past usage (fair share).
    quotas: tuple[QuotaShare, ...] = ()
    usage: tuple[TeamUsage, ...] = ()

    def launch_limit_of(self) -> dict[str, int]:
        """Remaining launches per offer group (never negative)."""
        return {limit.group: max(0, limit.remaining) for limit in self.launch_limits}


# ------------------------------------------------------------------------------------------ plan


class ReasonCode(str, Enum):
    """Why a job is still pending. Documented in docs/scheduling.md; values are stable API."""

    NO_GPU_MODEL = "NO_GPU_MODEL"  # no candidate has an allowed GPU model
    INSUFFICIENT_GPU_MEMORY = "INSUFFICIENT_GPU_MEMORY"  # GPUs too small / too little free memory
    INSUFFICIENT_GPUS = "INSUFFICIENT_GPUS"  # not enough free (or free enough) GPUs on one node
    NO_NVLINK_ISLAND = "NO_NVLINK_ISLAND"  # no free NVLink island of the size asked
    NO_FAST_FABRIC = "NO_FAST_FABRIC"  # multi-node job but no fast-fabric nodes/offers
    INSUFFICIENT_CPU_MEMORY = "INSUFFICIENT_CPU_MEMORY"  # host CPU or RAM short
    NODE_NOT_READY = "NODE_NOT_READY"  # nodes draining/down, GPUs unhealthy
    SPOT_POLICY = "SPOT_POLICY"  # only spot (or only on-demand) capacity fits
    PRICE_CEILING = "PRICE_CEILING"  # every fit costs more than max_price_per_hour
    PROVIDER_REGION = "PROVIDER_REGION"  # fits exist only outside allowed providers/regions
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # tenant GPU / CU quota would be exceeded
    NO_POOL_ACCESS = "NO_POOL_ACCESS"  # fits exist only in pools the team has no access to
    NOMINAL_QUOTA_USED = "NOMINAL_QUOTA_USED"  # nominal share used, and the cohort has too little idle
    BORROWING_LIMIT = "BORROWING_LIMIT"  # would borrow past the team's borrowing limit
    RECLAIMING = "RECLAIMING"  # borrowed jobs of other teams are checkpointing to return this share
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"  # tenant's remaining budget is below the cheapest fit
    OFFER_QUOTA = "OFFER_QUOTA"  # cloud offers fit but none can be launched (account quota)
    OUTRANKED = "OUTRANKED"  # fits alone, but capacity went to higher-priority jobs
    CAPACITY_TAKEN = "CAPACITY_TAKEN"  # fits alone, but the global optimum used the capacity better
    WAITING_FOR_PREEMPTION = "WAITING_FOR_PREEMPTION"  # victims are being checkpointed/stopped
    WAITING_FOR_DEFRAGMENTATION = "WAITING_FOR_DEFRAGMENTATION"  # small jobs are being moved
    INVALID_DEMAND = "INVALID_DEMAND"  # the demand cannot be satisfied by any shape (e.g. 0 GPUs)
    SOLVER_LIMIT = "SOLVER_LIMIT"  # the cycle ran out of time before considering the job
    NODE_SELECTOR = "NODE_SELECTOR"  # no node carries the labels the job's node selector asks for
    NO_CONTAINER_RUNTIME = "NO_CONTAINER_RUNTIME"  # an image job, and no fit has a container runtime
    NO_GPU_SHARING = "NO_GPU_SHARING"  # a share of a GPU, and the nodes hand out whole GPUs only (Kubernetes)


@dataclass(frozen=True, slots=True)
class Reason:
    code: ReasonCode
    message: str
    data: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlacementPart:
    """One node's share of a placement: an existing node, or instance `instance` of a launch."""

    gpu_indices: tuple[int, ...]
    gpu_milli: int = WHOLE_GPU_MILLI
    node_id: str | None = None
    launch_id: str | None = None
    instance: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: str
    parts: tuple[PlacementPart, ...]
    gpu_model: str = ""
    price_per_hour: float = 0.0  # what the job's GPUs cost per hour where placed
    spot: bool = False

    @property
    def node_id(self) -> str | None:
        return self.parts[0].node_id if self.parts else None

    @property
    def launch_id(self) -> str | None:
        return self.parts[0].launch_id if self.parts else None

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return self.parts[0].gpu_indices if self.parts else ()

    @property
    def gpu_milli(self) -> int:
        return self.parts[0].gpu_milli if self.parts else WHOLE_GPU_MILLI


@dataclass(frozen=True, slots=True)
class Launch:
    launch_id: str
    offer_id: str
    count: int
    spot: bool
    job_ids: tuple[str, ...]
    price_per_hour: float  # per instance


@dataclass(frozen=True, slots=True)
class Preemption:
    victim_job_id: str
    for_job_id: str
    node_id: str
    lost_work_s: float
    # "priority": a higher-priority job of the same team; "reclaim": the victim's team borrowed
    # capacity that the pending job's team needs back for its nominal quota.
    cause: str = "priority"


@dataclass(frozen=True, slots=True)
class Migration:
    job_id: str
    from_node_id: str
    to: PlacementPart
    reason: str  # "defragmentation" | "cheaper" | "spot_interruption" | ...
    for_job_id: str | None = None


@dataclass(frozen=True, slots=True)
class SolverInfo:
    method: SolverMethod
    proven_optimal: bool
    solve_seconds: float
    objective: float | None = None
    solver: str = ""  # "HiGHS", "PULP_CBC_CMD" or "" for greedy
    status: str = ""
    variables: int = 0
    note: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    placements: tuple[Placement, ...] = ()
    launches: tuple[Launch, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    migrations: tuple[Migration, ...] = ()
    pending: Mapping[str, Reason] = field(default_factory=dict)
    solver: SolverInfo = field(default_factory=lambda: SolverInfo("greedy", True, 0.0))

    def placement_for(self, job_id: str) -> Placement | None:
        for placement in self.placements:
            if placement.job_id == job_id:
                return placement
        return None


# ---------------------------------------------------------------------------------------- policy

DEFAULT_FILTERS: tuple[str, ...] = (
    "node_ready",
    "pool_access",
    "provider_region",
    "node_selector",
    "container_runtime",
    "gpu_sharing",
    "gpu_model",
    "gpu_memory",
    "gpu_count",
    "topology",
    "fast_fabric",
    "cpu_memory",
    "spot_policy",
    "price_ceiling",
    "offer_quota",
    "tenant_quota",
    "team_quota",
    "tenant_budget",
)
DEFAULT_SCORES: Mapping[str, float] = {"money": 1.0, "fragmentation": 1.0, "waiting": 1.0}


@dataclass(frozen=True, slots=True)
class Policy:
    """How a cycle decides: which filter plugins run, score weights, solver and planner limits.

    `schedule(snapshot, None)` uses the defaults with weights taken from `snapshot.weights`.
    """

    filters: tuple[str, ...] = DEFAULT_FILTERS
    # Score term name -> weight (multiplies the matching PolicyWeights term).
    scores: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SCORES))
    # "auto": aggregated MILP and greedy, the better answer under one objective is kept (greedy
    # alone when the MILP has no answer in time); "milp": the MILP's answer whenever it has one;
    # "exact": per-node MILP (small instances only, for measuring the optimality gap);
    # "greedy": the heuristic alone.
    method: Literal["auto", "milp", "exact", "greedy"] = "auto"
    time_limit_s: float = 0.8
    solver: Literal["auto", "highs", "cbc"] = "auto"
    mip_gap: float = 1e-4
    preemption: bool = True
    min_run_before_preempt_s: float = 600.0
    defragmentation: bool = True
    max_moves_per_cycle: int = 4
    min_run_before_move_s: float = 600.0
    # Empty rented instances whose jobs cost less elsewhere ("cheaper" migrations, consolidate.py).
    consolidation: bool = True
    max_consolidation_moves: int = 8
    min_remaining_to_move_s: float = 1800.0
    # Quotas (Snapshot.quotas; scheduling/quota.py): may a team borrow idle capacity beyond its
    # nominal quota (False: strict quotas); is borrowed capacity taken back (checkpoint, then stop)
    # when its owner needs it; are borrowers ordered by weighted, decayed dominant-resource fair
    # share (False: by priority and age only, as Kueue's borrowing without fair sharing).
    borrowing: bool = True
    reclaim: bool = True
    fair_share: bool = True
