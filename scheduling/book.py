"""The cycle's ledger: free capacity, launched instances, tenant allowances and placements so far.

Mapping, greedy placement, preemption and defragmentation all write through `Book.commit`, so
quotas, budgets, offer quotas and GPU capacity are checked in one place and never double-booked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import WHOLE_GPU_MILLI, JobDemand, Launch, Placement, PlacementPart, TenantBudget
from scheduling.packer import TargetPacker
from scheduling.plugins import owned
from scheduling.quota import QuotaLedger
from scheduling.problem import Problem
from scheduling.targets import Target, offer_node


@dataclass(slots=True)
class Instance:
    target: int  # offer target index
    number: int  # instance number within the launch of that offer variant
    cap: NodeCapacity


@dataclass(slots=True)
class Allowance:
    gpus: float | None
    cus: float | None
    dollars: float | None

    def admits(self, gpus: float, cus: float, dollars: float) -> bool:
        eps = 1e-9
        return ((self.gpus is None or gpus <= self.gpus + eps) and (self.cus is None or cus <= self.cus + eps)
                and (self.dollars is None or dollars <= self.dollars + eps))

    def charge(self, gpus: float, cus: float, dollars: float) -> None:
        if self.gpus is not None:
            self.gpus -= gpus
        if self.cus is not None:
            self.cus -= cus
        if self.dollars is not None:
            self.dollars -= dollars


def allowance_for(budget: TenantBudget | None) -> Allowance:
    if budget is None:
        return Allowance(None, None, None)
    return Allowance(
        None if budget.gpu_quota is None else budget.gpu_quota - budget.gpus_in_use,
        None if budget.cu_quota is None else budget.cu_quota - budget.cu_in_use,
        budget.remaining_budget,
    )


class Book:
    def __init__(self, problem: Problem, capacities: list[NodeCapacity] | None = None) -> None:
        self.problem = problem
        # Working copies: the problem's own capacities stay as they were at the start of the cycle.
        self.caps = [cap.copy() for cap in (capacities if capacities is not None else problem.capacities)]
        self.instances: list[Instance] = []
        self.launchable: dict[str, int] = {t.offer.id: t.count for t in problem.targets if t.offer is not None}
        # Shared caps of offer groups (a pool's max_instances): every launch of every path
        # (mapping, greedy, exact, repairs) goes through `launch`, so the cap holds in all of them.
        self.group_left: dict[str, int] = problem.snapshot.launch_limit_of()
        # Only teams with a limit: an unlimited team's placements would be priced three times each
        # (GPU share, CU, money) for nothing (a tenth of the engine's time for 5,000 such jobs).
        self.allowances: dict[str, Allowance] = {
            name: allowance for name, allowance in
            ((name, allowance_for(budget)) for name, budget in problem.ctx.tenants.items())
            if (allowance.gpus, allowance.cus, allowance.dollars) != (None, None, None)}
        # Members' own budgets (money only), charged beside their team's: one cycle cannot place two of
        # a member's jobs past what the member has left.
        self.owner_allowances: dict[tuple[str, str], Allowance] = {
            (name, owner.owner): Allowance(None, None, owner.remaining_budget)
            for name, budget in problem.ctx.tenants.items() for owner in budget.owners}
        # Teams' use of owned capacity against their quotas, charged by every placement here.
        self.quota: QuotaLedger | None = problem.ctx.quota.copy() if problem.ctx.quota is not None else None
        self.placements: dict[str, Placement] = {}
        self.packers: dict[int, TargetPacker] = {}
        self.packer_instances: dict[int, list[Instance]] = {}
        # node position -> (target index, index inside that target's packer)
        self.node_slot: dict[int, tuple[int, int]] = {}
        # (id of a capacity, GPU position) -> free GPU memory before a whole-GPU part took it
        self.memory_before_take: dict[tuple[int, int], int] = {}

    # ---------------------------------------------------------------------------------- packers

    def packer(self, target_index: int) -> TargetPacker:
        packer = self.packers.get(target_index)
        if packer is not None:
            return packer
        target = self.problem.targets[target_index]
        if target.kind == "node":
            packer = TargetPacker([self.caps[p] for p in target.members], strands=self._strands())
            for inside, position in enumerate(target.members):
                self.node_slot[position] = (target_index, inside)
        else:
            instances = self.packer_instances.setdefault(target_index, [])

            def grow() -> NodeCapacity | None:
                instance = self.launch(target_index)
                if instance is None:
                    return None
                instances.append(instance)
                return instance.cap

            packer = TargetPacker([], grow)
        self.packers[target_index] = packer
        return packer

    def _strands(self) -> "StrandingCheck | None":
        """For packers of multi-node shapes: does a part raise a node's stranded GPUs?"""
        if getattr(self, "_strand_check", None) is None:
            from scheduling.patterns import stranding_coefficients

            alpha, cpu_ratio, mem_ratio = (stranding_coefficients(self.problem.workload)
                                           if self.problem.weights["fragmentation"] else (0.0, 0.0, 0.0))
            self._strand_check = StrandingCheck(cpu_ratio, mem_ratio) if alpha else False
        return self._strand_check or None

    def place_job(self, job: JobDemand, target_index: int, part: PartDemand,
                  node: int | None = None) -> Placement | None:
        """Best-fit the job's gang into one target; commit it, or leave everything as it was.
        `node`: a one-node job goes to that node of the target's packer (the greedy priced it
        there) when it still fits, else where best fit puts it."""
        packer = self.packer(target_index)
        target = self.problem.targets[target_index]
        chosen: list[tuple[int, tuple[int, ...]]] = []
        if node is not None and max(1, job.nodes) == 1:
            positions = packer.caps[node].choose(part)
            if positions is not None:
                chosen.append((node, positions))
        for _ in range(max(1, job.nodes) - len(chosen)):
            found = packer.find(part, {index for index, _ in chosen})
            if found is None:
                break
            chosen.append(found)
        placement = None
        if len(chosen) == max(1, job.nodes) and self.admits(job, target):
            instances = self.packer_instances.get(target_index, [])
            slots = [(packer.caps[index], positions, instances[index] if target.kind == "offer" else None)
                     for index, positions in chosen]
            placement = self.commit(job, target, slots, part)
        for index, positions in chosen:
            packer.touch(index, positions)
        return placement

    def place_spread_gang(self, job: JobDemand, target_indices: list[int],
                          part: PartDemand) -> Placement | None:
        """A multi-node gang over nodes of several node shapes, best-fit in each, the shapes in the order
        given (the caller's: cheapest first, all of one fabric group, GPU model and price, so one price
        holds). Nodes of one pool fall into shapes of their own as soon as they differ in a label (a
        Kubernetes node's hostname) or in what already runs on them, and `place_job` keeps a gang inside
        one shape."""
        needed = max(1, job.nodes)
        chosen: list[tuple[int, int, tuple[int, ...]]] = []  # (target, node inside its packer, GPU positions)
        for target_index in target_indices:
            packer = self.packer(target_index)
            taken: set[int] = set()
            while len(chosen) < needed:
                found = packer.find(part, taken)
                if found is None:
                    break
                taken.add(found[0])
                chosen.append((target_index, *found))
            if len(chosen) == needed:
                break
        placement = None
        targets = [self.problem.targets[t] for t in dict.fromkeys(t for t, _, _ in chosen)]
        if len(chosen) == needed and all(t.kind == "node" and self.admits(job, t) for t in targets):
            slots = [(self.packers[t].caps[inside], positions, None) for t, inside, positions in chosen]
            placement = self.commit(job, targets[0], slots, part)
        for target_index, inside, positions in chosen:
            self.packers[target_index].touch(inside, positions)
        return placement

    def refresh_node(self, position: int) -> None:
        """Re-index a node whose capacity changed outside `place_job` (preemption, defrag)."""
        slot = self.node_slot.get(position)
        if slot is not None:
            target_index, inside = slot
            self.packers[target_index].touch(inside, tuple(range(len(self.caps[position].free_milli))))

    def unplace(self, job: JobDemand, target: Target, part: PartDemand) -> list[tuple[NodeCapacity, tuple[int, ...],
                                                                                  Instance | None]]:
        """Take a placement back (local search): free its GPUs, CPU and memory, refund the tenant,
        and return its slots so `commit` can put it back exactly as it was."""
        placement = self.placements.pop(job.job_id)
        allowance = self.allowances.get(job.tenant)
        pricing = self.problem.pricing
        if allowance is not None:
            allowance.charge(-pricing.gpu_share(job, target.gpu_model), -pricing.compute_units(job, target.gpu_model),
                             -pricing.money(job, target))
        owner = self.owner_allowance(job)
        if owner is not None:
            owner.charge(0.0, 0.0, -pricing.money(job, target))
        if self.quota is not None and owned(target):
            self.quota.charge(job, target.gpu_model, pricing.gpu_share(job, target.gpu_model), -1.0)
        slots = []
        for placed in placement.parts:
            cap, instance = self.capacity_of(placed)
            positions = cap.positions_of(placed.gpu_indices)
            cap.release(positions, part.milli if part.fractional else WHOLE_GPU_MILLI, part.min_gpu_memory_mb,
                        part.cpu_milli, part.memory_mb)
            if not part.fractional:
                for p in positions:
                    cap.free_memory[p] = self.memory_before_take.pop((id(cap), p), cap.free_memory[p])
            slots.append((cap, positions, instance))
        self.reindex(slots)
        return slots

    def capacity_of(self, placed: PlacementPart) -> tuple[NodeCapacity, Instance | None]:
        """The capacity a placement part sits on, and its instance (None on an owned node)."""
        if placed.launch_id is None:
            return self.caps[self.position_of(placed.node_id)], None
        target_index = self.target_of_launch(placed.launch_id)
        instance = next(i for i in self.instances if i.target == target_index and i.number == placed.instance)
        return instance.cap, instance

    def position_of(self, node_id: str | None) -> int:
        if not hasattr(self, "_positions"):
            self._positions = {cap.node.id: p for p, cap in enumerate(self.caps)}
        return self._positions[node_id]

    def reindex(self, slots: list[tuple[NodeCapacity, tuple[int, ...], Instance | None]]) -> None:
        """Re-index capacities changed by `commit` or `unplace` in their targets' packers."""
        for cap, _, instance in slots:
            if instance is None:
                self.refresh_node(self.position_of(cap.node.id))
                continue
            packer = self.packers.get(instance.target)
            index = packer.index_of(cap) if packer is not None else None
            if index is not None:
                packer.touch(index, tuple(range(len(cap.free_milli))))

    # -------------------------------------------------------------------------------- instances

    def launch(self, target_index: int) -> Instance | None:
        target = self.problem.targets[target_index]
        assert target.offer is not None
        if self.launches_left(target.offer.id, target.offer.launch_group) <= 0:
            return None
        self.launchable[target.offer.id] -= 1
        if target.offer.launch_group in self.group_left:
            self.group_left[target.offer.launch_group] -= 1
        number = sum(1 for i in self.instances if i.target == target_index)
        instance = Instance(target_index, number, NodeCapacity(offer_node(target.offer, target.spot)))
        self.instances.append(instance)
        return instance

    def launches_left(self, offer_id: str, group: str = "") -> int:
        """More instances of this offer the cycle may still launch (its own count and its group's cap)."""
        left = self.launchable.get(offer_id, 0)
        return min(left, self.group_left[group]) if group in self.group_left else left

    def instances_of(self, target_index: int) -> list[Instance]:
        return [i for i in self.instances if i.target == target_index]

    # ---------------------------------------------------------------------------------- placing

    def admits(self, job: JobDemand, target: Target) -> bool:
        pricing = self.problem.pricing
        if self.quota is not None and owned(target):
            ctx = self.problem.ctx
            if not self.quota.admits(job, target.gpu_model, pricing.gpu_share(job, target.gpu_model),
                                     nominal_only=ctx.nominal_only, borrowing=ctx.borrowing):
                return False
        owner = self.owner_allowance(job)
        if owner is not None and not owner.admits(0.0, 0.0, pricing.money(job, target)):
            return False
        allowance = self.allowances.get(job.tenant)
        if allowance is None:
            return True
        return allowance.admits(pricing.gpu_share(job, target.gpu_model),
                                pricing.compute_units(job, target.gpu_model), pricing.money(job, target))

    def owner_allowance(self, job: JobDemand) -> Allowance | None:
        """The job owner's own budget left this cycle (None: the owner has none)."""
        return self.owner_allowances.get((job.tenant, job.owner)) if job.owner else None

    def commit(self, job: JobDemand, target: Target, slots: list[tuple[NodeCapacity, tuple[int, ...],
               Instance | None]], part: PartDemand) -> Placement:
        """Take the chosen GPUs on every node of the gang and charge the tenant."""
        pricing = self.problem.pricing
        allowance = self.allowances.get(job.tenant)
        if allowance is not None:
            allowance.charge(pricing.gpu_share(job, target.gpu_model),
                             pricing.compute_units(job, target.gpu_model), pricing.money(job, target))
        owner = self.owner_allowance(job)
        if owner is not None:
            owner.charge(0.0, 0.0, pricing.money(job, target))
        if self.quota is not None and owned(target):
            self.quota.charge(job, target.gpu_model, pricing.gpu_share(job, target.gpu_model))
        parts = []
        for cap, positions, instance in slots:
            if not part.fractional:  # a whole GPU's free memory is zeroed: keep it for `unplace`
                for p in positions:
                    self.memory_before_take[id(cap), p] = cap.free_memory[p]
            cap.take(positions, part)
            parts.append(PlacementPart(
                gpu_indices=cap.gpu_indices(positions), gpu_milli=part.milli,
                node_id=None if instance is not None else cap.node.id,
                launch_id=None if instance is None else launch_id(self.problem.targets[instance.target]),
                instance=0 if instance is None else instance.number,
            ))
        placement = Placement(job_id=job.job_id, parts=tuple(parts), gpu_model=target.gpu_model,
                              price_per_hour=pricing.hourly_price(job, target), spot=target.spot)
        self.placements[job.job_id] = placement
        return placement

    def launches(self) -> tuple[Launch, ...]:
        """One launch per offer variant used; instances nobody uses are dropped (and not paid)."""
        used: dict[int, set[int]] = {}
        jobs: dict[int, list[str]] = {}
        for placement in self.placements.values():
            for part in placement.parts:
                if part.launch_id is None:
                    continue
                target_index = self.target_of_launch(part.launch_id)
                used.setdefault(target_index, set()).add(part.instance)
                if placement.job_id not in jobs.setdefault(target_index, []):
                    jobs[target_index].append(placement.job_id)
        result = []
        for target_index in sorted(used):
            target = self.problem.targets[target_index]
            assert target.offer is not None
            result.append(Launch(launch_id=launch_id(target), offer_id=target.offer.id,
                                 count=max(used[target_index]) + 1, spot=target.spot,
                                 job_ids=tuple(sorted(jobs[target_index])), price_per_hour=target.instance_price))
        return tuple(result)

    def target_of_launch(self, identifier: str) -> int:
        if not hasattr(self, "_launch_targets"):
            self._launch_targets = {launch_id(t): i for i, t in enumerate(self.problem.targets) if t.kind == "offer"}
        return self._launch_targets[identifier]

    def compact_instances(self) -> None:
        """Renumber instances so a launch's used instances are 0..n-1 (empty ones are dropped)."""
        renumber: dict[tuple[int, int], int] = {}
        for target_index in sorted({i.target for i in self.instances}):
            used = sorted({part.instance for p in self.placements.values() for part in p.parts
                           if part.launch_id == launch_id(self.problem.targets[target_index])})
            for new, old in enumerate(used):
                renumber[target_index, old] = new
        for job_id, placement in list(self.placements.items()):
            if not any(part.launch_id for part in placement.parts):
                continue
            parts = tuple(
                part if part.launch_id is None else PlacementPart(
                    part.gpu_indices, part.gpu_milli, None, part.launch_id,
                    renumber[self.target_of_launch(part.launch_id), part.instance])
                for part in placement.parts)
            self.placements[job_id] = Placement(job_id, parts, placement.gpu_model, placement.price_per_hour,
                                                placement.spot)


