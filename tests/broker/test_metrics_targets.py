"""GET /metrics/targets: every node agent's GPU metrics endpoint, in Prometheus's http_sd format,
served to loopback, an allow-list or a bearer token; never to tenants' API tokens from elsewhere."""
from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from broker.agents.models import NodeAgent

from .test_agent_api import API, agent_client, register_body, join_token  # noqa: F401 (fixtures)


def register(join_token, name, metrics_url):
    body = {**register_body(join_token, name=name, agent_key=f"key-{name}"), "metrics_url": metrics_url}
    return APIClient().post(f"{API}/register", body, format="json")


def targets(remote_addr="127.0.0.1", **headers):
    return Client(REMOTE_ADDR=remote_addr).get("/metrics/targets", **headers)


def test_agents_endpoints_are_listed_with_node_pool_and_tenant(acme, globex, join_token):
    from broker.inventory.services import pool_join_token_issue

    assert register(join_token, "gpu-a", "http://10.0.0.7:9400/metrics").status_code == 201
    resp = register(pool_join_token_issue(pool=globex.pool), "gpu-b", "http://gpu-b.example:9400/metrics")
    token = resp.json()["node_token"]
    groups = targets().json()
    assert groups == [
        {"targets": ["10.0.0.7:9400"], "labels": {"__metrics_path__": "/metrics", "__scheme__": "http",
                                                   "node": "gpu-a", "pool": "onprem", "tenant": "acme"}},
        {"targets": ["gpu-b.example:9400"], "labels": {"__metrics_path__": "/metrics", "__scheme__": "http",
                                                        "node": "gpu-b", "pool": "onprem", "tenant": "globex"}}]
    # An agent restarted on another port says so in its next heartbeat.
    beat = agent_client(token).post(f"{API}/heartbeat", {"agent_version": "x", "metrics_url":
                                                           "http://gpu-b.example:9500/metrics"}, format="json")
    assert beat.status_code == 200, beat.content
    assert targets().json()[1]["targets"] == ["gpu-b.example:9500"]


@pytest.mark.parametrize("url", ["ftp://h:1/metrics", "http://user:pw@h:9400/metrics", "http://h/metrics",
                                 "http://h:0/metrics", "http://h:70000/metrics", "http://h:9400/m?x=1",
                                 "http://h:9400/" + "a" * 400])
def test_a_bad_metrics_url_is_a_400_naming_the_field(acme, join_token, url):
    resp = register(join_token, "gpu-a", url)
    assert resp.status_code == 400 and "metrics_url" in resp.json(), resp.content
    assert not NodeAgent.objects.exists()


def test_only_loopback_the_allow_list_or_the_metrics_token_may_read_it(acme, settings):
    assert targets("10.1.2.3").status_code == 403
    assert "WHALEZEN_METRICS_TOKEN" in targets("10.1.2.3").json()["detail"]
    assert targets("10.1.2.3", HTTP_AUTHORIZATION=f"Bearer {acme.token_secret}").status_code == 403  # a tenant's
    settings.WHALEZEN_METRICS_TOKEN = "s3cret-scrape-token"
    assert targets("10.1.2.3", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token").status_code == 200
    assert targets("10.1.2.3", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    settings.WHALEZEN_METRICS_ALLOW = "10.1.0.0/16, 192.168.7.7"
    assert targets("10.1.2.3").status_code == 200 and targets("192.168.7.7").status_code == 200
    assert targets("10.2.0.1").status_code == 403
    assert targets("::1").status_code == 200
    assert Client(REMOTE_ADDR="127.0.0.1").post("/metrics/targets").status_code == 405
