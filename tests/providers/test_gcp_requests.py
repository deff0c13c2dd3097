"""What Compute Engine receives from the GCP provider and what the broker gets back: whole insert
bodies, request ids, adoption, the exact errors (kind, code, message, whether to go elsewhere)
and the records built from instances. Against tests/providers/fake_gce.py, like test_gcp.py."""
from __future__ import annotations

import dataclasses
import types
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from providers.base import ErrorKind, InstanceInfo, InstanceRef, InstanceState, Offer, ProviderError, ProvisionRequest
from providers.bootstrap import DEFAULT_AGENT_INSTALL, agent_boot_script
from providers.gcp import GcpProvider, instance_name
from providers.gcp import provider as gcp_module
from providers.gcp.provider import instance_info
from tests.providers.conftest import BROKER_ID, make_request
from tests.providers.fake_gce import FakeGceServer, _error

PROJECT = "wz-test-project"
ZONE = "us-central1-a"
REGION = "us-central1"
# Instance names and request ids must stay the same across broker restarts and versions: a retry
# after an upgrade has to meet the same requestId / name, or it launches a second instance.
NAMESPACE = uuid.UUID("5b0c5f4e-8d7e-4a51-9c55-57a1e2a10b0d")


def uuid_of(key: str) -> str:
    return str(uuid.uuid5(NAMESPACE, key))


def provider(fake_gce: FakeGceServer, **kwargs: Any) -> GcpProvider:
    kwargs.setdefault("sleep", lambda s: None)
    return GcpProvider(broker_id=kwargs.pop("broker_id", BROKER_ID), project=PROJECT,
                       credentials=AnonymousCredentials(), api_endpoint=fake_gce.endpoint, **kwargs)


def request(**kwargs: Any) -> ProvisionRequest:
    return make_request(provider="gcp", instance_type=kwargs.pop("instance_type", "n1-standard-8"), zone=ZONE,
                        region=REGION, **kwargs)


def inserts(fake_gce: FakeGceServer) -> list[tuple[dict, dict]]:
    return [(query, body) for (_, _, query, body) in fake_gce.fake.calls("POST", f"/zones/{ZONE}/instances")
            if body is not None]


