"""One instant query to a Prometheus HTTP API (`/api/v1/query`), standard library only.

Shared by the broker's telemetry source for agentless nodes (broker/agents/prometheus_telemetry.py) and the
Kubernetes bridge's (agent/kube/telemetry.py): both read a site's dcgm-exporter series from its Prometheus.
"""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

MAX_ANSWER_BYTES = 8 * 1024 * 1024


def instant_query(base_url: str, promql: str, timeout_s: float) -> list[dict[str, Any]]:
    """The result vector; raises OSError (down) or ValueError (not Prometheus, or it refused the query)."""
    url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body = json.loads(resp.read(MAX_ANSWER_BYTES))
    if not isinstance(body, dict) or body.get("status") != "success":
        raise ValueError(f"Prometheus answered {str(body)[:200]}")
    result = (body.get("data") or {}).get("result", [])
    return result if isinstance(result, list) else []
