"""Signals of the jobs app for other apps (billing fixes prices) without a dependency back on them."""
from __future__ import annotations

from typing import NamedTuple

from django.dispatch import Signal


class PlacedAllocation(NamedTuple):
    """What a receiver of `allocations_placed` learns of one allocation inserted in bulk."""
    pk: int
    node_id: int
    pool_id: int
    gpu_model: str  # the model name of its first GPU ("" when unknown)


# Sent inside the transaction that inserted allocations in bulk (broker/jobs/batch.py), after their
# slots, with `allocations` (a list of PlacedAllocation). Bulk inserts send no post_save. A receiver's
# writes commit or roll back with the placements; a receiver must not raise.
allocations_placed = Signal()
