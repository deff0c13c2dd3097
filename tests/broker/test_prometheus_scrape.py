"""A real Prometheus server (Debian's `prometheus`) scrapes the broker's /metrics and, found through
the broker's /metrics/targets service discovery, a real node agent's DCGM-named GPU metrics; queries
through Prometheus's HTTP API return the values, with the node, pool and tenant labels attached."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from django.utils import timezone

from tests.agent.clock import FakeClock

from .test_agent_live import make_agent, join_token  # noqa: F401 (fixture)
from bench.procs import free_port

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="needs Debian's prometheus (.ci/run installs it)")


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@contextlib.contextmanager
def running_prometheus(tmp_path, scrape_configs: str):
    """Debian's prometheus on a free loopback port, scraping every second; yields its base URL."""
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n" + scrape_configs)
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


def wait_for_series(base: str, promql: str, count: int, timeout: float = 60) -> list[dict]:
    deadline, found = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            found = query(base, promql)
        except OSError:  # Prometheus still starting
            found = []
        if len(found) >= count:
            return found
        time.sleep(0.5)
    raise AssertionError(f"Prometheus had {len(found)} of {count} series of {promql} after {timeout:g} s")


@pytest.fixture
def prometheus(live_server, tmp_path):
    broker = urllib.parse.urlsplit(live_server.url).netloc
    with running_prometheus(tmp_path, f"""
  - job_name: whalezen
    static_configs: [{{targets: ["{broker}"]}}]
  - job_name: gpus
    http_sd_configs: [{{url: "{live_server.url}/metrics/targets", refresh_interval: 1s}}]
""") as base:
        yield base


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


def test_agentless_nodes_take_their_gpu_readings_and_xid_health_from_prometheus(acme, tmp_path):
    """A site's own dcgm-exporter (here: our exporter on fake GPUs, same names) scraped by its own
    Prometheus: the broker maps the series to its GPUs by UUID, for nodes no WhaleZen agent runs on."""
    from agent.backends.fake import FakeBackend
    from agent.metrics import GpuCollector, MetricsServer
    from broker.agents.prometheus_telemetry import prometheus_telemetry_pull
    from broker.inventory.models import Gpu, GpuHealth

    backend = FakeBackend("2xA100-80GB-SXM", hostname="dgx-7")
    backend.start()
    inventory = backend.inventory()
    collector = GpuCollector("dgx-7", inventory.gpus)
    collector.update(backend.sample())
    exporter = MetricsServer(collector, "127.0.0.1", 0)
    agentless, with_agent = acme.nodes  # simulated nodes; the second one heartbeats through its own agent
    Gpu.objects.filter(node=agentless, index=0).update(uuid=inventory.gpus[0].uuid, utilization_pct=None)
    Gpu.objects.filter(node=with_agent, index=0).update(uuid=inventory.gpus[1].uuid, utilization_pct=None)
    type(with_agent).objects.filter(pk=with_agent.pk).update(last_heartbeat_at=timezone.now())
    try:
        with running_prometheus(tmp_path, f"""
  - job_name: dcgm
    static_configs: [{{targets: ["127.0.0.1:{exporter.port}"]}}]
""") as base:
            (series,) = wait_for_series(base, f'DCGM_FI_DEV_GPU_UTIL{{UUID="{inventory.gpus[0].uuid}"}}', 1)
            updated = prometheus_telemetry_pull(base_url=base)
            gpu = Gpu.objects.get(node=agentless, index=0)
            assert updated == [gpu.pk]
            assert gpu.utilization_pct == round(float(series["value"][1])) and gpu.last_seen_at is not None
            assert gpu.temperature_c is not None and gpu.memory_used_mb is not None
            assert Gpu.objects.get(node=with_agent, index=0).utilization_pct is None  # its agent's readings rule

            backend.inject_xid(0, 48)  # double-bit ECC error: fatal
            collector.update(backend.sample())
            wait_for_series(base, f'DCGM_FI_DEV_XID_ERRORS{{UUID="{inventory.gpus[0].uuid}"}} == 48', 1)
            prometheus_telemetry_pull(base_url=base)
            assert Gpu.objects.get(node=agentless, index=0).health == GpuHealth.FAILED
    finally:
        exporter.stop()
    assert prometheus_telemetry_pull(base_url=f"http://127.0.0.1:{free_port()}") == []  # down: nothing changes
