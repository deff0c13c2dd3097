"""Metering is safe to run twice at once, and beside a month close: no second lost, none doubled.

PostgreSQL only (DATABASE_URL=postgres://postgres@127.0.0.1:5432/wz_billing_test): there the runs really
race, and the unique record keys, the one-to-one price rows and the team-month row lock decide. (The test
SQLite database is in memory, shared by threads only through its table locks.) On SQLite, the week test
meters the same week repeatedly and checks nothing changes.
"""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.db import close_old_connections, connection

from broker.billing.models import AllocationMeter, BillingMonth, UsageRecord
from broker.billing.services import meter, month_close, rebuild
from broker.jobs.models import Allocation, Job
from broker.jobs.services import GpuRequest, allocation_commit, job_transition
from broker.jobs.states import JobState

from .conftest import requires_postgres
from .test_api_tenancy import submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, requires_postgres]
START = datetime(2026, 10, 28, 6, 0, tzinfo=dt_timezone.utc)  # Wed: runs into November


def _jobs(world, count: int) -> list[Job]:
    pool = world.pool
    pool.gpu_hour_rate_usd = Decimal("1.25")
    pool.save()
    jobs = []
    for i in range(count):
        job = submit(world, name=f"c{i}", resources={"gpus": 1})
        allocation_commit(job=job, requests=[GpuRequest(node=world.nodes[i // 8], gpu_indices=(i % 8,))])
        jobs.append(job)
    # Held from START for 1..count days plus i minutes; half released, half still held.
    for i, job in enumerate(jobs):
        alloc = Allocation.objects.get(job=job)
        begin = START + timedelta(minutes=7 * i)
        Allocation.objects.filter(pk=alloc.pk).update(created_at=begin)
        if i % 2 == 0:
            job_transition(job=job, to=JobState.CANCELLED)
            Allocation.objects.filter(pk=alloc.pk).update(released_at=begin + timedelta(days=1 + i % 5, seconds=13 * i))
    return jobs


def _at_once(*calls) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls))

    def body(call):
        try:
            barrier.wait()
            call()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            close_old_connections()
            connection.close()

    threads = [threading.Thread(target=body, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def _expected_total(now: datetime) -> Decimal:
    report = rebuild(check_only=True, now=now)
    assert report.agrees, (report.missing[:3], report.differing[:3], report.extra[:3])
    return sum(UsageRecord.objects.values_list("amount_usd", flat=True), Decimal("0"))


def test_two_metering_runs_at_once_write_each_record_once(acme):
    _jobs(acme, 12)
    now = datetime(2026, 11, 9, 12, 0, tzinfo=dt_timezone.utc)
    errors = _at_once(lambda: meter(now=now), lambda: meter(now=now), lambda: meter(now=now))
    assert not errors, errors
    assert AllocationMeter.objects.count() == 12
    keys = list(UsageRecord.objects.values_list("key", flat=True))
    assert len(keys) == len(set(keys)) and keys
    # Every final second is there once: the stored records are exactly what a rebuild computes.
    report = rebuild(check_only=True, now=now)
    assert report.agrees and not report.missing


def test_metering_beside_a_month_close_loses_and_doubles_nothing(acme):
    _jobs(acme, 12)
    now = datetime(2026, 11, 9, 12, 0, tzinfo=dt_timezone.utc)
    errors = _at_once(lambda: meter(now=now), lambda: month_close(tenant=acme.tenant, month="2026-10", now=now),
                      lambda: meter(now=now))
    assert not errors, errors
    row = BillingMonth.objects.get(tenant=acme.tenant, month="2026-10")
    october = UsageRecord.objects.filter(tenant=acme.tenant, month="2026-10")
    assert row.closed_at is not None
    assert Decimal(row.statement["totals"]["total_usd"]) == sum(october.values_list("amount_usd", flat=True))
    # October's held seconds, computed independently: each allocation from its start to the earlier of
    # its release and November 1st.
    nov1 = datetime(2026, 11, 1, tzinfo=dt_timezone.utc)
    expected_seconds = 0
    for alloc in Allocation.objects.filter(job__tenant=acme.tenant):
        end = min(alloc.released_at or now, nov1)
        expected_seconds += max(0, int(end.timestamp()) - int(alloc.created_at.timestamp()))
    assert sum(october.values_list("seconds", flat=True)) == expected_seconds
    # Metering again after the close writes nothing into October and everything else once.
    meter(now=now)
    assert UsageRecord.objects.filter(month="2026-10").count() == october.count()
    _expected_total(now)


def test_the_price_is_fixed_when_the_allocation_commits(acme):
    """Outside a test transaction, on_commit runs: the price is the pool's at commit, whatever comes later."""
    pool = acme.pool
    pool.gpu_hour_rate_usd = Decimal("3.10")
    pool.save()
    job = submit(acme, resources={"gpus": 1})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    pool.gpu_hour_rate_usd = Decimal("8.00")
    pool.save()
    alloc = Allocation.objects.get(job=job)
    assert AllocationMeter.objects.get(allocation=alloc).rate_usd_per_gpu_hour == Decimal("3.100000")


def test_a_bulk_placement_fixes_each_price_in_its_own_transaction(acme):
    """The set-based commit of a cycle (broker/jobs/batch.py) sends no post_save: its meters go in with
    its placements, at the pool's price of that moment."""
    from broker.jobs.batch import placements_commit

    pool = acme.pool
    pool.gpu_hour_rate_usd = Decimal("1.75")
    pool.save()
    jobs = [submit(acme, resources={"gpus": 1}) for _ in range(2)]
    result = placements_commit(items=[(job, [GpuRequest(node=acme.nodes[0], gpu_indices=(i,))])
                                      for i, job in enumerate(jobs)])
    assert sorted(result.placed) == sorted(j.pk for j in jobs)
    pool.gpu_hour_rate_usd = Decimal("8.00")
    pool.save()
    meters = AllocationMeter.objects.filter(allocation__job__in=jobs)
    assert sorted(m.rate_usd_per_gpu_hour for m in meters) == [Decimal("1.750000")] * 2
    assert all(m.rate_source == "pool" for m in meters)
