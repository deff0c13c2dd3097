"""Everything an agent sends is untrusted input (issue 8, items 2, 11, 12): each bad body is a 400
naming the field (409 for a GPU that belongs to another node), never a 500, and stores nothing;
what the real agent sends (`agent.protocol`, from simulated nodes) is accepted.
"""
from __future__ import annotations

import json

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from agent.backends.fake import FakeBackend
from agent.protocol import heartbeat_payload
from broker.agents.models import NodeAgent
from broker.inventory.models import Gpu, Node
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import JobEvent
from broker.jobs.states import JobState

from .conftest import is_postgres, requires_postgres
from .test_agent_api import API, agent_client, place, reading, register_body, report

# -- what the real agent sends -----------------------------------------------------------------


@pytest.fixture
def join_token(acme) -> str:
    return pool_join_token_issue(pool=acme.pool)


def register(body: dict, client: APIClient | None = None):
    return (client or APIClient()).post(f"{API}/register", body, format="json")


def raw_post(url: str, text: str, token: str | None = None):
    """A body as bytes on the wire: json.dumps escapes a lone surrogate as \\ud800, which a test
    client's own encoder could not send."""
    client = agent_client(token) if token else APIClient()
    return client.generic("POST", url, text.encode(), content_type="application/json")


@pytest.fixture
def registered(acme, join_token):
    resp = register(register_body(join_token))
    assert resp.status_code == 201, resp.content
    return Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]


@pytest.mark.parametrize("spec", ["8xH100-80GB-SXM", "4xT4", "8xV100-32GB-SXM2", "2xA100-80GB-SXM,lost=1,mig=on"])
def test_what_the_real_agent_sends_is_accepted(acme, join_token, spec):
    backend = FakeBackend(spec, hostname="real")
    backend.start()
    body = register_body(join_token, spec=spec, name="real")
    body["job_isolation"] = "separate-user"
    resp = register(body)
    assert resp.status_code == 201, resp.content
    token = resp.json()["node_token"]
    beat = heartbeat_payload(readings=backend.sample(), sampled_at=1.0, running={}, max_epoch=3,
                             missed_heartbeats=1, last_error="POST /heartbeat: broker unreachable (refused)")
    assert agent_client(token).post(f"{API}/heartbeat", beat, format="json").status_code == 200


def test_numa_node_is_optional(acme, join_token):
    body = register_body(join_token)
    for gpu in body["gpus"]:
        del gpu["numa_node"]
    resp = register(body)
    assert resp.status_code == 201, resp.content
    assert set(Gpu.objects.filter(node_id=resp.json()["node_id"]).values_list("numa_node", flat=True)) == {None}


# -- labels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("labels", [
    {"\ud800": "x"},  # the issue's poison key: a lone surrogate
    {"rack\u0000": "r1"},
    {"": "x"},
    {"-rack": "x"},
    {"rack": "r" * 64},
    {"n" * 64: "x"},
    {"Example.COM/rack": "x"},  # the prefix is a lowercase DNS subdomain
    {"/rack": "x"},
    {"rack": "a b"},
    {"rack": "\u00e9"},
    {"rack\n": "x"},
    {f"k{i}": "v" for i in range(65)},
    {"rack": 3},
])
def test_labels_outside_the_kubernetes_syntax_are_a_400_and_store_nothing(acme, join_token, labels):
    body = register_body(join_token)
    body["labels"] = labels
    resp = raw_post(f"{API}/register", json.dumps(body))
    assert resp.status_code == 400, resp.content
    assert set(resp.json()) & {"labels", "body"}  # the parser may refuse a NUL or lone surrogate first
    assert len(resp.content) < 4096
    assert not Node.objects.filter(name="gpu-node-1").exists()


