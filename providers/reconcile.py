"""The reconciler: make the providers' view and the broker's records agree, without ever losing
money to a leak or a record to a guess (Karpenter's garbage collection is the model).

For each provider: list everything carrying our tag; adopt instances that match a record by
request key (the launch succeeded but its answer was never stored); terminate instances no record
knows once they are older than a grace period (leaks, duplicates); confirm records of instances
the provider says are gone. Nothing is reported terminated unless the provider says so.

Pure logic: the broker hands in its records as plain `KnownInstance`s and a clock, and applies
the returned `ReconcileReport` itself (a periodic task in a later issue).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Mapping, Sequence

from providers.base import InstanceInfo, InstanceRef, InstanceState, Provider, ProviderError

log = logging.getLogger(__name__)

DEFAULT_ORPHAN_GRACE = timedelta(minutes=10)


@dataclass(frozen=True)
class KnownInstance:
    """One broker record of a launch. `request_key` is written before the provider is called;
    `provider_instance_id` once the provider answered ("" until then)."""

    provider: str
    request_key: str
    provider_instance_id: str = ""
    region: str = ""
    zone: str = ""
    recorded_at: datetime | None = None
    terminating: bool = False  # the broker asked for termination and waits for confirmation

    def ref(self) -> InstanceRef:
        return InstanceRef(provider=self.provider, region=self.region, zone=self.zone,
                           instance_id=self.provider_instance_id)


@dataclass(frozen=True)
class Adoption:
    record: KnownInstance
    instance: InstanceInfo  # store instance.ref.instance_id on the record


@dataclass(frozen=True)
class GoneConfirmation:
    record: KnownInstance
    instance: InstanceInfo  # the provider's answer: state TERMINATED (or not found)


@dataclass
class ReconcileReport:
    adopted: list[Adoption] = field(default_factory=list)
    matched: list[InstanceInfo] = field(default_factory=list)
    # Orphans (no record) older than the grace period: termination requested, with the state
    # the provider answered. They count as gone only when a later listing says TERMINATED.
    orphans_terminating: list[InstanceInfo] = field(default_factory=list)
    orphans_in_grace: list[InstanceInfo] = field(default_factory=list)
    terminated_confirmed: list[GoneConfirmation] = field(default_factory=list)  # records we were terminating
    lost: list[GoneConfirmation] = field(default_factory=list)  # records gone without our asking (spot, failure)
    termination_retried: list[InstanceInfo] = field(default_factory=list)
    # Recorded, not asked to terminate, but shutting down (e.g. a spot interruption under way):
    # not gone yet, so not `lost`; the broker may start moving the work now.
    going_away: list[InstanceInfo] = field(default_factory=list)
    launches_not_found: list[KnownInstance] = field(default_factory=list)  # no id, no tagged instance, past grace
    unconfirmed: list[KnownInstance] = field(default_factory=list)  # not listed, but not confirmed gone either
    errors: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.adopted or self.orphans_terminating or self.orphans_in_grace or self.lost
                    or self.going_away or self.launches_not_found or self.errors)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _age(instance: InstanceInfo, now: datetime) -> timedelta | None:
    launched = instance.launched_at
    if launched is None:
        return None
    if launched.tzinfo is None:
        launched = launched.replace(tzinfo=timezone.utc)
    return now - launched


def reconcile(
    providers: Mapping[str, Provider],
    known: Sequence[KnownInstance],
    *,
    orphan_grace: timedelta = DEFAULT_ORPHAN_GRACE,
    clock: Callable[[], datetime] = _utcnow,
    dry_run: bool = False,
) -> ReconcileReport:
    """Reconcile every provider in `providers` (kind -> Provider) against `known` records.
    A provider whose listing fails is skipped entirely: acting on a partial view could delete
    an instance that is simply missing from an error page."""
    report = ReconcileReport()
    now = clock()
    for kind, provider in sorted(providers.items()):
        records = [r for r in known if r.provider == kind]
        try:
            owned = provider.list_owned()
        except ProviderError as exc:
            report.errors.append(f"{kind}: list_owned failed: {exc}")
            continue
        _reconcile_provider(provider, records, owned, now, orphan_grace, dry_run, report)
    return report


def _reconcile_provider(
    provider: Provider,
    records: Sequence[KnownInstance],
    owned: Sequence[InstanceInfo],
    now: datetime,
    grace: timedelta,
    dry_run: bool,
    report: ReconcileReport,
) -> None:
    by_id = {r.provider_instance_id: r for r in records if r.provider_instance_id}
    waiting_by_key = {r.request_key: r for r in records if not r.provider_instance_id}
    accounted: set[int] = set()  # id() of records the listing accounted for

    for instance in owned:
        record = by_id.get(instance.ref.instance_id)
        if record is None and instance.request_key in waiting_by_key:
            record = waiting_by_key.pop(instance.request_key)
            if instance.state is not InstanceState.TERMINATED:
                report.adopted.append(Adoption(record, instance))
                accounted.add(id(record))
                continue
        if record is not None:
            accounted.add(id(record))
            _check_recorded(provider, record, instance, dry_run, report)
            continue
        # No record knows this instance: a leak, or a duplicate of a recorded launch.
        if instance.state is InstanceState.TERMINATED:
            continue  # already gone: nothing to pay for
        if instance.state is InstanceState.TERMINATING:
            report.orphans_terminating.append(instance)
            continue
        age = _age(instance, now)
        if age is None or age < grace:
            report.orphans_in_grace.append(instance)
            continue
        report.orphans_terminating.append(instance if dry_run else _terminate(provider, instance.ref, report))

    for record in records:
        if id(record) in accounted:
            continue
        if not record.provider_instance_id:
            if record.recorded_at is not None and now - record.recorded_at >= grace:
                report.launches_not_found.append(record)
            continue
        # Recorded but not listed: ask for this one instance before believing it is gone.
        try:
            info = provider.describe(record.ref())
        except ProviderError as exc:
            report.errors.append(f"{provider.kind}: describe {record.provider_instance_id} failed: {exc}")
            continue
        if info.state is InstanceState.TERMINATED:
            _confirm_gone(record, info, report)
        else:
            _check_recorded(provider, record, info, dry_run, report)


def _check_recorded(provider: Provider, record: KnownInstance, instance: InstanceInfo, dry_run: bool,
                    report: ReconcileReport) -> None:
    if instance.state is InstanceState.TERMINATED:
        _confirm_gone(record, instance, report)
    elif record.terminating and instance.state is not InstanceState.TERMINATING:
        # We asked for termination but it still runs (request lost, or stopped instead).
        report.termination_retried.append(instance if dry_run else _terminate(provider, instance.ref, report))
    elif record.terminating:
        report.unconfirmed.append(record)
    elif instance.state is InstanceState.TERMINATING:
        report.going_away.append(instance)
    else:
        report.matched.append(instance)


def _confirm_gone(record: KnownInstance, instance: InstanceInfo, report: ReconcileReport) -> None:
    target = report.terminated_confirmed if record.terminating else report.lost
    target.append(GoneConfirmation(record, instance))


def _terminate(provider: Provider, ref: InstanceRef, report: ReconcileReport) -> InstanceInfo:
    try:
        result = provider.terminate(ref)
    except ProviderError as exc:
        report.errors.append(f"{provider.kind}: terminate {ref.instance_id} failed: {exc}")
        return InstanceInfo(ref=ref, state=InstanceState.UNKNOWN, state_reason="terminate-failed")
    log.warning("reconcile: terminated orphan %s %s (state now %s)", provider.kind, ref.instance_id, result.state.value)
    return result
