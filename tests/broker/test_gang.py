"""Multi-node jobs on the broker side (broker/agents/gang.py, docs/agent.md "Multi-node jobs"): each
part's assignment says its rank and its peers, the same for every part; the job is RUNNING once
every part runs; one part failing or refused ends the whole gang, and the event names the rank."""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from broker.agents.gang import MASTER_PORT_BASE, MASTER_PORT_SPAN
from broker.inventory.models import Node
from broker.jobs.models import Allocation, Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit
from broker.jobs.states import JobState

from .test_agent_api import API, agent_client, join_token, register_body, report  # noqa: F401 (fixture)
from .test_api_tenancy import submit


def register(join_token: str, name: str, *, address: str | None = None, remote_addr: str = "127.0.0.1"):
    body = register_body(join_token, name=name, agent_key=f"key-{name}-xx")
    if address is not None:
        body["address"] = address
    return APIClient().post(f"{API}/register", body, format="json", REMOTE_ADDR=remote_addr)


@pytest.fixture
def gang_nodes(acme, join_token):
    """Two registered 4xA100 nodes: gang-a advertises its address, gang-b's is where it called from."""
    nodes = {}
    for name, address, remote in (("gang-a", "gpu-a.dc1.example", "10.9.9.9"), ("gang-b", None, "10.0.0.12")):
        resp = register(join_token, name, address=address, remote_addr=remote)
        assert resp.status_code == 201, resp.content
        nodes[name] = (Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"])
    return nodes


def place_gang(acme, gang_nodes, **spec) -> tuple[Job, dict[str, Allocation]]:
    job = submit(acme, resources={"gpus": 2, "nodes": 2}, **spec)
    allocations = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0, 1))
                                                       for node, _ in gang_nodes.values()])
    by_node = {a.node.name: a for a in allocations}
    return job, by_node


def assignment_of(token: str, job: Job) -> dict | None:
    body = agent_client(token).get(f"{API}/assignments").json()
    return next((a for a in body["assignments"] if a["job_id"] == str(job.pk)), None)


def test_registration_stores_the_advertised_address_or_the_callers(gang_nodes):
    assert gang_nodes["gang-a"][0].address == "gpu-a.dc1.example"
    assert gang_nodes["gang-b"][0].address == "10.0.0.12"


@pytest.mark.parametrize("address", ["10.0.0.1:29500", "two words", "10.0.0.1\n10.6.6.6", "http://x", "a" * 300,
                                     "under_score.example", 7])
def test_a_bad_advertised_address_is_refused_by_field(acme, join_token, address):
    resp = register(join_token, "gang-x", address=address)
    assert resp.status_code == 400 and "address" in resp.json(), resp.content
    assert not Node.objects.filter(name="gang-x").exists()


