"""A cloud pool the admin left half-configured (a GCP pool without `project`) must not take down what
reads offers: the savings report, quotes and the scheduling cycle skip it (found by the console's costs
page: /api/v1/costs/savings/ answered 500 with a TypeError)."""
from __future__ import annotations

from broker.inventory.models import Pool, PoolKind
from broker.provisioning.offers import cloud_offers
from broker.scheduler.services import scheduling_cycle_run
from tests.broker.conftest import MINIMAL_SPEC


def test_a_gcp_pool_without_a_project_is_skipped_not_a_500(acme):
    Pool.objects.create(tenant=acme.tenant, name="gcp-half", kind=PoolKind.GCP, region="us-central1",
                        provider_config={}, max_instances=8)
    offers, _ = cloud_offers(tenant=acme.tenant)
    assert all(o.provider != "gcp" for o in offers)
    assert acme.client.get("/api/v1/costs/savings/").status_code == 200
    quote = acme.client.post("/api/v1/quotes/", MINIMAL_SPEC, format="json")
    assert quote.status_code == 200, quote.content
    job = acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").json()
    scheduling_cycle_run(tenant=acme.tenant)
    assert acme.client.get(f"/api/v1/jobs/{job['id']}/").json()["state"] == "PLACED"