def test_valid_labels_are_stored_and_replaced_at_the_next_registration(acme, join_token):
    body = register_body(join_token)
    body["labels"] = {"example.com/rack": "r12", "zone": "", "fabric": "infiniband", "a_b.c-d": "X.y_z-1"}
    node_id = register(body).json()["node_id"]
    assert Node.objects.get(pk=node_id).labels == body["labels"]
    body["labels"] = {"zone": "b"}
    assert register(body).status_code == 200
    assert Node.objects.get(pk=node_id).labels == {"zone": "b"}  # replaced, not merged


def test_bad_labels_stored_before_validation_do_not_break_the_node_list(acme, registered):
    node, _ = registered
    stored = {"bad key!": "x", "rack": "r1", "ok": "a b"}
    if not is_postgres():  # PostgreSQL's jsonb cannot even hold a lone surrogate; SQLite stored it
        stored.update({"\ud800": "x", "ok2": "\ud800"})
    Node.objects.filter(pk=node.pk).update(labels=stored)
    resp = acme.client.get("/api/v1/nodes/")
    assert resp.status_code == 200
    (shown,) = [n for n in resp.json()["results"] if n["id"] == node.pk]
    assert shown["labels"] == {"rack": "r1"}
    assert acme.client.get(f"/api/v1/nodes/{node.pk}/").status_code == 200


# -- topology, telemetry, unknown fields -----------------------------------------------------------
def test_topology_has_the_shape_the_agent_sends(acme, join_token):
    body = register_body(join_token)
    cases = [
        ({**body["topology"], "extra": {"a": [1] * 1000}}, "extra"),  # unknown key
        ({**body["topology"], "p2p_read": [["X", "OK"], ["OK"]]}, "p2p_read"),  # not square
        ({**body["topology"], "pcie_common_ancestor": [["X" * 40]]}, "pcie_common_ancestor"),
        ({**body["topology"], "p2p_nvlink": [[{"nested": "x"}]]}, "p2p_nvlink"),
        ({**body["topology"], "gpus": [{"index": 0, "nvlinks": [{"link": 0, "active": "yes"}]}]}, "gpus"),
        ({"pcie_common_ancestor": [["X"] * 65] * 65}, "pcie_common_ancestor"),
        ("a string", None),
    ]
    for topology, field in cases:
        resp = register({**body, "topology": topology})
        assert resp.status_code == 400, (topology, resp.content)
        assert "topology" in resp.json()
        if field:
            assert field in json.dumps(resp.json()["topology"])
    assert not Node.objects.filter(name="gpu-node-1").exists()


def test_oversized_topology_is_refused(acme, join_token):
    body = register_body(join_token, spec="8xH100-80GB-SXM")
    gpus = body["topology"]["gpus"]
    # Within every per-field limit and the body limit, but 40 GPUs x 32 links is over the size cap.
    link = {"link": 0, "active": True, "remote_pci_bus_id": "0" * 32, "remote_device_type": "switch",
            "remote_gpu_index": None}
    body["topology"]["gpus"] = [{**gpus[0], "index": i, "nvlinks": [{**link, "link": n} for n in range(32)]}
                                for i in range(40)]
    assert 128 * 1024 < len(json.dumps(body["topology"])) and len(json.dumps(body)) < 256 * 1024
    resp = register(body)
    assert resp.status_code == 400 and "topology" in resp.json()


@pytest.mark.parametrize("change", [
    {"surprise": 1},
    {"cpu_milli": "8000"},  # numbers are numbers, as in a job spec
    {"cpu_milli": True},
    {"memory_mb": 2**70},
    {"hostname": "h" * 300},
    {"agent_key": 1234567890},
    {"job_isolation": "root"},
])
def test_malformed_registration_fields_are_refused(acme, join_token, change):
    body = {**register_body(join_token), **change}
    resp = register(body)
    assert resp.status_code == 400, resp.content
    # The parser refuses numbers no field could hold before any serializer (naming `body`).
    assert set(resp.json()) & {next(iter(change)), "body"}
    assert len(resp.content) < 4096  # errors quote a short excerpt at most
    assert not Node.objects.filter(name="gpu-node-1").exists()


