"""Reconciler rules on an in-memory provider: the cases a real cloud makes hard to stage."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from providers.base import InstanceInfo, InstanceRef, InstanceState, Offer, Provider, ProvisionRequest
from providers.reconcile import KnownInstance, reconcile

NOW = datetime(2026, 11, 29, 18, 0, tzinfo=timezone.utc)
GRACE = timedelta(minutes=10)


class MemoryProvider(Provider):
    kind = "mem"

    def __init__(self, instances: list[InstanceInfo]) -> None:
        super().__init__(broker_id="b")
        self.instances = {i.ref.instance_id: i for i in instances}
        self.terminate_calls: list[str] = []

    def list_offers(self) -> list[Offer]:
        return []

    def provision(self, request: ProvisionRequest) -> InstanceInfo:
        raise NotImplementedError

    def describe(self, ref: InstanceRef) -> InstanceInfo:
        return self.instances.get(ref.instance_id) or InstanceInfo(ref=ref, state=InstanceState.TERMINATED)

    def terminate(self, ref: InstanceRef) -> InstanceInfo:
        self.terminate_calls.append(ref.instance_id)
        return InstanceInfo(ref=ref, state=InstanceState.TERMINATING)

    def list_owned(self) -> list[InstanceInfo]:
        return list(self.instances.values())


def instance(instance_id: str, state: InstanceState, *, age_min: float = 60, key: str = "") -> InstanceInfo:
    return InstanceInfo(ref=InstanceRef(provider="mem", region="r", zone="z", instance_id=instance_id), state=state,
                        request_key=key, launched_at=NOW - timedelta(minutes=age_min))


def test_each_case_lands_in_its_bucket() -> None:
    provider = MemoryProvider([
        instance("i-shutting-orphan", InstanceState.TERMINATING),
        instance("i-dead-orphan", InstanceState.TERMINATED),
        instance("i-stopped-orphan", InstanceState.STOPPED),
        instance("i-young-orphan", InstanceState.RUNNING, age_min=2),
        instance("i-interrupted", InstanceState.TERMINATING, key="k-int"),
        instance("i-fine", InstanceState.RUNNING, key="k-fine"),
        instance("i-adopt", InstanceState.PENDING, key="k-adopt", age_min=1),
    ])
    known = [
        KnownInstance(provider="mem", request_key="k-int", provider_instance_id="i-interrupted"),
        KnownInstance(provider="mem", request_key="k-fine", provider_instance_id="i-fine"),
        KnownInstance(provider="mem", request_key="k-adopt", recorded_at=NOW - timedelta(minutes=1)),
        KnownInstance(provider="mem", request_key="k-never", recorded_at=NOW - timedelta(hours=1)),
        KnownInstance(provider="mem", request_key="k-soon", recorded_at=NOW - timedelta(minutes=1)),
        KnownInstance(provider="mem", request_key="k-gone", provider_instance_id="i-gone", terminating=True),
        KnownInstance(provider="other", request_key="k-x", provider_instance_id="i-x"),  # provider not given
    ]
    report = reconcile({"mem": provider}, known, orphan_grace=GRACE, clock=lambda: NOW)

    assert provider.terminate_calls == ["i-stopped-orphan"]  # shutting-down ones are not hit again
    assert [i.ref.instance_id for i in report.orphans_terminating] == ["i-shutting-orphan", "i-stopped-orphan"]
    assert [i.ref.instance_id for i in report.orphans_in_grace] == ["i-young-orphan"]
    assert [i.ref.instance_id for i in report.going_away] == ["i-interrupted"]
    assert [i.ref.instance_id for i in report.matched] == ["i-fine"]
    assert [a.instance.ref.instance_id for a in report.adopted] == ["i-adopt"]
    assert [r.request_key for r in report.launches_not_found] == ["k-never"]
    assert [c.record.request_key for c in report.terminated_confirmed] == ["k-gone"]
    assert not report.lost and not report.errors and not report.clean


def test_nothing_to_do_is_clean() -> None:
    provider = MemoryProvider([instance("i-1", InstanceState.RUNNING, key="k1")])
    report = reconcile({"mem": provider}, [KnownInstance(provider="mem", request_key="k1", provider_instance_id="i-1")],
                       orphan_grace=GRACE, clock=lambda: NOW)
    assert report.clean and provider.terminate_calls == []
