"""The API's shapes as TypedDicts (what `Client` returns is the server's JSON, typed).

They follow the OpenAPI document (`GET /api/schema/`). `total=False` where the server may add or omit
keys (billing shapes, which a server may not have yet).
"""
from __future__ import annotations

from typing import Any, Generic, Literal, TypedDict, TypeVar

JobState = Literal["PENDING", "PLACED", "PROVISIONING", "STARTING", "RUNNING", "CHECKPOINTING", "MIGRATING",
                   "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED"]
TERMINAL_STATES: frozenset[str] = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
RUNNING_STATES: frozenset[str] = frozenset({"RUNNING", "CHECKPOINTING"})

T = TypeVar("T")


class Page(TypedDict, Generic[T]):
    count: int
    next: str | None
    previous: str | None
    results: list[T]


class PendingReason(TypedDict):
    code: str
    message: str
    data: dict[str, Any]


class JobAllocation(TypedDict):
    id: int
    node: str
    gpus: list[int]
    epoch: int


class Demand(TypedDict):
    gpus_per_node: int
    nodes: int
    total_gpus: int
    gpu_milli: int
    compute_units: float | None
    gpu_models: list[str]
    min_gpu_memory_gb: int | None
    interconnect: str
    cpu_milli: int | None
    memory_mb: int | None
    spot: str
    max_price_per_hour: float | None
    expected_duration_hours: float | None


class Job(TypedDict):
    id: int
    name: str
    state: JobState
    priority: int
    preemptible: bool
    owner: str
    spec: dict[str, Any]
    demand: Demand
    pending_reason: PendingReason | None
    allocations: list[JobAllocation]
    created_at: str
    updated_at: str
    started_at: str | None
    finished_at: str | None


class JobEvent(TypedDict):
    id: int
    created_at: str
    kind: str
    reason_code: str
    message: str
    data: dict[str, Any]


class Checkpoint(TypedDict):
    id: int
    step: int
    state: str
    size_bytes: int | None
    uri: str
    created_at: str
    committed_at: str | None
    request_id: str | None
    problem: str
    written_on: str | None


class Migration(TypedDict):
    id: int
    cause: str
    state: str
    source: str
    target: str
    to: str
    downtime_s: float | None
    phases: dict[str, float | None]
    restored_step: int | None
    outcome: str
    requested_at: str
    finished_at: str | None


class GpuHolder(TypedDict):
    job: int | None
    share: float
    holder: str


class Gpu(TypedDict):
    index: int
    uuid: str
    model: str
    memory_mb: int
    nvlink_island: int | None
    numa_node: int | None
    pci_bus_id: str
    mig_mode: bool
    health: str
    utilization_pct: float | None
    memory_used_mb: int | None
    temperature_c: float | None
    power_w: float | None
    ecc_errors: int
    last_seen_at: str | None
    in_use: float
    held_by: list[GpuHolder]


class Node(TypedDict):
    id: int
    name: str
    pool: str
    pool_id: int
    shared: bool
    owned: bool
    hostname: str
    state: str
    cpu_milli: int
    memory_mb: int
    labels: dict[str, str]
    last_heartbeat_at: str | None
    agent_version: str
    job_isolation: str | None
    gpus: list[Gpu]


class Pool(TypedDict):
    id: int
    name: str
    kind: str
    region: str
    gpu_hour_rate_usd: str
    marginal_cost_usd_per_gpu_hour: str
    enabled: bool
    node_count: int
    owned: bool
    shared: bool
    owner: str
    created_at: str


class GpuModel(TypedDict):
    id: int
    name: str
    vendor: str
    aliases: list[str]
    memory_gb: int
    compute_units: str
    peak_dense_tflops: str
    nvlink: bool
    mig_profiles: list[Any]


class TeamQuota(TypedDict):
    flavor: str
    nominal: float
    borrowing_limit: float | None
    lending_limit: float | None
    in_use: float
    borrowed: float
    decayed_usage_hours: float


class Quota(TypedDict, total=False):
    tenant: str
    max_gpus: int
    max_compute_units: float
    monthly_budget_usd: float | None
    max_pending_jobs: int
    usage: dict[str, Any]
    quotas: list[TeamQuota]
    fair_share_factor: float | None


class Token(TypedDict):
    id: int
    name: str
    prefix: str
    user: str
    scopes: list[str]
    created_at: str
    expires_at: str | None
    last_used_at: str | None
    revoked_at: str | None
    active: bool


class TokenCreated(Token):
    token: str  # the secret: shown only in this response


class CostRow(TypedDict, total=False):
    """One row of `GET /api/v1/costs/`: the group's keys (team, user, job, gpu_model, provider, pool,
    region, day: those asked for) and the figures (money as decimal strings)."""
    gpu_hours: str
    cost: str
    idle_cost: str
    avg_gpu_utilisation: float | None


class CostReport(TypedDict, total=False):
    """Billing is issue 13's: keys this client does not know yet pass through unchanged."""
    rows: list[CostRow]
    group_by: list[str]
    scope: str
    currency: str


class QuoteOption(TypedDict, total=False):
    where: str
    placement: dict[str, Any]
    gpu_model: str
    gpus: float
    spot: bool
    market: str
    price_per_hour_usd: str
    expected_hours: float
    expected_cost_usd: str
    starts_at: str


class Quote(TypedDict, total=False):
    job: dict[str, Any]
    options: list[QuoteOption]
    unplaceable: list[dict[str, Any]]
    quoted_at: str


class Statement(TypedDict, total=False):
    team: str
    month: str
    currency: str
    status: str
    closed_at: str | None
    lines: list[dict[str, Any]]
    totals: dict[str, Any]
    total_usd: str


class Budget(TypedDict, total=False):
    team: str
    month: str
    monthly_budget_usd: str | None
    spent_usd: str
    remaining_usd: str | None
    used_pct: float | None
    alerts: list[dict[str, Any]]


class Savings(TypedDict, total=False):
    currency: str
    jobs: list[dict[str, Any]]  # job, job_name, gpu_hours, cost_usd, on_demand_usd, saved_usd, cheapest_offer
    totals: dict[str, str]