def test_unknown_gpu_fields_are_refused(acme, join_token):
    body = register_body(join_token)
    body["gpus"][0]["firmware"] = "x" * 100_000
    resp = register(body)
    assert resp.status_code == 400 and "gpus" in resp.json() and len(resp.content) < 4096


@pytest.mark.parametrize("body", [
    {"telemetry": [reading(0, surprise=1)]},
    {"telemetry": [reading(0, memory_used_mb=2**63)]},
    {"telemetry": [reading(0, power_w="NaN")]},
    {"telemetry": [reading(0, health_reasons=["x"] * 33)]},
    {"telemetry": [reading(0, health="HEALTHY" * 10_000)]},
    {"processes": [{"assignment_id": "1", "state": "zombie"}]},
    {"processes": [{"assignment_id": "1", "extra": [1, 2]}]},
    {"last_error": "e" * 2001},
    {"bogus": {}},
])
def test_bad_heartbeats_are_refused_and_change_nothing(registered, body):
    node, token = registered
    before = list(Gpu.objects.filter(node=node).values_list("utilization_pct", "health"))
    resp = agent_client(token).post(f"{API}/heartbeat", body, format="json")
    assert resp.status_code == 400, resp.content
    assert len(resp.content) < 4096
    assert list(Gpu.objects.filter(node=node).values_list("utilization_pct", "health")) == before
    assert NodeAgent.objects.get(node=node).last_telemetry == []


def test_heartbeats_checked_at_once_each_get_their_own_answer():
    """The heartbeat's serializers share their fields' prototypes across requests (PrebuiltFieldsMixin):
    sixteen threads checking bodies at once must each get their own values and their own errors."""
    from concurrent.futures import ThreadPoolExecutor

    from broker.agents.serializers import HeartbeatSerializer

    def check(i: int) -> tuple[int, bool, object]:
        bad = i % 2 == 1  # odd bodies carry one bad reading, at a position of their own
        telemetry = [reading(k, utilization_pct=(101 + i) if bad and k == i % 4 else i % 100) for k in range(4)]
        body = {"agent_version": f"v{i}", "telemetry": telemetry, "missed_heartbeats": i}
        serializer = HeartbeatSerializer(data=body)
        ok = serializer.is_valid()
        return i, ok, serializer.validated_data if ok else serializer.errors

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(check, range(400)))
    for i, ok, answer in answers:
        if i % 2 == 0:
            assert ok, answer
            assert answer["agent_version"] == f"v{i}" and answer["missed_heartbeats"] == i
            assert [r["utilization_pct"] for r in answer["telemetry"]] == [i % 100] * 4
        else:
            assert not ok
            assert list(answer["telemetry"]) == [i % 4], answer  # the error is where this body had its bad reading, only there
            assert "utilization_pct" in answer["telemetry"][i % 4]


# -- job isolation ---------------------------------------------------------------------------------
def test_job_isolation_is_stored_and_shown_to_the_tenant(acme, join_token):
    body = {**register_body(join_token), "job_isolation": "shared-user"}
    node_id = register(body).json()["node_id"]
    assert NodeAgent.objects.get(node_id=node_id).job_isolation == "shared-user"
    nodes = {n["id"]: n for n in acme.client.get("/api/v1/nodes/").json()["results"]}
    assert nodes[int(node_id)]["job_isolation"] == "shared-user"
    assert nodes[acme.nodes[0].pk]["job_isolation"] is None  # no agent yet: nobody said


# -- ids and keys in ASCII digits ----------------------------------------------------------------
def test_assignment_ids_are_ascii_digits_and_in_range(acme, registered):
    node, token = registered
    _, allocation = place(acme, node)
    client = agent_client(token)
    body = {"epoch": allocation.epoch, "state": "running"}
    for bad in ("%C2%B2", "\u0661", "1%C2%B2", "-1", "1.0", "9" * 19, "99999999999999999999999999"):
        resp = client.post(f"{API}/assignments/{bad}/status", body, format="json")
        assert resp.status_code == 404, (bad, resp.status_code)
    assert client.post(f"{API}/assignments/{'9' * 18}/status", body, format="json").status_code == 404
    assert client.post(f"{API}/assignments/{allocation.pk}/status", body, format="json").status_code == 200


