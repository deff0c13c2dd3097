"""Filter plugins at their edges: the words of a pending reason and the limits a job may just reach (issue 9).

Each test is a scenario a user can meet: what the pending message says, or that a job that fits
exactly (price, quota, budget, launch quota) is placed and one a little over is not.
"""

from __future__ import annotations

from engine_factories import FAST, budget, gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import OwnerBudget, ReasonCode


def reason_of(snap, job_id="j", policy=FAST):
    plan = schedule(snap, policy)
    assert job_id not in {p.job_id for p in plan.placements}
    return plan.pending[job_id]


def busy(*positions: int, milli: int = 1000) -> dict[int, int]:
    return {p: milli for p in positions}


# -- how many GPUs a job lacks, in its own terms ---------------------------------------------------
def test_a_fractional_job_is_told_the_share_it_needs():
    node = gpu_node("n", used=busy(*range(8), milli=600))
    reason = reason_of(snapshot([node], [job("j", gpu_milli=500)]))
    assert reason.code == ReasonCode.INSUFFICIENT_GPUS
    assert reason.message == "INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have no GPU with 0.5 of a GPU free; no cloud offers"


def test_a_job_with_alternatives_is_told_each_alternatives_count():
    node = gpu_node("n", used=busy(*range(6)))
    pending = [job("j", gpus=2, gpus_by_model=(("A100", 4), ("H100", 2)))]
    reason = reason_of(snapshot([node], pending))
    assert reason.message == ("INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have fewer free GPUs per node than any "
                              "alternative needs (A100:4, H100:2); no cloud offers")


def test_a_compute_unit_job_is_told_the_compute_units_it_needs():
    node = gpu_node("n", used=busy(*range(6)))
    reason = reason_of(snapshot([node], [job("j", compute_units=4.0)]))
    assert reason.message == ("INSUFFICIENT_GPUS: 0/1 nodes fit: 1 have fewer than 4 CU of free GPUs per "
                              "node; no cloud offers")


def test_a_multi_node_job_is_told_the_gpus_it_needs_on_each_node():
    nodes = [gpu_node(f"n{i}", fast_fabric=True, used=busy(0, 1)) for i in range(2)]
    reason = reason_of(snapshot(nodes, [job("j", gpus=16, nodes=2)]))
    assert reason.message == "INSUFFICIENT_GPUS: 0/2 nodes fit: 2 have fewer than 8 free GPUs per node; no cloud offers"


# -- limits a job may reach exactly ----------------------------------------------------------------
def test_an_offer_at_exactly_the_price_ceiling_is_taken_and_one_above_it_is_not():
    plan = schedule(snapshot([], [job("j", gpus=8, max_price_per_hour=32.0)], [offer("p4", price=32.0)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], [job("j", gpus=8, max_price_per_hour=31.5)], [offer("p4", price=32.0)]))
    assert reason.code == ReasonCode.PRICE_CEILING
    assert reason.data["offer_rejections"] == {"price_ceiling": 1}


def test_a_job_that_fills_the_gpu_quota_exactly_is_placed_and_one_more_gpu_is_refused():
    tenants = [budget(gpu_quota=4, gpus_in_use=2)]
    plan = schedule(snapshot([gpu_node("n")], [job("j", gpus=2)], tenants=tenants), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n")], [job("j", gpus=3)], tenants=tenants))
    assert reason.code == ReasonCode.QUOTA_EXCEEDED
    assert reason.message == ("QUOTA_EXCEEDED: 0/1 nodes fit: 1 would exceed tenant acme's GPU/CU quota; "
                              "no cloud offers")


def test_a_job_that_fills_the_compute_unit_quota_exactly_is_placed_and_one_more_is_refused():
    # An A100 is 1 CU (engine_factories.MODELS).
    tenants = [budget(cu_quota=4, cu_in_use=2)]
    plan = schedule(snapshot([gpu_node("n")], [job("j", gpus=2)], tenants=tenants), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([gpu_node("n")], [job("j", gpus=3)], tenants=tenants))
    assert reason.code == ReasonCode.QUOTA_EXCEEDED


def test_a_run_that_costs_exactly_the_budget_left_is_placed_and_a_dollar_more_is_not():
    pending = [job("j", gpus=8, expected_duration_hours=10)]  # 10 h at $21/h: $210
    plan = schedule(snapshot([], pending, [offer("p4", price=21.0)], tenants=[budget(remaining_budget=210.0)]), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], pending, [offer("p4", price=21.0)], tenants=[budget(remaining_budget=209.0)]))
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert reason.data["offer_rejections"] == {"tenant_budget": 1}


def test_a_run_that_costs_exactly_the_owners_budget_left_is_placed_and_a_dollar_more_is_not():
    pending = [job("j", gpus=8, expected_duration_hours=10, owner="alice")]

    def alice_left(left):
        return [budget(owners=(OwnerBudget(owner="alice", remaining_budget=left, monthly_budget=500.0),))]

    plan = schedule(snapshot([], pending, [offer("p4", price=21.0)], tenants=alice_left(210.0)), FAST)
    assert plan.placement_for("j") is not None
    reason = reason_of(snapshot([], pending, [offer("p4", price=21.0)], tenants=alice_left(209.0)))
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert reason.data["user_budget_left"] == 209.0
