"""Properties of quotas over random teams, quotas, running jobs and pending jobs (Hypothesis).

- the plan passes the independent checker (no GPU booked twice, no borrowing past a borrowing limit
  or the cohort's pool, no job that cannot be preempted borrowing, no team outside its pools);
- every pending job's reason names its quota step;
- the plan is deterministic;
- no team is held below its nominal quota while another borrows from it: a pending job that fits
  in its team's unused nominal share is placed or waits for a reclaim (RECLAIMING), unless no other
  team holds borrowed capacity it could take back.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_factories import DETERMINISM_LIMIT_S, gpu_node, job, snapshot
from scheduling.engine import schedule
from scheduling.model import Policy, QuotaShare, ReasonCode, RunningAllocation
from scheduling.validate import plan_violations

TEAMS = ("t0", "t1", "t2")
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def worlds(draw, one_gpu_only: bool = False):
    node_count = draw(st.integers(1, 3))
    nodes = [gpu_node(f"n{i}", gpus=8, price=0.0, island_size=1) for i in range(node_count)]
    quotas = []
    for team in TEAMS:
        if draw(st.booleans()) or team == "t0":
            nominal = draw(st.integers(0, 12))
            borrowing = None if one_gpu_only else draw(st.one_of(st.none(), st.integers(0, 8)))
            lending = None if one_gpu_only else draw(st.one_of(st.none(), st.integers(0, nominal)))
            quotas.append(QuotaShare(team, "A100", float(nominal), None if borrowing is None else float(borrowing),
                                     None if lending is None else float(lending)))
    sizes = (1,) if one_gpu_only else (1, 2, 4)
    running, free = [], {node.id: list(range(8)) for node in nodes}
    for number in range(draw(st.integers(0, 8 * node_count))):
        node = draw(st.sampled_from(nodes))
        size = draw(st.sampled_from(sizes))
        if len(free[node.id]) < size:
            continue
        gpus, free[node.id] = free[node.id][:size], free[node.id][size:]
        preemptible = True if one_gpu_only else draw(st.booleans())
        running.append(RunningAllocation(
            job_id=f"r{number}", node_id=node.id, gpu_indices=tuple(gpus), tenant=draw(st.sampled_from(TEAMS)),
            preemptible=preemptible, checkpointable=True, run_seconds=5000.0, checkpoint_age_s=60.0,
            cpu_milli=1000 * size, memory_mb=1024))
    nodes = [gpu_node(node.id, gpus=8, price=0.0, island_size=1,
                      used={g: 1000 for g in range(8) if g not in free[node.id]}) for node in nodes]
    pending = [job(f"p{i}", gpus=draw(st.sampled_from(sizes)), tenant=draw(st.sampled_from(TEAMS)),
                   submitted_at=float(i), preemptible=True if one_gpu_only else draw(st.booleans()))
               for i in range(draw(st.integers(1, 16)))]
    policy = Policy(time_limit_s=DETERMINISM_LIMIT_S, defragmentation=False, consolidation=False,
                    borrowing=True if one_gpu_only else draw(st.booleans()),
                    fair_share=draw(st.booleans()))
    return snapshot(nodes, pending, running=running, quotas=tuple(quotas)), policy


@PROPERTY_SETTINGS
@given(worlds())
def test_plans_keep_every_quota_rule_and_name_each_quota_step(world):
    snap, policy = world
    plan = schedule(snap, policy)
    assert plan_violations(snap, plan) == []
    for reason in plan.pending.values():
        assert reason.data["quota"]["step"] in {"nominal", "borrowing", "limit"}
    again = schedule(snap, policy)
    assert again.placements == plan.placements and again.preemptions == plan.preemptions
    assert {j: r.code for j, r in again.pending.items()} == {j: r.code for j, r in plan.pending.items()}


@PROPERTY_SETTINGS
@given(worlds(one_gpu_only=True))
def test_no_team_is_held_below_its_nominal_while_another_borrows(world):
    snap, policy = world
    plan = schedule(snap, policy)
    nominal = defaultdict(float, {q.tenant: q.nominal for q in snap.quotas})
    team_of = {j.job_id: j.tenant for j in snap.pending}
    used = defaultdict(float)
    reclaimed = {p.victim_job_id for p in plan.preemptions if p.cause == "reclaim"}
    for allocation in snap.running:
        if allocation.job_id not in reclaimed:
            used[allocation.tenant] += len(allocation.gpu_indices)
    for placement in plan.placements:
        used[team_of[placement.job_id]] += 1
    for job_id, reason in plan.pending.items():
        if reason.code == ReasonCode.RECLAIMING:
            used[team_of[job_id]] += 1  # its GPU is reserved once the victims stop
    for job_id, reason in plan.pending.items():
        team = team_of[job_id]
        if reason.code == ReasonCode.RECLAIMING or used[team] + 1 > nominal[team]:
            continue
        lenders = [a.job_id for a in snap.running if a.job_id not in reclaimed and a.tenant != team
                   and a.preemptible and used[a.tenant] - 1 >= nominal[a.tenant]]
        assert not lenders, (job_id, reason.message, dict(used), dict(nominal))
