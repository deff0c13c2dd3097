"""AWS provider against moto in server mode (a real HTTP endpoint, as boto3 sees EC2)."""
from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from providers.aws import AwsProvider, client_token, make_ec2_client
from providers.base import TAG_ALLOCATION, TAG_BROKER, TAG_REQUEST, ErrorKind, InstanceState, Offer, ProviderError
from providers.catalog import AwsAvailability, refresh_availability
from tests.providers.conftest import BROKER_ID, make_request

REGION = "us-east-1"


def ec2(endpoint: str) -> Any:
    return boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)


@pytest.fixture
def aws_account(moto_endpoint: str) -> str:
    return moto_endpoint


@pytest.fixture
def aws(aws_account: str, moto_ami: str, broker_id: str) -> AwsProvider:
    return AwsProvider(broker_id=broker_id, regions=[REGION], endpoint_url=aws_account, image_ids={REGION: moto_ami})


def tags_of(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


@pytest.mark.parametrize(
    "instance_type, zone, spot",
    [("p4d.24xlarge", "us-east-1a", False), ("g5.xlarge", "us-east-1b", False), ("p5.48xlarge", "us-east-1c", True),
     ("g6e.4xlarge", "use1-az1", True)],
)
def test_launch_gpu_instance_tagged_at_creation(aws: AwsProvider, aws_account: str, instance_type: str, zone: str,
                                                spot: bool) -> None:
    request = make_request(provider="aws", instance_type=instance_type, zone=zone, region=REGION, spot=spot)
    info = aws.provision(request)

    client = ec2(aws_account)
    instance = client.describe_instances(InstanceIds=[info.ref.instance_id])["Reservations"][0]["Instances"][0]
    assert instance["InstanceType"] == instance_type
    assert (instance.get("InstanceLifecycle") == "spot") is spot
    assert info.spot is spot and info.request_key == request.request_key
    assert info.state in (InstanceState.PENDING, InstanceState.RUNNING)
    tags = tags_of(instance)
    assert tags[TAG_BROKER] == aws.broker_id
    assert tags[TAG_REQUEST] == request.request_key
    assert tags[TAG_ALLOCATION] == "alloc-1"
    if zone.startswith("use1-"):  # an AZ id from the public catalog: placed in that physical zone
        zones = client.describe_availability_zones(ZoneIds=[zone])["AvailabilityZones"]
        assert instance["Placement"]["AvailabilityZone"] == zones[0]["ZoneName"]
    else:
        assert instance["Placement"]["AvailabilityZone"] == zone

    volumes = client.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [info.ref.instance_id]}])
    assert volumes["Volumes"], "the root volume should exist"
    for volume in volumes["Volumes"]:
        assert tags_of(volume)[TAG_REQUEST] == request.request_key
        assert tags_of(volume)[TAG_BROKER] == aws.broker_id

    user_data = client.describe_instance_attribute(InstanceId=info.ref.instance_id, Attribute="userData")
    script = base64.b64decode(user_data["UserData"]["Value"]).decode()
    assert "-m agent --server" in script and "WHALEZEN_SERVER=http://broker.test:8000" in script
    assert "\njoin-secret-123\n" in script  # its root-only token file


def test_spot_request_asks_for_spot_market_and_tags_the_request(aws: AwsProvider) -> None:
    request = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION, spot=True)
    params = aws.run_instances_params(request)
    assert params["InstanceMarketOptions"]["MarketType"] == "spot"
    assert {s["ResourceType"] for s in params["TagSpecifications"]} == {
        "instance", "volume", "network-interface", "spot-instances-request"}
    on_demand = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION)
    assert "InstanceMarketOptions" not in aws.run_instances_params(on_demand)