def answer(fake_gce: FakeGceServer, rule: Callable[[str, str, dict], tuple[int, Any] | None]) -> None:
    """Let `rule(method, path, query)` answer a call instead of the fake (None: the fake answers)."""
    real = fake_gce.fake.handle

    def handle(method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        reply = rule(method, path, query)
        if reply is not None:
            fake_gce.fake.requests.append((method, path, query, body))
            return reply
        return real(method, path, query, body)

    fake_gce.fake.handle = handle  # type: ignore[method-assign]


def error_fields(exc: ProviderError) -> tuple:
    return exc.kind, exc.retry_elsewhere, exc.provider, exc.code, exc.message


def labels_of(req: ProvisionRequest, broker: str = BROKER_ID) -> dict[str, str]:
    return {"whalezen-broker": broker, "whalezen-request": req.request_key, "whalezen-allocation": req.allocation_id,
            "whalezen-attempt": str(req.attempt), "whalezen-node": req.node_name}


# -- the insert ----------------------------------------------------------------------------------
def test_provision_waits_until_the_operation_is_done(fake_gce: FakeGceServer) -> None:
    fake_gce.fake.polls_until_done = 2
    info = provider(fake_gce).provision(request())
    assert info.state is InstanceState.RUNNING
    assert len(fake_gce.fake.calls("POST", "/operations/")) == 3  # RUNNING, RUNNING, DONE


def test_default_insert_body_and_the_record_returned(fake_gce: FakeGceServer) -> None:
    req = request(gpu_model="T4", gpu_count=1)
    info = provider(fake_gce).provision(req)

    [(query, body)] = inserts(fake_gce)
    name = f"wz-{uuid_of(req.request_key)}"
    labels = labels_of(req)
    script = agent_boot_script(server_url="http://broker.test:8000", join_token="join-secret-123",
                               node_name=req.node_name, install_command=DEFAULT_AGENT_INSTALL)
    assert query == {"requestId": [uuid_of(req.request_key)]}
    assert body == {
        "name": name,
        "machineType": f"zones/{ZONE}/machineTypes/n1-standard-8",
        "labels": labels,
        "networkInterfaces": [{"network": "global/networks/default",
                               "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}],
        "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
            "sourceImage": "projects/debian-cloud/global/images/family/debian-12", "diskSizeGb": "200",
            "diskType": f"zones/{ZONE}/diskTypes/pd-balanced", "labels": labels}}],
        "metadata": {"items": [{"key": "startup-script", "value": script},
                               {"key": "install-nvidia-driver", "value": "True"}]},
        "scheduling": {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE", "automaticRestart": True},
        "guestAccelerators": [{"acceleratorType": f"zones/{ZONE}/acceleratorTypes/nvidia-tesla-t4",
                               "acceleratorCount": 1}],
    }
    stored = fake_gce.fake.instances[(PROJECT, ZONE, name)]
    assert info == InstanceInfo(
        ref=InstanceRef(provider="gcp", region=REGION, zone=ZONE, instance_id=name),
        state=InstanceState.RUNNING, instance_type="n1-standard-8", spot=False, request_key=req.request_key,
        launched_at=datetime.fromisoformat(stored["creationTimestamp"]), private_ip="10.128.0.7",
        public_ip="34.1.2.3", tags=tuple(sorted(labels.items())),
    )


def test_spot_insert_is_deleted_not_restarted(fake_gce: FakeGceServer) -> None:
    provider(fake_gce).provision(request(spot=True))
    [(_, body)] = inserts(fake_gce)
    assert body["scheduling"] == {"provisioningModel": "SPOT", "onHostMaintenance": "TERMINATE",
                                  "automaticRestart": False, "instanceTerminationAction": "DELETE"}


def test_configured_insert_body(fake_gce: FakeGceServer) -> None:
    gcp = provider(fake_gce, image="projects/wz/global/images/gpu-base", network="projects/wz/global/networks/gpu",
                   subnetwork="regions/us-central1/subnetworks/gpu-a", external_ip=False,
                   service_account_email="node@wz.iam.gserviceaccount.com", boot_disk_gb=500,
                   agent_install_command="pip install whalezen-agent --index-url {server_url}/simple")
    # No node name: the node is named after its instance. Extra tags become labels, GCP-spelled.
    req = dataclasses.replace(request(instance_type="g2-standard-8"), node_name="",
                              extra_tags=(("team::ML", "Vision Research/2026"), ("note", "x" * 70)))
    gcp.provision(req)
    custom_image = dataclasses.replace(request(instance_type="g2-standard-8", allocation_id="alloc-2"),
                                       image="projects/wz/global/images/pinned")
    gcp.provision(custom_image)

    [(_, body), (_, pinned)] = inserts(fake_gce)
    name = f"wz-{uuid_of(req.request_key)}"
    assert body["networkInterfaces"] == [{"network": "projects/wz/global/networks/gpu",
                                          "subnetwork": "regions/us-central1/subnetworks/gpu-a"}]
    assert body["serviceAccounts"] == [{"email": "node@wz.iam.gserviceaccount.com",
                                        "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}]
    assert body["disks"][0]["initializeParams"]["sourceImage"] == "projects/wz/global/images/gpu-base"
    assert body["disks"][0]["initializeParams"]["diskSizeGb"] == "500"
    assert pinned["disks"][0]["initializeParams"]["sourceImage"] == "projects/wz/global/images/pinned"
    assert body["labels"] == {"whalezen-broker": BROKER_ID, "whalezen-request": req.request_key,
                              "whalezen-allocation": "alloc-1", "whalezen-attempt": "1",
                              "team--ml": "vision-research-2026", "note": "x" * 63}
    script = {i["key"]: i["value"] for i in body["metadata"]["items"]}["startup-script"]
    assert script == agent_boot_script(server_url="http://broker.test:8000", join_token="join-secret-123",
                                       node_name=name,
                                       install_command="pip install whalezen-agent --index-url {server_url}/simple")


def test_broker_id_is_spelled_as_a_label_value(fake_gce: FakeGceServer) -> None:
    broker = "Team-A/Prod " + "b" * 60
    gcp = provider(fake_gce, broker_id=broker)
    req = request()
    gcp.provision(req)
    spelled = ("team-a-prod-" + "b" * 60)[:63]
    [(_, body)] = inserts(fake_gce)
    assert body["labels"]["whalezen-broker"] == spelled
    gcp.list_owned()
    [(_, _, query, _)] = fake_gce.fake.calls("GET", "/aggregated/instances")
    assert query["filter"] == [f'labels.whalezen-broker = "{spelled}"']


def test_provision_needs_a_zone(fake_gce: FakeGceServer) -> None:
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce).provision(dataclasses.replace(request(), zone=""))
    assert error_fields(caught.value) == (ErrorKind.BAD_REQUEST, False, "gcp", "", "GCP needs a zone")
    assert not fake_gce.fake.requests


def test_unknown_gpu_model_is_refused_before_any_call(fake_gce: FakeGceServer) -> None:
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce).provision(request(gpu_model="X9", gpu_count=2))
    assert error_fields(caught.value) == (ErrorKind.BAD_REQUEST, False, "gcp", "", "unknown GPU model X9")
    assert not fake_gce.fake.requests


def test_instance_gone_right_after_creation_keeps_its_ref(fake_gce: FakeGceServer) -> None:
    req = request()
    name = instance_name(req.request_key)
    answer(fake_gce, lambda method, path, query: (404, _error(404, "notFound", "gone"))
           if method == "GET" and path.endswith(f"/instances/{name}") else None)
    info = provider(fake_gce).provision(req)  # e.g. a spot VM preempted at once
    assert info == InstanceInfo(ref=InstanceRef(provider="gcp", region=REGION, zone=ZONE, instance_id=name),
                                state=InstanceState.TERMINATED, state_reason="not-found")


# -- adoption --------------------------------------------------------------------------------------
@pytest.mark.parametrize("whose", ["unlabelled", "other-broker", "other-request"])
def test_name_taken_without_both_our_labels_is_not_adopted(fake_gce: FakeGceServer, whose: str) -> None:
    req = request()
    name = instance_name(req.request_key)
    labels = {"unlabelled": {}, "other-broker": {"whalezen-broker": "another", "whalezen-request": req.request_key},
              "other-request": {"whalezen-broker": BROKER_ID, "whalezen-request": "wz-other-key"}}[whose]
    fake_gce.fake.plant_instance(PROJECT, ZONE, name, labels=labels)
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce).provision(req)
    assert error_fields(caught.value) == (
        ErrorKind.BAD_REQUEST, False, "gcp", "alreadyExists",
        f"instance {name} exists but does not carry this request's labels; not adopting it")