@pytest.mark.parametrize("failed_gpus", [{"\u00b2": ["x"]}, {"\u0661": []}, {"64": []}, {"00": ["x"] * 33},
                                         {"1": "lost"}, ["1"]])
def test_failed_gpus_keys_are_ascii_gpu_indices(acme, registered, failed_gpus):
    node, token = registered
    job, allocation = place(acme, node)
    resp = report(token, allocation, "failed", reason="signal", exit_code=-9, failed_gpus=failed_gpus)
    assert resp.status_code == 400 and "failed_gpus" in resp.json()
    job.refresh_from_db()
    assert job.state == JobState.PLACED and not job.events.filter(kind="agent").exists()


def test_status_report_fields_are_checked(acme, registered):
    node, token = registered
    _, allocation = place(acme, node)
    for extra in ({"surprise": 1}, {"exit_code": "0"}, {"pid": 2**40}, {"reason": "r" * 25}):
        resp = report(token, allocation, "running", **extra)
        assert resp.status_code == 400 and next(iter(extra)) in resp.json()


# -- duplicate GPUs ------------------------------------------------------------------------------
def test_a_gpu_uuid_twice_in_one_node_is_a_400(acme, join_token):
    body = register_body(join_token)
    body["gpus"][1]["uuid"] = body["gpus"][0]["uuid"]
    resp = register(body)
    assert resp.status_code == 400 and "UUID" in str(resp.json()["gpus"])
    assert not Node.objects.filter(name="gpu-node-1").exists()


def test_a_gpu_uuid_of_another_tenants_node_is_a_409_that_names_neither(acme, globex, registered):
    node, _ = registered
    stolen = list(node.gpus.order_by("index").values_list("uuid", flat=True))
    globex_token = pool_join_token_issue(pool=globex.pool)
    body = register_body(globex_token, name="copycat", agent_key="key-copycat")
    body["gpus"][2]["uuid"] = stolen[2]
    resp = register(body)
    assert resp.status_code == 409 and "gpus" in resp.json()
    text = resp.content.decode()
    assert node.name not in text and "acme" not in text.lower() and acme.pool.name not in text
    assert not Node.objects.filter(name="copycat").exists()
    # The same node registering again with its own GPUs is no conflict.
    assert register(register_body(pool_join_token_issue(pool=acme.pool))).status_code == 200


# -- reports for finished jobs -------------------------------------------------------------------
@pytest.mark.parametrize("late", ["running", "exited", "failed", "stopped", "checkpoint_requested"])
def test_reports_for_a_finished_job_record_nothing_and_are_acknowledged(acme, registered, late):
    node, token = registered
    job, allocation = place(acme, node)
    assert report(token, allocation, "running", reason="started").status_code == 200
    assert report(token, allocation, "exited", reason="exit", exit_code=0).status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    events = list(JobEvent.objects.filter(job=job).values_list("pk", flat=True))
    shown_before = acme.client.get(f"/api/v1/jobs/{job.pk}/events/").json()["results"]
    # 2xx: the agent drops the report from its outbox instead of retrying it forever.
    resp = report(token, allocation, late, reason="started", failed_gpus={"1": ["Xid 79"]})
    assert resp.status_code == 200 and resp.json()["recorded"] is False
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert list(JobEvent.objects.filter(job=job).values_list("pk", flat=True)) == events
    assert Gpu.objects.get(node=node, index=1).health == "HEALTHY"
    assert acme.client.get(f"/api/v1/jobs/{job.pk}/events/").json()["results"] == shown_before


