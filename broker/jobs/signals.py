"""Signals of the jobs app for other apps (billing fixes prices) without a dependency back on them."""
from __future__ import annotations

from django.dispatch import Signal

# Sent after the transaction that created allocations in bulk commits (broker/jobs/batch.py), with
# `allocation_ids`: bulk inserts send no post_save.
allocations_committed = Signal()
