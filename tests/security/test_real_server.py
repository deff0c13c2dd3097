"""The issue's 488-byte alias bomb against the real web server `make run` starts (`broker.ops.web`, DEBUG off as there,
SQLite, demo data), through the lead's benchmark: the anonymous registration and a job submission."""
from __future__ import annotations

import pytest

from bench.hostile_input import measure


@pytest.mark.slow
def test_alias_bomb_costs_the_real_server_nothing():
    result = measure(runs=2, timeout_s=10)
    for route, figures in result.items():
        assert figures["status"] == 400, (route, figures)
        assert figures["response_bytes"] < 1000, (route, figures)  # was 312 MB
        assert figures["seconds"] < 1.0, (route, figures)  # was 22 s
        assert figures["rss_growth_mb"] < 50, (route, figures)  # was 2.76 GB
