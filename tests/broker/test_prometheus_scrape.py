"""A real Prometheus server (Debian's `prometheus`) scrapes the broker's /metrics and, found through
the broker's /metrics/targets service discovery, a real node agent's DCGM-named GPU metrics; queries
through Prometheus's HTTP API return the values, with the node, pool and tenant labels attached."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.agent.clock import FakeClock

from .test_agent_live import make_agent, join_token  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="needs Debian's prometheus (.ci/run installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(live_server, tmp_path):
    broker = urllib.parse.urlsplit(live_server.url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: whalezen
    static_configs: [{{targets: ["{broker}"]}}]
  - job_name: gpus
    http_sd_configs: [{{url: "{live_server.url}/metrics/targets", refresh_interval: 1s}}]
""")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_prometheus_scrapes_the_broker_and_finds_and_scrapes_the_agent(live_server, acme, join_token, tmp_path,
                                                                      prometheus):
    clock = FakeClock()
    agent = make_agent(live_server.url, join_token, tmp_path, clock, spec="4xA100-80GB-SXM",
                       metrics_listen=("127.0.0.1", 0))
    try:
        agent.step()
        deadline = time.monotonic() + 60
        gpus = broker = []
        while time.monotonic() < deadline and not (len(gpus) == 4 and broker):
            time.sleep(0.5)
            try:
                gpus = query(prometheus, 'DCGM_FI_DEV_FB_FREE{job="gpus"}')
                broker = query(prometheus, 'whalezen_gpus{job="whalezen",tenant="acme",pool="onprem",state="free"}')
            except OSError:  # Prometheus still starting
                continue
        assert len(gpus) == 4, gpus
        first = next(r for r in gpus if r["metric"]["gpu"] == "0")
        assert first["metric"]["node"] == "live-node" and first["metric"]["tenant"] == "acme"
        assert first["metric"]["pool"] == "onprem" and first["metric"]["modelName"] == "NVIDIA A100-SXM4-80GB"
        assert float(first["value"][1]) > 0
        # The broker's view: acme's 2 simulated 8-GPU nodes plus the agent's 4 GPUs, all free.
        assert sum(float(r["value"][1]) for r in broker) == 20, broker
    finally:
        agent.shutdown()
