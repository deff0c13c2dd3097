"""Within a team, like jobs start oldest first; the younger ones wait for new instances' boots
(scheduling/start_order.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine_factories import budget, gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import Policy, QuotaShare
from scheduling.validate import plan_violations
from test_quota_properties import PROPERTY_SETTINGS

POLICY = Policy(time_limit_s=2.0, defragmentation=False, consolidation=False)


def one_free_gpu(**fields):
    """An owned node with one free GPU, a one-GPU offer, and two one-GPU jobs: the older expected to
    run an hour, the newer ten (dollars alone give the free GPU to the newer)."""
    node = gpu_node("n1", gpus=2, price=0.0, used={0: 1000})
    pending = [job("old", tenant=fields.pop("old_team", "acme"), submitted_at=100.0, expected_duration_hours=1.0),
               job("new", tenant=fields.pop("new_team", "acme"), submitted_at=200.0, expected_duration_hours=10.0)]
    return snapshot(nodes=[node], pending=pending, offers=[offer("o1", gpus=1, price=3.0)], **fields)


def where(plan) -> dict[str, str]:
    return {p.job_id: p.node_id or f"launch:{p.launch_id}" for p in plan.placements}


def test_the_older_of_two_like_jobs_takes_the_free_gpu_and_the_newer_waits_for_the_instance():
    plan = schedule(one_free_gpu(), POLICY)
    assert where(plan)["old"] == "n1" and where(plan)["new"].startswith("launch:")
    (launch,) = plan.launches
    assert launch.job_ids == ("new",) and launch.count == 1
    assert plan.pending == {} and plan_violations(one_free_gpu(), plan) == []


def test_jobs_of_different_teams_keep_the_cheaper_assignment():
    plan = schedule(one_free_gpu(old_team="acme", new_team="globex"), POLICY)
    assert where(plan)["new"] == "n1" and where(plan)["old"].startswith("launch:")


def test_a_team_with_a_budget_keeps_the_assignment_its_budget_was_checked_against():
    plan = schedule(one_free_gpu(tenants=[budget("acme", remaining_budget=1000.0)]), POLICY)
    assert where(plan)["new"] == "n1" and where(plan)["old"].startswith("launch:")


def test_under_quotas_the_older_job_takes_the_nominal_share_and_neither_is_left_pending():
    # The owned GPU has a marginal price, so the nominal phase (no launches) takes the job that is
    # cheaper there, the newer and shorter one; the older then rents in the borrowing phase.
    node = gpu_node("n1", gpus=2, price=0.5, used={0: 1000})
    pending = [job("old", submitted_at=100.0, expected_duration_hours=10.0),
               job("new", submitted_at=200.0, expected_duration_hours=1.0)]
    snap = snapshot(nodes=[node], pending=pending, offers=[offer("o1", gpus=1, price=3.0)],
                    quotas=(QuotaShare("acme", "A100", 1.0, None, None),))
    plan = schedule(snap, POLICY)
    assert where(plan)["old"] == "n1" and where(plan)["new"].startswith("launch:")
    assert sorted(p.job_id for p in plan.placements) == ["new", "old"] and plan.pending == {}
    assert plan.launches[0].job_ids == ("new",) and plan_violations(snap, plan) == []


@st.composite
def like_jobs(draw):
    free = draw(st.integers(0, 4))
    node = gpu_node("n1", gpus=4, price=0.0, used={g: 1000 for g in range(4 - free)})
    count = draw(st.integers(1, 8))
    durations = draw(st.lists(st.floats(0.1, 20.0), min_size=count, max_size=count))
    teams = draw(st.lists(st.sampled_from(("acme", "globex")), min_size=count, max_size=count))
    pending = [job(f"j{i}", tenant=teams[i], submitted_at=float(i), expected_duration_hours=durations[i])
               for i in range(count)]
    return snapshot(nodes=[node], pending=pending, offers=[offer("o1", gpus=1, price=3.0, launchable=8)])


@PROPERTY_SETTINGS
@given(like_jobs())
def test_no_job_waits_for_a_boot_while_a_newer_like_job_of_its_team_starts_at_once(snap):
    plan = schedule(snap, POLICY)
    assert plan_violations(snap, plan) == []
    jobs = {j.job_id: j for j in snap.pending}
    boots = {p.job_id for p in plan.placements if p.launch_id is not None}
    at_once = {p.job_id for p in plan.placements if p.node_id is not None}
    for waiting in boots:
        for started in at_once:
            if jobs[waiting].tenant == jobs[started].tenant:
                assert jobs[waiting].submitted_at > jobs[started].submitted_at, (waiting, started)
    launched = {j for launch in plan.launches for j in launch.job_ids}
    assert launched == boots
