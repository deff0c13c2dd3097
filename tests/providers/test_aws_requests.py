"""AWS provider: the ClientToken it sends and what `describe` reports (moto in server mode, and a
stubbed EC2 for answers moto never gives)."""
from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import boto3
import pytest
from botocore.stub import Stubber

from providers.aws import AwsProvider, client_token
from providers.aws.provider import instance_info as aws_instance_info
from providers.base import (
    TAG_ALLOCATION,
    TAG_ATTEMPT,
    TAG_BROKER,
    TAG_NODE_NAME,
    TAG_REQUEST,
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    ProviderError,
    derive_request_key,
)
from providers.bootstrap import DEFAULT_AGENT_INSTALL, agent_boot_script
from tests.providers.conftest import make_request

REGION = "us-east-1"


def error_fields(exc: ProviderError) -> tuple:
    return exc.kind, exc.retry_elsewhere, exc.provider, exc.code, exc.message


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


# -- a stubbed EC2: every call the provider makes is listed, with its exact parameters ----------
AMI = "ami-0abc1234def567890"


def ec2_stub(region: str = REGION) -> tuple[Any, Stubber]:
    client = boto3.client("ec2", region_name=region, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.activate()
    return client, stub


def stubbed(stub_region: str = REGION, **kwargs: Any) -> tuple[AwsProvider, Stubber]:
    client, stub = ec2_stub(stub_region)
    kwargs.setdefault("image_ids", {REGION: AMI})
    provider = AwsProvider(broker_id=kwargs.pop("broker_id", "wz-b"), regions=kwargs.pop("regions", [REGION]),
                           client_factory={stub_region: client}.__getitem__, **kwargs)  # a call's region decides
    return provider, stub


def root_device_answer(stub: Stubber, device: str | None = "/dev/xvda", image: str = AMI) -> None:
    found = [{"ImageId": image, **({"RootDeviceName": device} if device else {})}]
    stub.add_response("describe_images", {"Images": found}, {"ImageIds": [image]})


def tags(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in sorted(pairs)]


def test_run_instances_receives_the_whole_on_demand_request() -> None:
    aws, stub = stubbed()
    req = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION)
    root_device_answer(stub)
    tag_list = tags((TAG_BROKER, "wz-b"), (TAG_ALLOCATION, "alloc-1"), (TAG_REQUEST, req.request_key),
                    (TAG_ATTEMPT, "1"), (TAG_NODE_NAME, req.node_name), ("Name", req.node_name))
    expected = {
        "ImageId": AMI, "InstanceType": "p5.48xlarge", "MinCount": 1, "MaxCount": 1, "ClientToken": req.request_key,
        "TagSpecifications": [{"ResourceType": rt, "Tags": tag_list} for rt in ("instance", "volume",
                                                                                "network-interface")],
        "UserData": agent_boot_script(server_url="http://broker.test:8000", join_token="join-secret-123",
                                      node_name=req.node_name, install_command=DEFAULT_AGENT_INSTALL),
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "BlockDeviceMappings": [{"DeviceName": "/dev/xvda",
                                 "Ebs": {"VolumeSize": 200, "VolumeType": "gp3", "DeleteOnTermination": True}}],
        "Placement": {"AvailabilityZone": "us-east-1a"},
    }
    assert aws.run_instances_params(req) == expected
    assert aws.run_instances_params(req) == expected  # the root device is looked up once

    launched = {"InstanceId": "i-0123", "InstanceType": "p5.48xlarge", "State": {"Name": "pending"},
                "Placement": {"AvailabilityZone": "us-east-1a"}, "Tags": [{"Key": TAG_REQUEST, "Value": req.request_key}]}
    stub.add_response("describe_instances", {"Reservations": []}, {"Filters": [
        {"Name": f"tag:{TAG_BROKER}", "Values": ["wz-b"]}, {"Name": f"tag:{TAG_REQUEST}", "Values": [req.request_key]}]})
    stub.add_response("run_instances", {"Instances": [launched]}, expected)
    info = aws.provision(req)
    assert info == InstanceInfo(ref=InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0123"),
                                state=InstanceState.PENDING, instance_type="p5.48xlarge", request_key=req.request_key,
                                tags=((TAG_REQUEST, req.request_key),))
    stub.assert_no_pending_responses()


