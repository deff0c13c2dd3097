"""Policies by name, so benchmarks and tests pick them from one list."""

from __future__ import annotations

from typing import Sequence

from scheduling.fragmentation import Workload
from scheduling.sim.cluster import TaskSpec
from scheduling.sim.policies import BASELINES, FGDPolicy, Policy
from scheduling.sim.whalezen import WhaleZenOnline

# The order benchmarks report them in: ours first, then the published baselines, then the rest.
ONLINE_POLICIES: tuple[str, ...] = (
    "whalezen-online", "fgd", "bestfit", "gpupacking", "gpuclustering", "dotprod", "random",
    "firstfit", "k8s-spread",
)


def make_policy(name: str, workload: Workload, *, lookahead_powers: Sequence[float] | None = None,
                tasks: Sequence[TaskSpec] | None = None, home_weight: float | None = None,
                stranding_alpha: float | None = None) -> Policy:
    """A fresh online policy; ``workload`` is the task mix that FGD-style measures use.
    whalezen-online only: ``lookahead_powers`` replaces its look-ahead horizons, and
    ``home_weight`` its scarce-homes weight and ``stranding_alpha`` the weight of its CPU/memory
    stranding term (for sweeps); ``tasks`` is the whole task list, from
    which it derives the scarce homes (without it that term is off)."""
    if name == "fgd":
        return FGDPolicy(workload)
    if name == "whalezen-online":
        options: dict[str, object] = {"tasks": tasks}
        if lookahead_powers is not None:
            options["powers"] = tuple(lookahead_powers)
        if home_weight is not None:
            options["home_weight"] = home_weight
        if stranding_alpha is not None:
            options["alpha"] = stranding_alpha
        return WhaleZenOnline(workload, **options)  # type: ignore[arg-type]
    try:
        return BASELINES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(ONLINE_POLICIES)}") from None
