"""Independent checks of a plan against its snapshot: what must hold whatever method produced it.

Written separately from the engine (it re-derives everything from the snapshot and the plan) so
tests, the simulator and the broker can assert a plan is safe before acting on it.
"""

from __future__ import annotations

from collections import defaultdict

from scheduling.model import WHOLE_GPU_MILLI, Plan, Snapshot
from scheduling.targets import Pricing, offer_price


def plan_violations(snapshot: Snapshot, plan: Plan) -> list[str]:
    problems: list[str] = []
    nodes = {node.id: node for node in snapshot.nodes}
    offers = {offer.id: offer for offer in snapshot.offers}
    jobs = {job.job_id: job for job in snapshot.pending}
    launches = {launch.launch_id: launch for launch in plan.launches}
    pricing = Pricing(snapshot)
    used: dict[tuple[str, int, int], int] = defaultdict(int)  # (node or launch, instance, GPU) -> milli
    cpu: dict[tuple[str, int], int] = defaultdict(int)
    mem: dict[tuple[str, int], int] = defaultdict(int)
    tenant_gpus: dict[str, float] = defaultdict(float)
    tenant_cus: dict[str, float] = defaultdict(float)
    tenant_money: dict[str, float] = defaultdict(float)

    placed = {p.job_id for p in plan.placements}
    for job_id in jobs:
        if job_id not in placed and job_id not in plan.pending:
            problems.append(f"{job_id}: neither placed nor given a pending reason")
        if job_id in placed and job_id in plan.pending:
            problems.append(f"{job_id}: both placed and pending")
    for job_id, reason in plan.pending.items():
        if not reason.message or not reason.message.startswith(reason.code.value):
            problems.append(f"{job_id}: reason message does not start with its code")

    for placement in plan.placements:
        job = jobs.get(placement.job_id)
        if job is None:
            problems.append(f"{placement.job_id}: placed but not pending")
            continue
        parts = placement.parts
        if len(parts) != max(1, job.nodes):
            problems.append(f"{job.job_id}: gang split: {len(parts)} parts for {job.nodes} nodes")
        homes = {(part.node_id or part.launch_id, part.instance) for part in parts}
        if len(homes) != len(parts):
            problems.append(f"{job.job_id}: two parts of one gang on the same node")
        if len({part.node_id is None for part in parts}) > 1 or len({part.launch_id for part in parts}) > 1:
            problems.append(f"{job.job_id}: gang spread over owned nodes and launches")
        if len(parts) > 1 and not all(_fast_fabric(part, nodes, offers, launches) for part in parts):
            problems.append(f"{job.job_id}: multi-node gang without a fast fabric")
        model = placement.gpu_model
        count = pricing.gpu_count(job, model)
        if count % max(1, job.nodes):
            problems.append(f"{job.job_id}: {count} GPUs do not split evenly over {job.nodes} nodes")
        for part in parts:
            home = part.node_id or part.launch_id or "?"
            gpus = _gpus_of(part, nodes, offers, launches)
            if gpus is None:
                problems.append(f"{job.job_id}: unknown node or launch {home}")
                continue
            if len(part.gpu_indices) != count // max(1, job.nodes):
                problems.append(f"{job.job_id}: {len(part.gpu_indices)} GPUs on {home}, wants {count // max(1, job.nodes)}")
            if len(set(part.gpu_indices)) != len(part.gpu_indices):
                problems.append(f"{job.job_id}: a GPU listed twice on {home}")
            islands = set()
            for index in part.gpu_indices:
                gpu = gpus.get(index)
                if gpu is None:
                    problems.append(f"{job.job_id}: no GPU {index} on {home}")
                    continue
                key = (home, part.instance, index)
                used[key] += part.gpu_milli
                if used[key] + gpu[1] > WHOLE_GPU_MILLI:
                    problems.append(f"{job.job_id}: GPU {index} on {home} over-allocated")
                if job.allowed_models and gpu[0] not in job.allowed_models:
                    problems.append(f"{job.job_id}: GPU model {gpu[0]} not allowed")
                if not gpu[2]:
                    problems.append(f"{job.job_id}: GPU {index} on {home} is unhealthy")
                islands.add(gpu[3])
            if job.interconnect == "nvlink" and len(part.gpu_indices) > 1 and (len(islands) != 1 or None in islands):
                problems.append(f"{job.job_id}: NVLink gang not on one island of {home}")
            cpu[home, part.instance] += job.cpu_milli
            mem[home, part.instance] += job.memory_mb
        target_price = placement.price_per_hour
        tenant_gpus[job.tenant] += pricing.gpu_share(job, model)
        tenant_cus[job.tenant] += pricing.compute_units(job, model)
        tenant_money[job.tenant] += target_price * pricing.runtime_hours(job, model)
        if job.max_price_per_hour is not None and target_price > job.max_price_per_hour + 1e-6:
            problems.append(f"{job.job_id}: ${target_price:.2f}/h above its ceiling")
        if job.spot == "never" and placement.spot or job.spot == "required" and parts[0].launch_id and not placement.spot:
            problems.append(f"{job.job_id}: spot policy {job.spot} broken")

    problems += _migration_violations(snapshot, plan, nodes, offers, launches, used, cpu, mem)
    problems += _access_and_quota_violations(snapshot, plan, nodes, offers, launches)
    for (home, instance), total in cpu.items():
        limit = _host_limit(home, nodes, launches, offers)
        if limit is not None and (total > limit[0] or mem[home, instance] > limit[1]):
            problems.append(f"{home}#{instance}: CPU or memory over-allocated")
    for budget in snapshot.tenants:
        t = budget.tenant
        if budget.gpu_quota is not None and budget.gpus_in_use + tenant_gpus[t] > budget.gpu_quota + 1e-6:
            problems.append(f"tenant {t}: GPU quota exceeded")
        if budget.cu_quota is not None and budget.cu_in_use + tenant_cus[t] > budget.cu_quota + 1e-6:
            problems.append(f"tenant {t}: CU quota exceeded")
        if budget.remaining_budget is not None and tenant_money[t] > budget.remaining_budget + 1e-6:
            problems.append(f"tenant {t}: budget exceeded")
    per_offer: dict[str, int] = defaultdict(int)
    for launch in plan.launches:
        per_offer[launch.offer_id] += launch.count
        offer = offers.get(launch.offer_id)
        if offer is not None and abs(launch.price_per_hour - offer_price(offer, launch.spot)) > 1e-6:
            problems.append(f"{launch.launch_id}: price does not match the offer")
    per_group: dict[str, int] = defaultdict(int)
    for offer_id, count in per_offer.items():
        offer = offers.get(offer_id)
        if offer is None or count > offer.launchable:
            problems.append(f"offer {offer_id}: {count} launches above its launchable count")
        if offer is not None:
            per_group[offer.launch_group] += count
    for group, remaining in snapshot.launch_limit_of().items():
        if per_group.get(group, 0) > remaining:
            problems.append(f"launch group {group}: {per_group[group]} launches above its cap of {remaining} more")
    return problems