def test_operation_saying_already_exists_adopts_ours(fake_gce: FakeGceServer) -> None:
    req = request()
    name = instance_name(req.request_key)
    fake_gce.fake.fail_next_insert = "RESOURCE_ALREADY_EXISTS"
    real = fake_gce.fake.handle

    def handle(method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        reply = real(method, path, query, body)
        if method == "POST" and path.endswith(f"/zones/{ZONE}/instances"):  # a concurrent insert won the race
            fake_gce.fake.plant_instance(PROJECT, ZONE, name, labels=labels_of(req),
                                         created="2026-01-01T00:00:00.000-00:00")
        return reply

    fake_gce.fake.handle = handle  # type: ignore[method-assign]
    info = provider(fake_gce).provision(req)
    assert info == InstanceInfo(
        ref=InstanceRef(provider="gcp", region=REGION, zone=ZONE, instance_id=name), state=InstanceState.RUNNING,
        instance_type="n1-standard-8", request_key=req.request_key,
        launched_at=datetime(2026, 1, 1, tzinfo=timezone.utc), tags=tuple(sorted(labels_of(req).items())))


def test_adoption_lookup_refused_is_an_auth_error(fake_gce: FakeGceServer) -> None:
    req = request()
    name = instance_name(req.request_key)
    fake_gce.fake.plant_instance(PROJECT, ZONE, name, labels=labels_of(req))
    answer(fake_gce, lambda method, path, query: (403, _error(403, "forbidden", "no compute.instances.get"))
           if method == "GET" else None)
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce).provision(req)
    assert (caught.value.kind, caught.value.code) == (ErrorKind.AUTH, "Forbidden")


