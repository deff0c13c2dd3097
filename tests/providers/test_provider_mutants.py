"""Cloud providers: behaviour pinned by the mutation triage of issue 9 (docs/mutation/providers.md).

Each test states what an operator or the broker would notice if the provider got it wrong; none
touches the internet (a stubbed EC2 through botocore's Stubber, a closed port on 127.0.0.1 for an
EC2 that cannot be reached)."""
from __future__ import annotations

import dataclasses
import socket
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from providers.aws import AwsProvider
from providers.base import TAG_BROKER, TAG_REQUEST, ErrorKind, InstanceRef, Offer, ProviderError
from tests.providers.conftest import make_request

REGION = "us-east-1"
AMI = "ami-0abc1234def567890"


def error_fields(exc: ProviderError) -> tuple:
    return exc.kind, exc.retry_elsewhere, exc.provider, exc.code, exc.message


def stubbed_ec2(region: str = REGION) -> tuple[Any, Stubber]:
    client = boto3.client("ec2", region_name=region, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.activate()
    return client, stub


def closed_port() -> int:
    """A local port nobody listens on: connecting is refused at once, like an EC2 endpoint that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def unreachable_aws() -> AwsProvider:
    session = boto3.session.Session(aws_access_key_id="AKIAWZTEST", aws_secret_access_key="secret")
    return AwsProvider(broker_id="wz-b", regions=[REGION], session=session, image_ids={REGION: AMI},
                       endpoint_url=f"http://127.0.0.1:{closed_port()}")


# -- EC2 that cannot be reached: transient, named after the failure, nothing launched ----------------
def test_a_launch_whose_key_lookup_cannot_reach_ec2_is_transient_and_names_why(unreachable_aws: AwsProvider) -> None:
    """The idempotency lookup runs before every launch; if EC2 cannot be reached the broker must get a
    TRANSIENT error (retry the same key later), named after the transport failure, not a crash or 'NoneType'."""
    request = make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION)
    with pytest.raises(ProviderError) as caught:
        unreachable_aws.provision(request)
    assert error_fields(caught.value) == (ErrorKind.TRANSIENT, False, "aws", "EndpointConnectionError",
                                          "EndpointConnectionError")


def test_describe_and_list_owned_of_an_unreachable_ec2_are_transient_not_gone(unreachable_aws: AwsProvider) -> None:
    """An unreachable EC2 must never read as 'instance confirmed gone' (the reconciler would drop the record)."""
    ref = InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0abc")
    for call in (lambda: unreachable_aws.describe(ref), unreachable_aws.list_owned):
        with pytest.raises(ProviderError) as caught:
            call()
        assert (caught.value.kind, caught.value.code) == (ErrorKind.TRANSIENT, "EndpointConnectionError")


def test_terminate_of_an_unreachable_ec2_is_transient_and_names_why(unreachable_aws: AwsProvider) -> None:
    """terminate goes through `_call`: a transport failure there must also be TRANSIENT and named."""
    ref = InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0abc")
    with pytest.raises(ProviderError) as caught:
        unreachable_aws.terminate(ref)
    assert error_fields(caught.value) == (ErrorKind.TRANSIENT, False, "aws", "EndpointConnectionError",
                                          "EndpointConnectionError")


# -- GPU facts from describe_instance_types ---------------------------------------------------------
def catalog_offer(**facts: Any) -> Offer:
    base = Offer(provider="aws", region=REGION, zone="use1-az1", instance_type="g5.48xlarge", gpu_model="A10G",
                 gpu_count=8, gpu_memory_mib=24576, vcpus=192, memory_gib=768.0, on_demand_per_hour=16.288)
    return dataclasses.replace(base, **facts)


def test_a_gpu_entry_without_count_or_memory_keeps_the_catalog_figures() -> None:
    """EC2 naming the GPU but not its count or memory says nothing about them: the catalog's 8 GPUs
    of 24 GiB stay (not 1 GPU of 1 MiB)."""
    offer = catalog_offer()
    facts = {"GpuInfo": {"Gpus": [{"Name": "A10G", "Manufacturer": "NVIDIA"}]}}
    assert AwsProvider._with_facts(offer, facts) == offer


def test_memory_ec2_does_not_report_keeps_the_catalog_memory_exactly() -> None:
    """Without MemoryInfo the catalog's memory is kept to the tenth of a GiB (768.0, not 768.8)."""
    offer = catalog_offer()
    facts = {"GpuInfo": {"Gpus": [{"Name": "A10G", "Count": 8, "MemoryInfo": {"SizeInMiB": 24576}}]},
             "VCpuInfo": {"DefaultVCpus": 192}}
    assert AwsProvider._with_facts(offer, facts) == offer


# -- launch idempotency: the lookup before every launch ----------------------------------------------
def test_a_retried_launch_looks_for_instances_carrying_both_our_broker_and_the_request_key() -> None:
    """Before launching, the provider asks EC2 for instances tagged with this broker AND this request
    key, nothing wider (another broker's or another request's instance must never be adopted) and
    nothing narrower; what EC2 answers comes back as records of that region."""
    client, stub = stubbed_ec2()
    key = "wz-aws-retried-key"
    found = {"InstanceId": "i-0live", "InstanceType": "g5.xlarge", "State": {"Name": "running"},
             "Placement": {"AvailabilityZone": "us-east-1b"},
             "Tags": [{"Key": TAG_BROKER, "Value": "wz-b"}, {"Key": TAG_REQUEST, "Value": key}]}
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [found]}]},
                      {"Filters": [{"Name": f"tag:{TAG_BROKER}", "Values": ["wz-b"]},
                                   {"Name": f"tag:{TAG_REQUEST}", "Values": [key]}]})
    aws = AwsProvider(broker_id="wz-b", regions=[REGION], client_factory={REGION: client}.__getitem__)
    records = aws.find_by_request_key(REGION, key)
    assert [(r.ref.region, r.ref.zone, r.ref.instance_id, r.request_key) for r in records] == [
        (REGION, "us-east-1b", "i-0live", key)]
    stub.assert_no_pending_responses()


def test_a_retried_launch_whose_key_ec2_already_knows_launches_nothing_new() -> None:
    """provision with a key EC2 already has an instance for returns that instance and never calls
    run_instances (the Stubber would refuse an unexpected call)."""
    client, stub = stubbed_ec2()
    request = make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION)
    found = {"InstanceId": "i-0first", "InstanceType": "g5.xlarge", "State": {"Name": "pending"},
             "Tags": [{"Key": TAG_BROKER, "Value": "wz-b"}, {"Key": TAG_REQUEST, "Value": request.request_key}]}
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [found]}]},
                      {"Filters": [{"Name": f"tag:{TAG_BROKER}", "Values": ["wz-b"]},
                                   {"Name": f"tag:{TAG_REQUEST}", "Values": [request.request_key]}]})
    aws = AwsProvider(broker_id="wz-b", regions=[REGION], client_factory={REGION: client}.__getitem__,
                      image_ids={REGION: AMI})
    assert aws.provision(request).ref.instance_id == "i-0first"
    stub.assert_no_pending_responses()