def _migration_violations(snapshot: Snapshot, plan: Plan, nodes, offers, launches, used, cpu, mem) -> list[str]:
    """Moves: of running, movable jobs, each once, not also preempted, onto GPUs nothing else in
    the snapshot or the plan holds (their CPU and memory added to the destination's). Moves act in
    plan order: a move may land on GPUs that a move listed before it leaves (consolidation frees an
    owned node that way, then brings a rented job onto it)."""
    problems: list[str] = []
    running = {allocation.job_id: allocation for allocation in snapshot.running}
    victims = {p.victim_job_id for p in plan.preemptions}
    moved: set[str] = set()
    for migration in plan.migrations:
        allocation = running.get(migration.job_id)
        if allocation is None:
            problems.append(f"{migration.job_id}: moved but not running")
            continue
        if migration.job_id in moved or migration.job_id in victims:
            problems.append(f"{migration.job_id}: moved twice, or moved and preempted")
        moved.add(migration.job_id)
        if allocation.node_id != migration.from_node_id or migration.to.node_id in (None, allocation.node_id):
            problems.append(f"{migration.job_id}: move from {migration.from_node_id} to {migration.to.node_id} "
                            f"does not leave {allocation.node_id}")
        if not (allocation.checkpointable and allocation.preemptible):
            problems.append(f"{migration.job_id}: moved but not checkpointable and preemptible")
        home = migration.to.node_id or "?"
        gpus = _gpus_of(migration.to, nodes, offers, launches)
        if gpus is None:
            problems.append(f"{migration.job_id}: unknown node {home}")
            continue
        allowed = allocation.demand.allowed_models if allocation.demand is not None else ()
        for index in migration.to.gpu_indices:
            gpu = gpus.get(index)
            if gpu is None:
                problems.append(f"{migration.job_id}: no GPU {index} on {home}")
                continue
            used[home, 0, index] += migration.to.gpu_milli
            if used[home, 0, index] + gpu[1] > WHOLE_GPU_MILLI or not gpu[2]:
                problems.append(f"{migration.job_id}: GPU {index} on {home} over-allocated or unhealthy")
            if allowed and gpu[0] not in allowed:
                problems.append(f"{migration.job_id}: GPU model {gpu[0]} not allowed")
        cpu[home, 0] += allocation.cpu_milli
        mem[home, 0] += allocation.memory_mb
        for index in allocation.gpu_indices:  # what it leaves, later moves may take
            used[allocation.node_id, 0, index] -= allocation.gpu_milli
        cpu[allocation.node_id, 0] -= allocation.cpu_milli
        mem[allocation.node_id, 0] -= allocation.memory_mb
    return problems


