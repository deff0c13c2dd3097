"""Image jobs on the broker's side: nodes report their container runtimes, the engine places image
jobs only where one is (and says why otherwise), the assignment carries the image, and cloud offers
say which runtimes their machine image comes with."""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from broker.agents.selectors import node_assignments
from broker.inventory.models import Node, Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.jobs.states import JobState
from broker.provisioning import offers
from broker.scheduler.services import scheduling_cycle_run

from .test_agent_api import API, register_body
from .test_api_tenancy import submit

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


@pytest.fixture
def join_token(acme) -> str:
    return pool_join_token_issue(pool=acme.pool)


def register(body: dict):
    return APIClient().post(f"{API}/register", body, format="json")


# -- registration --------------------------------------------------------------------------------
def test_registration_stores_the_runtimes_and_a_later_one_replaces_them(acme, join_token):
    body = {**register_body(join_token), "container_runtimes": ["podman", "apptainer"]}
    resp = register(body)
    assert resp.status_code == 201, resp.content
    node = Node.objects.get(pk=resp.json()["node_id"])
    assert node.container_runtimes == ["podman", "apptainer"]
    # The agent's own payload always carries the list: [] when docker went away since.
    assert register({**body, "container_runtimes": []}).status_code == 200  # the same agent, re-admitted
    node.refresh_from_db()
    assert node.container_runtimes == []


@pytest.mark.parametrize("value, fragment", [
    (["containerd"], "Must be one of: podman, docker, apptainer, singularity, kubernetes."),
    (["docker", "docker"], "Each runtime may appear once."),
    ("docker", 'Expected a list of items but got type "str".'),
    ([None], "This field may not be null."),
    (["docker", "podman", "apptainer", "singularity", "kubernetes", "docker"],
     "Ensure this field has no more than 5 elements."),
])
def test_a_bad_runtime_list_is_refused_by_field(acme, join_token, value, fragment):
    resp = register({**register_body(join_token), "container_runtimes": value})
    assert resp.status_code == 400, resp.content
    assert fragment in str(resp.json()["container_runtimes"])
    assert not Node.objects.filter(name="gpu-node-1").exists()


# -- placement -----------------------------------------------------------------------------------
def test_an_image_job_waits_with_a_readable_reason_until_a_node_has_a_runtime(acme, settings):
    job = submit(acme, image=IMAGE, resources={"gpus": 2})
    host_job = submit(acme, name="plain", resources={"gpus": 2})
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    host_job.refresh_from_db()
    assert host_job.state == JobState.PLACED  # a job without an image runs as before
    assert job.state == JobState.PENDING and job.pending_reason_code == "NO_CONTAINER_RUNTIME"
    body = acme.client.get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["pending_reason"]["code"] == "NO_CONTAINER_RUNTIME"
    message = body["pending_reason"]["message"]
    assert message.startswith("NO_CONTAINER_RUNTIME: 0/2 nodes fit: 2 have no container runtime (podman, docker or "
                              "apptainer) for the job's image"), message

    with_docker = acme.nodes[1]
    # What its agent's next registration does (which also starts a new epoch, so the cycle decides again).
    Node.objects.filter(pk=with_docker.pk).update(container_runtimes=["docker"])
    settings.WHALEZEN_CYCLE_REFRESH_SECONDS = 0
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    allocation = job.allocations.get(active=True)
    assert allocation.node_id == with_docker.pk
    (assignment,) = [a for a in node_assignments(node=with_docker)["assignments"] if a["job_id"] == str(job.pk)]
    assert assignment["image"] == IMAGE and len(assignment["gpu_indices"]) == 2


def test_a_job_without_an_image_gets_none_in_its_assignment(acme):
    job = submit(acme, resources={"gpus": 1})
    scheduling_cycle_run(tenant=acme.tenant)
    node = Node.objects.get(pk=job.allocations.get(active=True).node_id)
    (assignment,) = node_assignments(node=node)["assignments"]
    assert assignment["image"] is None and assignment["command"] == ["python", "train.py"]


# -- cloud offers --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, config, expected", [
    (PoolKind.AWS, {}, ("docker",)),  # the default Deep Learning Base AMI ships Docker + the NVIDIA toolkit
    (PoolKind.AWS, {"image_ids": {"us-east-1": "ami-0123456789abcdef0"}}, ()),  # a custom AMI: unknown
    (PoolKind.AWS, {"image_ids": {"us-east-1": "ami-0123456789abcdef0"}, "container_runtimes": ["podman"]},
     ("podman",)),
    (PoolKind.GCP, {"project": "p"}, ()),  # plain Debian 12
    (PoolKind.GCP, {"project": "p", "container_runtimes": ["docker", "apptainer"]}, ("docker", "apptainer")),
    (PoolKind.GCP, {"project": "p", "container_runtimes": ["rkt"]}, ()),  # a misconfiguration grants nothing
])
def test_a_pool_says_which_runtimes_its_machine_image_has(acme, kind, config, expected):
    pool = Pool.objects.create(tenant=acme.tenant, name=f"cloud-{kind}", kind=kind, region="us-east-1",
                               provider_config=config)
    assert offers.pool_container_runtimes(pool) == expected


def test_local_cloud_offers_carry_what_this_machine_has(acme, settings, tmp_path, monkeypatch):
    settings.VAR_DIR = tmp_path
    pool = Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim-east-1",
                               max_instances=2)
    monkeypatch.setattr(offers, "_this_machines_runtimes", lambda: ("apptainer",))
    found, _ = offers.cloud_offers(tenant=acme.tenant)
    assert found and all(o.container_runtimes == ("apptainer",) for o in found)
    pool.provider_config = {"container_runtimes": ["docker"]}
    pool.save()
    found, _ = offers.cloud_offers(tenant=acme.tenant)
    assert found and all(o.container_runtimes == ("docker",) for o in found)


def test_an_image_job_rents_only_an_instance_whose_image_has_a_runtime(acme, settings, tmp_path, monkeypatch):
    settings.VAR_DIR = tmp_path
    for node in acme.nodes:  # no owned capacity: the job must burst
        Node.objects.filter(pk=node.pk).update(state="OFFLINE")
    pool = Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim-east-1",
                               max_instances=2, provider_config={"container_runtimes": []})
    job = submit(acme, image=IMAGE, resources={"gpus": 1}, placement={"providers": ["local"]},
                 expected_duration_hours=1)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert outcome.launched == [] and job.state == JobState.PENDING
    assert job.pending_reason_code == "NO_CONTAINER_RUNTIME", job.pending_reason
    pool.provider_config = {"container_runtimes": ["docker"]}
    pool.save()
    settings.WHALEZEN_CYCLE_REFRESH_SECONDS = 0  # a pool's settings are read again at the next full decision
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert outcome.launched and job.state == JobState.PROVISIONING
