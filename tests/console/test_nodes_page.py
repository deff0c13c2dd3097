"""The nodes page: every node the team may use, by pool, GPUs coloured by utilisation, NVLink islands
boxed, the team's own jobs linked on the GPUs they hold, another team's only "in use by another team"."""
from __future__ import annotations

import re

import pytest

from broker.inventory.models import Gpu
from tests.broker.test_api_tenancy import submit
from tests.broker.test_shared_pools import H100, make_platform
from tests.broker.test_shared_visibility import SECRET_NAME, running

from .conftest import Browser, text_of


def test_the_team_sees_its_pool_nodes_and_gpus_by_nvlink_island(acme, as_member):
    Gpu.objects.filter(node=acme.nodes[0], index=0).update(utilization_pct=93, memory_used_mb=40960)
    Gpu.objects.filter(node=acme.nodes[0], index=1).update(utilization_pct=5, memory_used_mb=1024)
    resp = as_member.get("/nodes/")
    assert resp.status_code == 200
    text = text_of(resp)
    assert "acme-a100-0" in text and "acme-a100-1" in text and "onprem" in text and "dc1" in text
    assert "owned by your team" in text
    html = resp.content.decode()
    # Two nodes x two islands of four GPUs: four boxed islands, sixteen cells.
    assert html.count('class="island"') == 4 and text.count("NVLink island 0") == 2
    assert len(re.findall(r'<li class="gpu ', html)) == 16
    # The colour is a class by utilisation bucket, and the memory use is written out.
    assert '<li class="gpu util-4">' in html and '<li class="gpu util-0">' in html
    assert "93%" in text and "40 / 80 GB" in text
    assert 'style="' not in html  # the CSP refuses style attributes


def test_a_shared_node_shows_own_jobs_and_only_occupied_for_another_team(acme, globex, gpu_models, as_member):
    from broker.inventory.services import pool_share

    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    acme_job = running(submit(acme, name="acme-run", resources=H100), platform.node, (0, 1, 2, 3))
    globex_job = running(submit(globex, name=SECRET_NAME, resources=H100), platform.node, (4, 5, 6, 7))
    Gpu.objects.filter(node=platform.node).update(utilization_pct=97, memory_used_mb=70000)
    html = as_member.get("/nodes/").content.decode()
    assert f'href="/jobs/{acme_job.pk}/"' in html
    assert html.count("in use by another team") >= 4
    assert SECRET_NAME not in html and f"/jobs/{globex_job.pk}/" not in html and "globex-admin" not in html
    assert f"#{globex_job.pk}<" not in html
    # The other team's GPUs have no load or memory figure (hidden, as in the API): four of eight read 97%.
    node = html.split(platform.node.name, 1)[1]
    assert node.count("97%") == 4 and node.count("util-na") == 4
    # globex's own pool is not listed at all; the platform pool is, as shared.
    assert "globex-a100-0" not in html and "shared by" in html


def test_the_grid_fragment_polls_and_answers_alone(acme, as_viewer):
    page = as_viewer.get("/nodes/").content.decode()
    assert 'hx-get="/nodes/"' in page and 'hx-trigger="every 10s"' in page
    fragment = as_viewer.get("/nodes/", HTTP_HX_REQUEST="true")
    assert fragment.status_code == 200 and b"<html" not in fragment.content and b"acme-a100-0" in fragment.content


def test_long_node_names_are_wrappable_and_another_team_sees_none_of_acmes_nodes(acme, globex, as_member,
                                                                                 as_other_team):
    acme.nodes[0].name = "n" * 180
    acme.nodes[0].save(update_fields=["name"])
    # In a heading the stylesheet lets wrap anywhere (.name: overflow-wrap), not in a fixed-width cell.
    assert f'class="name">{"n" * 180}</h3>' in as_member.get("/nodes/").content.decode()
    html = as_other_team.get("/nodes/").content.decode()
    assert "n" * 180 not in html and "acme-a100-1" not in html and "globex-a100-0" in html


def test_a_visitor_is_sent_to_log_in(db):
    resp = Browser().get("/nodes/")
    assert resp.status_code == 302 and resp.url.startswith("/login/")


def test_a_gpu_that_a_pod_outside_whalezen_holds_is_shown_taken_not_free(acme, as_member):
    """A Kubernetes node's GPU held by another pod (the bridge reports it held_outside): not free, counted."""
    Gpu.objects.filter(node=acme.nodes[0], index=7).update(held_outside=True)
    text = text_of(as_member.get("/nodes/"))
    node = text.split("acme-a100-0", 1)[1].split("acme-a100-1", 1)[0]
    assert "1 of 8 GPUs in use" in node and node.count("held by a pod outside WhaleZen") == 1
    assert node.count("free") == 7
    api = as_member.get(f"/api/v1/nodes/{acme.nodes[0].pk}/").json()
    assert [g["held_outside"] for g in api["gpus"]] == [False] * 7 + [True]


def test_a_kubernetes_pool_that_cannot_see_other_namespaces_says_so_above_its_nodes(acme, as_member):
    """The bridge labels the nodes of a cluster that answered 403 to listing all pods; the pool's card
    says what that means, with the namespace counted; a pool without it says nothing."""
    from broker.inventory.models import Pool, PoolKind

    acme.pool.kind, acme.pool.provider_config = PoolKind.KUBERNETES, {"namespace": "ml-jobs"}
    acme.pool.save()
    for node in acme.nodes:
        node.labels = {**node.labels, "whalezen.io/pod-visibility": "namespace-only"}
        node.save()
    Pool.objects.create(tenant=acme.tenant, name="zz-other", kind=PoolKind.ONPREM, region="dc2")
    text = text_of(as_member.get("/nodes/"))
    warned, other = text.split("zz-other", 1)
    assert "forbids listing pods in all namespaces (403)" in warned and "namespace ml-jobs" in warned
    assert "forbids" not in other
