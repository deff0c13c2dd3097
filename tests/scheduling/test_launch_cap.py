"""A pool's instance cap (`LaunchLimit`) is shared by all its instance types and holds in every path.

Issue 8 item 9: three offers of one pool, each launchable twice, and a pool cap of 2 gave one cycle
six launches. The cap is a limit on money, so it must hold whichever planner answers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_factories import gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import LaunchLimit, Policy
from scheduling.validate import plan_violations

POLICIES = [Policy(time_limit_s=2.0, preemption=False, defragmentation=False),
            Policy(method="milp", time_limit_s=2.0, preemption=False, defragmentation=False),
            Policy(method="greedy", preemption=False, defragmentation=False),
            Policy(method="exact", time_limit_s=2.0, preemption=False, defragmentation=False)]


def pooled(offer_id: str, group: str = "pool:7", **fields):
    return replace(offer(offer_id, **fields), launch_group=group)


def launches_by_group(snap, plan) -> Counter:
    group_of = {o.id: o.launch_group for o in snap.offers}
    counts: Counter = Counter()
    for launch in plan.launches:
        counts[group_of[launch.offer_id]] += launch.count
    return counts


def demo_like(remaining: int):
    """The demo's cloud-sim pool: 1xL4, 4xT4, 8xA100, each launchable twice, many 1-GPU jobs."""
    offers = [pooled("sim.1xL4", model="T4", gpus=1, price=0.8), pooled("sim.4xT4", model="T4", gpus=4, price=3.9),
              pooled("sim.8xA100", model="A100", gpus=8, price=32.0)]
    pending = [job(f"j{k}", gpus=1, allowed_models=("A100",) if k % 3 == 0 else ("T4",), submitted_at=float(k),
                   expected_duration_hours=8.0) for k in range(40)]
    return snapshot([], pending, offers, launch_limits=(LaunchLimit("pool:7", remaining),))


def test_one_cycle_never_launches_more_than_the_pools_cap_in_any_method():
    for policy in POLICIES:
        snap = demo_like(remaining=2)
        plan = schedule(snap, policy)
        assert launches_by_group(snap, plan)["pool:7"] == 2, policy.method  # up to the cap, not 6
        assert plan_violations(snap, plan) == []
        # Every job that did not fit on the two instances waits, with a reason.
        placed = {p.job_id for p in plan.placements}
        assert len(placed) + len(plan.pending) == 40 and plan.pending


def test_a_pool_at_its_cap_launches_nothing_and_says_why():
    snap = demo_like(remaining=0)
    plan = schedule(snap, POLICIES[0])
    assert plan.launches == () and plan.placements == ()
    # Each reason names the used-up launch quota (the headline code is the most common rejection).
    assert len(plan.pending) == 40
    assert all(": quota 0" in r.message for r in plan.pending.values())


def test_another_pools_offers_are_not_held_by_this_cap():
    snap = demo_like(remaining=1)
    other = pooled("other.8xA100", group="pool:9", model="A100", gpus=8, price=33.0, launchable=1)
    snap = snapshot([], snap.pending, snap.offers + (other,), launch_limits=snap.launch_limits)
    plan = schedule(snap, POLICIES[0])
    counts = launches_by_group(snap, plan)
    assert counts["pool:7"] <= 1 and counts["pool:9"] <= 1 and sum(counts.values()) == 2
    assert plan_violations(snap, plan) == []


def test_the_validator_catches_a_plan_above_the_cap():
    uncapped = demo_like(remaining=6)
    plan = schedule(uncapped, POLICIES[0])
    assert launches_by_group(uncapped, plan)["pool:7"] > 2
    capped = snapshot([], uncapped.pending, uncapped.offers, launch_limits=(LaunchLimit("pool:7", 2),))
    assert any("launch group pool:7" in p for p in plan_violations(capped, plan))


@st.composite
def capped_snapshots(draw):
    nodes = [gpu_node(f"n{n}", gpus=draw(st.sampled_from([1, 4])), model=draw(st.sampled_from(["A100", "T4"])))
             for n in range(draw(st.integers(0, 2)))]
    offers = [pooled(f"o{k}", group=draw(st.sampled_from(["pool:1", "pool:2", ""])),
                     model=draw(st.sampled_from(["A100", "T4"])), gpus=draw(st.sampled_from([1, 4, 8])),
                     price=draw(st.sampled_from([3.0, 20.0])), spot=draw(st.sampled_from([None, 1.0])),
                     launchable=draw(st.integers(0, 3)))
              for k in range(draw(st.integers(1, 4)))]
    pending = [job(f"j{k}", gpus=draw(st.sampled_from([1, 2, 4, 8])), spot=draw(st.sampled_from(["never", "allowed"])),
                   expected_duration_hours=draw(st.sampled_from([1.0, 8.0])), submitted_at=float(k))
               for k in range(draw(st.integers(1, 10)))]
    limits = (LaunchLimit("pool:1", draw(st.integers(0, 2))), LaunchLimit("pool:2", draw(st.integers(0, 2))))
    return snapshot(nodes, pending, offers, launch_limits=limits)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capped_snapshots(), st.sampled_from(POLICIES))
def test_property_no_plan_exceeds_a_group_cap(snap, policy):
    plan = schedule(snap, policy)
    counts = launches_by_group(snap, plan)
    for limit in snap.launch_limits:
        assert counts[limit.group] <= limit.remaining
    assert plan_violations(snap, plan) == []
