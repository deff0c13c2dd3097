"""The reconciler against moto: leaks are terminated, foreign instances kept, lost records adopted."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from providers.aws import AwsProvider
from providers.base import TAG_BROKER, TAG_REQUEST, ErrorKind, InstanceState, ProviderError
from providers.reconcile import KnownInstance, reconcile
from tests.providers.conftest import make_request

REGION = "us-east-1"
GRACE = timedelta(minutes=10)


def later(minutes: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(minutes=minutes)


@pytest.fixture
def aws(moto_endpoint: str, moto_ami: str, broker_id: str) -> AwsProvider:
    return AwsProvider(broker_id=broker_id, regions=[REGION], endpoint_url=moto_endpoint, image_ids={REGION: moto_ami})


def state_of(endpoint: str, instance_id: str) -> str:
    client = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)
    return client.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]


def plant(endpoint: str, ami: str, tags: dict[str, str]) -> str:
    """An instance started behind the broker's back (a leak: its record was never written)."""
    client = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)
    spec: dict[str, Any] = {"ImageId": ami, "InstanceType": "p4d.24xlarge", "MinCount": 1, "MaxCount": 1}
    if tags:
        spec["TagSpecifications"] = [{"ResourceType": "instance",
                                      "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
    return client.run_instances(**spec)["Instances"][0]["InstanceId"]


def test_orphan_terminated_foreign_kept_lost_record_adopted(aws: AwsProvider, moto_endpoint: str,
                                                           moto_ami: str) -> None:
    orphan = plant(moto_endpoint, moto_ami, {TAG_BROKER: aws.broker_id, TAG_REQUEST: "wz-nobody-knows-me"})
    foreign = plant(moto_endpoint, moto_ami, {})
    other_broker = plant(moto_endpoint, moto_ami, {TAG_BROKER: "another-broker"})
    recorded = aws.provision(make_request(provider="aws", instance_type="g5.xlarge", zone="us-east-1a", region=REGION))
    # Launched, but the worker died before storing the instance id: only the key was stored.
    request = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1b", region=REGION,
                           allocation_id="alloc-lost")
    lost_record_instance = aws.provision(request)
    known = [
        KnownInstance(provider="aws", request_key=recorded.request_key, provider_instance_id=recorded.ref.instance_id,
                      region=REGION, zone=recorded.ref.zone),
        KnownInstance(provider="aws", request_key=request.request_key, region=REGION, zone="us-east-1b",
                      recorded_at=datetime.now(timezone.utc)),
    ]

    report = reconcile({"aws": aws}, known, orphan_grace=GRACE, clock=lambda: later(60))

    assert [i.ref.instance_id for i in report.orphans_terminating] == [orphan]
    assert state_of(moto_endpoint, orphan) in ("shutting-down", "terminated")
    assert state_of(moto_endpoint, foreign) in ("pending", "running")
    assert state_of(moto_endpoint, other_broker) in ("pending", "running")
    assert [(a.record.request_key, a.instance.ref.instance_id) for a in report.adopted] == [
        (request.request_key, lost_record_instance.ref.instance_id)]
    assert state_of(moto_endpoint, lost_record_instance.ref.instance_id) in ("pending", "running")
    assert [i.ref.instance_id for i in report.matched] == [recorded.ref.instance_id]
    assert not report.errors and not report.lost


def test_orphan_within_grace_is_left_alone_and_dry_run_changes_nothing(aws: AwsProvider, moto_endpoint: str,
                                                                       moto_ami: str) -> None:
    orphan = plant(moto_endpoint, moto_ami, {TAG_BROKER: aws.broker_id})
    young = reconcile({"aws": aws}, [], orphan_grace=GRACE, clock=lambda: later(1))
    assert [i.ref.instance_id for i in young.orphans_in_grace] == [orphan] and not young.orphans_terminating
    dry = reconcile({"aws": aws}, [], orphan_grace=GRACE, clock=lambda: later(60), dry_run=True)
    assert [i.ref.instance_id for i in dry.orphans_terminating] == [orphan]
    assert state_of(moto_endpoint, orphan) in ("pending", "running")


def test_duplicate_launch_for_a_recorded_key_is_an_orphan(aws: AwsProvider, moto_endpoint: str, moto_ami: str) -> None:
    request = make_request(provider="aws", instance_type="g5.xlarge", zone="us-east-1a", region=REGION)
    kept = aws.provision(request)
    duplicate = plant(moto_endpoint, moto_ami, {TAG_BROKER: aws.broker_id, TAG_REQUEST: request.request_key})
    known = [KnownInstance(provider="aws", request_key=request.request_key, provider_instance_id=kept.ref.instance_id,
                           region=REGION)]
    report = reconcile({"aws": aws}, known, orphan_grace=GRACE, clock=lambda: later(60))
    assert [i.ref.instance_id for i in report.orphans_terminating] == [duplicate]
    assert state_of(moto_endpoint, kept.ref.instance_id) in ("pending", "running")


def test_termination_reported_only_when_confirmed(aws: AwsProvider, moto_endpoint: str) -> None:
    info = aws.provision(make_request(provider="aws", instance_type="g6.xlarge", zone="us-east-1a", region=REGION))
    record = KnownInstance(provider="aws", request_key=info.request_key, provider_instance_id=info.ref.instance_id,
                           region=REGION, terminating=True)
    # Asked to terminate, but the instance still runs: not confirmed; the reconciler asks again.
    first = reconcile({"aws": aws}, [record], orphan_grace=GRACE, clock=lambda: later(60))
    assert not first.terminated_confirmed
    assert [i.ref.instance_id for i in first.termination_retried] == [info.ref.instance_id]
    # Now EC2 says terminated: confirmed.
    second = reconcile({"aws": aws}, [record], orphan_grace=GRACE, clock=lambda: later(61))
    assert [c.record.provider_instance_id for c in second.terminated_confirmed] == [info.ref.instance_id]
    assert second.terminated_confirmed[0].instance.state is InstanceState.TERMINATED


def test_instance_gone_without_our_asking_is_reported_lost(aws: AwsProvider, moto_endpoint: str) -> None:
    info = aws.provision(make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION,
                                      spot=True))
    boto3.client("ec2", region_name=REGION, endpoint_url=moto_endpoint).terminate_instances(
        InstanceIds=[info.ref.instance_id])  # e.g. a spot interruption
    record = KnownInstance(provider="aws", request_key=info.request_key, provider_instance_id=info.ref.instance_id,
                           region=REGION)
    report = reconcile({"aws": aws}, [record], orphan_grace=GRACE, clock=lambda: later(60))
    assert [c.record.provider_instance_id for c in report.lost] == [info.ref.instance_id]
    assert not report.matched


class _BrokenListing(AwsProvider):
    def list_owned(self):  # type: ignore[override]
        raise ProviderError(ErrorKind.TRANSIENT, "simulated outage", provider="aws")


def test_failed_listing_terminates_nothing(moto_endpoint: str, moto_ami: str, broker_id: str) -> None:
    provider = _BrokenListing(broker_id=broker_id, regions=[REGION], endpoint_url=moto_endpoint,
                              image_ids={REGION: moto_ami})
    orphan = plant(moto_endpoint, moto_ami, {TAG_BROKER: broker_id})
    report = reconcile({"aws": provider}, [], orphan_grace=GRACE, clock=lambda: later(60))
    assert report.errors and not report.orphans_terminating
    assert state_of(moto_endpoint, orphan) in ("pending", "running")
