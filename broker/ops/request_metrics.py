"""API request durations for Prometheus: `whalezen_api_request_duration_seconds{method,route,status}`.

Unlike the database-backed figures in broker/ops/metrics.py, a request's duration exists only in the
process that served it, so it is counted in memory. `route` is the URL pattern that matched (e.g.
`api/v1/jobs/<pk>/`), never the raw path, so an attacker's random URLs cannot grow the label set;
anything unmatched is `unmatched`. With several server processes (gunicorn `--workers N`, the
production shape) set `PROMETHEUS_MULTIPROC_DIR` to an empty directory shared by them: prometheus-client
then keeps each process's counts in files there and `/metrics` adds them up.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator

from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# Seconds: from a cached read (a few ms) to a request that waited on a locked database (seconds).
REQUEST_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

REQUEST_DURATION = Histogram(
    "whalezen_api_request_duration_seconds", "HTTP request duration by method, matched route and status.",
    labelnames=["method", "route", "status"], buckets=REQUEST_BUCKETS_S, registry=None)


_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")


def route_of(request: HttpRequest) -> str:
    """The matched URL pattern; DRF routers' regexes are written back as `<name>` (`api/v1/jobs/<pk>/`)."""
    match = getattr(request, "resolver_match", None)
    if match is None or not match.route:
        return "unmatched"
    return _GROUP.sub(r"<\1>", match.route).lstrip("^").rstrip("$")


class RequestDurationMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        method = request.method if request.method in METHODS else "OTHER"
        REQUEST_DURATION.labels(method, route_of(request), str(response.status_code)).observe(
            time.perf_counter() - started)
        return response


class _ThisProcess(Collector):
    def collect(self) -> Iterator[Metric]:
        yield from REQUEST_DURATION.collect()


def register_request_metrics(registry: CollectorRegistry) -> None:
    """Add the request histogram to a scrape's registry: every server process's under
    PROMETHEUS_MULTIPROC_DIR, else this process's."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_ThisProcess())