def test_retry_with_same_key_creates_no_second_instance(aws: AwsProvider, aws_account: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    request = make_request(provider="aws", instance_type="p4d.24xlarge", zone="us-east-1a", region=REGION)
    client = aws.client(REGION)
    calls: list[dict[str, Any]] = []
    real_run = client.run_instances
    monkeypatch.setattr(client, "run_instances", lambda **kw: calls.append(kw) or real_run(**kw))

    first = aws.provision(request)
    second = aws.provision(request)  # e.g. the worker died after the call and the task ran again
    # A fresh provider (another worker, after a restart) must find it too.
    third = AwsProvider(broker_id=aws.broker_id, regions=[REGION], endpoint_url=aws_account,
                        image_ids=aws.image_ids).provision(request)

    assert first.ref == second.ref == third.ref
    assert len(calls) == 1  # moto ignores ClientToken: the tag lookup is what prevented a duplicate
    tagged = ec2(aws_account).describe_instances(
        Filters=[{"Name": f"tag:{TAG_REQUEST}", "Values": [request.request_key]},
                 {"Name": f"tag:{TAG_BROKER}", "Values": [aws.broker_id]}])["Reservations"]
    assert sum(len(r["Instances"]) for r in tagged) == 1


def test_retry_after_the_instance_was_terminated_launches_nothing(aws: AwsProvider, aws_account: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A key names one launch for good, as an EC2 ClientToken does: a retry of a request whose instance was
    since terminated (a spot reclaim, the reconciler) gets that terminated instance back, and the caller
    decides on a new attempt with a new key; it never silently launches (and pays for) a second one."""
    request = make_request(provider="aws", instance_type="g5.xlarge", zone="us-east-1a", region=REGION)
    client = aws.client(REGION)
    calls: list[dict[str, Any]] = []
    real_run = client.run_instances
    monkeypatch.setattr(client, "run_instances", lambda **kw: calls.append(kw) or real_run(**kw))

    first = aws.provision(request)
    aws.terminate(first.ref)
    retried = aws.provision(request)

    assert retried.ref == first.ref and retried.state is InstanceState.TERMINATED
    assert len(calls) == 1
    live = ec2(aws_account).describe_instances(
        Filters=[{"Name": f"tag:{TAG_REQUEST}", "Values": [request.request_key]},
                 {"Name": f"tag:{TAG_BROKER}", "Values": [aws.broker_id]},
                 {"Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"]
    assert live == []


def test_client_token_is_stable_bounded_and_sent(aws: AwsProvider) -> None:
    token = client_token(allocation_id="alloc-42", attempt=3, instance_type="p5.48xlarge", zone="us-east-1a")
    assert token == client_token(allocation_id="alloc-42", attempt=3, instance_type="p5.48xlarge", zone="us-east-1a")
    assert len(token) <= 64 and token.isascii()
    others = {
        client_token(allocation_id="alloc-42", attempt=4, instance_type="p5.48xlarge", zone="us-east-1a"),
        client_token(allocation_id="alloc-42", attempt=3, instance_type="p4d.24xlarge", zone="us-east-1a"),
        client_token(allocation_id="alloc-42", attempt=3, instance_type="p5.48xlarge", zone="us-east-1b"),
        client_token(allocation_id="alloc-43", attempt=3, instance_type="p5.48xlarge", zone="us-east-1a"),
    }
    assert token not in others and len(others) == 4
    long_token = client_token(allocation_id="x" * 300, attempt=99999, instance_type="p5.48xlarge", zone="z")
    assert len(long_token) <= 64

    request = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION)
    params = aws.run_instances_params(request)
    assert params["ClientToken"] == request.request_key
    # A retry must send identical parameters, or EC2 answers IdempotentParameterMismatch.
    assert aws.run_instances_params(request) == params


@pytest.mark.parametrize(
    "code, kind, elsewhere",
    [
        ("InsufficientInstanceCapacity", ErrorKind.CAPACITY, True),
        ("SpotMaxPriceTooLow", ErrorKind.CAPACITY, True),
        ("InstanceLimitExceeded", ErrorKind.QUOTA, True),
        ("VcpuLimitExceeded", ErrorKind.QUOTA, True),
        ("Unsupported", ErrorKind.BAD_REQUEST, True),
        ("AuthFailure", ErrorKind.AUTH, False),
        ("UnauthorizedOperation", ErrorKind.AUTH, False),
        ("RequestLimitExceeded", ErrorKind.TRANSIENT, False),
        ("InvalidParameterValue", ErrorKind.BAD_REQUEST, False),
    ],
)
def test_launch_errors_are_classified(aws: AwsProvider, monkeypatch: pytest.MonkeyPatch, code: str, kind: ErrorKind,
                                      elsewhere: bool) -> None:
    def refuse(**kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": code, "Message": f"simulated {code}"}}, "RunInstances")

    monkeypatch.setattr(aws.client(REGION), "run_instances", refuse)
    request = make_request(provider="aws", instance_type="p5.48xlarge", zone="us-east-1a", region=REGION)
    with pytest.raises(ProviderError) as caught:
        aws.provision(request)
    assert caught.value.kind is kind
    assert caught.value.retry_elsewhere is elsewhere
    assert caught.value.code == code
    assert caught.value.permanent is (kind in (ErrorKind.AUTH, ErrorKind.BAD_REQUEST))


class _CapacityRefusingEc2(BaseHTTPRequestHandler):
    """Answers every call like EC2 out of capacity (HTTP 500 + InsufficientInstanceCapacity)."""

    calls = 0
    body = (b'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>InsufficientInstanceCapacity'
            b'</Code><Message>We currently do not have sufficient p5.48xlarge capacity.</Message></Error></Errors>'
            b'<RequestID>1</RequestID></Response>')

    def do_POST(self) -> None:
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(500)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def test_ec2_client_does_not_retry_capacity_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CapacityRefusingEc2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def attempts(client: Any) -> int:
            _CapacityRefusingEc2.calls = 0
            with pytest.raises(ClientError):
                client.run_instances(ImageId="ami-1", InstanceType="p5.48xlarge", MinCount=1, MaxCount=1)
            return _CapacityRefusingEc2.calls

        assert attempts(make_ec2_client(REGION, endpoint_url=endpoint)) == 1
        # The point of the config: boto3's default client would have re-sent it.
        assert attempts(boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)) > 1
    finally:
        server.shutdown()
        server.server_close()


def test_terminate_and_describe_confirm_termination(aws: AwsProvider) -> None:
    info = aws.provision(make_request(provider="aws", instance_type="g6.xlarge", zone="us-east-1a", region=REGION))
    after = aws.terminate(info.ref)
    assert after.state in (InstanceState.TERMINATING, InstanceState.TERMINATED)
    assert aws.describe(info.ref).state is InstanceState.TERMINATED
    # Terminating twice is harmless, and an id EC2 does not know is confirmed gone.
    assert aws.terminate(info.ref).state in (InstanceState.TERMINATING, InstanceState.TERMINATED)
    missing = info.ref.__class__(provider="aws", region=REGION, zone="us-east-1a", instance_id="i-0123456789abcdef0")
    assert aws.describe(missing).state is InstanceState.TERMINATED


def test_list_owned_sees_only_our_tagged_instances(aws: AwsProvider, aws_account: str) -> None:
    ours = aws.provision(make_request(provider="aws", instance_type="g4dn.xlarge", zone="us-east-1a", region=REGION))
    other_broker = AwsProvider(broker_id="someone-else", regions=[REGION], endpoint_url=aws_account,
                               image_ids=aws.image_ids)
    theirs = other_broker.provision(make_request(provider="aws", instance_type="g4dn.xlarge", zone="us-east-1a",
                                                 region=REGION, allocation_id="alloc-x"))
    ec2(aws_account).run_instances(ImageId=aws.image_ids[REGION], InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1)

    owned = {i.ref.instance_id for i in aws.list_owned()}
    assert owned == {ours.ref.instance_id}
    assert theirs.ref.instance_id not in owned


def test_offers_take_gpu_facts_from_describe_instance_types(aws: AwsProvider, aws_account: str) -> None:
    wrong = Offer(provider="aws", region=REGION, zone="use1-az1", instance_type="p4d.24xlarge", gpu_model="A100",
                  gpu_count=1, gpu_memory_mib=1, vcpus=1, memory_gib=1, on_demand_per_hour=21.957642)
    elsewhere = Offer(provider="aws", region="eu-west-1", zone="", instance_type="p4d.24xlarge", gpu_model="A100",
                      gpu_count=8, gpu_memory_mib=40960, vcpus=96, memory_gib=1152, on_demand_per_hour=1.0)
    provider = AwsProvider(broker_id=BROKER_ID, regions=[REGION], endpoint_url=aws_account, offers=[wrong, elsewhere])
    [offer] = provider.list_offers()
    assert (offer.gpu_count, offer.gpu_memory_mib, offer.vcpus, offer.memory_gib) == (8, 40960, 96.0, 1152.0)
    assert offer.on_demand_per_hour == 21.957642  # prices stay the catalog's


def test_default_offers_come_from_shipped_catalog(aws: AwsProvider) -> None:
    offers = aws.list_offers()
    types = {o.instance_type for o in offers}
    assert {"p5.48xlarge", "p4d.24xlarge", "g6.xlarge", "g5.xlarge", "g4dn.xlarge"} <= types
    assert all(o.region == REGION for o in offers)


def test_refresh_availability_from_instance_type_offerings(aws: AwsProvider) -> None:
    def offer(instance_type: str, zone: str) -> Offer:
        return Offer(provider="aws", region=REGION, zone=zone, instance_type=instance_type, gpu_model="A100",
                     gpu_count=8, gpu_memory_mib=40960, vcpus=96, memory_gib=1152, on_demand_per_hour=21.96)

    gcp_offer = Offer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-1g",
                      gpu_model="A100", gpu_count=1, gpu_memory_mib=40960, vcpus=12, memory_gib=85,
                      on_demand_per_hour=3.67)
    offers = [offer("p4d.24xlarge", "use1-az1"), offer("p4d.24xlarge", "us-east-1a"), offer("p4d.24xlarge", ""),
              offer("p4d.24xlarge", "use1-az3"), offer("p9.notreal", ""), gcp_offer]
    report = refresh_availability(offers, AwsAvailability(aws.client))
    assert [o.available for o in report.offers] == [True, True, True, False, False, True]
    assert report.became_unavailable == 2 and not report.errors