def test_run_instances_receives_the_whole_configured_spot_request() -> None:
    install = "pip install whalezen-agent --index-url {server_url}/simple"
    aws, stub = stubbed(subnet_ids={"us-east-1b": "subnet-0b"}, security_group_ids=["sg-1", "sg-2"],
                        iam_instance_profile="wz-node", key_name="ops", root_volume_gib=500,
                        agent_install_command=install)
    # An AZ id from the public catalog, no node name, a price cap.
    req = dataclasses.replace(make_request(provider="aws", instance_type="g5.xlarge", zone="use1-az2", region=REGION,
                                           spot=True), node_name="", max_spot_price=1.23456789)
    root_device_answer(stub, device=None)  # an AMI without RootDeviceName: /dev/sda1
    stub.add_response("describe_availability_zones", {"AvailabilityZones": [{"ZoneName": "us-east-1b",
                                                                             "ZoneId": "use1-az2"}]},
                      {"ZoneIds": ["use1-az2"]})
    tag_list = tags((TAG_BROKER, "wz-b"), (TAG_ALLOCATION, "alloc-1"), (TAG_REQUEST, req.request_key),
                    (TAG_ATTEMPT, "1"), ("Name", req.request_key))
    expected = {
        "ImageId": AMI, "InstanceType": "g5.xlarge", "MinCount": 1, "MaxCount": 1, "ClientToken": req.request_key,
        "TagSpecifications": [{"ResourceType": rt, "Tags": tag_list} for rt in (
            "instance", "volume", "network-interface", "spot-instances-request")],
        "UserData": agent_boot_script(server_url="http://broker.test:8000", join_token="join-secret-123",
                                      node_name=req.request_key, install_command=install),
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "BlockDeviceMappings": [{"DeviceName": "/dev/sda1",
                                 "Ebs": {"VolumeSize": 500, "VolumeType": "gp3", "DeleteOnTermination": True}}],
        "Placement": {"AvailabilityZone": "us-east-1b"},
        "SubnetId": "subnet-0b",
        "SecurityGroupIds": ["sg-1", "sg-2"],
        "IamInstanceProfile": {"Name": "wz-node"},
        "KeyName": "ops",
        "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate", "MaxPrice": "1.23457"}},
    }
    assert aws.run_instances_params(req) == expected
    uncapped = aws.run_instances_params(dataclasses.replace(req, max_spot_price=None))  # zone name cached
    assert uncapped["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    stub.assert_no_pending_responses()


def test_request_without_a_zone_is_not_placed_and_an_unknown_zone_id_goes_elsewhere() -> None:
    aws, stub = stubbed()
    root_device_answer(stub)
    anywhere = dataclasses.replace(make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION))
    assert "Placement" not in aws.run_instances_params(anywhere)
    stub.add_response("describe_availability_zones", {"AvailabilityZones": []}, {"ZoneIds": ["use1-az9"]})
    with pytest.raises(ProviderError) as caught:
        aws.zone_name(REGION, "use1-az9")
    assert error_fields(caught.value) == (ErrorKind.BAD_REQUEST, True, "aws", "", "no zone use1-az9 in us-east-1")
    assert aws.zone_name(REGION, "us-east-1c") == "us-east-1c"  # a zone name: no lookup


def test_missing_ami_is_a_bad_request() -> None:
    aws, stub = stubbed()
    stub.add_response("describe_images", {"Images": []}, {"ImageIds": [AMI]})
    with pytest.raises(ProviderError) as caught:
        aws.run_instances_params(make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION))
    assert error_fields(caught.value) == (ErrorKind.BAD_REQUEST, False, "aws", "", f"AMI {AMI} not found in us-east-1")


