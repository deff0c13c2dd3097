"""The agent's GPU metrics under dcgm-exporter's names, scraped over HTTP as Prometheus would."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .test_loop import make_agent

DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname", "hostname"}


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_the_gpus_readings_are_served_under_dcgm_names_and_the_broker_is_told_where(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock, metrics_listen=("127.0.0.1", 0))
    try:
        agent.step()
        (registration,) = broker.state.registrations
        url = registration["metrics_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert broker.state.heartbeats[-1]["metrics_url"] == url  # a restart's new port reaches the broker too

        families = scrape(url)
        util = families["DCGM_FI_DEV_GPU_UTIL"]
        assert sorted(s.labels["gpu"] for s in util) == ["0", "1", "2", "3"]
        first = next(s for s in util if s.labels["gpu"] == "0")
        assert set(first.labels) == DCGM_LABELS
        assert first.labels["UUID"].startswith("GPU-") and first.labels["modelName"] == "NVIDIA A100-SXM4-80GB"
        assert first.labels["device"] == "nvidia0" and first.labels["Hostname"] == "node-a"
        assert first.labels["pci_bus_id"]
        used = {s.labels["gpu"]: s.value for s in families["DCGM_FI_DEV_FB_USED"]}
        free = {s.labels["gpu"]: s.value for s in families["DCGM_FI_DEV_FB_FREE"]}
        assert used["0"] + free["0"] == 81920  # MiB, as dcgm-exporter reports them
        for name in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"):
            assert len(families[name]) == 4, name
        assert {s.value for s in families["DCGM_FI_DEV_XID_ERRORS"]} == {0}

        # An Xid shows as the last Xid value once the agent samples again (its heartbeat's sample).
        agent.backend.inject_xid(2, 48)  # a double-bit ECC error (79, off the bus, would make the GPU lost)
        clock.advance(agent.heartbeat_s)
        agent.step()
        xids = {s.labels["gpu"]: s.value for s in scrape(url)["DCGM_FI_DEV_XID_ERRORS"]}
        assert xids["2"] == 48 and xids["0"] == 0
    finally:
        agent.shutdown()


def test_without_a_listen_address_nothing_is_served_or_reported(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (registration,) = broker.state.registrations
    assert "metrics_url" not in registration and agent.metrics_server is None
