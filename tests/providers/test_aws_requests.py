"""AWS provider: the ClientToken it sends and what `describe` reports (moto in server mode, and a
stubbed EC2 for answers moto never gives)."""
from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from providers.aws import AwsProvider, client_token
from providers.base import TAG_BROKER, TAG_REQUEST, InstanceInfo, InstanceRef, InstanceState, derive_request_key
from tests.providers.conftest import make_request

REGION = "us-east-1"


@pytest.fixture
def aws(moto_endpoint: str, moto_ami: str, broker_id: str) -> AwsProvider:
    return AwsProvider(broker_id=broker_id, regions=[REGION], endpoint_url=moto_endpoint, image_ids={REGION: moto_ami})


def test_client_token_is_the_request_key_the_broker_stores_for_aws() -> None:
    token = client_token(allocation_id="alloc-42", attempt=3, instance_type="p5.48xlarge", zone="us-east-1a")
    assert token == derive_request_key(allocation_id="alloc-42", attempt=3, provider="aws",
                                       instance_type="p5.48xlarge", zone="us-east-1a")


def test_describe_reports_a_live_instance(aws: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    request = make_request(provider="aws", instance_type="g5.xlarge", zone="us-east-1a", region=REGION)
    launched = aws.provision(request)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")  # the ref's region decides, not the environment
    info = aws.describe(launched.ref)
    assert info.ref == launched.ref
    assert info.state is InstanceState.RUNNING
    assert (info.instance_type, info.request_key, info.tag(TAG_BROKER), info.tag(TAG_REQUEST)) == (
        "g5.xlarge", request.request_key, aws.broker_id, request.request_key)


def test_describe_of_an_id_ec2_does_not_know_confirms_it_gone(aws: AwsProvider) -> None:
    missing = InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0123456789abcdef0")
    assert aws.describe(missing) == InstanceInfo(ref=missing, state=InstanceState.TERMINATED, state_reason="not-found")


def test_describe_answered_with_no_reservation_confirms_it_gone() -> None:
    client = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_response("describe_instances", {"Reservations": []}, {"InstanceIds": ["i-0aaaaaaaaaaaaaaaa"]})
    ref = InstanceRef(provider="aws", region=REGION, zone="us-east-1b", instance_id="i-0aaaaaaaaaaaaaaaa")
    with stub:
        info = AwsProvider(broker_id="b", regions=[REGION], client_factory=lambda region: client).describe(ref)
    assert info == InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
    stub.assert_no_pending_responses()
