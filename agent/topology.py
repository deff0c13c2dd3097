"""Pure helpers that turn NVML topology answers into peers, islands and readable names."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

# nvmlGpuTopologyLevel_t values -> nvidia-smi `topo -m` vocabulary, which admins already read.
TOPOLOGY_LEVEL_NAMES: dict[int, str] = {
    0: "BOARD",  # NVML_TOPOLOGY_INTERNAL: two GPUs on one board (K80-style)
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: one PCIe switch
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe switches, no host bridge
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: same PCIe host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: same NUMA node, different host bridges
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across the CPU interconnect (QPI/UPI/xGMI)
}

# nvmlGpuP2PStatus_t values.
P2P_STATUS_NAMES: dict[int, str] = {
    0: "OK",
    1: "CHIPSET_NOT_SUPPORTED",
    2: "GPU_NOT_SUPPORTED",
    3: "IOH_TOPOLOGY_NOT_SUPPORTED",
    4: "DISABLED_BY_REGKEY",
    5: "NOT_SUPPORTED",
    6: "UNKNOWN",
}

# nvmlNvLinkDeviceType_t values.
NVLINK_DEVICE_TYPE_NAMES: dict[int, str] = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """NVML's form is "00000000:07:00.0"; remote PCI info sometimes has a 4-digit domain."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    bus_id = bus_id.strip().rstrip("\x00").upper()
    if not bus_id:
        return None
    domain, _, rest = bus_id.partition(":")
    if rest and len(domain) < 8:
        domain = domain.rjust(8, "0")
    return f"{domain}:{rest}" if rest else bus_id


def nvlink_islands(peers: Mapping[int, Iterable[int]], indices: Sequence[int]) -> dict[int, int | None]:
    """Group GPUs joined by NVLink (transitively) and number the groups 0, 1, ... by lowest index.

    A GPU with no NVLink peer gets None: it is an island of one, which a job asking for NVLink
    between several GPUs cannot use.
    """
    parent = {i: i for i in indices}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for gpu, gpu_peers in peers.items():
        for peer in gpu_peers:
            if gpu in parent and peer in parent:
                a, b = root(gpu), root(peer)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    has_peer = {i for i in indices if any(True for _ in peers.get(i, ()))}
    island_ids: dict[int, int] = {}
    result: dict[int, int | None] = {}
    for i in sorted(indices):
        if i not in has_peer:
            result[i] = None
            continue
        r = root(i)
        if r not in island_ids:
            island_ids[r] = len(island_ids)
        result[i] = island_ids[r]
    return result


def cpu_list(mask_words: Sequence[int]) -> str | None:
    """Turn NVML's CPU affinity bitmask (64-bit words, lowest CPUs first) into "0-31,64-95"."""
    cpus = [word_no * 64 + bit for word_no, word in enumerate(mask_words) for bit in range(64) if word >> bit & 1]
    if not cpus:
        return None
    ranges: list[str] = []
    start = prev = cpus[0]
    for cpu in cpus[1:] + [None]:  # type: ignore[list-item]
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)
