"""The web server `make run` starts runs several processes (broker/ops/web.py); what must be counted across
them is (broker/ops/gunicorn_conf.py): a rate limit holds for the whole server, /metrics counts every
process's requests, and the files they share go with the server."""
from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.submit_load import bench_env, seeded_server, submit
from broker.ops.web import WEB_WORKERS

RATE = 20


def worker_pids(arbiter_pid: int) -> set[int]:
    children = Path(f"/proc/{arbiter_pid}/task/{arbiter_pid}/children").read_text().split()
    return {int(pid) for pid in children}


def submissions_counted(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(value) for value in re.findall(
        r'^whalezen_api_request_duration_seconds_count\{[^}]*method="POST"[^}]*route="api/v1/jobs/"[^}]*\} (\S+)$',
        text, re.M))


@pytest.mark.slow
def test_a_rate_limit_and_the_request_metrics_cover_every_process_of_the_server(tmp_path):
    assert WEB_WORKERS >= 2
    env = bench_env(tmp_path, WHALEZEN_SUBMIT_RATE=f"{RATE}/min")
    with seeded_server(tmp_path, worker=False, env=env) as server:
        assert len(worker_pids(server.process.pid)) == WEB_WORKERS
        shared = [p for p in (tmp_path / "web").iterdir() if p.is_dir()]
        assert [p.name for p in shared] == [str(server.process.pid)]
        token = server.tokens[0]
        with ThreadPoolExecutor(max_workers=8) as pool:  # 8 at once: both processes take some
            answers = list(pool.map(lambda _: submit(server.base, token, 30), range(3 * RATE)))
        statuses = [a.status for a in answers]
        # One process's own count would let through RATE per process. The sliding window may let one more
        # through if the test straddles a minute.
        assert RATE <= statuses.count(201) <= RATE + 1, statuses
        assert statuses.count(429) == len(answers) - statuses.count(201)
        refused = next(a for a in answers if a.status == 429)
        assert "throttled" in json.loads(refused.body)["detail"].lower()
        assert submissions_counted(server.base) == len(answers)
    assert not any(p.is_dir() for p in (tmp_path / "web").iterdir()), "the server's shared files outlive it"
