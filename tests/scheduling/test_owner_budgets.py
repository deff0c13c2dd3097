"""Per-user budgets in the pure engine (issue 13): a member's jobs spend from their own budget beside the
team's; one cycle cannot place two of them past it, whichever method decides; free capacity still runs."""

from __future__ import annotations

import dataclasses

import pytest

from engine_factories import FAST, budget, gpu_node, job, snapshot
from scheduling.engine import schedule
from scheduling.model import OwnerBudget, ReasonCode


def alice(left: float, monthly: float = 10.0) -> OwnerBudget:
    return OwnerBudget(owner="alice", remaining_budget=left, monthly_budget=monthly)


@pytest.mark.parametrize("method", ["greedy", "milp", "auto"])
def test_two_jobs_of_one_user_cannot_both_spend_past_the_budget_in_one_cycle(method):
    """$1/GPU-h, 2 GPUs for an hour = $2 a job. Alice has $3 left: one of her two jobs, and Bob's."""
    pending = [job("a1", gpus=2, owner="alice", submitted_at=1), job("a2", gpus=2, owner="alice", submitted_at=2),
               job("b1", gpus=2, owner="bob", submitted_at=3)]
    snap = snapshot([gpu_node("n", price=1.0)], pending, tenants=[budget(owners=(alice(3.0),))])
    plan = schedule(snap, dataclasses.replace(FAST, method=method))
    placed = {p.job_id for p in plan.placements}
    assert placed == {"a1", "b1"}, (method, placed, plan.pending)
    reason = plan.pending["a2"]
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert "budget: user alice of acme has $1.00 left of $10.00 this month" in reason.message
    assert "cheapest fit costs $2.00" in reason.message
    assert reason.data["user"] == "alice" and reason.data["user_budget_left"] == pytest.approx(1.0)


def test_a_spent_budget_holds_back_what_costs_and_names_the_numbers():
    snap = snapshot([gpu_node("n", price=1.0)], [job("j", gpus=2, owner="alice")],
                    tenants=[budget(remaining_budget=500.0, owners=(alice(0.0, monthly=100.0),))])
    plan = schedule(snap, FAST)
    assert not plan.placements
    reason = plan.pending["j"]
    assert reason.code == ReasonCode.BUDGET_EXCEEDED
    assert "user alice of acme has $0.00 left of $100.00 this month, cheapest fit costs $2.00" in reason.message
    assert "or user alice's" in reason.message  # the filter's count names the user too


def test_capacity_that_spends_nothing_still_takes_the_job_and_other_owners_are_free():
    """The rule of the team budget: only a placement that would spend is held back."""
    free = snapshot([gpu_node("n", price=0.0)], [job("j", gpus=2, owner="alice")],
                    tenants=[budget(owners=(alice(0.0),))])
    assert {p.job_id for p in schedule(free, FAST).placements} == {"j"}
    others = snapshot([gpu_node("n", price=1.0)], [job("j", gpus=2, owner="carol"), job("k", gpus=2)],
                      tenants=[budget(owners=(alice(0.0),))])
    assert {p.job_id for p in schedule(others, FAST).placements} == {"j", "k"}
