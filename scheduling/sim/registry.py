"""Policies by name, so benchmarks and tests pick them from one list."""

from __future__ import annotations

from scheduling.fragmentation import Workload
from scheduling.sim.policies import BASELINES, FGDPolicy, Policy
from scheduling.sim.whalezen import WhaleZenOnline

# The order benchmarks report them in: ours first, then the published baselines, then the rest.
ONLINE_POLICIES: tuple[str, ...] = (
    "whalezen-online", "fgd", "bestfit", "gpupacking", "gpuclustering", "dotprod", "random",
    "firstfit", "k8s-spread",
)


def make_policy(name: str, workload: Workload, *, lookahead_power: float | None = None) -> Policy:
    """A fresh online policy; ``workload`` is the task mix that FGD-style measures use.
    ``lookahead_power``: whalezen-online's look-ahead power instead of its default (for sweeps)."""
    if name == "fgd":
        return FGDPolicy(workload)
    if name == "whalezen-online":
        return WhaleZenOnline(workload) if lookahead_power is None else WhaleZenOnline(workload, power=lookahead_power)
    try:
        return BASELINES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(ONLINE_POLICIES)}") from None
