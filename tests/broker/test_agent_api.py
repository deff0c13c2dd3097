"""The broker side of the agent protocol through the HTTP API (docs/agent.md).

Registration bodies are built by the agent's own code (`agent.protocol`) from a simulated node, so
the broker is tested against exactly what agents send.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from agent.backends.fake import FakeBackend
from agent.protocol import registration_payload
from broker.agents.models import AssignmentReport, NodeAgent
from broker.agents.services import lost_after_seconds, nodes_mark_lost
from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import Allocation, Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_transition, jobs_requeue_on_node
from broker.jobs.states import JobState
from broker.tenancy import tokens

from .conftest import requires_postgres
from .test_api_tenancy import submit

API = "/api/v1/agent"


def register_body(join_token: str, *, name: str = "gpu-node-1", spec: str = "4xA100-80GB-SXM",
                  agent_key: str = "key-aaaaaaaa") -> dict:
    backend = FakeBackend(spec, hostname=name)
    backend.start()
    return registration_payload(inventory=backend.inventory(), join_token=join_token, name=name,
                                agent_key=agent_key, labels={"rack": "r1"})


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def join_token(acme) -> str:
    return pool_join_token_issue(pool=acme.pool)


@pytest.fixture
def registered(acme, join_token):
    """A registered 4xA100 node: (node, node token)."""
    resp = APIClient().post(f"{API}/register", register_body(join_token), format="json")
    assert resp.status_code == 201, resp.content
    return Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]


def reading(index: int, **overrides) -> dict:
    values = {"index": index, "uuid": None, "utilization_pct": 40 + index, "memory_utilization_pct": 10,
              "memory_used_mb": 1000 * (index + 1), "memory_total_mb": 81920, "temperature_c": 50 + index,
              "power_w": 200.5, "power_limit_w": 400.0, "ecc_corrected": 0, "ecc_uncorrected": 0,
              "retired_pages": None, "remapped_rows_pending": False, "remapped_rows_failed": False,
              "xid_errors": [], "mig_mode": "disabled", "lost": False, "health": "HEALTHY", "health_reasons": []}
    values.update(overrides)
    return values


# -- registration --------------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["nonsense", "wzj_deadbeef_" + "x" * 43, "wzi_00000000_" + "0" * 64])
def test_bad_join_token_is_refused(acme, join_token, token):
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    assert resp.status_code == 401
    assert resp.json() == {"detail": "Invalid join token."}
    assert not Node.objects.filter(name="gpu-node-1").exists()


def test_join_token_of_a_disabled_pool_is_refused(acme, join_token):
    acme.pool.enabled = False
    acme.pool.save()
    assert APIClient().post(f"{API}/register", register_body(join_token), format="json").status_code == 401


def test_registration_records_the_node_its_gpus_and_topology(acme, join_token):
    resp = APIClient().post(f"{API}/register", register_body(join_token, spec="8xH100-80GB-SXM,nvlink=2x4"),
                            format="json")
    assert resp.status_code == 201
    body = resp.json()
    assert body["heartbeat_seconds"] == 5 and body["node_token"].startswith("wzn_")
    node = Node.objects.get(pk=body["node_id"])
    assert (node.pool, node.tenant, node.state) == (acme.pool, acme.tenant, NodeState.ONLINE)
    assert node.cpu_milli == 8 * 24 * 1000 and node.labels == {"rack": "r1"}
    assert node.epoch == body["epoch"] >= 1
    # The token is stored only as a hash, with its lookup prefix.
    assert node.token_hash == tokens.digest(body["node_token"]) and body["node_token"] not in str(node.__dict__)
    gpus = list(node.gpus.order_by("index"))
    assert [g.nvlink_island for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpus[0].model.name == "H100-80GB" and gpus[0].model_name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].memory_mb == 81559 and gpus[0].uuid.startswith("GPU-") and gpus[0].pci_bus_id
    assert node.topology["pcie_common_ancestor"][0][:2] == ["X", "PIX"]
    assert node.topology["gpus_summary"][5]["nvlink_peers"] == [4, 6, 7]
    assert NodeAgent.objects.get(node=node).backend == "fake:8xH100-80GB-SXM,nvlink=2x4"


def test_same_agent_registering_again_keeps_its_node_and_gets_a_new_token(registered, join_token):
    node, old_token = registered
    resp = APIClient().post(f"{API}/register", register_body(join_token), format="json")
    assert resp.status_code == 200 and resp.json()["node_id"] == str(node.pk)
    assert Node.objects.filter(name="gpu-node-1").count() == 1
    assert agent_client(old_token).get(f"{API}/assignments").status_code == 401
    assert agent_client(resp.json()["node_token"]).get(f"{API}/assignments").status_code == 200


def test_another_agent_cannot_take_a_live_nodes_name(registered, join_token):
    resp = APIClient().post(f"{API}/register", register_body(join_token, agent_key="key-bbbbbbbb"), format="json")
    assert resp.status_code == 409
    assert "another agent" in resp.json()["name"][0]


def test_another_agent_may_take_over_a_lost_node(registered, join_token):
    node, _ = registered
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    resp = APIClient().post(f"{API}/register", register_body(join_token, agent_key="key-bbbbbbbb"), format="json")
    assert resp.status_code == 200 and resp.json()["node_id"] == str(node.pk)
    node.refresh_from_db()
    assert node.state == NodeState.ONLINE and NodeAgent.objects.get(node=node).agent_key == "key-bbbbbbbb"


def test_agent_takes_over_a_pre_created_simulated_node(acme, join_token):
    node = acme.nodes[0]  # seeded: 8xA100-80GB, labels simulated=true, no agent
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(2, 3))])
    resp = APIClient().post(f"{API}/register", register_body(join_token, name=node.name, spec="8xA100-80GB-SXM"),
                            format="json")
    assert resp.status_code == 200 and resp.json()["node_id"] == str(node.pk)
    node.refresh_from_db()
    assert "simulated" not in node.labels
    assert all(g.uuid.startswith("GPU-") and "-sim-" not in g.uuid for g in node.gpus.all())
    assert Allocation.objects.get(job=job).active  # the GPUs it already holds are the same rows


def test_fewer_gpus_than_before_marks_the_missing_ones_failed(acme, join_token):
    node = acme.nodes[0]
    APIClient().post(f"{API}/register", register_body(join_token, name=node.name, spec="6xA100-80GB-SXM"),
                     format="json")
    health = list(node.gpus.order_by("index").values_list("health", flat=True))
    assert health == [GpuHealth.HEALTHY] * 6 + [GpuHealth.FAILED] * 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpus": None}, "gpus"),
        ({"name": "bad name!"}, "name"),
        ({"agent_key": "short"}, "agent_key"),
        ({"cpu_milli": -1}, "cpu_milli"),
    ],
)
def test_malformed_registration_is_a_400_naming_the_field(acme, join_token, change, field):
    body = register_body(join_token)
    body.update(change)
    if body["gpus"] is None:
        del body["gpus"]
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 400 and field in resp.json()


def test_duplicate_gpu_index_is_refused(acme, join_token):
    body = register_body(join_token)
    body["gpus"][1]["index"] = 0
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 400 and "once" in str(resp.json()["gpus"])


def test_cloud_instance_one_time_token_registers_under_the_instance_name(acme, gpu_models, monkeypatch):
    from broker.inventory.models import CloudInstance, Pool, PoolKind
    from broker.provisioning.services import instance_join_token

    pool = Pool.objects.create(tenant=acme.tenant, name="aws-east", kind=PoolKind.AWS, region="us-east-1")
    instance = CloudInstance.objects.create(tenant=acme.tenant, pool=pool, request_key="k" * 40,
                                            instance_type="p4d.24xlarge", node_name="aws-east-kkkk")
    token = instance_join_token(instance)
    CloudInstance.objects.filter(pk=instance.pk).update(join_token_hash=tokens.digest(token))
    handed_over = []
    monkeypatch.setattr("broker.provisioning.services.instance_node_registered",
                        lambda *, node: handed_over.append(node.name) or [])
    resp = APIClient().post(f"{API}/register", register_body(token, name="whatever"), format="json")
    assert resp.status_code == 201
    node = Node.objects.get(pk=resp.json()["node_id"])
    assert (node.pool, node.name) == (pool, "aws-east-kkkk")
    assert handed_over == ["aws-east-kkkk"]


# -- heartbeats ----------------------------------------------------------------------------------
def test_heartbeat_stores_telemetry_per_gpu(registered):
    node, token = registered
    telemetry = [reading(i) for i in range(4)]
    telemetry[2] = reading(2, health="FAILED", ecc_uncorrected=3, xid_errors=[48],
                           health_reasons=["Xid 48: double-bit ECC error"])
    telemetry.append(reading(9))  # not a GPU of this node: ignored
    resp = agent_client(token).post(f"{API}/heartbeat", {"telemetry": telemetry, "processes": [],
                                                          "missed_heartbeats": 2}, format="json")
    assert resp.status_code == 200
    assert resp.json() == {"epoch": node.epoch, "lost": False, "heartbeat_seconds": 5}
    gpus = {g.index: g for g in Gpu.objects.filter(node=node)}
    assert [gpus[i].utilization_pct for i in range(4)] == [40, 41, 42, 43]
    assert [gpus[i].memory_used_mb for i in range(4)] == [1000, 2000, 3000, 4000]
    assert gpus[1].temperature_c == 51 and gpus[1].power_w == 200.5 and gpus[1].last_seen_at is not None
    assert gpus[2].health == GpuHealth.FAILED and gpus[2].ecc_errors == 3
    agent = NodeAgent.objects.get(node=node)
    assert agent.last_telemetry[2]["xid_errors"] == [48] and agent.missed_heartbeats == 2
    node.refresh_from_db()
    assert node.last_heartbeat_at is not None


@pytest.mark.parametrize("header", [None, "Bearer nonsense", "Bearer wzn_deadbeef_" + "y" * 43, "Token abc"])
def test_agent_calls_need_a_valid_node_token(registered, header):
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    assert client.post(f"{API}/heartbeat", {"telemetry": []}, format="json").status_code in (401, 403)
    assert client.get(f"{API}/assignments").status_code in (401, 403)


def test_user_api_tokens_are_not_node_tokens(registered, acme):
    assert agent_client(acme.token_secret).get(f"{API}/assignments").status_code == 401


def test_bad_telemetry_is_a_400(registered):
    _, token = registered
    resp = agent_client(token).post(f"{API}/heartbeat", {"telemetry": [reading(0, utilization_pct=250)]},
                                    format="json")
    assert resp.status_code == 400 and "telemetry" in resp.json()


# -- assignments and status reports ------------------------------------------------------------
def place(acme, node, indices=(1, 3), **spec):
    job = submit(acme, resources={"gpus": len(indices)}, env={"LR": "0.1"},
                 checkpoint={"uri": "s3://ckpt-bucket/train"}, **spec)
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=tuple(indices))])
    return job, allocation


def test_assignments_list_active_allocations_with_everything_to_start_them(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    body = agent_client(token).get(f"{API}/assignments").json()
    node.refresh_from_db()
    assert body["epoch"] == node.epoch
    (a,) = body["assignments"]
    uuids = dict(node.gpus.values_list("index", "uuid"))
    assert a == {"id": str(allocation.pk), "job_id": str(job.pk), "epoch": allocation.epoch, "action": "start",
                 "gpu_indices": [1, 3], "gpu_uuids": [uuids[1], uuids[3]], "gpu_milli": 1000,
                 "command": ["python", "train.py"], "image": None, "env": {"LR": "0.1"},
                 "checkpoint_uri": "s3://ckpt-bucket/train", "checkpoint_request_id": None,
                 "restore_from": "",  # no committed checkpoint yet: start afresh
                 # A single-node job is a gang of one, at the address its registration came from.
                 "gang": {"rank": 0, "node_addresses": ["127.0.0.1"], "gpus_per_node": 2,
                          "master_port": 10000 + job.pk % 20000, "skypilot_env": False}}


def test_checkpointing_and_migrating_jobs_get_checkpoint_and_stop(acme, registered):
    node, token = registered
    job, _ = place(acme, node)
    for to in (JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINTING):
        job = job_transition(job=job, to=to)
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert a["action"] == "checkpoint" and a["checkpoint_request_id"].startswith(f"job{job.pk}-ev")
    job_transition(job=job, to=JobState.MIGRATING)
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert a["action"] == "stop"


def report(token, allocation, state, **extra):
    body = {"epoch": allocation.epoch, "state": state, "exit_code": None, "message": state, **extra}
    return agent_client(token).post(f"{API}/assignments/{allocation.pk}/status", body, format="json")


def test_running_then_exited_moves_the_job_to_succeeded_and_frees_its_gpus(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    assert report(token, allocation, "running", reason="started", pid=123).status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert report(token, allocation, "exited", reason="exit", exit_code=0).status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert not Allocation.objects.get(pk=allocation.pk).active
    assert AssignmentReport.objects.get(allocation=allocation).state == "exited"
    assert JobEvent.objects.filter(job=job, kind="agent").count() == 2
    assert agent_client(token).get(f"{API}/assignments").json()["assignments"] == []


def test_a_start_reads_as_one_start_in_the_jobs_timeline(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    assert report(token, allocation, "running", reason="started", pid=123).status_code == 200
    timeline = [(e.data.get("to"), e.reason_code, e.message)
                for e in JobEvent.objects.filter(job=job, kind="state").order_by("id")][-2:]
    assert timeline == [(JobState.STARTING, "AGENT_STARTED", f"{node.name} started the job's process."),
                        (JobState.RUNNING, "AGENT_RUNNING", f"Running on {node.name}.")]


def test_repeated_reports_change_nothing_more(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    for _ in range(2):
        assert report(token, allocation, "running", reason="started").status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert JobEvent.objects.filter(job=job, kind="state", data__to=JobState.RUNNING).count() == 1


def test_failed_exit_fails_the_job(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    report(token, allocation, "failed", reason="exit_code", exit_code=3, message="exited with code 3")
    job.refresh_from_db()
    assert job.state == JobState.FAILED


def test_refused_or_agent_crash_requeues_the_job(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "refused", reason="gpu_failed", message="GPU 1 is FAILED: Xid 79")
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "ASSIGNMENT_REFUSED"
    assert "GPU 1 is FAILED" in job.pending_reason
    job2, allocation2 = place(acme, node, indices=(0,))
    report(token, allocation2, "running", reason="started")
    report(token, allocation2, "failed", reason="agent_crashed", message="agent restarted while the job ran")
    job2.refresh_from_db()
    assert job2.state == JobState.PENDING and job2.pending_reason_code == "AGENT_RESTARTED"


def test_an_assignment_no_agent_can_run_fails_the_job_instead_of_looping(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "refused", reason="invalid",
           message="invalid assignment: command must be a non-empty argv list or shell string")
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.events.filter(reason_code="ASSIGNMENT_INVALID").exists()


def test_failure_on_a_failed_gpu_requeues_instead_of_failing_the_job(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    resp = report(token, allocation, "failed", reason="signal", exit_code=-9,
                  failed_gpus={"3": ["GPU is lost (fell off the bus); needs a reset or a reboot"]})
    assert resp.status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "GPU_FAILED"
    assert "GPU 3: GPU is lost" in job.pending_reason
    assert Gpu.objects.get(node=node, index=3).health == GpuHealth.FAILED
    assert report(token, allocation, "failed", failed_gpus={"x": []}).status_code == 400


def test_report_for_a_released_allocation_is_recorded_but_moves_nothing(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    job_transition(job=Job.objects.get(pk=job.pk), to=JobState.PENDING, reason_code="TEST")
    assert report(token, allocation, "stopped", reason="withdrawn", exit_code=0).status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert AssignmentReport.objects.get(allocation=allocation).state == "stopped"


def test_reports_with_a_wrong_epoch_or_for_other_nodes_are_rejected(acme, registered):
    node, token = registered
    _, allocation = place(acme, node)
    resp = report(token, allocation, "running", epoch=allocation.epoch + 5)
    assert resp.status_code == 409 and "epoch" in resp.json()
    _, foreign = place(acme, acme.nodes[1], indices=(0,))
    assert report(token, foreign, "running").status_code == 404
    assert agent_client(token).post(f"{API}/assignments/abc/status", {"epoch": 1, "state": "running"},
                                    format="json").status_code == 404
    assert report(token, allocation, "exploded").status_code == 400


def test_gang_job_succeeds_only_when_every_node_exited(acme, join_token):
    tokens_by_node = {}
    for name in ("gang-a", "gang-b"):
        resp = APIClient().post(f"{API}/register",
                                register_body(join_token, name=name, agent_key=f"key-{name}-xx"), format="json")
        tokens_by_node[name] = (Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"])
    job = submit(acme, resources={"gpus": 2, "nodes": 2})
    allocations = allocation_commit(job=job, requests=[GpuRequest(node=n, gpu_indices=(0, 1))
                                                       for n, _ in tokens_by_node.values()])
    (node_a, token_a), (node_b, token_b) = tokens_by_node.values()
    alloc_a, alloc_b = sorted(allocations, key=lambda a: a.node_id == node_b.pk)
    report(token_a, alloc_a, "running", reason="started")
    report(token_a, alloc_a, "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.STARTING  # RUNNING only once every part has started
    report(token_b, alloc_b, "running", reason="started")
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    report(token_b, alloc_b, "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


# -- lost nodes ----------------------------------------------------------------------------------
def test_silent_node_is_marked_lost_and_its_jobs_requeued(acme, registered, settings):
    settings.WHALEZEN_BROKER_PROBE_URL = ""  # no web server here: the agents' way in counts as up
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    node.refresh_from_db()
    epoch_before = node.epoch
    assert nodes_mark_lost(now=timezone.now() + timedelta(seconds=lost_after_seconds() - 5)) == []
    (lost,) = nodes_mark_lost(now=timezone.now() + timedelta(seconds=lost_after_seconds() + 5))
    assert lost.pk == node.pk and lost.state == NodeState.LOST
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "NODE_LOST"
    assert not Allocation.objects.get(pk=allocation.pk).active
    node.refresh_from_db()
    assert node.epoch > epoch_before
    # Simulated nodes without an agent never heartbeat and are never marked lost.
    assert all(n.state == NodeState.ONLINE for n in Node.objects.filter(pk__in=[n.pk for n in acme.nodes]))
    # Running the sweep again finds nothing more to do.
    assert nodes_mark_lost(now=timezone.now() + timedelta(seconds=lost_after_seconds() + 5)) == []


def test_heartbeat_brings_a_lost_node_back(registered, settings):
    settings.WHALEZEN_BROKER_PROBE_URL = ""  # no web server here: the agents' way in counts as up
    node, token = registered
    nodes_mark_lost(now=timezone.now() + timedelta(seconds=lost_after_seconds() + 1))
    resp = agent_client(token).post(f"{API}/heartbeat", {"telemetry": []}, format="json").json()
    assert resp["lost"] is True
    node.refresh_from_db()
    assert node.state == NodeState.ONLINE and resp["epoch"] == node.epoch
    assert agent_client(token).post(f"{API}/heartbeat", {"telemetry": []}, format="json").json()["lost"] is False


def test_agent_endpoints_are_not_in_the_public_api_document(client):
    import yaml

    schema = yaml.safe_load(client.get("/api/schema/").content)
    assert not [p for p in schema["paths"] if "/agent/" in p]


def test_the_owner_sees_the_end_of_a_failed_jobs_output(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started", pid=5)
    tail = "Traceback (most recent call last):\n  ...\nFileNotFoundError: train.py\n"
    assert report(token, allocation, "failed", reason="exit_code", exit_code=1, output_tail=tail).status_code == 200
    events = acme.client.get(f"/api/v1/jobs/{job.pk}/events/").json()["results"]
    failed = [e for e in events if e["reason_code"] == "AGENT_FAILED"]
    assert failed and failed[0]["data"]["output_tail"] == tail


# -- the one-time instance token and instances the broker gave up on (issue 8, item 4) ----------
def cloud_instance(acme, *, key: str = "k" * 40, state: str = "PENDING"):
    """A launched cloud instance waiting for its agent: (instance, its one-time join token)."""
    from broker.inventory.models import CloudInstance, Pool, PoolKind
    from broker.provisioning.services import instance_join_token

    pool, _ = Pool.objects.get_or_create(tenant=acme.tenant, name="aws-east", kind=PoolKind.AWS, region="us-east-1")
    instance = CloudInstance.objects.create(tenant=acme.tenant, pool=pool, request_key=key, state=state,
                                            instance_type="p4d.24xlarge", node_name=f"aws-east-{key[-4:]}")
    token = instance_join_token(instance)
    CloudInstance.objects.filter(pk=instance.pk).update(join_token_hash=tokens.digest(token))
    instance.refresh_from_db()
    return instance, token


def test_instance_token_works_once_then_401_forever(acme, gpu_models):
    instance, token = cloud_instance(acme)
    first = APIClient().post(f"{API}/register", register_body(token, agent_key="key-first-agent"), format="json")
    assert first.status_code == 201
    instance.refresh_from_db()
    assert instance.node_id == int(first.json()["node_id"]) and instance.join_token_hash == ""
    # The same agent again (its first answer lost) and anyone else: refused, nothing changes.
    for agent_key in ("key-first-agent", "key-intruder-1"):
        resp = APIClient().post(f"{API}/register", register_body(token, agent_key=agent_key), format="json")
        assert resp.status_code == 401 and resp.json() == {"detail": "Invalid join token."}
    assert NodeAgent.objects.get(node_id=instance.node_id).agent_key == "key-first-agent"
    assert agent_client(first.json()["node_token"]).get(f"{API}/assignments").status_code == 200


def test_reused_instance_token_cannot_bring_back_a_lost_instance_or_take_its_job(acme, gpu_models):
    """The attack of issue 8: read the instance token, SIGKILL the agent (its job moves on),
    register again with the token and a new agent key."""
    instance, token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(token, agent_key="key-victim-agent"), format="json")
    node, node_token = Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]
    job, allocation = place(acme, node, indices=(0, 1))
    report(node_token, allocation, "running", reason="started")
    # The agent went silent: what the lost-node sweep does.
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_LOST", message="silent")
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    node.refresh_from_db()
    seen_at = node.last_heartbeat_at

    again = APIClient().post(f"{API}/register", register_body(token, agent_key="key-attacker-1"), format="json")
    assert again.status_code == 401
    old = agent_client(node_token)
    assert old.post(f"{API}/heartbeat", {"telemetry": [reading(0)]}, format="json").status_code == 401
    assert old.get(f"{API}/assignments").status_code == 401
    node.refresh_from_db()
    assert (node.state, node.last_heartbeat_at, node.token_hash) == (NodeState.LOST, seen_at, "")
    assert NodeAgent.objects.get(node=node).agent_key == "key-victim-agent"
    # It is never handed a job: no allocation, and the scheduler does not see it as ready.
    from broker.scheduler.snapshot import tenant_snapshot

    assert not Allocation.objects.filter(node=node, active=True).exists()
    (seen,) = [n for n in tenant_snapshot(tenant=acme.tenant).nodes if n.id == str(node.pk)]
    assert seen.state != "ready"


def test_a_pool_join_token_cannot_take_over_a_given_up_instance_node(acme, gpu_models):
    from broker.inventory.services import pool_join_token_issue as issue

    instance, token = cloud_instance(acme)
    node_id = APIClient().post(f"{API}/register", register_body(token), format="json").json()["node_id"]
    Node.objects.filter(pk=node_id).update(state=NodeState.LOST)
    pool_token = issue(pool=instance.pool)
    resp = APIClient().post(f"{API}/register", register_body(pool_token, name=instance.node_name,
                                                             agent_key="key-takeover-1"), format="json")
    assert resp.status_code == 409 and "name" in resp.json()
    assert Node.objects.get(pk=node_id).state == NodeState.LOST


def test_terminating_an_instance_retires_its_node_at_once(acme, gpu_models):
    from broker.provisioning.services import instance_terminate

    instance, token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    node_token = resp.json()["node_token"]
    job, _ = place(acme, Node.objects.get(pk=resp.json()["node_id"]), indices=(0,))
    instance.refresh_from_db()
    instance_terminate(instance=instance, reason="idle")
    node = Node.objects.get(pk=resp.json()["node_id"])
    assert node.state == NodeState.OFFLINE and node.token_hash == ""
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert agent_client(node_token).post(f"{API}/heartbeat", {"telemetry": []}, format="json").status_code == 401
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE


@pytest.mark.parametrize("state", ["TERMINATING", "TERMINATED", "FAILED"])
def test_the_token_of_an_instance_given_up_before_it_booted_is_refused(acme, gpu_models, state):
    _, token = cloud_instance(acme, state=state)  # e.g. retired after its boot timeout
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    assert resp.status_code == 401
    assert not Node.objects.filter(name__startswith="aws-east").exists()


def test_instance_node_whose_instance_is_terminating_is_refused_on_its_next_call(acme, gpu_models):
    from broker.inventory.models import CloudInstance, InstanceState

    instance, token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    # Another path (the reconciler, an admin) changed the row without going through the node.
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED)
    client = agent_client(resp.json()["node_token"])
    assert client.get(f"{API}/assignments").status_code == 401
    node = Node.objects.get(pk=resp.json()["node_id"])
    assert node.state == NodeState.OFFLINE and node.token_hash == ""


def test_a_failed_registration_does_not_use_up_the_instance_token(acme, gpu_models):
    _, token = cloud_instance(acme)
    body = register_body(token)
    body["gpus"][1]["uuid"] = "GPU-" + "1" * 36
    globex_like = register_body(token)
    globex_like["gpus"][1]["uuid"] = body["gpus"][1]["uuid"]
    Gpu.objects.filter(node=acme.nodes[0], index=0).update(uuid=body["gpus"][1]["uuid"])  # taken: 409
    assert APIClient().post(f"{API}/register", body, format="json").status_code == 409
    assert APIClient().post(f"{API}/register", register_body(token), format="json").status_code == 201


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_registrations_with_one_instance_token_at_once_one_wins(acme, gpu_models):
    """Real concurrent transactions (PostgreSQL; SQLite serialises writers anyway)."""
    import threading

    from django.db import connection

    _, token = cloud_instance(acme)
    barrier = threading.Barrier(4)
    codes: list[int] = []

    def attempt(i: int) -> None:
        try:
            barrier.wait()
            body = register_body(token, agent_key=f"key-racer-{i:04d}")
            codes.append(APIClient().post(f"{API}/register", body, format="json").status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(codes) == [201, 401, 401, 401]
    assert Node.objects.filter(name__startswith="aws-east").count() == 1