# -- rate limits ---------------------------------------------------------------------------------
@override_settings(WHALEZEN_AGENT_REGISTER_RATE="3/min")
def test_anonymous_registration_is_limited_per_client_address(acme, join_token):
    answers = [register({"join_token": "nonsense"}).status_code for _ in range(3)]
    assert answers == [400, 400, 400]
    resp = register(register_body(join_token))
    assert resp.status_code == 429 and int(resp["Retry-After"]) > 0
    assert not Node.objects.filter(name="gpu-node-1").exists()
    # Forged X-Forwarded-For does not buy a new budget; another address has its own.
    assert APIClient(HTTP_X_FORWARDED_FOR="10.9.9.9").post(f"{API}/register", {}, format="json").status_code == 429
    other = APIClient(REMOTE_ADDR="10.0.0.2")
    assert other.post(f"{API}/register", register_body(join_token), format="json").status_code == 201


def test_the_default_registration_limit_lets_a_demo_start(acme, join_token):
    # `make run` starts 7 agents on one address at once (plus cloud-sim instances later).
    for i in range(10):
        body = register_body(join_token, name=f"demo-{i}", agent_key=f"key-demo-{i:04d}")
        assert register(body).status_code == 201


@override_settings(WHALEZEN_AGENT_HEARTBEAT_RATE="5/min", WHALEZEN_AGENT_STATUS_RATE="2/min")
def test_node_calls_are_limited_per_node(acme, join_token):
    first = register(register_body(join_token, name="n-1", agent_key="key-n1-xxxx")).json()
    second = register(register_body(join_token, name="n-2", agent_key="key-n2-xxxx")).json()
    client = agent_client(first["node_token"])
    codes = [client.post(f"{API}/heartbeat", {"telemetry": []}, format="json").status_code for _ in range(6)]
    assert codes == [200] * 5 + [429]
    other = agent_client(second["node_token"])
    assert other.post(f"{API}/heartbeat", {"telemetry": []}, format="json").status_code == 200
    node = Node.objects.get(pk=first["node_id"])
    _, allocation = place(acme, node)
    assert [report(first["node_token"], allocation, "running").status_code for _ in range(3)] == [200, 200, 429]


def test_gpus_renumbered_between_registrations_keep_their_uuids(acme, join_token):
    body = register_body(join_token)
    node_id = register(body).json()["node_id"]
    body["gpus"][0]["uuid"], body["gpus"][1]["uuid"] = body["gpus"][1]["uuid"], body["gpus"][0]["uuid"]
    assert register(body).status_code == 200
    uuids = dict(Gpu.objects.filter(node_id=node_id).values_list("index", "uuid"))
    assert [uuids[0], uuids[1]] == [body["gpus"][0]["uuid"], body["gpus"][1]["uuid"]]


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_one_gpu_uuid_registered_by_two_nodes_at_once_lands_on_one(acme, globex, gpu_models):
    """The check before the insert can race; the database's unique index answers the loser 409."""
    import threading

    from django.db import connection

    tokens_ = [pool_join_token_issue(pool=acme.pool), pool_join_token_issue(pool=globex.pool)]
    shared = "GPU-" + "ab" * 18
    barrier = threading.Barrier(2)
    codes: list[int] = []

    def attempt(i: int) -> None:
        try:
            body = register_body(tokens_[i], name=f"racer-{i}", agent_key=f"key-racer-{i:04d}")
            body["gpus"][0]["uuid"] = shared
            barrier.wait()
            codes.append(register(body).status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(codes) == [201, 409]
    assert Gpu.objects.filter(uuid=shared).count() == 1
    assert Node.objects.filter(name__startswith="racer-").count() == 1


def test_the_database_refuses_a_uuid_twice_even_when_the_check_is_raced(acme, globex, registered, monkeypatch):
    # What a registration that passed the check just before another one committed meets.
    monkeypatch.setattr("broker.agents.services._refuse_duplicate_gpus", lambda **kwargs: None)
    node, _ = registered
    body = register_body(pool_join_token_issue(pool=globex.pool), name="copycat", agent_key="key-copycat")
    body["gpus"][0]["uuid"] = node.gpus.get(index=3).uuid
    resp = register(body)
    assert resp.status_code == 409 and "gpus" in resp.json()
    assert not Node.objects.filter(name="copycat").exists()