class _Session:
    """Stands in for a boto3 Session: hands out a stubbed SSM client and records what was asked."""

    def __init__(self, answer: Callable[[Stubber], None]) -> None:
        self.asked: list[tuple[str, str]] = []
        self.ssm = boto3.client("ssm", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
        self.stub = Stubber(self.ssm)
        answer(self.stub)
        self.stub.activate()

    def client(self, service: str, region_name: str) -> Any:
        self.asked.append((service, region_name))
        return self.ssm


SSM_NAME = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


def test_default_ami_comes_from_the_public_ssm_parameter_once() -> None:
    session = _Session(lambda s: s.add_response("get_parameter", {"Parameter": {"Name": SSM_NAME, "Value": AMI}},
                                                {"Name": SSM_NAME}))
    aws, stub = stubbed(image_ids={}, session=session)
    root_device_answer(stub)
    req = make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION)
    assert aws.run_instances_params(req)["ImageId"] == AMI
    assert aws.run_instances_params(req)["ImageId"] == AMI
    assert session.asked == [("ssm", REGION)]
    # The request's own image wins over any default.
    root_device_answer(stub, image="ami-0own")
    assert aws.run_instances_params(dataclasses.replace(req, image="ami-0own"))["ImageId"] == "ami-0own"


def test_default_ami_unresolved_is_a_bad_request_naming_the_region() -> None:
    session = _Session(lambda s: s.add_client_error("get_parameter", "ParameterNotFound"))
    aws, _ = stubbed(image_ids={}, session=session)
    with pytest.raises(ProviderError) as caught:
        aws.run_instances_params(make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION))
    assert error_fields(caught.value) == (
        ErrorKind.BAD_REQUEST, False, "aws", "",
        "no AMI configured for us-east-1 and the default could not be resolved (ParameterNotFound)")


@pytest.mark.parametrize("region, key, message", [
    ("eu-west-1", "wz-ok", "region eu-west-1 is not configured"),
    (REGION, "", "request_key must be 1-64 ASCII characters"),
    (REGION, "k" * 65, "request_key must be 1-64 ASCII characters"),
    (REGION, "wz-ключ", "request_key must be 1-64 ASCII characters"),
])
def test_provision_refuses_what_ec2_cannot_take(region: str, key: str, message: str) -> None:
    aws, stub = stubbed()
    req = dataclasses.replace(make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION),
                              region=region, request_key=key)
    with pytest.raises(ProviderError) as caught:
        aws.provision(req)
    assert error_fields(caught.value) == (ErrorKind.BAD_REQUEST, False, "aws", "", message)


def described(*instances: dict[str, Any]) -> dict[str, Any]:
    return {"Reservations": [{"Instances": list(instances)}]}


def ec2_instance(instance_id: str, state: str, launched: datetime | None) -> dict[str, Any]:
    return {"InstanceId": instance_id, "State": {"Name": state}, **({"LaunchTime": launched} if launched else {})}


def test_a_key_already_launched_returns_its_live_instance_first_then_the_newest() -> None:
    aws, stub = stubbed()
    key = "k" * 64  # 64 characters is still a valid ClientToken
    req = dataclasses.replace(make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION),
                              request_key=key)
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    stub.add_response("describe_instances", described(
        ec2_instance("i-old-live", "running", t), ec2_instance("i-new-dead", "terminated", t + timedelta(hours=3)),
        ec2_instance("i-new-live", "stopped", t + timedelta(hours=1)),
    ))
    assert aws.provision(req).ref.instance_id == "i-new-live"
    stub.add_response("describe_instances", described(
        ec2_instance("i-dead-1", "terminated", t + timedelta(hours=1)), ec2_instance("i-dead-2", "terminated", t)))
    assert aws.provision(req).ref.instance_id == "i-dead-1"
    stub.assert_no_pending_responses()


def test_a_key_launched_twice_one_without_a_launch_time() -> None:
    aws, stub = stubbed()
    req = make_request(provider="aws", instance_type="g5.xlarge", zone="", region=REGION)
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    stub.add_response("describe_instances", described(ec2_instance("i-timed", "running", t),
                                                      ec2_instance("i-untimed", "running", None)))
    assert aws.provision(req).ref.instance_id == "i-timed"