def launch_id(target: Target) -> str:
    assert target.offer is not None
    return f"launch:{target.offer.id}:{'spot' if target.spot else 'od'}"


class StrandingCheck:
    """Would a part raise a node's CPU/memory-stranded GPUs (the mix's CPU and memory per GPU as the
    ratios)? `possible(part)` answers for every node at once when the part is within both ratios (it
    then never strands): the packer skips its stranding pass for such parts, most of them, instead of
    asking node by node (90,000 calls in a 5,000-job cycle)."""

    def __init__(self, cpu_ratio: float, mem_ratio: float) -> None:
        from scheduling.patterns import part_gpu_milli  # patterns imports this module

        self.cpu_ratio, self.mem_ratio, self.gpu_milli = cpu_ratio, mem_ratio, part_gpu_milli

    def possible(self, part: PartDemand) -> bool:
        return self._beyond_ratios(part, self.gpu_milli(part))

    def _beyond_ratios(self, part: PartDemand, used: float) -> bool:
        return (self.cpu_ratio > 0 and part.cpu_milli > used * self.cpu_ratio) or \
            (self.mem_ratio > 0 and part.memory_mb > used * self.mem_ratio)

    def for_part(self, part: PartDemand) -> Callable[[NodeCapacity], bool]:
        """The check for one part, node by node: what depends on the part alone is worked out once (the
        packer asks it of up to a few hundred nodes per part)."""
        used, cpu_ratio, mem_ratio = self.gpu_milli(part), self.cpu_ratio, self.mem_ratio
        if not self._beyond_ratios(part, used):
            return _never
        cpu_term = part.cpu_milli / cpu_ratio if cpu_ratio > 0 else 0.0
        mem_term = part.memory_mb / mem_ratio if mem_ratio > 0 else 0.0

        def strands(cap: NodeCapacity) -> bool:
            # Stranded before: max(0, now_c, now_m); after: each term grows by what the part
            # asks beyond the ratio, so it strands more iff an after-term exceeds the before.
            total = sum(cap.free_milli)
            now_c = total - cap.free_cpu / cpu_ratio if cpu_ratio > 0 else -1.0
            now_m = total - cap.free_mem / mem_ratio if mem_ratio > 0 else -1.0
            before = max(0.0, now_c, now_m)
            after_c = now_c - used + cpu_term if cpu_ratio > 0 else -1.0
            after_m = now_m - used + mem_term if mem_ratio > 0 else -1.0
            return max(after_c, after_m) > before + 1e-6

        return strands


def _never(cap: NodeCapacity) -> bool:
    return False