def _gpus_of(part, nodes, offers, launches) -> dict[int, tuple[str, int, bool, object]] | None:
    """GPU index -> (model, milli already used, healthy, island) where the part landed."""
    if part.node_id is not None:
        node = nodes.get(part.node_id)
        if node is None:
            return None
        return {g.index: (g.model, g.milli_used if g.healthy else WHOLE_GPU_MILLI, g.healthy, g.nvlink_island)
                for g in node.gpus}
    launch = launches.get(part.launch_id)
    offer = offers.get(launch.offer_id) if launch is not None else None
    if offer is None or part.instance >= launch.count:
        return None
    return {i: (offer.gpu_model, 0, True, 0 if offer.nvlink else None) for i in range(offer.gpu_count)}


def _fast_fabric(part, nodes, offers, launches) -> bool:
    if part.node_id is not None:
        node = nodes.get(part.node_id)
        return bool(node and node.fast_fabric)
    launch = launches.get(part.launch_id)
    offer = offers.get(launch.offer_id) if launch is not None else None
    return bool(offer and offer.fast_fabric)


def _host_limit(home, nodes, launches, offers) -> tuple[int, int] | None:
    if home in nodes:
        return nodes[home].free_cpu_milli, nodes[home].free_memory_mb
    launch = launches.get(home)
    offer = offers.get(launch.offer_id) if launch is not None else None
    return None if offer is None else (offer.vcpus * 1000, offer.memory_mb)


