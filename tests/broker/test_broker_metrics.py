"""GET /metrics: the broker's figures for Prometheus, read from the database at scrape time."""
from __future__ import annotations

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from broker.inventory.models import Gpu, GpuHealth
from broker.jobs.models import Migration, MigrationCause, MigrationState
from broker.jobs.services import GpuRequest, allocation_commit, job_set_pending_reason
from broker.scheduler.models import CycleRecord

from .test_api_tenancy import submit


def scrape(remote_addr: str = "127.0.0.1") -> dict[str, dict[tuple, float]]:
    resp = Client(REMOTE_ADDR=remote_addr).get("/metrics")
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/plain"), resp.content[:300]
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.content.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(metrics, name, **labels) -> float | None:
    return metrics.get(name, {}).get(tuple(sorted(labels.items())))


def test_jobs_gpus_moves_and_cycles_are_counted(acme, globex):
    waiting = submit(acme, name="waiting", resources={"gpus": 1})
    job_set_pending_reason(job=waiting, code="QUOTA_EXCEEDED", message="over quota", data={})
    placed = submit(acme, name="placed", resources={"gpus": 2})
    allocation_commit(job=placed, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    Gpu.objects.filter(node=acme.nodes[1], index=7).update(health=GpuHealth.FAILED)
    Migration.objects.create(job=placed, cause=MigrationCause.SPOT, state=MigrationState.COMPLETED, source_node="x")
    Migration.objects.create(job=placed, cause=MigrationCause.REQUESTED, state=MigrationState.ROLLED_BACK,
                             source_node="x")
    for seconds in (0.03, 0.4, 3.0):
        CycleRecord.objects.create(tenant=acme.tenant, solve_seconds=seconds)

    m = scrape()
    assert value(m, "whalezen_pending_jobs", tenant="acme", reason="QUOTA_EXCEEDED") == 1
    assert value(m, "whalezen_jobs", tenant="acme", state="PLACED") == 1
    gpus = dict(tenant="acme", pool="onprem", model="A100-80GB")
    assert value(m, "whalezen_gpus", **gpus, state="allocated") == 2
    assert value(m, "whalezen_gpus", **gpus, state="unhealthy") == 1
    assert value(m, "whalezen_gpus", **gpus, state="free") == 16 - 3
    assert value(m, "whalezen_gpus", tenant="globex", pool="onprem", model="A100-80GB", state="free") == 16
    assert value(m, "whalezen_admitted_jobs_total", tenant="acme") == 1
    assert value(m, "whalezen_migrations_total", cause="SPOT", result="COMPLETED") == 1
    assert value(m, "whalezen_migrations_total", cause="REQUESTED", result="ROLLED_BACK") == 1
    cycle = "whalezen_scheduling_cycle_duration_seconds"
    assert value(m, f"{cycle}_bucket", phase="solve", le="0.05") == 1
    assert value(m, f"{cycle}_bucket", phase="solve", le="0.5") == 2
    assert value(m, f"{cycle}_bucket", phase="solve", le="+Inf") == 3
    assert value(m, f"{cycle}_sum", phase="solve") == pytest.approx(3.43)


def test_metrics_are_for_loopback_the_allow_list_or_the_token(acme):
    assert Client(REMOTE_ADDR="10.9.9.9").get("/metrics").status_code == 403
    assert Client(REMOTE_ADDR="10.9.9.9").get("/metrics", HTTP_AUTHORIZATION=f"Bearer {acme.token_secret}"
                                               ).status_code == 403


def test_spend_by_tenant_and_provider_and_request_durations_by_route(acme, globex):
    from datetime import timedelta

    from django.utils import timezone

    from broker.jobs.models import Allocation

    acme.nodes[0].pool.gpu_hour_rate_usd = 2
    acme.nodes[0].pool.save()
    placed = submit(acme, name="placed", resources={"gpus": 2})
    allocation_commit(job=placed, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    # Held for three hours this month: 2 GPUs x 3 h x $2.
    Allocation.objects.filter(job=placed).update(created_at=max(timezone.now() - timedelta(hours=3),
                                                                timezone.now().replace(day=1, hour=0, minute=0)))
    client = Client(HTTP_AUTHORIZATION=f"Bearer {acme.token_secret}")
    for _ in range(3):
        assert client.get(f"/api/v1/jobs/{placed.pk}/").status_code == 200
    assert Client().get("/api/v1/no-such-thing/?x=1").status_code == 404

    m = scrape()
    expected = 2 * 2 * min(3.0, (timezone.now() - timezone.now().replace(day=1, hour=0, minute=0)).total_seconds() / 3600)
    assert value(m, "whalezen_spend_dollars", tenant="acme", provider="onprem") == pytest.approx(expected, rel=0.01)
    assert value(m, "whalezen_spend_dollars", tenant="globex", provider="onprem") is None
    duration = "whalezen_api_request_duration_seconds"
    assert value(m, f"{duration}_count", method="GET", route="api/v1/jobs/<pk>/", status="200") >= 3
    # A random path is one label value, whatever the path.
    assert value(m, f"{duration}_count", method="GET", route="unmatched", status="404") >= 1


def test_the_cycle_histogram_has_every_phase_of_recorded_cycles(acme):
    CycleRecord.objects.create(tenant=acme.tenant, solve_seconds=0.2,
                               phases={"snapshot": 0.03, "solve": 0.2, "commit": 1.5, "reasons": 0.004})
    CycleRecord.objects.create(tenant=acme.tenant, solve_seconds=0.1,
                               phases={"snapshot": 0.4, "solve": 0.1, "commit": 0.02, "reasons": 0.0})
    CycleRecord.objects.create(tenant=acme.tenant, solve_seconds=0.1)  # recorded before phases existed
    m = scrape()
    cycle = "whalezen_scheduling_cycle_duration_seconds"
    assert value(m, f"{cycle}_bucket", phase="solve", le="+Inf") == 3
    assert value(m, f"{cycle}_bucket", phase="commit", le="+Inf") == 2
    assert value(m, f"{cycle}_bucket", phase="commit", le="0.025") == 1
    assert value(m, f"{cycle}_bucket", phase="snapshot", le="0.05") == 1
    assert value(m, f"{cycle}_sum", phase="commit") == pytest.approx(1.52)
    assert value(m, f"{cycle}_bucket", phase="reasons", le="0.005") == 2
