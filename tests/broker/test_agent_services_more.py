"""The rest of the agent services under mutation testing (issue 9): a live cloud instance's node,
the timings an agent is told and the sweep reads, what registration stores of each GPU, status
reports moving a job, checkpoints.

Checked as an operator or an agent sees it: the answers of the agent API, the node and GPU records,
the job's state, its pending reason and its events.
"""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from broker.agents.models import NodeAgent
from broker.inventory.models import Node, NodeState
from broker.inventory.services import pool_join_token_issue

from broker.jobs.models import JobEvent

from .test_agent_api import API, agent_client, cloud_instance, join_token, register_body, registered  # noqa: F401
from .test_checkpoints import report_checkpoint, root, running_job, verify_queue, write  # noqa: F401 (fixtures)


# -- a cloud instance's node the broker has not given up on ----------------------------------------
def test_a_live_cloud_instances_agent_registering_again_through_the_pool_keeps_its_node(acme, gpu_models):
    """The instance is live and its node ONLINE: nothing was given up, so its own agent (its first
    answer lost, its one-time token used) gets its node back through the pool's join token."""
    instance, instance_token = cloud_instance(acme)
    first = APIClient().post(f"{API}/register", register_body(instance_token, agent_key="key-instance-1"),
                             format="json")
    assert first.status_code == 201, first.content
    body = register_body(pool_join_token_issue(pool=instance.pool), name=instance.node_name,
                         agent_key="key-instance-1")
    again = APIClient().post(f"{API}/register", body, format="json")
    assert again.status_code == 200, again.content
    assert again.json()["node_id"] == first.json()["node_id"]
    node = Node.objects.get(pk=first.json()["node_id"])
    assert node.state == NodeState.ONLINE
    assert NodeAgent.objects.get(node=node).agent_key == "key-instance-1"


# -- checkpoints ---------------------------------------------------------------------------------
def test_a_checkpoint_answering_a_request_is_listed_with_that_requests_id(acme, registered, root, verify_queue):
    """The job's checkpoint list and its timeline say which request a checkpoint answered: the
    operator who asked for one sees it was this one, not one the job wrote on its own schedule."""
    node, token = registered
    job, allocation = running_job(acme, node, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/").status_code == 202
    (assignment,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    request_id = assignment["checkpoint_request_id"]
    assert request_id
    resp = report_checkpoint(token, allocation, write(root, 12), request_id=request_id)
    assert resp.status_code == 200, resp.content
    listed = acme.client.get(f"/api/v1/jobs/{job.pk}/checkpoints/").json()["results"]
    assert [(c["step"], c["request_id"]) for c in listed] == [(12, request_id)]
    written = JobEvent.objects.get(job=job, reason_code="CHECKPOINT_WRITTEN")
    assert written.data["request_id"] == request_id
