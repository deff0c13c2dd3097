"""The simulated node, read through the real NvmlBackend code: every reading, every fault."""
from __future__ import annotations

import pytest

from agent.backends.fake import FakeBackend
from agent.model import Health, MigMode


def started(spec: str, clock=None, **kwargs) -> FakeBackend:
    backend = FakeBackend(spec, hostname="node-a", **({"clock": clock} if clock else {}), **kwargs)
    backend.start()
    return backend


def test_inventory_identity_of_an_a100_board():
    inv = started("8xA100-80GB-SXM").inventory()
    assert inv.backend == "fake:8xA100-80GB-SXM"
    assert inv.driver_version == "550.90.07" and inv.cuda_driver_version == "12.4"
    assert (inv.cpu_count, inv.memory_mb) == (256, 2048 * 1024)
    assert [g.index for g in inv.gpus] == list(range(8))
    gpu = inv.gpus[3]
    assert gpu.name == "NVIDIA A100-SXM4-80GB"
    assert gpu.memory_total_mb == 81920
    assert gpu.power_limit_w == 400.0
    assert gpu.mig_mode is MigMode.DISABLED and gpu.mig_pending is False
    assert gpu.uuid.startswith("GPU-") and len({g.uuid for g in inv.gpus}) == 8
    assert gpu.pci_bus_id == "00000000:28:00.0"
    assert len({g.pci_bus_id for g in inv.gpus}) == 8


def test_uuids_differ_between_simulated_nodes_and_are_stable_per_node():
    a1 = started("2xT4").inventory().gpus
    a2 = started("2xT4").inventory().gpus
    b = FakeBackend("2xT4", hostname="node-b")
    b.start()
    assert [g.uuid for g in a1] == [g.uuid for g in a2]
    assert {g.uuid for g in a1}.isdisjoint(g.uuid for g in b.inventory().gpus)


def test_nvswitch_board_is_one_island_with_all_peers():
    inv = started("8xA100-80GB-SXM").inventory()
    for topo in inv.topology:
        assert topo.nvlink_island == 0
        assert topo.nvlink_peers == tuple(i for i in range(8) if i != topo.index)
        assert len(topo.nvlinks) == 12 and all(link.active for link in topo.nvlinks)
        assert {link.remote_device_type for link in topo.nvlinks} == {"switch"}
        assert all(link.remote_gpu_index is None for link in topo.nvlinks)
    assert inv.p2p_nvlink[0][7] == "OK"


def test_two_islands_of_four_are_separate():
    inv = started("8xH100-80GB-SXM,nvlink=2x4").inventory()
    assert [t.nvlink_island for t in inv.topology] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv.topology[5].nvlink_peers == (4, 6, 7)
    assert len(inv.topology[0].nvlinks) == 18
    assert inv.p2p_nvlink[0][4] == "NOT_SUPPORTED"


def test_direct_nvlink_between_two_gpus_names_the_peer_gpu():
    inv = started("2xV100-16GB-SXM2").inventory()
    links = inv.topology[0].nvlinks
    assert len(links) == 6
    assert {(l.remote_device_type, l.remote_gpu_index, l.remote_pci_bus_id) for l in links} == {
        ("gpu", 1, inv.gpus[1].pci_bus_id)
    }
    assert [t.nvlink_island for t in inv.topology] == [0, 0]


def test_pcie_node_has_no_nvlink_and_a_pcie_matrix():
    inv = started("4xT4").inventory()
    assert all(t.nvlinks == () and t.nvlink_peers == () and t.nvlink_island is None for t in inv.topology)
    assert inv.pcie_common_ancestor == (
        ("X", "PIX", "SYS", "SYS"),
        ("PIX", "X", "SYS", "SYS"),
        ("SYS", "SYS", "X", "PIX"),
        ("SYS", "SYS", "PIX", "X"),
    )
    assert inv.p2p_read[0][1] == "OK" and inv.p2p_read[0][2] == "CHIPSET_NOT_SUPPORTED"
    assert inv.p2p_nvlink[0][1] == "NOT_SUPPORTED"
    assert inv.gpus[0].mig_mode is MigMode.UNSUPPORTED and inv.gpus[0].mig_pending is None


