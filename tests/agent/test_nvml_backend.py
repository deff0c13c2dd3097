"""The real-NVML backend against a monkeypatched `pynvml`: missing driver, unsupported calls, lost GPUs.

The patched functions come from FakeNvml (a 2xA100 board) and are then broken one at a time, so
each test shows that one missing answer turns into None for that field only.
"""
from __future__ import annotations

import pynvml
import pytest

from agent import cli
from agent.backends.base import GpuBackendUnavailable
from agent.backends.fake_models import parse_spec
from agent.backends.fake_nvml import FakeNvml
from agent.backends.nvml import NvmlBackend
from agent.model import Health, MigMode


def raising(code: int):
    def fn(*args, **kwargs):
        raise pynvml.NVMLError(code)

    return fn


@pytest.fixture
def fake_driver(monkeypatch) -> FakeNvml:
    """Make the real `pynvml` module answer like a 2xA100 SXM node."""
    fake = FakeNvml(parse_spec("2xA100-80GB-SXM"))
    for name in dir(FakeNvml):
        if name.startswith("nvml"):
            monkeypatch.setattr(pynvml, name, getattr(fake, name))
    return fake


def backend() -> NvmlBackend:
    b = NvmlBackend()  # no module passed: it must use `pynvml`
    b.start()
    return b


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVIDIA driver not found: NVML (libnvidia-ml.so.1) could not be loaded"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "installed but not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "No permission"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "versions differ"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML could not start: Unknown Error"),
    ],
)
def test_nvml_init_failures_become_one_clear_line(monkeypatch, code, fragment):
    monkeypatch.setattr(pynvml, "nvmlInit", raising(code))
    with pytest.raises(GpuBackendUnavailable) as err:
        NvmlBackend().start()
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_probe_without_driver_prints_one_line_and_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(pynvml, "nvmlInit", raising(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert cli.main(["probe"]) == cli.EXIT_NO_GPU_BACKEND
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("whalezen-agent: error: NVIDIA driver not found")
    assert "--fake-gpus" in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_run_without_driver_exits_3_before_contacting_the_broker(monkeypatch, capsys, tmp_path, broker):
    monkeypatch.setattr(pynvml, "nvmlInit", raising(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    code = cli.main(["--server", broker.url, "--join-token", "join-secret", "--state-dir", str(tmp_path)])
    assert code == cli.EXIT_NO_GPU_BACKEND
    assert "NVIDIA driver not found" in capsys.readouterr().err
    assert broker.state.requests == []


def test_real_backend_reads_everything_through_pynvml(fake_driver):
    b = backend()
    inv = b.inventory()
    assert inv.backend == "nvml"
    assert [g.name for g in inv.gpus] == ["NVIDIA A100-SXM4-80GB"] * 2
    assert [t.nvlink_island for t in inv.topology] == [0, 0]
    reading = b.sample()[0]
    assert reading.memory_total_mb == 81920 and reading.health is Health.HEALTHY
    b.close()
    assert fake_driver._initialized == 0  # nvmlShutdown was called


READINGS_BY_CALL = [
    ("nvmlDeviceGetUtilizationRates", ["utilization_pct", "memory_utilization_pct"]),
    ("nvmlDeviceGetMemoryInfo", ["memory_used_mb", "memory_total_mb"]),
    ("nvmlDeviceGetTemperature", ["temperature_c"]),
    ("nvmlDeviceGetPowerUsage", ["power_w"]),
    ("nvmlDeviceGetTotalEccErrors", ["ecc_corrected", "ecc_uncorrected"]),
    ("nvmlDeviceGetRemappedRows", ["remapped_rows_pending", "remapped_rows_failed"]),
]


@pytest.mark.parametrize(("call", "fields"), READINGS_BY_CALL)
def test_each_unsupported_telemetry_call_blanks_only_its_fields(fake_driver, monkeypatch, call, fields):
    b = backend()
    before = b.sample()[0]
    monkeypatch.setattr(pynvml, call, raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    after = b.sample()[0]
    for name in fields:
        assert getattr(before, name) is not None
        assert getattr(after, name) is None
    untouched = {"index", "uuid", "temperature_c", "memory_total_mb", "power_limit_w", "health"} - set(fields)
    for name in untouched:
        assert getattr(after, name) == getattr(before, name)
    assert after.health is Health.HEALTHY


@pytest.mark.parametrize(
    ("call", "check"),
    [
        ("nvmlDeviceGetName", lambda inv: inv.gpus[0].name is None and inv.gpus[0].uuid),
        ("nvmlDeviceGetUUID", lambda inv: inv.gpus[0].uuid is None and inv.gpus[0].name),
        ("nvmlDeviceGetPciInfo", lambda inv: inv.gpus[0].pci_bus_id is None),
        ("nvmlDeviceGetEnforcedPowerLimit", lambda inv: inv.gpus[0].power_limit_w is None),
        ("nvmlDeviceGetMigMode", lambda inv: inv.gpus[0].mig_mode is MigMode.UNSUPPORTED),
        ("nvmlDeviceGetCpuAffinity", lambda inv: inv.topology[0].cpu_affinity is None),
        ("nvmlDeviceGetTopologyCommonAncestor", lambda inv: inv.pcie_common_ancestor[0][1] is None),
        ("nvmlSystemGetDriverVersion", lambda inv: inv.driver_version is None),
        ("nvmlSystemGetCudaDriverVersion", lambda inv: inv.cuda_driver_version is None),
        # Without NVLink state there are no links, but P2P-over-NVLink still finds the peer.
        ("nvmlDeviceGetNvLinkState", lambda inv: inv.topology[0].nvlinks == () and inv.topology[0].nvlink_peers == (1,)),
        ("nvmlDeviceGetNvLinkRemotePciInfo", lambda inv: inv.topology[0].nvlinks[0].remote_pci_bus_id is None),
        ("nvmlDeviceGetP2PStatus", lambda inv: inv.p2p_nvlink[0][1] is None and inv.topology[0].nvlink_peers == (1,)),
    ],
)
def test_each_unsupported_inventory_call_blanks_only_its_field(fake_driver, monkeypatch, call, check):
    monkeypatch.setattr(pynvml, call, raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    inv = backend().inventory()
    assert check(inv)
    assert len(inv.gpus) == 2 and inv.gpus[1].memory_total_mb == 81920


def test_peers_need_one_signal_only_and_none_means_no_island(fake_driver, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetP2PStatus", raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    inv = backend().inventory()
    assert [t.nvlink_island for t in inv.topology] == [None, None]
    assert inv.topology[0].nvlink_peers == ()


def test_numa_node_falls_back_to_sysfs(fake_driver, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    seen: list[str | None] = []

    def sysfs(bus_id):
        seen.append(bus_id)
        return 1

    monkeypatch.setattr("agent.host.sysfs_numa_node", sysfs)
    inv = backend().inventory()
    assert [t.numa_node for t in inv.topology] == [1, 1]
    assert seen == [g.pci_bus_id for g in inv.gpus]


def test_p2p_status_gets_integer_capability_indices(fake_driver, monkeypatch):
    # pynvml 13.x defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,); ctypes would reject it.
    seen: list[object] = []
    original = fake_driver.nvmlDeviceGetP2PStatus

    def recording(h1, h2, index):
        seen.append(index)
        return original(h1, h2, index)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetP2PStatus", recording)
    backend().inventory()
    assert set(seen) == {0, 2} and all(type(i) is int for i in seen)


def test_gpu_lost_during_telemetry_marks_only_that_gpu_failed(fake_driver, monkeypatch):
    b = backend()
    b.inventory()
    original = fake_driver.nvmlDeviceGetTemperature

    def temperature(handle, sensor):
        if handle.index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return original(handle, sensor)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", temperature)
    first, second = b.sample()
    assert first.health is Health.HEALTHY and not first.lost
    assert second.lost and second.health is Health.FAILED and second.temperature_c is None


def test_handle_error_at_start_keeps_the_gpu_slot(fake_driver, monkeypatch):
    original = fake_driver.nvmlDeviceGetHandleByIndex

    def handle(index):
        if index == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return original(index)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    b = backend()
    assert [g.uuid is None for g in b.inventory().gpus] == [True, False]
    assert [r.health for r in b.sample()] == [Health.FAILED, Health.HEALTHY]


def test_xid_events_arrive_through_event_sets(fake_driver):
    b = backend()
    b.sample()
    fake_driver.inject_xid(1, 79)
    fake_driver.gpus[1].lost = False  # the event arrives although the GPU still answers
    readings = b.sample()
    assert readings[1].xid_errors == (79,) and readings[1].health is Health.FAILED
    assert readings[0].xid_errors == ()


def test_xid_registration_unsupported_leaves_other_readings(fake_driver, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    freed: list[object] = []
    monkeypatch.setattr(pynvml, "nvmlEventSetFree", freed.append)
    b = backend()
    fake_driver.gpus[0].pending_xids.append(48)
    reading = b.sample()[0]
    assert reading.xid_errors == () and reading.temperature_c is not None
    assert len(freed) == 2  # the unused event sets were released


def test_device_count_failure_is_a_clear_error(fake_driver, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", raising(pynvml.NVML_ERROR_UNKNOWN))
    with pytest.raises(GpuBackendUnavailable, match="cannot count GPUs"):
        NvmlBackend().start()
    assert fake_driver._initialized == 0
