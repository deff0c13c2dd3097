"""Fixtures for broker tests: two tenants (acme, globex) with users, nodes and API clients."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.test import APIClient

from broker.inventory.management.commands.seed_demo import seed_gpu_models
from broker.inventory.models import Node, Pool, PoolKind
from broker.inventory.services import node_create_simulated
from broker.tenancy.models import Role, Tenant
from broker.tenancy.services import api_token_create, membership_add, tenant_create


@dataclass
class TenantWorld:
    tenant: Tenant
    admin: object
    member: object
    viewer: object
    pool: Pool
    nodes: list[Node]
    client: APIClient  # authenticated as the admin
    member_client: APIClient
    viewer_client: APIClient
    token_secret: str


def bearer(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def make_world(slug: str, models) -> TenantWorld:
    User = get_user_model()
    tenant = tenant_create(slug=slug, name=slug.title())
    users = {}
    for role in (Role.ADMIN, Role.MEMBER, Role.VIEWER):
        user = User.objects.create_user(username=f"{slug}-{role}")  # no password: skips slow hashing
        membership_add(tenant=tenant, user=user, role=role)
        users[role] = user
    pool = Pool.objects.create(tenant=tenant, name="onprem", kind=PoolKind.ONPREM, region="dc1")
    nodes = [
        node_create_simulated(pool=pool, name=f"{slug}-a100-{i}", gpu_model=models["A100-80GB"], gpu_count=8,
                              nvlink_island_size=4, cpu_milli=96000, memory_mb=1024 * 1024)
        for i in range(2)
    ]
    secrets = {role: api_token_create(tenant=tenant, user=user, name="t").secret for role, user in users.items()}
    return TenantWorld(
        tenant=tenant, admin=users[Role.ADMIN], member=users[Role.MEMBER], viewer=users[Role.VIEWER],
        pool=pool, nodes=nodes, client=bearer(secrets[Role.ADMIN]), member_client=bearer(secrets[Role.MEMBER]),
        viewer_client=bearer(secrets[Role.VIEWER]), token_secret=secrets[Role.ADMIN],
    )


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with an empty cache: throttle histories (agent registration is limited per
    client address, and every test client is 127.0.0.1) and cached offers must not leak between tests."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def gpu_models(db):
    return seed_gpu_models()


@pytest.fixture
def acme(gpu_models) -> TenantWorld:
    return make_world("acme", gpu_models)


@pytest.fixture
def globex(gpu_models) -> TenantWorld:
    return make_world("globex", gpu_models)


@pytest.fixture
def anon() -> APIClient:
    return APIClient()


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


requires_postgres = pytest.mark.skipif(
    not is_postgres(), reason="needs PostgreSQL (set DATABASE_URL); SQLite serialises all writers"
)

MINIMAL_SPEC = {"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 1}}

requires_redis = pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs Redis (set REDIS_URL)")
