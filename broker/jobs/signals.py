"""Signals of the jobs app for other apps (billing fixes prices) without a dependency back on them."""
from __future__ import annotations

from django.dispatch import Signal

# Sent inside the transaction that inserted allocations in bulk (broker/jobs/batch.py), after their
# slots, with `allocations` (saved, each with its `node` loaded) and `gpu_models` (allocation id -> the
# model name of its first GPU). Bulk inserts send no post_save. A receiver's writes commit or roll back
# with the placements; a receiver must not raise.
allocations_placed = Signal()
