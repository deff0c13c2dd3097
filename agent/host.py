"""Facts about the host (not the GPUs) that the broker schedules on: CPUs, memory, NUMA."""
from __future__ import annotations

import os
import socket
from pathlib import Path


def hostname() -> str:
    return socket.gethostname()


def cpu_count() -> int:
    # The CPUs this process may use (cgroups/cpusets), which is what jobs it starts can use.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_count_total() -> int:
    """All CPUs of the machine: the width of NVML's CPU affinity bitmask."""
    return os.cpu_count() or 1


def memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def sysfs_numa_node(pci_bus_id: str | None, sys_root: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """NUMA node of a PCI device from sysfs, for drivers too old for nvmlDeviceGetNumaNodeId.

    NVML writes an 8-digit domain ("00000000:07:00.0"); sysfs uses 4 digits, lower case.
    """
    if not pci_bus_id:
        return None
    domain, _, rest = pci_bus_id.partition(":")
    sysfs_name = f"{domain[-4:]}:{rest}".lower()
    try:
        value = int((sys_root / sysfs_name / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None  # -1: the platform has no NUMA information
