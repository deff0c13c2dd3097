"""Quotas of owned capacity shared by teams: Kueue's cohort arithmetic and Slurm's fair-share factor.

Every team (tenant) has, per flavor (a GPU model, or `CU_FLAVOR` for compute units over all
models), a nominal quota, a borrowing limit and a lending limit (`model.QuotaShare`). Quotas count
shared owned GPUs only (`quota_governed`): what a team rents is bounded by its budget and the
cloud pool's instance cap, and a team's own private pool is its own, not the cohort's.
docs/quotas.md gives the same rules for users.

Per flavor r, with u_i the share of r team i's running jobs hold on owned nodes:

- reserved_i = nominal_i - lending_i is never lent; pool P = sum_i lending_i plus owned capacity
  of r that no nominal quota covers (capacity - sum_i nominal_i, when positive);
- team i may use available_i = min(nominal_i + borrowing_limit_i - u_i,
  reserved_i + P - sum_{j != i} max(0, u_j - reserved_j) - u_i), never below 0;
- it borrows what it uses above nominal_i; borrowed capacity is reclaimed for a team whose pending
  job fits in its unused nominal (`reclaimable`), never taking a team below its own nominal.

Fair share among borrowers (dominant-resource fairness weighted by quota, decayed as Slurm does):
with U_i,r the team's decayed usage (`Snapshot.usage`, or what it holds now when the snapshot
carries none) and S_i,r = nominal_i,r / sum_j nominal_j,r its entitlement,
dominant share d_i = max_r (U_i,r / sum_j U_j,r) / max(S_i,r, MIN_ENTITLEMENT) and factor
F_i = 2^(-d_i): 1 for a team that used nothing, 0.5 for one that used exactly its share. The
team with the higher F borrows first.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from scheduling.model import CU_FLAVOR, WHOLE_GPU_MILLI, JobDemand, NodeState, Snapshot

EPS = 1e-9
# Entitlement floor for a team with no nominal share of a flavor it used (its share of usage is
# then divided by this instead of 0): such a team ranks last among borrowers without infinities.
MIN_ENTITLEMENT = 1e-3
# Dominant shares above this give a factor of 2^-30, already "last"; keeps the numbers finite.
MAX_DOMINANT_SHARE = 30.0


@dataclass(frozen=True, slots=True)
class Limits:
    nominal: float
    borrowing_limit: float | None
    lending_limit: float | None

    @property
    def reserved(self) -> float:
        """The part of nominal that is never lent to other teams."""
        lent = self.nominal if self.lending_limit is None else min(self.nominal, self.lending_limit)
        return self.nominal - lent


UNQUOTED = Limits(0.0, None, 0.0)  # a team without a row for a managed flavor


def quota_governed(node: NodeState) -> bool:
    """Capacity quotas count: owned (not a rented instance) and open to more than one team (a shared
    pool; `tenants` empty means every team). A pool only its owner may use is outside the cohort:
    its GPUs are neither lent nor counted against the owner's quota."""
    return not node.rented and len(node.tenants) != 1