def test_record_of_an_ec2_instance() -> None:
    t = datetime(2026, 2, 3, 4, 5, 6, tzinfo=timezone.utc)
    full = {"InstanceId": "i-1", "InstanceType": "g6.xlarge", "State": {"Name": "shutting-down"},
            "Placement": {"AvailabilityZone": "us-east-1d"}, "InstanceLifecycle": "spot", "LaunchTime": t,
            "PrivateIpAddress": "10.0.0.5", "PublicIpAddress": "3.3.3.3",
            "StateReason": {"Code": "Server.SpotInstanceTermination", "Message": "reclaimed"},
            "Tags": [{"Key": TAG_REQUEST, "Value": "wz-k"}, {"Key": "Name", "Value": "n"}]}
    assert aws_instance_info(REGION, full) == InstanceInfo(
        ref=InstanceRef(provider="aws", region=REGION, zone="us-east-1d", instance_id="i-1"),
        state=InstanceState.TERMINATING, instance_type="g6.xlarge", spot=True, request_key="wz-k", launched_at=t,
        private_ip="10.0.0.5", public_ip="3.3.3.3", tags=(("Name", "n"), (TAG_REQUEST, "wz-k")),
        state_reason="Server.SpotInstanceTermination")
    bare = {"InstanceId": "i-2", "State": {"Name": "rebooting"}, "PrivateIpAddress": None, "PublicIpAddress": None,
            "StateReason": {"Code": None}}
    assert aws_instance_info("eu-west-1", bare) == InstanceInfo(
        ref=InstanceRef(provider="aws", region="eu-west-1", zone="", instance_id="i-2"), state=InstanceState.UNKNOWN)
    assert aws_instance_info(REGION, {"InstanceId": "i-3"}).state is InstanceState.UNKNOWN


@pytest.mark.parametrize("ec2_state, state", [("shutting-down", InstanceState.TERMINATING),
                                              ("terminated", InstanceState.TERMINATED),
                                              ("stopping", InstanceState.STOPPING),
                                              ("something-new", InstanceState.UNKNOWN)])
def test_terminate_reports_the_state_ec2_answers(ec2_state: str, state: InstanceState) -> None:
    aws, stub = stubbed()
    ref = InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0abc")
    stub.add_response("terminate_instances", {"TerminatingInstances": [
        {"InstanceId": "i-0abc", "CurrentState": {"Name": ec2_state, "Code": 32},
         "PreviousState": {"Name": "running", "Code": 16}}]}, {"InstanceIds": ["i-0abc"]})
    assert aws.terminate(ref) == InstanceInfo(ref=ref, state=state)


