"""Fixtures for the hostile-input suite: a tenant with a node registered through the agent API, a job
placed on it, a digest of every database row, and the test process's memory over the whole package."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.apps import apps
from django.core.cache import cache
from rest_framework.test import APIClient

from agent.backends.fake import FakeBackend
from agent.protocol import heartbeat_payload, registration_payload
from broker.inventory.models import Node
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import Allocation, Job
from broker.jobs.services import GpuRequest, allocation_commit
from broker.tenancy.models import ApiToken
from tests.broker.conftest import MINIMAL_SPEC, TenantWorld, acme, anon, bearer, globex, gpu_models  # noqa: F401

AGENT_API = "/api/v1/agent"
RSS_BUDGET_MB = 50  # the issue's bound on the test process's growth over the whole suite
NODE_SPEC = "2xA100-80GB-SXM"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="package", autouse=True)
def memory_stays_bounded():
    """Over every test of tests/security/: hostile bodies must not leave memory behind."""
    before = rss_mb()
    yield
    grown = rss_mb() - before
    assert grown < RSS_BUDGET_MB, f"the test process grew by {grown:.1f} MB (from {before:.1f} MB)"


@pytest.fixture(autouse=True)
def no_rate_limits():
    """Rate limits (the agent routes have them) would answer 429 before validation is reached: the
    suite is about what validation does, so each test starts with empty throttle histories."""
    cache.clear()
    yield
    cache.clear()


def db_digest() -> str:
    """A digest of every row of every model. Authentication's own bookkeeping (a token's
    `last_used_at`, written at most once a minute) is left out: it is not state a body can set."""
    digest = hashlib.sha256()
    for model in sorted(apps.get_models(), key=lambda m: m._meta.label):
        fields = [f.attname for f in model._meta.concrete_fields
                  if not (model is ApiToken and f.attname == "last_used_at")]
        digest.update(model._meta.label.encode())
        for row in model.objects.order_by("pk").values_list(*fields):
            digest.update(repr(row).encode())
    return digest.hexdigest()


def register_body(join_token: str) -> dict:
    """What a real agent sends (agent.protocol), for a simulated 2-GPU node."""
    return registration_payload(inventory=_backend().inventory(), join_token=join_token, name="sec-node",
                                agent_key="key-secsecsec", labels={"rack": "r1"})


def heartbeat_body(epoch: int) -> dict:
    return heartbeat_payload(readings=_backend().sample(), sampled_at=None, running={}, max_epoch=epoch,
                             missed_heartbeats=0, last_error=None)


def status_body(epoch: int) -> dict:
    return {"epoch": epoch, "state": "running", "exit_code": None, "message": "running"}


def _backend() -> FakeBackend:
    backend = FakeBackend(NODE_SPEC, hostname="sec-node")
    backend.start()
    return backend


@dataclass
class HostileWorld:
    world: TenantWorld
    join_token: str
    node: Node
    node_token: str
    job: Job
    allocation: Allocation

    @property
    def agent(self) -> APIClient:
        return bearer(self.node_token)


@pytest.fixture
def hostile(acme) -> HostileWorld:
    """acme with a node registered through the API (with its real node token) and a job placed on it."""
    join_token = pool_join_token_issue(pool=acme.pool)
    resp = APIClient().post(f"{AGENT_API}/register", register_body(join_token), format="json")
    assert resp.status_code == 201, resp.content
    node = Node.objects.get(pk=resp.json()["node_id"])
    created = acme.client.post("/api/v1/jobs/", {**MINIMAL_SPEC, "name": "placed"}, format="json")
    assert created.status_code == 201, created.content
    job = Job.objects.get(pk=created.json()["id"])
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    return HostileWorld(acme, join_token, node, resp.json()["node_token"], job, allocation)