class QuotaLedger:
    """Usage per (team, flavor) and the cohort arithmetic over it. The cycle's `Book` holds a copy
    and charges every placement on owned capacity to it, so every placing path sees the same room."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.cu_rating = {m.name: (m.cu_rating if m.cu_rating > 0 else 1.0) for m in snapshot.gpu_models}
        self.limits: dict[tuple[str, str], Limits] = {
            (q.tenant, q.flavor): Limits(max(0.0, q.nominal), q.borrowing_limit, q.lending_limit)
            for q in snapshot.quotas}
        self.flavors: tuple[str, ...] = tuple(sorted({q.flavor for q in snapshot.quotas}))
        self.capacity: dict[str, float] = defaultdict(float)
        for node in snapshot.nodes:
            if not quota_governed(node):
                continue
            for gpu in node.gpus:
                if gpu.healthy:
                    for flavor, amount in self.amounts(gpu.model, 1.0):
                        self.capacity[flavor] += amount
        self.usage: dict[tuple[str, str], float] = defaultdict(float)
        owned = {node.id: node for node in snapshot.nodes if quota_governed(node)}
        for allocation in snapshot.running:
            node = owned.get(allocation.node_id)
            if node is None:
                continue
            for index in allocation.gpu_indices:
                model = model_at(node, index)
                for flavor, amount in self.amounts(model, min(allocation.gpu_milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI):
                    self.usage[allocation.tenant, flavor] += amount
        self.teams: tuple[str, ...] = tuple(sorted(
            {q.tenant for q in snapshot.quotas} | {team for team, _ in self.usage}
            | {job.tenant for job in snapshot.pending}))
        self.factor = fair_share_factors(self, snapshot)

    @property
    def active(self) -> bool:
        return bool(self.flavors)

    def copy(self) -> "QuotaLedger":
        other = object.__new__(QuotaLedger)
        other.cu_rating, other.limits, other.flavors = self.cu_rating, self.limits, self.flavors
        other.capacity, other.teams, other.factor = self.capacity, self.teams, self.factor
        other.usage = defaultdict(float, self.usage)
        return other

    # ----------------------------------------------------------------------------- amounts

    def amounts(self, model: str, gpu_share: float) -> list[tuple[str, float]]:
        """What holding `gpu_share` GPUs of `model` on owned nodes counts against each managed flavor."""
        amounts = []
        if model in self.flavors:
            amounts.append((model, gpu_share))
        if CU_FLAVOR in self.flavors:
            amounts.append((CU_FLAVOR, gpu_share * self.cu_rating.get(model, 1.0)))
        return amounts

    # -------------------------------------------------------------------------- arithmetic

    def limits_of(self, team: str, flavor: str) -> Limits:
        return self.limits.get((team, flavor), UNQUOTED)

    def pool(self, flavor: str) -> float:
        """What the cohort lends: every team's lendable nominal and capacity no quota covers."""
        members = [limits for (_, f), limits in self.limits.items() if f == flavor]
        lendable = sum(limits.nominal - limits.reserved for limits in members)
        uncovered = max(0.0, self.capacity.get(flavor, 0.0) - sum(limits.nominal for limits in members))
        return lendable + uncovered

    def pool_used_by_others(self, team: str, flavor: str) -> float:
        return sum(max(0.0, self.usage[other, flavor] - self.limits_of(other, flavor).reserved)
                   for other in self.teams if other != team)

    def available(self, team: str, flavor: str) -> float:
        """More of `flavor` the team may hold now, its borrowing included (never negative)."""
        limits = self.limits_of(team, flavor)
        used = self.usage[team, flavor]
        by_cohort = limits.reserved + self.pool(flavor) - self.pool_used_by_others(team, flavor) - used
        by_limit = math.inf if limits.borrowing_limit is None else limits.nominal + limits.borrowing_limit - used
        return max(0.0, min(by_cohort, by_limit))

    def nominal_left(self, team: str, flavor: str) -> float:
        return max(0.0, self.limits_of(team, flavor).nominal - self.usage[team, flavor])

    def borrowed(self, team: str, flavor: str) -> float:
        return max(0.0, self.usage[team, flavor] - self.limits_of(team, flavor).nominal)

    def idle(self, flavor: str, team: str) -> float:
        """What the cohort could still lend `team` (beyond its own nominal)."""
        return max(0.0, self.pool(flavor) - self.pool_used_by_others(team, flavor)
                   - max(0.0, self.usage[team, flavor] - self.limits_of(team, flavor).reserved))

    def admits(self, job: JobDemand, model: str, gpu_share: float, *, nominal_only: bool = False,
               borrowing: bool = True) -> bool:
        """Whether the team may take this much more owned `model` now. `nominal_only`: within its
        unused nominal; a job that cannot be preempted never borrows (it could not be given back)."""
        nominal_room_only = nominal_only or bool(borrowing_barred(job, borrowing))
        for flavor, amount in self.amounts(model, gpu_share):
            within_nominal = amount <= self.nominal_left(job.tenant, flavor) + EPS
            if nominal_room_only and not within_nominal:
                return False
            if amount > self.available(job.tenant, flavor) + EPS:
                return False
        return True

    def charge(self, job: JobDemand, model: str, gpu_share: float, sign: float = 1.0) -> None:
        for flavor, amount in self.amounts(model, gpu_share):
            self.usage[job.tenant, flavor] += sign * amount

    def release(self, team: str, node: NodeState, gpu_indices: tuple[int, ...], gpu_milli: int) -> None:
        """A running allocation stops (preemption, reclaim): its team holds that much less."""
        if not quota_governed(node):
            return
        for index in gpu_indices:
            for flavor, amount in self.amounts(model_at(node, index), min(gpu_milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI):
                self.usage[team, flavor] -= amount

    def describe(self, team: str, flavor: str, no_borrowing: str = "") -> dict[str, float | str | None]:
        """The numbers behind a quota reason. `no_borrowing`: why this job may not borrow at all
        (strict quotas, or a job that cannot be preempted), which leaves it nothing to borrow."""
        limits = self.limits_of(team, flavor)
        borrow_left = (0.0 if no_borrowing else None if limits.borrowing_limit is None
                       else max(0.0, limits.nominal + limits.borrowing_limit - self.usage[team, flavor]
                                - self.nominal_left(team, flavor)))
        return {"team": team, "flavor": flavor, "used": round(self.usage[team, flavor], 3),
                "nominal": limits.nominal, "borrowing_limit": limits.borrowing_limit,
                "borrow_left": None if borrow_left is None else round(borrow_left, 3),
                "no_borrowing": no_borrowing,
                "cohort_idle": round(self.idle(flavor, team), 3),
                "fair_share_factor": round(self.factor.get(team, 1.0), 4)}

    def step(self, job: JobDemand, model: str, gpu_share: float) -> str:
        """Which quota step a job of this size on `model` is at: "nominal" (fits in its team's unused
        nominal), "borrowing" (needs to borrow, within the team's borrowing limit; whether the cohort
        has that much idle is in `describe`), "limit" (past its borrowing limit, or it may not borrow:
        strict quotas, or a job that cannot be preempted), or "none" (no managed flavor)."""
        amounts = self.amounts(model, gpu_share)
        if not amounts:
            return "none"
        if all(amount <= self.nominal_left(job.tenant, flavor) + EPS for flavor, amount in amounts):
            return "nominal"
        for flavor, amount in amounts:
            limit = self.limits_of(job.tenant, flavor).borrowing_limit
            if limit is not None and self.usage[job.tenant, flavor] + amount > self.limits_of(
                    job.tenant, flavor).nominal + limit + EPS:
                return "limit"
        return "borrowing" if job.preemptible else "limit"

    def blocking_flavor(self, job: JobDemand, model: str, gpu_share: float, *, borrowing: bool = True
                        ) -> tuple[str, float] | None:
        """The first flavor (and amount) that keeps the job off owned `model`, or None. Without
        borrowing (strict quotas, or a job that cannot be preempted) the unused nominal is the room."""
        may_borrow = not borrowing_barred(job, borrowing)
        for flavor, amount in self.amounts(model, gpu_share):
            room = (self.available(job.tenant, flavor) if may_borrow
                    else min(self.available(job.tenant, flavor), self.nominal_left(job.tenant, flavor)))
            if amount > room + EPS:
                return flavor, amount
        return None


def borrowing_barred(job: JobDemand, borrowing: bool) -> str:
    """Why this job may not borrow at all, "" when it may: strict quotas (`borrowing` False), or a job
    that cannot be preempted (a borrowed GPU must be reclaimable). One rule for admitting, for what
    blocks a job, and for the words of its reason."""
    if not borrowing:
        return "strict quotas"
    if not job.preemptible:
        return "the job cannot be preempted"
    return ""


def model_at(node: NodeState, index: int) -> str:
    for gpu in node.gpus:
        if gpu.index == index:
            return gpu.model
    return node.gpus[0].model if node.gpus else ""


def fair_share_factors(ledger: QuotaLedger, snapshot: Snapshot) -> dict[str, float]:
    """F_i = 2^(-d_i) per team (module docstring). Decayed usage from the snapshot when it has any,
    else what each team holds now."""
    decayed: dict[tuple[str, str], float] = defaultdict(float)
    for record in snapshot.usage:
        decayed[record.tenant, record.flavor] += max(0.0, record.decayed_hours)
    usage = decayed if decayed else ledger.usage
    totals = {flavor: (sum(usage.get((t, flavor), 0.0) for t in ledger.teams),
                       sum(ledger.limits_of(t, flavor).nominal for t in ledger.teams)) for flavor in ledger.flavors}
    factors = {}
    for team in ledger.teams:
        dominant = 0.0
        for flavor in ledger.flavors:
            total_usage, total_nominal = totals[flavor]
            if total_usage <= EPS:
                continue
            entitlement = ledger.limits_of(team, flavor).nominal / total_nominal if total_nominal > EPS else 0.0
            share = usage.get((team, flavor), 0.0) / total_usage
            dominant = max(dominant, share / max(entitlement, MIN_ENTITLEMENT))
        factors[team] = 2.0 ** -min(dominant, MAX_DOMINANT_SHARE)
    return factors


def quota_message(code: str, info: dict, amount: float) -> str:
    """The sentence of a NOMINAL_QUOTA_USED / BORROWING_LIMIT reason, with its numbers."""
    team, flavor = info["team"], info["flavor"]
    used, nominal = info["used"], info["nominal"]
    if code == "BORROWING_LIMIT":
        return (f"BORROWING_LIMIT: {team} uses {used:g}/{nominal:g} nominal {flavor} and its borrowing limit "
                f"is {info['borrowing_limit']:g}; this job needs {amount:g} more")
    borrow = (f"may not borrow ({info['no_borrowing']})" if info.get("no_borrowing")
              else "may borrow without limit" if info["borrow_left"] is None
              else f"may borrow {info['borrow_left']:g} more")
    return (f"NOMINAL_QUOTA_USED: {team} uses {used:g}/{nominal:g} nominal {flavor} and {borrow}; the cohort "
            f"has {info['cohort_idle']:g} idle, this job needs {amount:g}")
