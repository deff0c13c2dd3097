"""jobs.0010: slot rows (one per GPU slot) become one row per (allocation, GPU) with a slot mask, and back."""
from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from broker.jobs.models import AllocationSlice
from broker.jobs.services import GpuRequest, allocation_commit, job_cancel

from .test_api_tenancy import submit

BEFORE = [("jobs", "0009_single_column_indexes_dropped")]
AFTER = [("jobs", "0010_slice_masks")]


def _migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def _rows() -> list[tuple[int, int, int, int, bool]]:
    return sorted(AllocationSlice.objects.values_list("allocation_id", "gpu_id", "mask", "slots", "active"))


@pytest.mark.django_db(transaction=True)
def test_slot_rows_merge_into_masks_and_split_back(acme):
    node = acme.nodes[0]
    whole, half, gone = submit(acme, name="whole"), submit(acme, name="half"), submit(acme, name="gone")
    allocation_commit(job=whole, requests=[GpuRequest(node=node, gpu_indices=(0, 1))])
    allocation_commit(job=half, requests=[GpuRequest(node=node, gpu_indices=(2,), milli=500)])
    allocation_commit(job=gone, requests=[GpuRequest(node=node, gpu_indices=(2,), milli=300)])
    job_cancel(job=gone)  # released: history rows, inactive
    before = _rows()
    assert [(mask, slots, active) for *_, mask, slots, active in before] == [
        (1023, 10, True), (1023, 10, True), (0b11111, 5, True), (0b11100000, 3, False)]
    try:
        _migrate(BEFORE)
        with connection.cursor() as cursor:
            cursor.execute("SELECT allocation_id, gpu_id, slot, active FROM jobs_allocationslice")
            split = sorted(cursor.fetchall())
        assert len(split) == 10 + 10 + 5 + 3, "one row per slot again"
        with connection.cursor() as cursor:  # a slot row written before the change, as the old code did
            cursor.execute("INSERT INTO jobs_allocationslice (allocation_id, gpu_id, slot, active) "
                           "VALUES (%s, %s, 9, %s)", [before[2][0], before[2][1], True])
    finally:
        _migrate(AFTER)
    after = _rows()
    assert after[:2] == before[:2] and after[3] == before[3]
    assert after[2] == (*before[2][:2], 0b1000011111, 6, True), "the old row joined its allocation's mask"
