"""Quotas of shared owned capacity: nominal first, borrowing, limits, reclaim, fair share, access."""

from __future__ import annotations

from dataclasses import replace

from engine_factories import gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import Policy, QuotaShare, ReasonCode, RunningAllocation, TeamUsage
from scheduling.quota import QuotaLedger
from scheduling.validate import plan_violations

POLICY = Policy(time_limit_s=5.0, min_run_before_preempt_s=600, defragmentation=False, consolidation=False)


def fleet(nodes: int = 2, gpus: int = 8, **fields):
    return [gpu_node(f"n{i}", gpus=gpus, price=0.0, **fields) for i in range(nodes)]


def quotas(**nominal):
    return tuple(QuotaShare(team, "A100", float(n)) for team, n in nominal.items())


def jobs(team: str, count: int, gpus: int = 1, start: int = 0, **fields):
    return [job(f"{team}{i}", gpus=gpus, tenant=team, submitted_at=float(start + i), **fields) for i in range(count)]


def held(team: str, node: str, gpus, name: str, **fields) -> RunningAllocation:
    fields.setdefault("preemptible", True)
    fields.setdefault("checkpointable", True)
    return RunningAllocation(job_id=name, node_id=node, gpu_indices=tuple(gpus), tenant=team,
                             run_seconds=50.0, checkpoint_age_s=10.0, cpu_milli=1000 * len(tuple(gpus)),
                             memory_mb=1024, **fields)


def busy(node_id: str, used_gpus, gpus: int = 8):
    return gpu_node(node_id, gpus=gpus, price=0.0, used={g: 1000 for g in used_gpus})


