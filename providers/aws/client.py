"""EC2 client construction. boto3's default retry policy re-sends InsufficientInstanceCapacity;
we want one attempt so the broker fails over to another zone, region or cloud at once."""
from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

EC2_CLIENT_CONFIG = Config(
    retries={"total_max_attempts": 1, "mode": "standard"},
    connect_timeout=10,
    read_timeout=60,
)


def make_ec2_client(
    region: str, *, session: boto3.session.Session | None = None, endpoint_url: str | None = None
) -> Any:
    """An EC2 client that does not retry. `endpoint_url` points it at moto in tests."""
    session = session or boto3.session.Session()
    return session.client("ec2", region_name=region, endpoint_url=endpoint_url, config=EC2_CLIENT_CONFIG)
