"""/nodes/: every node the team may use, by pool, each GPU a cell coloured by utilisation.

The data is the API's: the same scoped queryset and the same serializers as /api/v1/nodes/ and
/api/v1/pools/ (broker/api/inventory.py), so the tenancy rule lives in one place: a GPU held by another
team's job shows only "in use by another team", without its job and with its load, memory and power
hidden. The view only arranges those dicts for the template (pools -> nodes -> NVLink islands -> GPUs).
"""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from broker.api.inventory import OTHER_TEAM, NodeSerializer, NodeViewSet, PoolSerializer, PoolViewSet
from broker.console.access import console_page
from broker.inventory.selectors import nodes_usable_by, pools_usable_by

# Utilisation buckets -> CSS classes util-0..util-4 (a style="" colour would break the page's CSP).
UTIL_BUCKETS = 5


def util_class(pct: int | None) -> str:
    """"util-na" when unknown or hidden, else util-0 (idle) .. util-4 (80% and up)."""
    if pct is None:
        return "util-na"
    return f"util-{min(UTIL_BUCKETS - 1, max(0, int(pct)) * UTIL_BUCKETS // 100)}"


def _gpu_cell(gpu: dict) -> dict:
    used, total = gpu["memory_used_mb"], gpu["memory_mb"]
    mem_pct = round(100 * used / total) if used is not None and total else None
    own = [h for h in gpu["held_by"] if h["job"] is not None]
    return {**gpu, "util_class": util_class(gpu["utilization_pct"]), "memory_pct": mem_pct,
            "own_holders": own, "other_team": any(h["job"] is None for h in gpu["held_by"]),
            "free": not gpu["held_by"] and not gpu["held_outside"]}


def _islands(gpus: list[dict]) -> list[dict]:
    """GPUs grouped by NVLink island, in index order; GPUs without one form one "no NVLink" group."""
    groups: dict[int | None, list[dict]] = {}
    for gpu in sorted(gpus, key=lambda g: g["index"]):
        groups.setdefault(gpu["nvlink_island"], []).append(_gpu_cell(gpu))
    return [{"island": key, "gpus": cells}
            for key, cells in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def node_groups(request: HttpRequest) -> list[dict]:
    """Pools the team may use (API shape) with their nodes (API shape, GPUs grouped by island)."""
    tenant = request.console.tenant
    context = {"request": request}  # the serializers read the caller's team through tenant_context()
    pools = PoolSerializer(PoolViewSet.queryset.filter(pk__in=pools_usable_by(tenant).values("pk"))
                           .order_by("name", "pk"), many=True, context=context).data
    nodes = NodeSerializer(NodeViewSet.queryset.filter(pk__in=nodes_usable_by(tenant).values("pk"))
                           .order_by("name", "pk"), many=True, context=context).data
    by_pool: dict[int, list[dict]] = {}
    for node in nodes:
        gpus = node["gpus"]
        by_pool.setdefault(node["pool_id"], []).append({
            **node, "islands": _islands(gpus), "gpu_count": len(gpus),
            "gpus_busy": sum(1 for g in gpus if g["held_by"] or g["held_outside"]),
            "unhealthy": sum(1 for g in gpus if g["health"] != "HEALTHY")})
    return [{**pool, "nodes": by_pool.get(pool["id"], [])} for pool in pools]


@console_page
def nodes(request: HttpRequest) -> HttpResponse:
    groups = node_groups(request)
    context = {"pools": groups, "nav": "nodes", "other_team": OTHER_TEAM,
               "node_total": sum(len(p["nodes"]) for p in groups)}
    template = "console/partials/nodes_grid.html" if request.htmx else "console/nodes.html"
    return render(request, template, context)