def test_numa_node_and_cpu_affinity_follow_the_socket():
    inv = started("8xA100-80GB-SXM").inventory()
    assert [t.numa_node for t in inv.topology] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv.topology[0].cpu_affinity == "0-127"
    assert inv.topology[7].cpu_affinity == "128-255"
    assert inv.pcie_common_ancestor[0][2] == "NODE" and inv.pcie_common_ancestor[0][5] == "SYS"


def test_idle_reading_has_every_field():
    reading = started("1xA100-80GB-SXM").sample()[0]
    assert reading.index == 0 and reading.uuid.startswith("GPU-")
    assert 0 <= reading.utilization_pct < 5 and 0 <= reading.memory_utilization_pct < 5
    assert reading.memory_total_mb == 81920 and reading.memory_used_mb == 4
    assert 30 <= reading.temperature_c < 40
    assert 40 < reading.power_w < 60 and reading.power_limit_w == 400.0
    assert (reading.ecc_corrected, reading.ecc_uncorrected) == (0, 0)
    assert reading.retired_pages is None  # Ampere remaps rows instead
    assert (reading.remapped_rows_pending, reading.remapped_rows_failed) == (False, False)
    assert reading.xid_errors == () and reading.lost is False
    assert reading.mig_mode is MigMode.DISABLED
    assert reading.health is Health.HEALTHY and reading.health_reasons == ()


def test_pre_ampere_gpu_reports_retired_pages_not_remapped_rows():
    backend = started("1xT4")
    reading = backend.sample()[0]
    assert reading.retired_pages == 0
    assert reading.remapped_rows_pending is None and reading.remapped_rows_failed is None
    backend.retire_pages(0, 61)
    reading = backend.sample()[0]
    assert reading.retired_pages == 61
    assert reading.health is Health.DEGRADED and "retired memory pages" in reading.health_reasons[0]


def test_busy_gpu_uses_memory_power_and_heat(clock):
    backend = started("2xH100-80GB-SXM", clock=clock)
    backend.note_busy_gpus({1})
    idle, busy = backend.sample()
    assert busy.utilization_pct >= 55 and idle.utilization_pct < 5
    assert busy.memory_used_mb > 0.4 * busy.memory_total_mb
    assert busy.power_w > idle.power_w and busy.temperature_c > idle.temperature_c


def numbers(reading) -> tuple:
    return reading.utilization_pct, reading.memory_used_mb, reading.temperature_c, reading.power_w


def test_telemetry_changes_over_time_and_is_deterministic(clock):
    def series(spec: str, node: str = "node-a") -> list[tuple]:
        c = type(clock)()
        backend = FakeBackend(spec, hostname=node, clock=c)
        backend.start()
        backend.note_busy_gpus({0})
        out = []
        for _ in range(6):
            out.append(numbers(backend.sample()[0]))
            c.advance(1.0)
        return out

    first = series("1xA100")
    assert first == series("1xA100")
    assert len(set(first)) > 1
    assert first != series("1xA100,seed=3")
    assert first != series("1xA100", node="node-b")  # simulated nodes do not move in lockstep


def test_mig_enabled_gpu_reports_mode_and_no_whole_gpu_utilisation():
    backend = started("2xA100-80GB-SXM,mig=on")
    assert backend.inventory().gpus[0].mig_mode is MigMode.ENABLED
    reading = backend.sample()[0]
    assert reading.mig_mode is MigMode.ENABLED
    assert reading.utilization_pct is None and reading.memory_utilization_pct is None
    assert reading.memory_used_mb is not None


def test_xid_48_makes_the_gpu_failed_and_counts_an_uncorrectable_ecc_error():
    backend = started("4xA100-80GB-SXM")
    backend.inject_xid(2, 48)
    readings = backend.sample()
    bad = readings[2]
    assert bad.xid_errors == (48,)
    assert bad.ecc_uncorrected == 1 and bad.remapped_rows_pending is True
    assert bad.health is Health.FAILED
    assert "Xid 48: double-bit ECC error" in bad.health_reasons
    assert all(r.health is Health.HEALTHY for i, r in enumerate(readings) if i != 2)
    # The Xid stays on record: a later sample is still FAILED.
    assert backend.sample()[2].health is Health.FAILED


