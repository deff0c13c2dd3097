"""Fixtures for provider tests: moto EC2 in server mode, a fake GCE endpoint, shared requests.
No test here touches the network beyond 127.0.0.1 or needs the database."""
from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

from providers.base import ProvisionRequest, derive_request_key

BROKER_ID = "wz-test-broker"


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """One moto server for the session; tests isolate by broker id / request key, and
    tests that need an empty account use `aws_account` (a fresh moto reset)."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                             "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_SESSION_TOKEN="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                      AWS_CONFIG_FILE="/nonexistent")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def moto_ami(moto_endpoint: str) -> str:
    """Any AMI moto knows (listing them is slow, so once per session)."""
    import boto3

    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    return client.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]


@pytest.fixture
def broker_id() -> str:
    """A broker id of its own per test: tests share one moto server (resetting it costs seconds)
    and never see each other's instances, because everything is found by this tag."""
    return f"{BROKER_ID}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fake_gce():
    from tests.providers.fake_gce import FakeGceServer

    with FakeGceServer() as server:
        yield server


def make_request(
    *,
    provider: str,
    instance_type: str,
    zone: str,
    region: str,
    allocation_id: str = "alloc-1",
    attempt: int = 1,
    spot: bool = False,
    gpu_model: str = "",
    gpu_count: int = 0,
) -> ProvisionRequest:
    return ProvisionRequest(
        request_key=derive_request_key(allocation_id=allocation_id, attempt=attempt, provider=provider,
                                       instance_type=instance_type, zone=zone),
        allocation_id=allocation_id,
        attempt=attempt,
        region=region,
        zone=zone,
        instance_type=instance_type,
        agent_server_url="http://broker.test:8000",
        agent_join_token="join-secret-123",
        node_name=f"node-{allocation_id}-{attempt}",
        spot=spot,
        gpu_model=gpu_model,
        gpu_count=gpu_count,
    )
