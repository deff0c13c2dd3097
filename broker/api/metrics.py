"""Monitoring endpoints for Prometheus, outside the tenant API.

`GET /metrics`: the broker's own metrics (broker/ops/metrics.py), in Prometheus's text format.

`GET /metrics/targets`: a Prometheus HTTP service-discovery document (the `http_sd_configs` JSON
format: a list of `{"targets": ["host:port"], "labels": {...}}`) with every node agent that serves
its GPUs' DCGM-named metrics (agent/metrics.py), labelled with its node, pool and tenant, so one
Prometheus job scrapes them all.

Who may read them (`metrics_access_allowed`): they name every tenant's nodes and jobs, so not the tenants' API
tokens. A caller on loopback may; others only with `Authorization: Bearer <WHALEZEN_METRICS_TOKEN>`
or from an address in `WHALEZEN_METRICS_ALLOW` (comma-separated addresses or CIDR networks).
Anything else is a 403 naming what would be accepted.
"""
from __future__ import annotations

import hmac
import ipaddress
import urllib.parse

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from broker.agents.models import NodeAgent
from broker.inventory.models import NodeState


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for entry in str(getattr(settings, "WHALEZEN_METRICS_ALLOW", "") or "").split(","):
        if entry.strip():
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))  # checked at start: settings
    return networks


def metrics_access_allowed(request: HttpRequest) -> bool:
    token = str(getattr(settings, "WHALEZEN_METRICS_TOKEN", "") or "")
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
        return True
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    return address.is_loopback or any(address in network for network in _allowed_networks())


def refused() -> JsonResponse:
    return JsonResponse({"detail": "Metrics are served to loopback, to addresses in WHALEZEN_METRICS_ALLOW, or "
                                   "with Authorization: Bearer <WHALEZEN_METRICS_TOKEN>."}, status=403)


def metrics_targets(request: HttpRequest) -> JsonResponse:
    if request.method != "GET":
        return JsonResponse({"detail": f'Method "{request.method[:16]}" not allowed.'}, status=405)
    if not metrics_access_allowed(request):
        return refused()
    groups = []
    agents = (NodeAgent.objects.exclude(metrics_url="").filter(node__state__in=[NodeState.ONLINE, NodeState.DRAINING])
              .select_related("node__pool", "node__tenant").order_by("node_id"))
    for agent in agents:
        url = urllib.parse.urlsplit(agent.metrics_url)
        groups.append({"targets": [url.netloc],
                       "labels": {"__metrics_path__": url.path or "/metrics", "__scheme__": url.scheme,
                                  "node": agent.node.name, "pool": agent.node.pool.name,
                                  "tenant": agent.node.tenant.slug}})
    return JsonResponse(groups, safe=False)


def metrics(request: HttpRequest) -> HttpResponse:
    from broker.ops.metrics import BrokerCollector
    from broker.ops.request_metrics import register_request_metrics

    if request.method != "GET":
        return JsonResponse({"detail": f'Method "{request.method[:16]}" not allowed.'}, status=405)
    if not metrics_access_allowed(request):
        return refused()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector())
    register_request_metrics(registry)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