def test_application_xid_does_not_change_health():
    backend = started("1xT4")
    backend.inject_xid(0, 13)  # graphics engine exception: a bug in the user's kernel
    reading = backend.sample()[0]
    assert reading.xid_errors == (13,) and reading.health is Health.HEALTHY


def test_uncorrectable_ecc_without_xid_fails_the_gpu():
    backend = started("1xT4")
    backend.inject_ecc(0, uncorrected=3, corrected=10)
    reading = backend.sample()[0]
    assert (reading.ecc_corrected, reading.ecc_uncorrected) == (10, 3)
    assert reading.health is Health.FAILED
    assert reading.health_reasons == ("3 uncorrectable ECC error(s) since driver load",)


def test_corrected_ecc_errors_alone_stay_healthy():
    backend = started("1xT4")
    backend.inject_ecc(0, corrected=5)
    assert backend.sample()[0].health is Health.HEALTHY


def test_gpu_falling_off_the_bus_gives_a_failed_reading_without_numbers():
    backend = started("4xA100-80GB-SXM")
    backend.fall_off_bus(1)
    readings = backend.sample()
    lost = readings[1]
    assert lost.lost is True and lost.health is Health.FAILED
    assert lost.uuid == backend.inventory().gpus[1].uuid  # still identifiable
    assert lost.utilization_pct is None and lost.memory_used_mb is None and lost.temperature_c is None
    assert any("fell off the bus" in reason for reason in lost.health_reasons)
    assert 79 in lost.xid_errors
    assert [r.lost for r in readings] == [False, True, False, False]


def test_gpu_lost_before_start_is_still_listed_as_failed():
    backend = started("4xA100-80GB-SXM,lost=3")
    inv = backend.inventory()
    assert len(inv.gpus) == 4 and inv.gpus[3].uuid is None
    assert inv.topology[3].nvlink_island is None and inv.topology[0].nvlink_peers == (1, 2)
    assert inv.pcie_common_ancestor[0][3] is None
    assert backend.sample()[3].health is Health.FAILED


def test_faults_from_the_spec_apply_from_the_start():
    readings = started("4xT4,xid=0:79,ecc=2:1").sample()
    assert readings[0].health is Health.FAILED and readings[0].lost
    assert readings[2].health is Health.FAILED and readings[2].ecc_uncorrected == 1
    assert readings[1].health is Health.HEALTHY


def test_fault_file_breaks_a_running_backend_once_per_line(tmp_path):
    faults = tmp_path / "faults"
    backend = started("4xT4", faults_file=faults)
    assert all(r.health is Health.HEALTHY for r in backend.sample())
    faults.write_text("xid 1 48\nnonsense\n")
    readings = backend.sample()
    assert readings[1].xid_errors == (48,) and readings[1].health is Health.FAILED
    faults.write_text("xid 1 48\nnonsense\nlost 3\n")
    readings = backend.sample()
    assert readings[1].xid_errors == (48,)  # not applied twice
    assert readings[3].lost


def test_inventory_json_is_plain_data():
    data = started("2xA100").inventory().to_json()
    assert data["gpus"][0]["mig_mode"] == "disabled"
    assert data["topology"][0]["nvlinks"][0]["remote_device_type"] == "switch"
    assert data["pcie_common_ancestor"][0] == ["X", "PIX"]


@pytest.mark.parametrize("spec", ["1xL4", "2xL40S-48GB", "4xA10G", "2xH200", "8xV100-32GB-SXM2", "2xA100-80GB-PCIE"])
def test_every_model_family_samples_healthy(spec):
    backend = started(spec)
    readings = backend.sample()
    assert len(readings) == int(spec.split("x")[0])
    assert all(r.health is Health.HEALTHY and r.memory_total_mb for r in readings)
