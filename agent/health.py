"""Turn raw NVML error signals into a GPU health verdict the broker can schedule on.

Xid meanings follow NVIDIA's "Xid Errors" table. Only hardware/driver Xids change health: 13, 31,
43 and friends are faults of the user's program and say nothing about the GPU.
"""
from __future__ import annotations

from agent.model import Health

# The GPU needs a reset or replacement; work placed there would fail.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# The GPU still works but is wearing out or needs a reset soon.
DEGRADING_XIDS: dict[int, str] = {
    63: "ECC page retirement / row remapping event",
    64: "ECC page retirement / row remapping failure",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
}
# NVIDIA's RMA guidance: 60 or more retired pages means the board should be replaced.
RETIRED_PAGES_DEGRADED = 60
TEMPERATURE_DEGRADED_C = 90


def classify(
    *,
    lost: bool,
    ecc_uncorrected: int | None,
    retired_pages: int | None,
    remapped_rows_pending: bool | None,
    remapped_rows_failed: bool | None,
    xid_errors: tuple[int, ...],
    temperature_c: int | None,
) -> tuple[Health, tuple[str, ...]]:
    """Return the health and the reasons for it (empty when healthy)."""
    failed: list[str] = []
    degraded: list[str] = []
    if lost:
        failed.append("GPU is lost (fell off the bus); needs a reset or a reboot")
    if ecc_uncorrected:
        failed.append(f"{ecc_uncorrected} uncorrectable ECC error(s) since driver load")
    if remapped_rows_failed:
        failed.append("row remapping failed; the GPU needs replacement")
    for xid in dict.fromkeys(xid_errors):  # each distinct code once, in order seen
        if xid in FATAL_XIDS:
            failed.append(f"Xid {xid}: {FATAL_XIDS[xid]}")
        elif xid in DEGRADING_XIDS:
            degraded.append(f"Xid {xid}: {DEGRADING_XIDS[xid]}")
    if remapped_rows_pending:
        degraded.append("row remapping pending; reset the GPU to apply it")
    if retired_pages is not None and retired_pages >= RETIRED_PAGES_DEGRADED:
        degraded.append(f"{retired_pages} retired memory pages (replacement threshold {RETIRED_PAGES_DEGRADED})")
    if temperature_c is not None and temperature_c >= TEMPERATURE_DEGRADED_C:
        degraded.append(f"temperature {temperature_c} C >= {TEMPERATURE_DEGRADED_C} C")
    if failed:
        return Health.FAILED, tuple(failed + degraded)
    if degraded:
        return Health.DEGRADED, tuple(degraded)
    return Health.HEALTHY, ()
