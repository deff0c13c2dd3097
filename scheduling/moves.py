"""The rules for moving running jobs, in one place for the broker and the simulator.

The broker (broker.scheduler.services) and the cost week's simulator (scheduling.sim.engine_policy)
both build their engine policy with :func:`move_policy` and decide whether a cycle runs with
:func:`cycle_wanted`, so the figures `bench.cost` prints come from the rules the broker applies:

- a job is preempted only after `min_run_before_preempt_s` of running, and moved (defragmentation or
  consolidation) only after `min_run_before_move_s` since it (re)started, so no job moves twice
  within that interval;
- at most `max_moves_per_cycle` moves per cycle, defragmentation and consolidation together;
- with nothing pending, a cycle still runs to consolidate when some job runs on rented capacity, but
  at most every `consolidation_interval_s` (a pending job runs a cycle at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.model import Policy


@dataclass(frozen=True)
class MoveRules:
    min_run_before_preempt_s: float = 600.0
    min_run_before_move_s: float = 600.0
    max_moves_per_cycle: int = 4
    consolidation_interval_s: float = 60.0


def move_policy(rules: MoveRules, *, time_limit_s: float = 2.0) -> Policy:
    """The engine policy that applies `rules`: preemption, defragmentation and consolidation on."""
    return Policy(preemption=True, defragmentation=True, consolidation=True, time_limit_s=time_limit_s,
                  min_run_before_preempt_s=rules.min_run_before_preempt_s,
                  min_run_before_move_s=rules.min_run_before_move_s,
                  max_moves_per_cycle=rules.max_moves_per_cycle,
                  max_consolidation_moves=rules.max_moves_per_cycle)


def cycle_wanted(*, pending: bool, running_on_rented: bool, seconds_since_last_cycle: float | None,
                 rules: MoveRules, policy: Policy) -> bool:
    """Whether a scheduling cycle should run now.

    `seconds_since_last_cycle`: None when no cycle has run yet.
    """
    if pending:
        return True
    if not (policy.consolidation and running_on_rented):
        return False
    return seconds_since_last_cycle is None or seconds_since_last_cycle >= rules.consolidation_interval_s
