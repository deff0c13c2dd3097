"""The move and cycle rules the broker and the cost week's simulator share (scheduling/moves.py)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduling.engine import schedule
from scheduling.moves import MoveRules, cycle_wanted, move_policy
from scheduling.sim.engine_policy import EnginePolicy
from scheduling.sim.events import SimJob, SimNode, SimOffer, Simulator

RULES = MoveRules(min_run_before_preempt_s=30, min_run_before_move_s=45, max_moves_per_cycle=3,
                  consolidation_interval_s=60)


def test_the_policy_carries_the_rules_with_every_kind_of_move_on():
    policy = move_policy(RULES)
    assert (policy.preemption, policy.defragmentation, policy.consolidation) == (True, True, True)
    assert (policy.min_run_before_preempt_s, policy.min_run_before_move_s) == (30, 45)
    # One cap for every move of a cycle: consolidation may not add its own on top.
    assert policy.max_moves_per_cycle == policy.max_consolidation_moves == 3


@pytest.mark.parametrize("pending, rented, since, wanted", [
    (True, False, 0.0, True),      # a pending job: a cycle now
    (False, False, None, False),   # nothing pending, nothing on rented capacity: nothing to do
    (False, True, None, True),     # consolidation, never tried
    (False, True, 59.0, False),    # ... tried within the interval
    (False, True, 60.0, True),
])
def test_when_a_cycle_runs(pending, rented, since, wanted):
    assert cycle_wanted(pending=pending, running_on_rented=rented, seconds_since_last_cycle=since,
                        rules=RULES, policy=move_policy(RULES)) is wanted


def test_without_consolidation_a_cycle_runs_only_for_pending_jobs():
    off = dataclasses.replace(move_policy(RULES), consolidation=False)
    assert not cycle_wanted(pending=False, running_on_rented=True, seconds_since_last_cycle=None, rules=RULES,
                            policy=off)


def test_the_simulator_runs_the_engine_when_the_broker_would():
    """One long job: on on-prem, the engine is asked once (to place it); on a rented instance, again
    each consolidation interval while it runs, as the broker's sweep does."""
    calls: list[float] = []

    def counting(snapshot, policy):
        calls.append(snapshot.now)
        return schedule(snapshot, policy)

    def run(nodes, offers):
        calls.clear()
        sim = Simulator([SimJob("a", 0, 1, 3600)], nodes, offers, {"V100": 1.0, "A100": 2.0}, cycle_s=60.0,
                        boot_s=0.0)
        sim.run(EnginePolicy(policy=move_policy(RULES), rules=RULES, schedule=counting))
        return list(calls)

    assert run([SimNode("op", "V100", 2, 1.0)], []) == [60.0]
    rented = run([], [SimOffer("one", "gcp", "r", "z", "x1", "A100", 1, 3.0)])
    assert len(rented) > 10 and rented[0] == 60.0  # placed at 60 s, then consolidation cycles while it runs