# -- waiting ---------------------------------------------------------------------------------------
@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[float]], None]:
    def install(readings: list[float]) -> None:
        values: Iterator[float] = iter(readings)
        last = readings[-1]
        monkeypatch.setattr(gcp_module, "time", types.SimpleNamespace(monotonic=lambda: next(values, last)))
    return install


def test_operation_still_running_at_the_default_deadline_is_transient(fake_gce: FakeGceServer, clock: Any) -> None:
    fake_gce.fake.polls_until_done = 100
    clock([0.0, 600.0, 10_000.0])  # the deadline is 600 s after the insert; the first poll ends right at it
    sleeps: list[float] = []
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce, sleep=sleeps.append).provision(request())
    [(_, _, op_name)] = fake_gce.fake.operations
    assert error_fields(caught.value) == (ErrorKind.TRANSIENT, False, "gcp", "OperationTimeout",
                                          f"operation {op_name} still running after 600s")
    assert sleeps == [] and len(fake_gce.fake.calls("POST", "/operations/")) == 1


def test_operation_polled_once_a_second_until_the_deadline(fake_gce: FakeGceServer, clock: Any) -> None:
    fake_gce.fake.polls_until_done = 100
    clock([0.0, 1.0, 2.0])
    sleeps: list[float] = []
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce, sleep=sleeps.append, operation_timeout_s=2.0).provision(request())
    assert caught.value.code == "OperationTimeout" and caught.value.message.endswith("still running after 2s")
    assert sleeps == [1.0] and len(fake_gce.fake.calls("POST", "/operations/")) == 2


# -- describe, terminate, list ---------------------------------------------------------------------
def ref_of(name: str, region: str = REGION) -> InstanceRef:
    return InstanceRef(provider="gcp", region=region, zone=ZONE, instance_id=name)


def test_describe_and_terminate_of_a_missing_instance_confirm_it_gone(fake_gce: FakeGceServer) -> None:
    gcp = provider(fake_gce)
    gone = InstanceInfo(ref=ref_of("wz-gone"), state=InstanceState.TERMINATED, state_reason="not-found")
    assert gcp.describe(ref_of("wz-gone")) == gone
    assert gcp.terminate(ref_of("wz-gone")) == gone


def test_terminate_sends_a_stable_request_id(fake_gce: FakeGceServer) -> None:
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-victim")
    assert provider(fake_gce).terminate(ref_of("wz-victim")) == InstanceInfo(ref=ref_of("wz-victim"),
                                                                            state=InstanceState.TERMINATING)
    [(_, _, query, _)] = fake_gce.fake.calls("DELETE", "/instances/wz-victim")
    assert query == {"requestId": [uuid_of("delete:wz-victim")]}


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_describe_and_terminate_refused_are_auth_errors(fake_gce: FakeGceServer, method: str) -> None:
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-x")
    answer(fake_gce, lambda m, path, query: (403, _error(403, "forbidden", "denied")) if m == method else None)
    gcp = provider(fake_gce)
    with pytest.raises(ProviderError) as caught:
        gcp.describe(ref_of("wz-x")) if method == "GET" else gcp.terminate(ref_of("wz-x"))
    assert (caught.value.kind, caught.value.code) == (ErrorKind.AUTH, "Forbidden")


def test_list_owned_records_carry_their_region(fake_gce: FakeGceServer) -> None:
    mine = {"whalezen-broker": BROKER_ID, "whalezen-request": "wz-k1"}
    fake_gce.fake.plant_instance(PROJECT, "europe-west4-b", "wz-a", labels=mine, status="STOPPING")
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-b", labels={"whalezen-broker": BROKER_ID})
    owned = sorted(provider(fake_gce).list_owned(), key=lambda i: i.ref.instance_id)
    assert owned == [
        InstanceInfo(ref=InstanceRef(provider="gcp", region="europe-west4", zone="europe-west4-b", instance_id="wz-a"),
                     state=InstanceState.STOPPING, instance_type="n1-standard-8", request_key="wz-k1",
                     launched_at=datetime(2026, 1, 1, tzinfo=timezone.utc), tags=tuple(sorted(mine.items()))),
        InstanceInfo(ref=InstanceRef(provider="gcp", region=REGION, zone=ZONE, instance_id="wz-b"),
                     state=InstanceState.RUNNING, instance_type="n1-standard-8",
                     launched_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                     tags=(("whalezen-broker", BROKER_ID),)),
    ]


