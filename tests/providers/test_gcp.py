"""GCP provider against a local fake of the Compute REST API (tests/providers/fake_gce.py),
through the real google-cloud-compute client (REST transport, anonymous credentials)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from google.auth.credentials import AnonymousCredentials

from providers.base import ErrorKind, InstanceRef, InstanceState, Offer, ProviderError
from providers.catalog import GcpAvailability, refresh_availability
from providers.gcp import GcpProvider, instance_name, label_value, request_uuid
from providers.reconcile import KnownInstance, reconcile
from tests.providers.conftest import BROKER_ID, make_request
from tests.providers.fake_gce import FakeGceServer

PROJECT = "wz-test-project"
ZONE = "us-central1-a"


@pytest.fixture
def gcp(fake_gce: FakeGceServer) -> GcpProvider:
    return GcpProvider(broker_id=BROKER_ID, project=PROJECT, zones=[ZONE], credentials=AnonymousCredentials(),
                       api_endpoint=fake_gce.endpoint, sleep=lambda s: None)


def insert_body(fake_gce: FakeGceServer) -> dict:
    [(_, _, query, body)] = fake_gce.fake.calls("POST", f"/zones/{ZONE}/instances")
    return {"query": query, **body}


def test_insert_n1_with_attached_gpus_on_spot(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    fake_gce.fake.polls_until_done = 2  # the insert takes a few operation polls to finish
    request = make_request(provider="gcp", instance_type="n1-standard-8", zone=ZONE, region="us-central1",
                           spot=True, gpu_model="T4", gpu_count=2)
    info = gcp.provision(request)

    assert info.state is InstanceState.RUNNING and info.spot
    assert info.ref.instance_id == instance_name(request.request_key)
    assert info.request_key == request.request_key
    body = insert_body(fake_gce)
    assert body["query"]["requestId"] == [request_uuid(request.request_key)]
    assert body["name"] == f"wz-{request_uuid(request.request_key)}"
    assert body["guestAccelerators"] == [
        {"acceleratorType": f"zones/{ZONE}/acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 2}]
    assert body["scheduling"]["provisioningModel"] == "SPOT"
    assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert body["labels"]["whalezen-broker"] == label_value(BROKER_ID)
    assert body["labels"]["whalezen-request"] == request.request_key
    assert body["disks"][0]["initializeParams"]["labels"] == body["labels"]  # the disk is labelled too
    script = {i["key"]: i["value"] for i in body["metadata"]["items"]}["startup-script"]
    assert "-m agent --server" in script and "\njoin-secret-123\n" in script  # its root-only token file
    # We waited through our own operations client, against our endpoint.
    assert len(fake_gce.fake.calls("POST", "/operations/")) >= 3


def test_insert_a2_on_demand_uses_bundled_gpus(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    request = make_request(provider="gcp", instance_type="a2-highgpu-1g", zone=ZONE, region="us-central1",
                           gpu_model="A100", gpu_count=1)
    info = gcp.provision(request)
    body = insert_body(fake_gce)
    assert info.state is InstanceState.RUNNING and not info.spot
    assert "guestAccelerators" not in body  # A2 comes with its A100; listing it again is an error
    assert body["scheduling"]["provisioningModel"] == "STANDARD"
    assert body["machineType"] == f"zones/{ZONE}/machineTypes/a2-highgpu-1g"


def test_retry_after_request_window_meets_409_and_adopts(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    request = make_request(provider="gcp", instance_type="g2-standard-8", zone=ZONE, region="us-central1")
    first = gcp.provision(request)
    same_op = gcp.provision(request)  # within GCE's requestId window: the same operation comes back
    fake_gce.fake.ops_by_request_id.clear()  # the requestId window has passed
    adopted = gcp.provision(request)

    assert first.ref == same_op.ref == adopted.ref
    assert len(fake_gce.fake.instances) == 1
    assert len(fake_gce.fake.calls("POST", f"/zones/{ZONE}/instances")) == 3


def test_name_taken_by_an_unlabelled_instance_is_not_adopted(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    request = make_request(provider="gcp", instance_type="g2-standard-8", zone=ZONE, region="us-central1")
    fake_gce.fake.plant_instance(PROJECT, ZONE, instance_name(request.request_key), labels={"team": "other"})
    with pytest.raises(ProviderError) as caught:
        gcp.provision(request)
    assert caught.value.kind is ErrorKind.BAD_REQUEST and not caught.value.retry_elsewhere


@pytest.mark.parametrize(
    "code, kind, elsewhere",
    [("ZONE_RESOURCE_POOL_EXHAUSTED", ErrorKind.CAPACITY, True),
     ("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", ErrorKind.CAPACITY, True),
     ("QUOTA_EXCEEDED", ErrorKind.QUOTA, True),
     ("INVALID_FIELD_VALUE", ErrorKind.BAD_REQUEST, False)],
)
def test_failed_operation_is_classified(gcp: GcpProvider, fake_gce: FakeGceServer, code: str, kind: ErrorKind,
                                        elsewhere: bool) -> None:
    fake_gce.fake.fail_next_insert = code
    request = make_request(provider="gcp", instance_type="a2-highgpu-8g", zone=ZONE, region="us-central1")
    with pytest.raises(ProviderError) as caught:
        gcp.provision(request)
    assert (caught.value.kind, caught.value.retry_elsewhere, caught.value.code) == (kind, elsewhere, code)
    assert not fake_gce.fake.instances


@pytest.mark.parametrize(
    "status, reason, kind",
    [(403, "forbidden", ErrorKind.AUTH), (401, "unauthorized", ErrorKind.AUTH),
     (403, "quotaExceeded", ErrorKind.QUOTA), (429, "rateLimitExceeded", ErrorKind.TRANSIENT),
     (503, "backendError", ErrorKind.TRANSIENT), (400, "invalid", ErrorKind.BAD_REQUEST)],
)
def test_http_errors_are_classified(gcp: GcpProvider, fake_gce: FakeGceServer, status: int, reason: str,
                                    kind: ErrorKind) -> None:
    fake_gce.fake.http_error_next_insert = (status, reason)
    with pytest.raises(ProviderError) as caught:
        gcp.provision(make_request(provider="gcp", instance_type="g2-standard-4", zone=ZONE, region="us-central1"))
    assert caught.value.kind is kind


def test_delete_then_describe_confirms(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    info = gcp.provision(make_request(provider="gcp", instance_type="g2-standard-4", zone=ZONE, region="us-central1"))
    assert gcp.terminate(info.ref).state is InstanceState.TERMINATING
    assert fake_gce.fake.calls("DELETE", f"/instances/{info.ref.instance_id}")
    assert gcp.describe(info.ref).state is InstanceState.TERMINATED
    assert gcp.terminate(info.ref).state is InstanceState.TERMINATED  # already gone: fine


def test_stopped_instance_is_not_reported_terminated(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    # GCE's own "TERMINATED" status means stopped (disk still billed), not deleted.
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-stopped", status="TERMINATED",
                                 labels={"whalezen-broker": label_value(BROKER_ID)})
    info = gcp.describe(InstanceRef(provider="gcp", region="us-central1", zone=ZONE, instance_id="wz-stopped"))
    assert info.state is InstanceState.STOPPED


def test_list_owned_by_label_across_zones(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    ours = gcp.provision(make_request(provider="gcp", instance_type="g2-standard-4", zone=ZONE, region="us-central1"))
    fake_gce.fake.plant_instance(PROJECT, "europe-west4-b", "wz-leak-elsewhere",
                                 labels={"whalezen-broker": label_value(BROKER_ID)})
    fake_gce.fake.plant_instance(PROJECT, ZONE, "someone-elses", labels={"whalezen-broker": "another-broker"})
    fake_gce.fake.plant_instance(PROJECT, ZONE, "unlabelled")

    owned = {(i.ref.zone, i.ref.instance_id) for i in gcp.list_owned()}
    assert owned == {(ZONE, ours.ref.instance_id), ("europe-west4-b", "wz-leak-elsewhere")}
    [(_, _, query, _)] = fake_gce.fake.calls("GET", "/aggregated/instances")
    assert query["filter"] == [f'labels.whalezen-broker = "{label_value(BROKER_ID)}"']


def test_reconcile_deletes_labelled_orphan_and_adopts_lost_record(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    request = make_request(provider="gcp", instance_type="g2-standard-4", zone=ZONE, region="us-central1")
    launched = gcp.provision(request)
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-orphan", labels={"whalezen-broker": label_value(BROKER_ID)},
                                 created="2026-01-01T00:00:00.000-08:00")
    fake_gce.fake.plant_instance(PROJECT, ZONE, "foreign")
    known = [KnownInstance(provider="gcp", request_key=request.request_key, region="us-central1", zone=ZONE)]
    now = datetime.now(timezone.utc) + timedelta(hours=1)
    report = reconcile({"gcp": gcp}, known, orphan_grace=timedelta(minutes=10), clock=lambda: now)

    assert [i.ref.instance_id for i in report.orphans_terminating] == ["wz-orphan"]
    assert [a.instance.ref.instance_id for a in report.adopted] == [launched.ref.instance_id]
    assert set(name for (_, _, name) in fake_gce.fake.instances) == {launched.ref.instance_id, "foreign"}


def test_refresh_availability_from_accelerator_types(gcp: GcpProvider, fake_gce: FakeGceServer) -> None:
    fake_gce.fake.accelerator_types = {ZONE: ["nvidia-tesla-t4", "nvidia-l4"], "us-east4-a": ["nvidia-h100-80gb"]}

    def offer(instance_type: str, gpu: str, zone: str) -> Offer:
        return Offer(provider="gcp", region=zone.rsplit("-", 1)[0], zone=zone, instance_type=instance_type,
                     gpu_model=gpu, gpu_count=1, gpu_memory_mib=16384, vcpus=8, memory_gib=30,
                     on_demand_per_hour=1.0)

    offers = [offer("n1-standard-8", "T4", ZONE), offer("g2-standard-4", "L4", ZONE),
              offer("a2-highgpu-1g", "A100", ZONE), offer("a3-highgpu-1g", "H100", "us-east4-a")]
    report = refresh_availability(offers, GcpAvailability(gcp.accelerator_types_client(), PROJECT))
    assert [o.available for o in report.offers] == [True, True, False, True]
    assert not report.errors


def test_offers_come_from_catalog_limited_to_regions_and_zones(fake_gce: FakeGceServer) -> None:
    def provider(**kwargs: object) -> GcpProvider:
        return GcpProvider(broker_id=BROKER_ID, project=PROJECT, credentials=AnonymousCredentials(),
                           api_endpoint=fake_gce.endpoint, **kwargs)  # type: ignore[arg-type]

    everywhere = provider().list_offers()
    assert {o.region for o in everywhere} >= {"us-central1", "us-east4"}
    east = provider(regions=["us-east4"]).list_offers()
    assert east and {o.region for o in east} == {"us-east4"}
    one_zone = provider(zones=[ZONE]).list_offers()
    assert one_zone and {o.zone for o in one_zone} == {ZONE}
    a2 = [o for o in one_zone if o.instance_type == "a2-highgpu-1g"]
    assert a2 and a2[0].on_demand_per_hour == pytest.approx(3.67339, abs=1e-5)
