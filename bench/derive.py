"""Task lists derived at run time from a published list, to stress mixes the lists do not have.

Never written to disk: the FGD protocol (shuffle, clone until 130% arrived) then runs on the
derived list as on any other, so clones are drawn only from the derived tasks.

- ``share``: only the fractional-GPU tasks (one GPU, ``gpu_milli`` < 1000).
- ``multigpu``: only the tasks asking for two GPUs or more.
- ``constrained``: only the tasks that name GPU models.  A list that names none (``default``)
  would give an empty list, so there every GPU task is kept and tied to one model, drawn per seed
  with probability proportional to the cluster's GPUs of that model, among the models that have
  a node with at least the task's GPU count (so every derived task fits on an empty cluster and
  each model's tied demand is in proportion to its capacity, as the cluster's owner would buy).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from scheduling.sim.cluster import MILLI, NodeSpec, TaskSpec

DERIVATIONS = ("share", "multigpu", "constrained")


def is_share(t: TaskSpec) -> bool:
    return t.num_gpu == 1 and 0 < t.gpu_milli < MILLI


def _tie_to_models(tasks: Sequence[TaskSpec], nodes: Sequence[NodeSpec],
                   rng: np.random.Generator) -> list[TaskSpec]:
    models = sorted({n.model for n in nodes})
    gpus = np.array([sum(n.num_gpu for n in nodes if n.model == m) for m in models], dtype=float)
    largest = np.array([max(n.num_gpu for n in nodes if n.model == m) for m in models])
    out: list[TaskSpec] = []
    for t in tasks:
        if t.num_gpu == 0:
            continue
        weight = np.where(largest >= t.num_gpu, gpus, 0.0)
        if weight.sum() == 0:  # no node could ever take it: not a task of this cluster
            continue
        m = models[int(rng.choice(len(models), p=weight / weight.sum()))]
        out.append(replace(t, gpu_models=frozenset({m})))
    return out


def derive(tasks: Sequence[TaskSpec], kind: str, nodes: Sequence[NodeSpec],
           rng: np.random.Generator) -> list[TaskSpec]:
    """The derived list; ``rng`` is used only by ``constrained`` on a list that names no model."""
    if kind == "share":
        out = [t for t in tasks if is_share(t)]
    elif kind == "multigpu":
        out = [t for t in tasks if t.num_gpu >= 2]
    elif kind == "constrained":
        out = [t for t in tasks if t.gpu_models]
        if not out:
            out = _tie_to_models(tasks, nodes, rng)
    else:
        raise ValueError(f"unknown derivation {kind!r}; one of {', '.join(DERIVATIONS)}")
    if not out:
        raise ValueError(f"--derive {kind}: the list has no such task")
    return out