def placed_by_team(plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for placement in plan.placements:
        team = placement.job_id.rstrip("0123456789")
        counts[team] = counts.get(team, 0) + sum(len(p.gpu_indices) for p in placement.parts)
    return counts


def test_nominal_quotas_come_before_older_jobs_that_would_borrow():
    # acme's 16 jobs are older, but only 8 fit in its nominal share: globex's 8 are within its own.
    snap = snapshot(fleet(), jobs("acme", 16) + jobs("globex", 8, start=100), quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert placed_by_team(plan) == {"acme": 8, "globex": 8}
    assert plan_violations(snap, plan) == []
    assert plan.pending["acme8"].data["quota"]["step"] == "borrowing"


def test_a_team_borrows_what_others_leave_idle_and_strict_quotas_do_not():
    snap = snapshot(fleet(), jobs("acme", 16), quotas=quotas(acme=8, globex=8))
    assert placed_by_team(schedule(snap, POLICY)) == {"acme": 16}
    strict = schedule(snap, replace(POLICY, borrowing=False))
    assert placed_by_team(strict) == {"acme": 8}
    reason = strict.pending["acme8"]
    assert reason.code == ReasonCode.NOMINAL_QUOTA_USED
    assert "acme uses 8/8 nominal A100 and may not borrow (strict quotas)" in reason.message
    assert reason.data["quota"]["borrow_left"] == 0


def test_borrowing_stops_at_the_borrowing_limit_with_the_numbers():
    limited = (QuotaShare("acme", "A100", 8, borrowing_limit=4), QuotaShare("globex", "A100", 8))
    snap = snapshot(fleet(), jobs("acme", 16), quotas=limited)
    plan = schedule(snap, POLICY)
    assert placed_by_team(plan) == {"acme": 12}
    reason = plan.pending["acme15"]
    assert reason.code == ReasonCode.BORROWING_LIMIT
    assert "acme uses 12/8 nominal A100 and its borrowing limit is 4" in reason.message
    assert plan_violations(snap, plan) == []


def test_lending_limit_keeps_part_of_a_nominal_share_for_its_owner():
    lending = (QuotaShare("acme", "A100", 8), QuotaShare("globex", "A100", 8, lending_limit=2))
    plan = schedule(snapshot(fleet(), jobs("acme", 16), quotas=lending), POLICY)
    assert placed_by_team(plan) == {"acme": 10}


def test_reclaim_takes_borrowed_jobs_back_for_a_team_within_its_nominal_share():
    # acme holds all 16 GPUs (8 borrowed); globex needs 4 of its nominal 8 back.
    nodes = [busy("n0", range(8)), busy("n1", range(8))]
    running = [held("acme", "n0", range(8), "a-big")] + [held("acme", "n1", [g], f"a{g}") for g in range(8)]
    snap = snapshot(nodes, jobs("globex", 1, gpus=4), running=running, quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert {p.cause for p in plan.preemptions} == {"reclaim"}
    assert sorted(p.victim_job_id for p in plan.preemptions) == ["a0", "a1", "a2", "a3"]
    reason = plan.pending["globex0"]
    assert reason.code == ReasonCode.RECLAIMING
    assert "of acme" in reason.message and "globex's nominal share" in reason.message
    # Never below the lender's own nominal: acme keeps 12 >= 8. Without reclaim, globex just waits.
    assert schedule(snap, replace(POLICY, reclaim=False)).preemptions == ()


def test_reclaim_stops_the_borrowed_job_with_the_least_work_left():
    # acme borrows all 8 owned GPUs of n0 (nominal 4) with 1-GPU jobs of different lengths; globex
    # needs 1 GPU of its nominal back. The victim restarts elsewhere (with the owned node full, on a
    # rented instance), so the one with 20 minutes left goes, not one with days left, even though
    # it has more work since its last checkpoint to lose.
    nodes = [busy("n0", range(8))]
    hours = {0: 50.0, 1: 30.0, 2: 0.5, 3: 80.0, 4: 12.0, 5: 40.0, 6: 60.0, 7: 24.0}
    running = [replace(held("acme", "n0", [g], f"a{g}", demand=job(f"a{g}", expected_duration_hours=hours[g])),
                       run_seconds=1800.0, checkpoint_age_s=10.0 if g != 2 else 1500.0)
               for g in range(8)]
    snap = snapshot(nodes, jobs("globex", 1), running=running, quotas=quotas(acme=4, globex=4))
    plan = schedule(snap, POLICY)
    assert [p.victim_job_id for p in plan.preemptions] == ["a2"]
    assert plan.pending["globex0"].code == ReasonCode.RECLAIMING
    assert plan_violations(snap, plan) == []


def test_reclaim_picks_the_node_whose_victims_have_the_least_gpu_time_left():
    # A 4-GPU job of globex fits on either node once acme's borrowed jobs leave: n0 by stopping one
    # 4-GPU job with 10 hours left, n1 by stopping four 1-GPU jobs with 1 hour left each (4 GPU-hours
    # to run again elsewhere against 40). n1's go.
    nodes = [busy("n0", range(8)), busy("n1", range(8))]
    running = ([held("acme", "n0", range(4), "long", demand=job("long", gpus=4, expected_duration_hours=10.0)),
                held("acme", "n0", range(4, 8), "keep0", demand=job("keep0", gpus=4, expected_duration_hours=9.0))]
               + [held("acme", "n1", [g], f"short{g}", demand=job(f"short{g}", expected_duration_hours=1.0))
                  for g in range(8)])
    snap = snapshot(nodes, jobs("globex", 1, gpus=4), running=running, quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert {p.node_id for p in plan.preemptions} == {"n1"}
    assert len(plan.preemptions) == 4


def test_reclaim_never_takes_a_team_below_its_nominal():
    # acme holds 8 of its nominal 12; globex holds 8 of its nominal 4 (4 borrowed). acme wants 6 more:
    # only globex's 4 borrowed GPUs can be reclaimed, so the 6-GPU job is not helped by reclaim at all,
    # while a 4-GPU one is.
    nodes = [busy("n0", range(8)), busy("n1", range(8))]
    running = ([held("acme", "n0", [g], f"a{g}") for g in range(8)]
               + [held("globex", "n1", [g], f"g{g}") for g in range(8)])
    too_big = snapshot(nodes, jobs("acme", 1, gpus=6), running=running, quotas=quotas(acme=12, globex=4))
    assert schedule(too_big, POLICY).preemptions == ()
    snap = replace(too_big, pending=tuple(jobs("acme", 1, gpus=4) + jobs("globex", 1, start=600)))
    plan = schedule(snap, POLICY)
    assert sorted(p.victim_job_id for p in plan.preemptions) == ["g0", "g1", "g2", "g3"]
    assert plan.pending["acme0"].code == ReasonCode.RECLAIMING
    assert plan.pending["globex0"].code != ReasonCode.RECLAIMING


def test_a_job_that_cannot_be_preempted_never_borrows():
    snap = snapshot(fleet(), jobs("acme", 16, preemptible=False), quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert placed_by_team(plan) == {"acme": 8}
    assert plan_violations(snap, plan) == []
    reason = plan.pending["acme8"]
    assert reason.code == ReasonCode.NOMINAL_QUOTA_USED
    assert "may not borrow (the job cannot be preempted)" in reason.message


def test_fair_share_lets_the_less_served_team_borrow_first():
    # 8 idle GPUs beyond both nominal shares (capacity 16, nominal 4 + 4); both teams want 8 more.
    snap = snapshot(fleet(), jobs("acme", 12) + jobs("globex", 12, start=100),
                    quotas=quotas(acme=4, globex=4),
                    usage=(TeamUsage("acme", "A100", 500.0), TeamUsage("globex", "A100", 10.0)))
    plan = schedule(snap, POLICY)
    counts = placed_by_team(plan)
    assert counts["globex"] > counts["acme"], counts
    # Without fairness weighting, the older jobs (acme's) borrow first.
    counts = placed_by_team(schedule(snap, replace(POLICY, fair_share=False)))
    assert counts["acme"] >= counts["globex"], counts


def test_fair_share_factor_follows_slurms_formula():
    ledger = QuotaLedger(snapshot(fleet(), [], quotas=quotas(acme=12, globex=4),
                                  usage=(TeamUsage("acme", "A100", 75.0), TeamUsage("globex", "A100", 25.0))))
    # Both used exactly their share of usage (75/25 against 12/16 and 4/16): F = 2^-1.
    assert abs(ledger.factor["acme"] - 0.5) < 1e-9 and abs(ledger.factor["globex"] - 0.5) < 1e-9
    ledger = QuotaLedger(snapshot(fleet(), [], quotas=quotas(acme=8, globex=8),
                                  usage=(TeamUsage("acme", "A100", 100.0),)))
    assert abs(ledger.factor["acme"] - 2 ** -2) < 1e-9 and ledger.factor["globex"] == 1.0


def test_quotas_do_not_limit_renting():
    # acme used its nominal of owned GPUs; renting is bounded by budget, not by quota.
    nodes = [busy("n0", range(8))]
    snap = snapshot(nodes, jobs("acme", 1, gpus=8), offers=[offer("p4d", launchable=1)],
                    running=[held("acme", "n0", range(8), "a-big")], quotas=quotas(acme=8, globex=0))
    plan = schedule(snap, POLICY)
    assert plan.placements and plan.placements[0].launch_id is not None


def test_idle_owned_capacity_is_borrowed_before_anything_is_rented():
    snap = snapshot(fleet(), jobs("acme", 16), offers=[offer("p4d", launchable=2)], quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert placed_by_team(plan) == {"acme": 16} and plan.launches == ()


def test_a_team_is_never_placed_in_a_pool_it_has_no_access_to():
    nodes = [gpu_node("mine", price=0.0, tenants=("acme",)), gpu_node("shared", price=0.0, tenants=("acme", "globex"))]
    snap = snapshot(nodes, jobs("globex", 2, gpus=8))
    plan = schedule(snap, POLICY)
    assert [p.node_id for p in plan.placements] == ["shared"]
    only_mine = snapshot(nodes[:1], jobs("globex", 1, gpus=8))
    assert schedule(only_mine, POLICY).pending["globex0"].code == ReasonCode.NO_POOL_ACCESS


def test_every_pending_job_names_its_quota_step():
    snap = snapshot(fleet(nodes=1), jobs("acme", 12) + jobs("globex", 3, gpus=4, start=50),
                    quotas=quotas(acme=4, globex=4))
    plan = schedule(snap, POLICY)
    assert plan.pending
    for reason in plan.pending.values():
        assert reason.data["quota"]["step"] in {"nominal", "borrowing", "limit"}
        assert reason.message.startswith(reason.code.value)


def test_compute_unit_quotas_count_every_model_by_its_rating():
    nodes = [gpu_node("h", model="H100", price=0.0), gpu_node("a", price=0.0)]
    cu = (QuotaShare("acme", "CU", 8.0), QuotaShare("globex", "CU", 16.0))
    snap = snapshot(nodes, jobs("acme", 4, gpus=2, allowed_models=("H100",)), quotas=cu)
    plan = schedule(snap, replace(POLICY, borrowing=False))
    # An H100 is 2 CU: 8 CU of nominal is 4 H100s, so two of the four 2-GPU jobs.
    assert len(plan.placements) == 2


def test_other_teams_private_nodes_do_not_hide_that_the_shared_pool_is_full():
    # globex's two private nodes outnumber the one shared node acme may use, which globex fills.
    nodes = [busy("shared", range(8)), gpu_node("g1", price=0.0, tenants=("globex",)),
             gpu_node("g2", price=0.0, tenants=("globex",))]
    nodes[0] = replace(nodes[0], tenants=("acme", "globex"))
    running = [held("globex", "shared", range(8), "theirs")]
    snap = snapshot(nodes, jobs("acme", 1, gpus=8), running=running, quotas=quotas(acme=8, globex=0))
    plan = schedule(snap, POLICY)
    assert plan.pending["acme0"].code == ReasonCode.RECLAIMING
    assert [p.victim_job_id for p in plan.preemptions] == ["theirs"]
    alone = replace(snap, quotas=())
    assert schedule(alone, POLICY).pending["acme0"].code == ReasonCode.INSUFFICIENT_GPUS


def test_a_team_within_its_nominal_reclaims_instead_of_renting():
    # acme borrows all 16 owned GPUs; globex's job fits its unused nominal: it gets its share back
    # rather than a rented instance (renting would leave acme on globex's share indefinitely).
    nodes = [busy("n0", range(8)), busy("n1", range(8))]
    running = [held("acme", "n0", range(8), "a-big")] + [held("acme", "n1", [g], f"a{g}") for g in range(8)]
    snap = snapshot(nodes, jobs("globex", 1, gpus=4), running=running, offers=[offer("p4d", launchable=2)],
                    quotas=quotas(acme=8, globex=8))
    plan = schedule(snap, POLICY)
    assert plan.launches == () and plan.placements == ()
    assert sorted(p.victim_job_id for p in plan.preemptions) == ["a0", "a1", "a2", "a3"]
    assert plan.pending["globex0"].code == ReasonCode.RECLAIMING
    assert plan_violations(snap, plan) == []
    # acme's own job beyond its nominal still rents: nobody owes it anything.
    more = replace(snap, pending=tuple(jobs("acme", 1, gpus=8, start=900)))
    assert schedule(more, POLICY).launches


def test_a_free_gpu_of_a_running_instance_does_not_stand_in_for_a_teams_nominal_share():
    # acme borrows globex's share of the owned node; a rented instance of acme's has a GPU free (paid
    # already). globex's job fits its unused nominal: it gets its share back, not the instance's GPU,
    # where it would keep acme on globex's share until it ended.
    nodes = [busy("n0", range(8)), gpu_node("i-1", gpus=2, price=3.0, rented=True, used={0: 1000})]
    running = [held("acme", "n0", [g], f"a{g}") for g in range(8)] + [held("acme", "i-1", [0], "a-rented")]
    snap = snapshot(nodes, jobs("globex", 1), running=running, quotas=quotas(acme=4, globex=4))
    plan = schedule(snap, POLICY)
    assert plan.placement_for("globex0") is None
    assert plan.pending["globex0"].code == ReasonCode.RECLAIMING
    assert len(plan.preemptions) == 1 and plan.preemptions[0].cause == "reclaim"
    assert plan_violations(snap, plan) == []
    # With nothing borrowed from globex, the instance's free GPU is as good as any: it is used.
    mine = replace(snap, running=tuple(held("globex" if g < 4 else "acme", "n0", [g], f"x{g}") for g in range(8))
                   + (held("acme", "i-1", [0], "a-rented"),))
    assert schedule(mine, POLICY).placement_for("globex0").parts[0].node_id == "i-1"


def test_a_backlog_of_borrowers_jobs_does_not_hide_a_job_owed_a_reclaim():
    nodes = [busy("n0", range(8))]
    running = [held("acme", "n0", [g], f"a{g}") for g in range(8)]
    backlog = jobs("acme", 40)  # older, and all beyond acme's nominal
    snap = snapshot(nodes, backlog + jobs("globex", 1, start=100), running=running, quotas=quotas(acme=4, globex=4))
    plan = schedule(snap, POLICY)
    assert plan.pending["globex0"].code == ReasonCode.RECLAIMING


def test_a_borrowed_job_bigger_than_what_its_team_borrows_is_taken_when_nothing_else_frees_room():
    # globex holds two 8-GPU jobs against a nominal of 9 (7 borrowed); acme needs 1 of its nominal 7.
    nodes = [busy("n0", range(8)), busy("n1", range(8))]
    running = [held("globex", "n0", range(8), "g-a"), held("globex", "n1", range(8), "g-b")]
    snap = snapshot(nodes, jobs("acme", 1), running=running, quotas=quotas(acme=7, globex=9))
    plan = schedule(snap, POLICY)
    assert len(plan.preemptions) == 1 and plan.preemptions[0].cause == "reclaim"
    assert plan.pending["acme0"].code == ReasonCode.RECLAIMING


def test_moves_back_from_rented_capacity_respect_strict_quotas():
    # acme runs 4 one-GPU jobs on a rented instance; the owned node is idle, acme's nominal is 2:
    # under strict quotas at most 2 of them may move onto owned GPUs.
    rented = gpu_node("i-1", gpus=4, price=3.0, rented=True, used={g: 1000 for g in range(4)})
    owned = gpu_node("n0", price=0.0)
    running = [held("acme", "i-1", [g], f"r{g}", demand=job(f"r{g}", tenant="acme", expected_duration_hours=10.0))
               for g in range(4)]
    running = [replace(a, run_seconds=5000.0) for a in running]
    snap = snapshot([rented, owned], [], running=running, quotas=quotas(acme=2, globex=6))
    strict = schedule(snap, replace(POLICY, consolidation=True, borrowing=False))
    onto_owned = [m for m in strict.migrations if m.to.node_id == "n0"]
    assert len(onto_owned) <= 2
    assert plan_violations(snap, strict) == []


def test_a_teams_private_pool_is_outside_the_cohorts_quotas():
    # acme's own node (only acme may use it) is neither counted against acme's quota nor lent.
    private = gpu_node("acme-own", price=0.0, tenants=("acme",))
    shared = gpu_node("shared", price=0.0, tenants=("acme", "globex"))
    snap = snapshot([private, shared], jobs("acme", 16), quotas=quotas(acme=0, globex=8))
    plan = schedule(snap, replace(POLICY, borrowing=False))
    # Strict quotas with nominal 0: only the private node's 8 GPUs.
    assert {p.node_id for p in plan.placements} == {"acme-own"} and len(plan.placements) == 8
    ledger = QuotaLedger(snap)
    assert ledger.capacity["A100"] == 8