def test_terminate_of_an_unknown_id_confirms_it_gone_and_other_refusals_are_raised() -> None:
    aws, stub = stubbed()
    ref = InstanceRef(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0abc")
    stub.add_client_error("terminate_instances", "InvalidInstanceID.NotFound")
    assert aws.terminate(ref) == InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
    stub.add_client_error("terminate_instances", "UnauthorizedOperation", "not allowed")
    with pytest.raises(ProviderError) as caught:
        aws.terminate(ref)
    assert error_fields(caught.value) == (ErrorKind.AUTH, False, "aws", "UnauthorizedOperation", "not allowed")
    stub.add_client_error("describe_instances", "UnauthorizedOperation", "not allowed")
    with pytest.raises(ProviderError) as caught:
        aws.describe(ref)
    assert error_fields(caught.value) == (ErrorKind.AUTH, False, "aws", "UnauthorizedOperation", "not allowed")


def test_list_owned_asks_every_region_for_our_broker_tag() -> None:
    stubs: dict[str, Stubber] = {}
    clients: dict[str, Any] = {}
    for region in ("us-east-1", "us-west-2"):
        clients[region], stubs[region] = ec2_stub(region)
        stubs[region].add_response("describe_instances", described(ec2_instance(f"i-{region}", "running", None)),
                                   {"Filters": [{"Name": f"tag:{TAG_BROKER}", "Values": ["wz-b"]}]})
    aws = AwsProvider(broker_id="wz-b", regions=["us-east-1", "us-west-2"], client_factory=clients.__getitem__)
    assert [(i.ref.region, i.ref.instance_id) for i in aws.list_owned()] == [
        ("us-east-1", "i-us-east-1"), ("us-west-2", "i-us-west-2")]


# -- offers and the GPU facts EC2 reports ----------------------------------------------------------
def offer(instance_type: str, region: str = REGION, zone: str = "use1-az1", provider: str = "aws") -> Offer:
    return Offer(provider=provider, region=region, zone=zone, instance_type=instance_type, gpu_model="A10G",
                 gpu_count=1, gpu_memory_mib=1, vcpus=1, memory_gib=1.5, on_demand_per_hour=1.006)


G5_FACTS = {"InstanceType": "g5.12xlarge", "VCpuInfo": {"DefaultVCpus": 48}, "MemoryInfo": {"SizeInMiB": 196608},
            "GpuInfo": {"Gpus": [{"Name": "A10G", "Count": 4, "MemoryInfo": {"SizeInMiB": 24576}}]}}


def test_offers_are_ours_with_the_facts_ec2_reports_asked_once() -> None:
    catalog = [offer("g5.12xlarge"), offer("g5.12xlarge", zone="use1-az2"), offer("g4dn.xlarge"),
               offer("g5.12xlarge", region="eu-west-1"), offer("n1-standard-8", region=REGION, provider="gcp")]
    aws, stub = stubbed(offers=catalog)
    stub.add_response("describe_instance_types", {"InstanceTypes": [G5_FACTS]},
                      {"Filters": [{"Name": "instance-type", "Values": ["g4dn.xlarge", "g5.12xlarge"]}]})
    facts = {"gpu_count": 4, "gpu_memory_mib": 24576, "vcpus": 48.0, "memory_gib": 192.0}
    expected = [dataclasses.replace(catalog[0], **facts), dataclasses.replace(catalog[1], **facts), catalog[2]]
    assert aws.list_offers() == expected
    # Facts are cached: only g4dn, which EC2 did not describe, is asked again.
    stub.add_response("describe_instance_types", {"InstanceTypes": []},
                      {"Filters": [{"Name": "instance-type", "Values": ["g4dn.xlarge"]}]})
    assert aws.list_offers() == expected
    stub.assert_no_pending_responses()


def test_offers_keep_catalog_facts_when_ec2_refuses() -> None:
    catalog = [offer("g5.12xlarge")]
    aws, stub = stubbed(offers=catalog)
    stub.add_client_error("describe_instance_types", "UnauthorizedOperation", "no ec2:DescribeInstanceTypes")
    assert aws.list_offers() == catalog
    stub.add_client_error("describe_instance_types", "UnauthorizedOperation", "no ec2:DescribeInstanceTypes")
    with pytest.raises(ProviderError) as caught:
        aws.instance_type_facts(REGION, ["g5.12xlarge"])
    assert error_fields(caught.value) == (ErrorKind.AUTH, False, "aws", "UnauthorizedOperation",
                                          "no ec2:DescribeInstanceTypes")


def test_instance_type_facts_are_asked_a_hundred_types_at_a_time() -> None:
    aws, stub = stubbed()
    names = [f"t{i:03d}.large" for i in range(150)]
    stub.add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": "t000.large"}]},
                      {"Filters": [{"Name": "instance-type", "Values": names[:100]}]})
    stub.add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": "t149.large"}]},
                      {"Filters": [{"Name": "instance-type", "Values": names[100:]}]})
    assert aws.instance_type_facts(REGION, names) == {"t000.large": {"InstanceType": "t000.large"},
                                                      "t149.large": {"InstanceType": "t149.large"}}
    stub.assert_no_pending_responses()


@pytest.mark.parametrize("facts, changes", [
    (None, {}),
    ({"InstanceType": "x"}, {}),
    ({"GpuInfo": {"Gpus": []}}, {}),
    ({"GpuInfo": {"Gpus": [{"Count": 4, "MemoryInfo": {"SizeInMiB": 24576}}, {"Count": 2}]},
      "VCpuInfo": {"DefaultVCpus": 48}, "MemoryInfo": {"SizeInMiB": 200000}},
     {"gpu_count": 6, "gpu_memory_mib": 24576, "vcpus": 48.0, "memory_gib": 195.3}),
    ({"GpuInfo": {"Gpus": [{"Name": "A10G"}]}}, {"vcpus": 1.0, "memory_gib": 1.5}),
    ({"GpuInfo": {"Gpus": [{"Count": 0, "MemoryInfo": {}}]}, "VCpuInfo": {}, "MemoryInfo": {}}, {}),
])
def test_gpu_facts_override_the_catalog_only_where_ec2_knows(facts: dict | None, changes: dict) -> None:
    base = offer("g5.12xlarge")
    assert AwsProvider._with_facts(base, facts) == dataclasses.replace(base, **changes)


