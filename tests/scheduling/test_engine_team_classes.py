"""Jobs of different teams share demand classes only where the team changes nothing: same pools, no
quota, budget or owner budget, no quotas of owned capacity in force (scheduling.problem.tenant_groups).
Sharing is what keeps a cycle over many teams as cheap as one team's; these tests pin that it never
lets a team's job go where, or cost what, its own limits forbid."""

from __future__ import annotations

from scheduling.engine import schedule
from scheduling.model import QuotaShare, ReasonCode
from scheduling.problem import build_problem, tenant_groups
from scheduling.quota import QuotaLedger
from tests.scheduling.engine_factories import FAST, budget, gpu_node, job, offer, snapshot


def test_identical_jobs_of_unlimited_teams_on_the_same_pools_form_one_class():
    pending = [job(f"{team}-{i}", tenant=team, submitted_at=float(i)) for team in ("acme", "globex", "initech")
               for i in range(3)]
    snap = snapshot([gpu_node("n1", gpus=8), gpu_node("n2", gpus=8)], pending, tenants=[budget("acme"), budget("globex")])
    problem = build_problem(snap, FAST)
    assert len(problem.classes) == 1
    assert sorted(problem.classes[0].job_ids) == sorted(j.job_id for j in pending)
    plan = schedule(snap, FAST)
    assert {p.job_id for p in plan.placements} == {j.job_id for j in pending}


def test_the_older_job_gets_the_last_gpu_whichever_team_submitted_it():
    pending = [job("acme-late", tenant="acme", submitted_at=20.0), job("globex-early", tenant="globex", submitted_at=10.0)]
    plan = schedule(snapshot([gpu_node("n", gpus=1)], pending), FAST)
    assert [p.job_id for p in plan.placements] == ["globex-early"]
    assert "acme-late" in plan.pending


def test_a_team_out_of_budget_waits_beside_an_unlimited_team_whose_identical_job_rents():
    # Only a cloud offer: renting costs money, acme has none left, globex has no budget.
    pending = [job("acme-1", tenant="acme", submitted_at=1.0), job("globex-1", tenant="globex", submitted_at=2.0)]
    snap = snapshot([], pending, offers=[offer("o", gpus=1, price=4.0)],
                    tenants=[budget("acme", remaining_budget=0.5), budget("globex")])
    groups = tenant_groups(snap, None)
    assert groups["acme"] == "acme" and groups["globex"] != "acme"
    plan = schedule(snap, FAST)
    assert [p.job_id for p in plan.placements] == ["globex-1"]
    reason = plan.pending["acme-1"]
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert "acme" in reason.message and "globex" not in reason.message


def test_a_node_only_one_team_may_use_never_takes_the_other_teams_identical_job():
    # globex's job is older, so it would lead a shared class: it must still not reach acme's node.
    pending = [job("globex-1", tenant="globex", submitted_at=1.0), job("acme-1", tenant="acme", submitted_at=2.0)]
    snap = snapshot([gpu_node("acme-node", gpus=2, tenants=("acme",))], pending)
    groups = tenant_groups(snap, None)
    assert groups["acme"] != groups["globex"]
    plan = schedule(snap, FAST)
    assert [(p.job_id, p.parts[0].node_id) for p in plan.placements] == [("acme-1", "acme-node")]
    reason = plan.pending["globex-1"]
    assert reason.code == ReasonCode.NO_POOL_ACCESS
    assert "team globex" in reason.message and "acme-1" not in reason.message


def test_a_team_with_a_gpu_quota_keeps_its_own_class_and_its_quota():
    pending = [job(f"{team}-{i}", tenant=team, submitted_at=float(i)) for team in ("acme", "globex") for i in range(3)]
    snap = snapshot([gpu_node("n", gpus=8)], pending, tenants=[budget("acme", gpu_quota=1), budget("globex")])
    assert len(build_problem(snap, FAST).classes) == 2
    plan = schedule(snap, FAST)
    placed = {p.job_id for p in plan.placements}
    assert placed == {"acme-0", "globex-0", "globex-1", "globex-2"}
    assert plan.pending["acme-1"].code == ReasonCode.QUOTA_EXCEEDED


def test_with_quotas_of_owned_capacity_every_team_is_a_group_of_its_own():
    pending = [job("acme-1", tenant="acme"), job("globex-1", tenant="globex")]
    snap = snapshot([gpu_node("n", gpus=8)], pending,
                    quotas=(QuotaShare(tenant="acme", flavor="A100", nominal=4),
                            QuotaShare(tenant="globex", flavor="A100", nominal=4)))
    ledger = QuotaLedger(snap)
    assert ledger.active
    assert tenant_groups(snap, ledger) == {"acme": "acme", "globex": "globex"}
    assert len(build_problem(snap, FAST).classes) == 2