def _access_and_quota_violations(snapshot: Snapshot, plan: Plan, nodes, offers, launches) -> list[str]:
    """Pool access (a team only on nodes and offers open to it) and quotas of owned capacity, derived
    here from the rules of docs/quotas.md, not from the engine's ledger: what the plan adds to a
    team's use of a flavor stays within nominal + borrowing limit, all teams' use beyond their
    never-lent reserve within what the cohort lends, and jobs that cannot be preempted within the
    team's unused nominal. Use that was already over before the plan is not the plan's fault."""
    problems: list[str] = []
    jobs = {job.job_id: job for job in snapshot.pending}
    limits = {(q.tenant, q.flavor): q for q in snapshot.quotas}
    flavors = {q.flavor for q in snapshot.quotas}
    rating = {m.name: (m.cu_rating if m.cu_rating > 0 else 1.0) for m in snapshot.gpu_models}

    def counted(model: str, share: float) -> list[tuple[str, float]]:
        out = [(model, share)] if model in flavors else []
        return out + ([("CU", share * rating.get(model, 1.0))] if "CU" in flavors else [])

    def model_of(node, index: int) -> str:
        return next((g.model for g in node.gpus if g.index == index), "")

    before: dict[tuple[str, str], float] = defaultdict(float)
    capacity: dict[str, float] = defaultdict(float)
    def shared(node) -> bool:  # docs/quotas.md: owned, and open to more than one team
        return not node.rented and len(node.tenants) != 1

    for node in snapshot.nodes:
        if shared(node):
            for gpu in node.gpus:
                if gpu.healthy:
                    for flavor, amount in counted(gpu.model, 1.0):
                        capacity[flavor] += amount
    for allocation in snapshot.running:
        node = nodes.get(allocation.node_id)
        if node is not None and shared(node):
            for index in allocation.gpu_indices:
                for flavor, amount in counted(model_of(node, index), min(allocation.gpu_milli, 1000) / 1000):
                    before[allocation.tenant, flavor] += amount
    added: dict[tuple[str, str], float] = defaultdict(float)
    fixed: dict[tuple[str, str], float] = defaultdict(float)
    for placement in plan.placements:
        job = jobs.get(placement.job_id)
        if job is None:
            continue
        for part in placement.parts:
            if part.node_id is not None:
                node = nodes.get(part.node_id)
                allowed = node.tenants if node is not None else ()
            else:
                launch = launches.get(part.launch_id)
                offer = offers.get(launch.offer_id) if launch is not None else None
                allowed, node = (offer.tenants if offer is not None else ()), None
            if allowed and job.tenant not in allowed:
                problems.append(f"{job.job_id}: team {job.tenant} placed where it has no access")
            if node is None or not shared(node):
                continue
            for index in part.gpu_indices:
                for flavor, amount in counted(model_of(node, index), min(part.gpu_milli, 1000) / 1000):
                    added[job.tenant, flavor] += amount
                    if not job.preemptible:
                        fixed[job.tenant, flavor] += amount
    teams = {team for team, _ in before} | {team for team, _ in added} | {q.tenant for q in snapshot.quotas}
    for flavor in sorted(flavors):
        rows = [q for q in snapshot.quotas if q.flavor == flavor]

        def reserved(team: str) -> float:
            q = limits.get((team, flavor))
            if q is None:
                return 0.0
            return q.nominal - (q.nominal if q.lending_limit is None else min(q.nominal, q.lending_limit))
        lent = sum(q.nominal for q in rows) - sum(reserved(q.tenant) for q in rows)
        pool = lent + max(0.0, capacity[flavor] - sum(q.nominal for q in rows))
        use_before = sum(max(0.0, before[t, flavor] - reserved(t)) for t in teams)
        use_after = sum(max(0.0, before[t, flavor] + added[t, flavor] - reserved(t)) for t in teams)
        if use_after > pool + 1e-6 and use_after > use_before + 1e-6:
            problems.append(f"flavor {flavor}: teams use {use_after:g} of the cohort's pool of {pool:g}")
        for team in sorted(teams):
            if added[team, flavor] <= 1e-9:
                continue
            q = limits.get((team, flavor))
            nominal = q.nominal if q is not None else 0.0
            after = before[team, flavor] + added[team, flavor]
            if q is not None and q.borrowing_limit is not None and after > nominal + q.borrowing_limit + 1e-6:
                problems.append(f"team {team}: {after:g} {flavor} is past nominal {nominal:g} + borrowing limit "
                                f"{q.borrowing_limit:g}")
            if fixed[team, flavor] > max(0.0, nominal - before[team, flavor]) + 1e-6:
                problems.append(f"team {team}: jobs that cannot be preempted borrow {flavor}")
    return problems
