"""Pure helpers: health verdicts, NVLink islands, CPU lists, PCI ids, host facts."""
from __future__ import annotations

from agent import host
from agent.health import classify
from agent.model import Health
from agent.procs import process_start_ticks
from agent.topology import cpu_list, normalize_pci_bus_id, nvlink_islands


def verdict(**overrides):
    values = dict(lost=False, ecc_uncorrected=0, retired_pages=None, remapped_rows_pending=None,
                  remapped_rows_failed=None, xid_errors=(), temperature_c=50)
    values.update(overrides)
    return classify(**values)


def test_clean_gpu_is_healthy():
    assert verdict() == (Health.HEALTHY, ())


def test_failures_and_degradations():
    assert verdict(lost=True)[0] is Health.FAILED
    assert verdict(ecc_uncorrected=1)[0] is Health.FAILED
    assert verdict(remapped_rows_failed=True)[0] is Health.FAILED
    assert verdict(xid_errors=(79,))[0] is Health.FAILED
    assert verdict(xid_errors=(94,)) == (Health.DEGRADED, ("Xid 94: contained ECC error",))
    assert verdict(remapped_rows_pending=True)[0] is Health.DEGRADED
    assert verdict(retired_pages=59)[0] is Health.HEALTHY
    assert verdict(retired_pages=60)[0] is Health.DEGRADED
    assert verdict(temperature_c=91)[0] is Health.DEGRADED
    assert verdict(xid_errors=(13, 31, 43))[0] is Health.HEALTHY


def test_failed_lists_degradations_too_and_each_xid_once():
    health, reasons = verdict(xid_errors=(48, 48, 63), temperature_c=95)
    assert health is Health.FAILED
    assert reasons == ("Xid 48: double-bit ECC error", "Xid 63: ECC page retirement / row remapping event",
                       "temperature 95 C >= 90 C")


def test_unknown_values_do_not_count_as_errors():
    assert verdict(ecc_uncorrected=None, temperature_c=None)[0] is Health.HEALTHY


def test_islands_are_connected_components_numbered_by_lowest_gpu():
    peers = {0: [1], 1: [0], 2: [], 3: [4], 4: [3, 5], 5: [4], 6: []}
    assert nvlink_islands(peers, range(7)) == {0: 0, 1: 0, 2: None, 3: 1, 4: 1, 5: 1, 6: None}


def test_islands_ignore_peers_that_are_not_gpus_of_the_node():
    assert nvlink_islands({0: [9]}, [0, 1]) == {0: 0, 1: None}


def test_cpu_list_compresses_ranges_across_words():
    assert cpu_list([0b1111, 0]) == "0-3"
    assert cpu_list([1 << 63, 0b11]) == "63-65"
    assert cpu_list([0b10101]) == "0,2,4"
    assert cpu_list([0, 0]) is None


def test_pci_bus_id_normalisation():
    assert normalize_pci_bus_id(b"0000:07:00.0\x00") == "00000000:07:00.0"
    assert normalize_pci_bus_id("00000000:b7:00.0") == "00000000:B7:00.0"
    assert normalize_pci_bus_id("") is None and normalize_pci_bus_id(None) is None


def test_sysfs_numa_node(tmp_path):
    device = tmp_path / "0000:b7:00.0"
    device.mkdir()
    (device / "numa_node").write_text("1\n")
    assert host.sysfs_numa_node("00000000:B7:00.0", sys_root=tmp_path) == 1
    (device / "numa_node").write_text("-1\n")
    assert host.sysfs_numa_node("00000000:B7:00.0", sys_root=tmp_path) is None
    assert host.sysfs_numa_node("00000000:01:00.0", sys_root=tmp_path) is None


def test_memory_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    assert host.memory_mb(meminfo) == 16000
    assert host.memory_mb(tmp_path / "missing") is None


def test_process_start_ticks_tells_processes_apart(tmp_path):
    (tmp_path / "42").mkdir()
    stat = "42 (my (odd) job) S " + " ".join(str(n) for n in range(4, 22)) + " 777 0 0"
    (tmp_path / "42" / "stat").write_text(stat)
    assert process_start_ticks(42, proc=tmp_path) == 777
    assert process_start_ticks(43, proc=tmp_path) is None
