"""Array-based cluster for fast placement simulation (the FGD protocol, the cost week).

A node is a row: free milli per GPU (padded to ``max_gpus`` with 0), free CPU, free memory, GPU
model index.  Policies score nodes by *state*: nodes whose rows are identical (same model, same
free CPU and memory, same free milli per GPU in the same order) get the same score for the same
task, so the cluster interns each distinct row as a state id and policies memoise
``score[state, task_type]``.  A placement changes one node, hence one state id, so a decision
costs one vector look-up over the nodes plus scoring the few states never seen before.

Nothing here does I/O; loaders build :class:`NodeSpec` and :class:`TaskSpec` lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MILLI = 1000


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    model: str


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task: ``gpu_milli`` per GPU (< 1000 = shared), ``num_gpu`` GPUs, allowed models."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_models: frozenset[str] | None = None

    @property
    def total_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def type_key(self) -> tuple[int, int, int, int, tuple[str, ...]]:
        return (self.cpu_milli, self.memory_mib, self.num_gpu, self.gpu_milli,
                tuple(sorted(self.gpu_models)) if self.gpu_models else ())


class StateTable:
    """Interned node states with array views, grown by doubling."""

    def __init__(self, max_gpus: int) -> None:
        self.max_gpus = max_gpus
        self._ids: dict[bytes, int] = {}
        cap = 1024
        self.gpu = np.zeros((cap, max_gpus), dtype=np.int64)
        self.cpu = np.zeros(cap, dtype=np.int64)
        self.mem = np.zeros(cap, dtype=np.int64)
        self.model = np.zeros(cap, dtype=np.int64)
        self.ngpu = np.zeros(cap, dtype=np.int64)
        self.size = 0

    def intern(self, gpu: np.ndarray, cpu: int, mem: int, model: int, ngpu: int) -> int:
        key = gpu.tobytes() + np.array([cpu, mem, model, ngpu], dtype=np.int64).tobytes()
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        sid = self.size
        if sid == len(self.cpu):
            self._grow()
        self.gpu[sid] = gpu
        self.cpu[sid] = cpu
        self.mem[sid] = mem
        self.model[sid] = model
        self.ngpu[sid] = ngpu
        self.size += 1
        self._ids[key] = sid
        return sid

    def _grow(self) -> None:
        cap = 2 * len(self.cpu)
        for name in ("gpu", "cpu", "mem", "model", "ngpu"):
            old = getattr(self, name)
            new = np.zeros((cap,) + old.shape[1:], dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


class ArrayCluster:
    """Mutable cluster state as numpy arrays plus the state interning used for memoised scoring."""

    def __init__(self, nodes: Sequence[NodeSpec], max_gpus: int | None = None) -> None:
        self.nodes = list(nodes)
        self.names = [n.name for n in nodes]
        self.models: list[str] = sorted({n.model for n in nodes})
        model_idx = {m: i for i, m in enumerate(self.models)}
        g = max_gpus or max((n.num_gpu for n in nodes), default=1)
        self.max_gpus = max(g, 1)
        n = len(nodes)
        self.ngpu = np.array([x.num_gpu for x in nodes], dtype=np.int64)
        self.cpu_cap = np.array([x.cpu_milli for x in nodes], dtype=np.int64)
        self.mem_cap = np.array([x.memory_mib for x in nodes], dtype=np.int64)
        self.model = np.array([model_idx[x.model] for x in nodes], dtype=np.int64)
        self.gpu_cap = np.zeros((n, self.max_gpus), dtype=np.int64)
        for i, x in enumerate(nodes):
            self.gpu_cap[i, : x.num_gpu] = MILLI
        self.total_gpu_milli = int(self.gpu_cap.sum())
        self.reset()

    def reset(self) -> None:
        # A fresh state table per run: memo tables are sized by the number of states, and states
        # from earlier runs (other policies, other seeds) would only cost memory.
        self.states = StateTable(self.max_gpus)
        self.gpu_free = self.gpu_cap.copy()
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        self.allocated_milli = 0
        self.state = np.array([self._intern(i) for i in range(len(self.nodes))], dtype=np.int64)

    def _intern(self, i: int) -> int:
        return self.states.intern(self.gpu_free[i], int(self.cpu_free[i]), int(self.mem_free[i]),
                                  int(self.model[i]), int(self.ngpu[i]))

    # ---------------------------------------------------------------------------------- mutation

    def place(self, node: int, gpus: Sequence[int], task: TaskSpec) -> None:
        """Take the task's CPU, memory and ``gpu_milli`` on each GPU in ``gpus`` of ``node``."""
        if len(gpus) != task.num_gpu:
            raise ValueError(f"{task.name}: {len(gpus)} GPUs given, {task.num_gpu} asked")
        if self.cpu_free[node] < task.cpu_milli or self.mem_free[node] < task.memory_mib:
            raise ValueError(f"{task.name} does not fit on {self.names[node]} (cpu/memory)")
        for g in gpus:
            if g >= self.ngpu[node] or self.gpu_free[node, g] < task.gpu_milli:
                raise ValueError(f"{task.name} does not fit on GPU {g} of {self.names[node]}")
        if len(set(gpus)) != len(gpus):
            raise ValueError("a task takes distinct GPUs")
        for g in gpus:
            self.gpu_free[node, g] -= task.gpu_milli
        self.cpu_free[node] -= task.cpu_milli
        self.mem_free[node] -= task.memory_mib
        self.allocated_milli += task.total_milli
        self.state[node] = self._intern(node)

    def release(self, node: int, gpus: Sequence[int], task: TaskSpec) -> None:
        """Give back what :meth:`place` took (a departure or the source side of a migration)."""
        for g in gpus:
            self.gpu_free[node, g] += task.gpu_milli
            if self.gpu_free[node, g] > MILLI:
                raise ValueError("released more than was placed")
        self.cpu_free[node] += task.cpu_milli
        self.mem_free[node] += task.memory_mib
        self.allocated_milli -= task.total_milli
        self.state[node] = self._intern(node)

    # ----------------------------------------------------------------------------------- queries

    @property
    def allocation_ratio(self) -> float:
        return self.allocated_milli / self.total_gpu_milli if self.total_gpu_milli else 0.0

    def model_ok(self, task: TaskSpec) -> np.ndarray:
        """(num_models,) may the task run on each GPU model."""
        if task.gpu_models is None or task.num_gpu == 0:
            return np.ones(len(self.models), dtype=bool)
        return np.array([m in task.gpu_models for m in self.models], dtype=bool)

    def fits_states(self, sids: np.ndarray, task: TaskSpec) -> np.ndarray:
        """Vector feasibility of a task on interned states ``sids``."""
        st = self.states
        ok = (st.cpu[sids] >= task.cpu_milli) & (st.mem[sids] >= task.memory_mib)
        if task.num_gpu > 0:
            usable = (st.gpu[sids] >= task.gpu_milli).sum(axis=1)
            ok &= usable >= task.num_gpu
            ok &= self.model_ok(task)[st.model[sids]]
        return ok

    def fits(self, task: TaskSpec) -> np.ndarray:
        """(N,) can each node host the task now."""
        return self.fits_states(self.state, task)


def exclusive_gpus(gpu_free_row: np.ndarray, num: int) -> list[int]:
    """The first ``num`` fully free GPUs in index order (how whole-GPU tasks are bound)."""
    idx = np.flatnonzero(gpu_free_row == MILLI)[:num]
    return [int(i) for i in idx]