def test_every_part_gets_the_same_peers_in_rank_order_and_its_own_rank(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    gangs = {name: assignment_of(token, job)["gang"] for name, (_, token) in gang_nodes.items()}
    # Rank order is allocation order; here gang-a's part was allocated first.
    first, second = sorted(parts, key=lambda name: parts[name].pk)
    assert (gangs[first]["rank"], gangs[second]["rank"]) == (0, 1)
    addresses = {"gang-a": "gpu-a.dc1.example", "gang-b": "10.0.0.12"}
    assert gangs[first]["node_addresses"] == gangs[second]["node_addresses"] == [addresses[first], addresses[second]]
    assert gangs[first]["master_port"] == gangs[second]["master_port"] == MASTER_PORT_BASE + job.pk % MASTER_PORT_SPAN
    assert gangs[first]["gpus_per_node"] == gangs[second]["gpus_per_node"] == 2
    assert gangs[first]["skypilot_env"] is False


def test_two_gangs_on_the_same_nodes_get_different_master_ports(acme, gang_nodes):
    job_1, _ = place_gang(acme, gang_nodes)
    job_2 = submit(acme, resources={"gpus": 2, "nodes": 2})
    allocation_commit(job=job_2, requests=[GpuRequest(node=node, gpu_indices=(2, 3))
                                           for node, _ in gang_nodes.values()])
    token = gang_nodes["gang-a"][1]
    assert assignment_of(token, job_1)["gang"]["master_port"] != assignment_of(token, job_2)["gang"]["master_port"]


def test_a_skypilot_task_is_told_to_set_the_skypilot_names(acme, gang_nodes):
    job, _ = place_gang(acme, gang_nodes)
    Job.objects.filter(pk=job.pk).update(spec={**job.spec, "format": "skypilot"})
    assert assignment_of(gang_nodes["gang-b"][1], job)["gang"]["skypilot_env"] is True


def test_the_gang_runs_only_once_every_part_runs(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    report(gang_nodes["gang-a"][1], parts["gang-a"], "running", reason="started")
    job.refresh_from_db()
    assert job.state == JobState.STARTING and job.started_at is None
    waiting = JobEvent.objects.filter(job=job, reason_code="GANG_STARTING").get()
    assert "waiting for rank" in waiting.message and "(gang-b)" in waiting.message
    report(gang_nodes["gang-b"][1], parts["gang-b"], "running", reason="started")
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.started_at is not None


def test_one_part_failing_fails_the_job_names_its_rank_and_withdraws_the_other(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    for name, (_, token) in gang_nodes.items():
        report(token, parts[name], "running", reason="started")
    failing = max(parts, key=lambda name: parts[name].pk)  # rank 1
    survivor = min(parts, key=lambda name: parts[name].pk)
    survivor_node, survivor_token = gang_nodes[survivor]
    epoch_before = Node.objects.get(pk=survivor_node.pk).epoch
    resp = report(gang_nodes[failing][1], parts[failing], "failed", reason="exit_code", exit_code=3,
                  message="exited with code 3")
    assert resp.status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    event = JobEvent.objects.get(job=job, reason_code="JOB_FAILED")
    assert event.message.startswith(f"rank 1 of 2 on {failing} failed: exited with code 3")
    assert event.data["rank"] == 1 and event.data["num_nodes"] == 2 and event.data["node"] == failing
    agent_event = JobEvent.objects.get(job=job, reason_code="AGENT_FAILED")
    assert agent_event.data["rank"] == 1 and agent_event.message.startswith(f"rank 1 of 2 on {failing}:")
    # The survivor's part is withdrawn: its node's list no longer holds it (its agent stops what is
    # missing from the list, agent/loop.py) and its epoch rose, so the agent's next view is current.
    assert assignment_of(survivor_token, job) is None
    assert Node.objects.get(pk=survivor_node.pk).epoch > epoch_before
    assert not Allocation.objects.filter(job=job, active=True).exists()


def test_a_part_that_cannot_start_takes_the_gang_back_to_the_queue(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    report(gang_nodes["gang-a"][1], parts["gang-a"], "running", reason="started")
    report(gang_nodes["gang-b"][1], parts["gang-b"], "refused", reason="gpu_busy",
           message="GPU 0 is already in use by another assignment on this node")
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "ASSIGNMENT_REFUSED"
    rank = sorted(parts, key=lambda name: parts[name].pk).index("gang-b")
    assert job.pending_reason.startswith(f"rank {rank} of 2 on gang-b refused the job: GPU 0 is already in use")
    assert assignment_of(gang_nodes["gang-a"][1], job) is None  # the running part is stopped too


def test_a_gang_succeeds_when_every_rank_exited_cleanly(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    for name, (_, token) in gang_nodes.items():
        report(token, parts[name], "running", reason="started")
    (first, _), (second, _) = gang_nodes.items()
    report(gang_nodes[first][1], parts[first], "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING  # one rank done, the other still running
    report(gang_nodes[second][1], parts[second], "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert JobEvent.objects.filter(job=job, reason_code="JOB_EXITED", message__startswith="Every rank exited").exists()