def test_each_region_gets_its_own_client_from_the_configured_session_and_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    session = boto3.session.Session(aws_access_key_id="AKIAWZTEST", aws_secret_access_key="secret")
    aws = AwsProvider(broker_id="wz-b", regions=["eu-west-1", "us-west-2"], session=session,
                      endpoint_url="http://127.0.0.1:9")
    west = aws.client("us-west-2")
    assert aws.client("us-west-2") is west and aws.client("eu-west-1") is not west
    assert (west.meta.region_name, west.meta.endpoint_url) == ("us-west-2", "http://127.0.0.1:9")
    assert west._request_signer._credentials.access_key == "AKIAWZTEST"  # the session's keys, not the env's


def test_zone_ids_and_root_devices_are_remembered_each_for_its_own() -> None:
    aws, stub = stubbed()
    for zone_id, name in (("use1-az2", "us-east-1b"), ("use1-az4", "us-east-1d")):
        stub.add_response("describe_availability_zones", {"AvailabilityZones": [{"ZoneName": name, "ZoneId": zone_id}]},
                          {"ZoneIds": [zone_id]})
    assert [aws.zone_name(REGION, z) for z in ("use1-az2", "use1-az4", "use1-az2")] == [
        "us-east-1b", "us-east-1d", "us-east-1b"]
    root_device_answer(stub, "/dev/xvda", image="ami-0a")
    root_device_answer(stub, "/dev/nvme0n1", image="ami-0b")
    assert [aws._root_device(REGION, i) for i in ("ami-0a", "ami-0b", "ami-0a")] == [
        "/dev/xvda", "/dev/nvme0n1", "/dev/xvda"]
    stub.assert_no_pending_responses()


def test_offers_of_every_region_each_with_facts_from_its_own_region() -> None:
    catalog = [offer("g5.12xlarge"), offer("g5.12xlarge", region="us-west-2", zone="usw2-az1")]
    clients: dict[str, Any] = {}
    stubs: dict[str, Stubber] = {}
    for region in (REGION, "us-west-2"):
        clients[region], stubs[region] = ec2_stub(region)
        stubs[region].add_response("describe_instance_types", {"InstanceTypes": [G5_FACTS]},
                                   {"Filters": [{"Name": "instance-type", "Values": ["g5.12xlarge"]}]})
    aws = AwsProvider(broker_id="wz-b", regions=[REGION, "us-west-2"], offers=catalog,
                      client_factory=clients.__getitem__)
    facts = {"gpu_count": 4, "gpu_memory_mib": 24576, "vcpus": 48.0, "memory_gib": 192.0}
    assert aws.list_offers() == [dataclasses.replace(o, **facts) for o in catalog]
    for stub in stubs.values():
        stub.assert_no_pending_responses()


def test_instance_type_facts_that_cannot_be_reached_are_a_transient_error_naming_why() -> None:
    """EC2 not answering (a transport error, not an API error) while fetching GPU facts: the caller gets
    a TRANSIENT ProviderError named after the failure, so the offer refresh retries later."""
    from botocore.exceptions import EndpointConnectionError

    aws, stub = stubbed()

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com")

    paginator = aws.client(REGION).get_paginator("describe_instance_types")
    paginator.paginate = unreachable  # type: ignore[method-assign]
    aws.client(REGION).get_paginator = lambda name: paginator  # type: ignore[method-assign]
    with pytest.raises(ProviderError) as caught:
        aws.instance_type_facts(REGION, ["p5.48xlarge"])
    assert caught.value.kind is ErrorKind.TRANSIENT and caught.value.code == "EndpointConnectionError"