@pytest.mark.parametrize("page", ["first", "second"])
def test_list_owned_refused_on_any_page_is_an_auth_error(fake_gce: FakeGceServer, page: str) -> None:
    fake_gce.fake.plant_instance(PROJECT, ZONE, "wz-b", labels={"whalezen-broker": BROKER_ID})

    def rule(method: str, path: str, query: dict) -> tuple[int, Any] | None:
        if "/aggregated/instances" not in path:
            return None
        if page == "first" or "pageToken" in query:
            return 403, _error(403, "forbidden", "denied")
        listing = fake_gce.fake._aggregated(PROJECT, query)
        return 200, {**listing, "nextPageToken": "page-2"}

    answer(fake_gce, rule)
    with pytest.raises(ProviderError) as caught:
        provider(fake_gce).list_owned()
    assert (caught.value.kind, caught.value.code) == (ErrorKind.AUTH, "Forbidden")


def test_instance_without_a_zone_takes_the_region_it_was_asked_in(fake_gce: FakeGceServer) -> None:
    req = request()
    name = instance_name(req.request_key)
    fake_gce.fake.plant_instance(PROJECT, ZONE, name, labels=labels_of(req))
    del fake_gce.fake.instances[(PROJECT, ZONE, name)]["zone"]
    gcp = provider(fake_gce)
    assert gcp.provision(req).ref == InstanceRef(provider="gcp", region=REGION, zone="", instance_id=name)  # adopted
    assert gcp.describe(ref_of(name, region="us-central2")).ref.region == "us-central2"
    [listed] = gcp.list_owned()
    assert listed.ref.region == ""


# -- records from instances ----------------------------------------------------------------------
def test_record_of_an_instance_with_nothing_set() -> None:
    assert instance_info(REGION, compute_v1.Instance()) == InstanceInfo(
        ref=InstanceRef(provider="gcp", region=REGION, zone="", instance_id=""), state=InstanceState.UNKNOWN,
        instance_type="", spot=False, request_key="", launched_at=None, private_ip="", public_ip="", tags=())


def test_record_of_an_instance_with_bare_names_and_no_external_ip() -> None:
    instance = compute_v1.Instance(
        name="wz-n", zone="europe-west4-b", machine_type="g2-standard-4", status="STAGING",
        creation_timestamp="2026-03-04T05:06:07.890Z", labels={"whalezen-request": "wz-k"},
        network_interfaces=[compute_v1.NetworkInterface(network_i_p="10.0.0.9")],
        scheduling=compute_v1.Scheduling(provisioning_model="SPOT"),
    )
    assert instance_info("", instance) == InstanceInfo(
        ref=InstanceRef(provider="gcp", region="europe-west4", zone="europe-west4-b", instance_id="wz-n"),
        state=InstanceState.PENDING, instance_type="g2-standard-4", spot=True, request_key="wz-k",
        launched_at=datetime(2026, 3, 4, 5, 6, 7, 890000, tzinfo=timezone.utc), private_ip="10.0.0.9",
        public_ip="", tags=(("whalezen-request", "wz-k"),))
    later = compute_v1.Instance(creation_timestamp="2026-03-04T05:06:07.890-08:00")
    assert instance_info("", later).launched_at == datetime(2026, 3, 4, 13, 6, 7, 890000, tzinfo=timezone.utc)


def test_offers_given_are_the_offers_listed(fake_gce: FakeGceServer) -> None:
    offers = [Offer(provider="gcp", region="us-west9", zone="us-west9-z", instance_type="n1-standard-8",
                    gpu_model="T4", gpu_count=1, gpu_memory_mib=16384, vcpus=8, memory_gib=30,
                    on_demand_per_hour=0.5),
              Offer(provider="aws", region="us-east-1", zone="us-east-1a", instance_type="g4dn.xlarge",
                    gpu_model="T4", gpu_count=1, gpu_memory_mib=16384, vcpus=4, memory_gib=16,
                    on_demand_per_hour=0.5)]
    assert provider(fake_gce, offers=offers).list_offers() == offers[:1]
