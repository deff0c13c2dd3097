"""GPU fragmentation measure of FGD (Weng et al., "Beware of Fragmentation", USENIX ATC'23).

The measure answers: of the GPU capacity still free on a node, how much can the *current task
mix* not use?  For one task class ``m`` a node's free capacity is either usable or a fragment:

* the class asks for no GPU (CPU-only): every free milli-GPU is a fragment (such a task can
  never consume it);
* the node cannot host the class at all (wrong GPU model, too few GPUs with enough free milli,
  not enough CPU, not enough memory): every free milli-GPU is a fragment;
* otherwise only the GPUs whose free milli is below the class's per-GPU request are fragments
  (a 0.5-GPU task cannot use a GPU with 300 milli left).

The node's fragmentation is the popularity-weighted expectation over classes::

    F(node) = sum_m  p_m * frag_m(node)           (milli-GPU)

and FGD places a task where it *increases* F the least.  All quantities are milli-GPU (1000 =
one whole GPU) so the measure adds up across nodes and can be used as a linear cost.

API (pure functions, no I/O, deterministic):

* :class:`TaskClass` / :class:`Workload` describe the task mix.  Build one with
  :func:`workload_from_tasks` (FGD's "typical pods": the most frequent classes that cover
  ``coverage`` of all tasks, renormalised) or directly from classes.
* :func:`node_fragmentation` measures one node given its free milli-GPU per GPU, free CPU, free
  memory and GPU model.
* :func:`fragmentation_batch` measures many nodes at once (numpy arrays), which is what the
  simulator and a MILP builder (one cost per candidate node shape / packing pattern) want.
* :func:`fragmentation_delta` is the FGD placement criterion for one node: F(after) - F(before).
* :func:`fgd_score` turns a delta into the integer 0..100 node score of the reference
  implementation (sigmoid of the reduction in whole GPUs, truncated): the truncation matters
  for reproducing the published figures because it creates ties that a per-node priority breaks.

Memory: the paper's classes ignore memory; a class with ``memory_mib == 0`` never fails on
memory, so the published protocol is reproduced by building classes with ``use_memory=False``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

MILLI = 1000  # milli-GPU per whole GPU


@dataclass(frozen=True)
class TaskClass:
    """One kind of task in the workload distribution.

    ``gpu_milli`` is per GPU (0..1000; < 1000 means a shared fraction of one GPU), ``num_gpu`` how
    many such GPUs, ``gpu_models`` the allowed models (``None``: any model), ``weight`` the
    popularity (probability after normalisation).
    """

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    weight: float
    memory_mib: int = 0
    gpu_models: frozenset[str] | None = None


@dataclass(frozen=True)
class Workload:
    """A normalised task distribution (weights sum to 1) plus array views for vector code."""

    classes: tuple[TaskClass, ...]

    def __post_init__(self) -> None:
        total = sum(c.weight for c in self.classes)
        if self.classes and not math.isclose(total, 1.0, rel_tol=1e-6):
            raise ValueError(f"class weights must sum to 1, got {total}")

    @property
    def weights(self) -> np.ndarray:
        return np.array([c.weight for c in self.classes], dtype=np.float64)

    @property
    def cpu(self) -> np.ndarray:
        return np.array([c.cpu_milli for c in self.classes], dtype=np.int64)

    @property
    def mem(self) -> np.ndarray:
        return np.array([c.memory_mib for c in self.classes], dtype=np.int64)

    @property
    def gpu_milli(self) -> np.ndarray:
        return np.array([c.gpu_milli for c in self.classes], dtype=np.int64)

    @property
    def num_gpu(self) -> np.ndarray:
        return np.array([c.num_gpu for c in self.classes], dtype=np.int64)

    def model_access(self, models: Sequence[str]) -> np.ndarray:
        """Boolean matrix (len(models), K): may class k run on a GPU of model ``models[i]``."""
        out = np.ones((len(models), len(self.classes)), dtype=bool)
        for k, c in enumerate(self.classes):
            if c.gpu_models is not None:
                out[:, k] = [m in c.gpu_models for m in models]
        return out


def normalise(classes: Iterable[TaskClass]) -> Workload:
    """Workload from classes with arbitrary positive weights (rescaled to sum to 1)."""
    items = list(classes)
    total = sum(c.weight for c in items)
    if total <= 0:
        raise ValueError("total weight must be positive")
    return Workload(tuple(
        TaskClass(c.cpu_milli, c.gpu_milli, c.num_gpu, c.weight / total, c.memory_mib, c.gpu_models)
        for c in items
    ))


def workload_from_tasks(
    tasks: Iterable[tuple[int, int, int, int, frozenset[str] | None]],
    coverage: float = 0.95,
    use_memory: bool = False,
) -> Workload:
    """Task distribution from observed tasks ``(cpu_milli, memory_mib, gpu_milli, num_gpu, models)``.

    As FGD's "typical pods": count identical demands, keep the most frequent classes until they
    cover ``coverage`` of all tasks (one class at a time, most frequent first, ties broken by the
    smaller demand so the result is deterministic), renormalise.  CPU-only tasks are included:
    to them every free GPU is a fragment.  ``use_memory=False`` drops memory from the class key,
    as the paper does.
    """
    counts: Counter[tuple[int, int, int, int, tuple[str, ...]]] = Counter()
    for cpu, mem, milli, num, models in tasks:
        key_models = tuple(sorted(models)) if models else ()
        counts[(int(cpu), int(mem) if use_memory else 0, int(milli), int(num), key_models)] += 1
    if not counts:
        raise ValueError("no tasks")
    total = sum(counts.values())
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept: list[TaskClass] = []
    cum = 0
    for (cpu, mem, milli, num, models), n in ordered:
        if cum >= coverage * total:
            break
        kept.append(TaskClass(cpu, milli, num, float(n), mem, frozenset(models) if models else None))
        cum += n
    return normalise(kept)


def fragmentation_batch(
    gpu_free: np.ndarray,
    cpu_free: np.ndarray,
    workload: Workload,
    mem_free: np.ndarray | None = None,
    access: np.ndarray | None = None,
) -> np.ndarray:
    """Fragmentation (milli-GPU) of N nodes.

    ``gpu_free``: (N, G) free milli per GPU, padded with 0 for nodes with fewer GPUs (a padded
    GPU has nothing free, so it never counts as usable and adds nothing).  ``cpu_free`` and
    ``mem_free``: (N,).  ``access``: (N, K) booleans, may class k use node n's GPU model
    (``None``: all allowed).  Returns a float array (N,).
    """
    g = np.asarray(gpu_free, dtype=np.int64)
    if g.ndim != 2:
        raise ValueError("gpu_free must be (N, G)")
    cpu = np.asarray(cpu_free, dtype=np.int64)
    total = g.sum(axis=1)  # (N,)
    if not workload.classes:
        return np.zeros(len(g))
    milli = workload.gpu_milli  # (K,)
    # (N, K, G) masks are small: N * K * 8 booleans.
    usable = g[:, None, :] >= milli[None, :, None]
    usable_count = usable.sum(axis=2)  # (N, K)
    small_sum = np.where(~usable, g[:, None, :], 0).sum(axis=2)  # free milli on GPUs too small
    ok = (usable_count >= workload.num_gpu[None, :]) & (cpu[:, None] >= workload.cpu[None, :])
    if mem_free is not None:
        ok &= np.asarray(mem_free, dtype=np.int64)[:, None] >= workload.mem[None, :]
    if access is not None:
        ok &= access
    ok &= milli[None, :] > 0  # CPU-only classes can use no GPU at all
    frag = np.where(ok, small_sum, total[:, None])  # (N, K)
    return frag @ workload.weights


def node_fragmentation(
    gpu_free: Sequence[int],
    cpu_free: int,
    workload: Workload,
    mem_free: int | None = None,
    model: str | None = None,
) -> float:
    """Fragmentation (milli-GPU) of one node: free milli per GPU, free CPU milli, free MiB, model.

    Example: a node with GPUs free ``[1000, 300]`` and plenty of CPU, under a workload that is
    half 1-GPU tasks and half 0.5-GPU tasks: the 1-GPU class can use the full GPU but not the
    300 left (fragment 300), the 0.5-GPU class likewise (fragment 300): F = 300.
    """
    access = None
    if model is not None:
        access = workload.model_access([model])
    mem = None if mem_free is None else np.array([mem_free])
    g = np.asarray([list(gpu_free) or [0]], dtype=np.int64)
    return float(fragmentation_batch(g, np.array([cpu_free]), workload, mem, access)[0])


def fragmentation_delta(
    gpu_free: Sequence[int],
    cpu_free: int,
    take_gpu: Sequence[int],
    take_cpu: int,
    workload: Workload,
    mem_free: int | None = None,
    take_mem: int = 0,
    model: str | None = None,
) -> float:
    """F(after) - F(before) for placing a task that takes ``take_gpu[i]`` milli from GPU i.

    Negative means the placement reduces fragmentation (it used capacity that was a fragment).
    """
    before = node_fragmentation(gpu_free, cpu_free, workload, mem_free, model)
    after_gpu = [f - t for f, t in zip(gpu_free, take_gpu)]
    if min(after_gpu, default=0) < 0 or take_cpu > cpu_free:
        raise ValueError("task does not fit on this node")
    after_mem = None if mem_free is None else mem_free - take_mem
    after = node_fragmentation(after_gpu, cpu_free - take_cpu, workload, after_mem, model)
    return after - before


def fgd_score(delta_milli: float | np.ndarray) -> np.ndarray:
    """FGD node score 0..100: ``int(sigmoid(-delta / 1000) * 100)`` (higher is better).

    The truncation to an integer is part of the published protocol: it makes many placements tie
    and a fixed per-node priority break the tie, which is what packs tasks consistently.
    """
    x = -np.asarray(delta_milli, dtype=np.float64) / MILLI
    return np.floor(100.0 / (1.0 + np.exp(-x))).astype(np.int64)



def lookahead_fragmentation_batch(
    gpu_free: np.ndarray,
    cpu_free: np.ndarray,
    workload: Workload,
    mem_free: np.ndarray | None = None,
    access: np.ndarray | None = None,
    power: float = 1.0,
) -> np.ndarray:
    """A longer-sighted variant of :func:`fragmentation_batch` (WhaleZen's).

    FGD's measure equals ``sum_g free_g * (1 - q_g)`` where ``q_g`` is the popularity of the
    classes that could use GPU g's free share on this node now.  That is the chance the *next*
    task cannot use it.  A share stays unused for good only if *no* later task can use it, which
    for n later tasks is about ``(1 - q_g) ** n``; ``power`` is that n.  With ``power = 1`` this
    is exactly FGD's measure; larger powers stop counting a 0.5-GPU gap that many classes can
    fill and keep counting 0.19-GPU dust that almost nothing fits.
    """
    g = np.asarray(gpu_free, dtype=np.int64)
    cpu = np.asarray(cpu_free, dtype=np.int64)
    if not workload.classes:
        return np.zeros(len(g))
    milli = workload.gpu_milli
    usable = g[:, None, :] >= milli[None, :, None]  # (N, K, G)
    ok = (usable.sum(axis=2) >= workload.num_gpu[None, :]) & (cpu[:, None] >= workload.cpu[None, :])
    if mem_free is not None:
        ok &= np.asarray(mem_free, dtype=np.int64)[:, None] >= workload.mem[None, :]
    if access is not None:
        ok &= access
    ok &= milli[None, :] > 0
    q = np.einsum("nkg,k->ng", (usable & ok[:, :, None]).astype(np.float64), workload.weights)
    return (g * np.clip(1.0 - q, 0.0, 1.0) ** power).sum(axis=1)


# The horizons WhaleZen's measure averages (`horizons_fragmentation_batch`), fixed once for every
# cluster and task list: n = 10 alone was best on the default list but on a list of shares made a
# fresh GPU and a 0.35-GPU gap look equally fillable; n = 2 keeps a partly used GPU cheaper to fill
# (bench/README.md section 1). whalezen-online and the engine (`patterns.node_cost_batch`) share it.
LOOKAHEAD_POWERS: tuple[float, ...] = (2.0, 10.0)


def horizons_fragmentation_batch(gpu_free: np.ndarray, cpu_free: np.ndarray, workload: Workload,
                                 mem_free: np.ndarray | None = None, access: np.ndarray | None = None,
                                 powers: Sequence[float] = LOOKAHEAD_POWERS) -> np.ndarray:
    """The mean of :func:`lookahead_fragmentation_batch` over ``powers`` (power 1: FGD's own
    :func:`fragmentation_batch`)."""
    return sum(fragmentation_batch(gpu_free, cpu_free, workload, mem_free, access) if power == 1.0
               else lookahead_fragmentation_batch(gpu_free, cpu_free, workload, mem_free, access, power)
               for power in powers) / len(powers)


def mix_ratios(workload: Workload) -> tuple[float, float]:
    """Expected CPU milli and memory MiB per milli-GPU over the GPU classes of the mix (0 when
    the mix has no GPU class): the rates at which the average GPU task uses host resources."""
    w = workload.weights
    gpu = workload.gpu_milli * workload.num_gpu
    has = gpu > 0
    g = float((w * gpu)[has].sum())
    if g <= 0:
        return 0.0, 0.0
    return float((w * workload.cpu)[has].sum()) / g, float((w * workload.mem)[has].sum()) / g


def stranded_batch(
    gpu_free: np.ndarray,
    cpu_free: np.ndarray,
    cpu_per_gpu: float,
    mem_free: np.ndarray | None = None,
    mem_per_gpu: float = 0.0,
) -> np.ndarray:
    """GPU capacity (milli) N nodes will not sell because CPU (or memory) runs out first if they
    keep receiving the mix's average GPU task (WhaleZen's stranding look-ahead)::

        max(0, gpu_free - cpu_free / cpu_per_gpu, gpu_free - mem_free / mem_per_gpu)

    ``gpu_free``: (N, G) free milli per GPU; ``cpu_free``, ``mem_free``: (N,); a ratio of 0
    switches that resource off.
    """
    total = np.asarray(gpu_free, dtype=np.int64).sum(axis=1).astype(np.float64)
    out = np.zeros_like(total)
    if cpu_per_gpu > 0:
        out = np.maximum(out, total - np.asarray(cpu_free, dtype=np.float64) / cpu_per_gpu)
    if mem_per_gpu > 0 and mem_free is not None:
        out = np.maximum(out, total - np.asarray(mem_free, dtype=np.float64) / mem_per_gpu)
    return out


@dataclass(frozen=True)
class ScarceHomes:
    """Task classes whose homes are a small part of the cluster, with the worth of keeping them.

    One entry per distinct GPU task of the list (CPU, memory, milli-GPU per GPU, GPUs, allowed
    models), whatever its popularity: FGD's typical-task cut drops a class asked for by 5 tasks
    in 8,000, yet 8-GPU gangs of 120 cores and 720 GiB fit only the 39 largest of 1,213 nodes.
    ``weight[k] = g_k * (1 / S_k - 1)``: ``g_k`` is the class's share of the list's GPU demand,
    ``S_k`` the share of the cluster's GPUs on nodes that could take the class when empty. A class
    that fits everywhere weighs 0 (the FGD measure already sees it); one whose homes hold 5% of the
    GPUs weighs 19 times its demand share; one that fits nowhere weighs 0 (nothing to keep).
    """

    cpu: np.ndarray
    mem: np.ndarray
    milli: np.ndarray
    num: np.ndarray
    models: tuple[frozenset[str] | None, ...]
    weight: np.ndarray

    def model_access(self, models: Sequence[str]) -> np.ndarray:
        """Boolean matrix (len(models), K): may class k run on a GPU of model ``models[i]``."""
        return np.array([[allowed is None or m in allowed for allowed in self.models] for m in models],
                        dtype=bool).reshape(len(models), len(self.models))


def scarce_homes(tasks: Iterable[tuple[int, int, int, int, frozenset[str] | None, float]],
                 nodes: Iterable[tuple[int, int, int, str]]) -> ScarceHomes:
    """:class:`ScarceHomes` of a task mix ``(cpu_milli, memory_mib, gpu_milli, num_gpu, models,
    count)`` (one row per task with count 1, or one per class with its count or popularity) on a
    cluster of nodes ``(num_gpu, cpu_milli, memory_mib, model)``; derived at run time from both,
    nothing tuned. Only the classes with a positive weight are kept."""
    demand: Counter[tuple[int, int, int, int, frozenset[str] | None]] = Counter()
    for cpu, mem, milli, num, models, count in tasks:
        if num > 0 and milli > 0 and count > 0:
            demand[(int(cpu), int(mem), int(milli), int(num), frozenset(models) if models else None)] += (
                int(milli) * int(num) * count)
    shapes = Counter(nodes)  # a cluster has few node shapes
    cluster_gpus = sum(n[0] * count for n, count in shapes.items())
    total = sum(demand.values())
    kept: list[tuple[tuple[int, int, int, int, frozenset[str] | None], float]] = []
    for key, gpu_milli in sorted(demand.items(), key=lambda kv: (kv[0][:4], sorted(kv[0][4] or ()))):
        cpu, mem, milli, num, models = key
        homes = sum(g * count for (g, c, m, model), count in shapes.items()
                    if g >= num and c >= cpu and m >= mem and (models is None or model in models))
        if homes <= 0 or cluster_gpus <= 0:
            continue
        weight = gpu_milli / total * (cluster_gpus / homes - 1.0)
        if weight > 1e-9:
            kept.append((key, weight))
    return ScarceHomes(
        cpu=np.array([k[0] for k, _ in kept], dtype=np.int64),
        mem=np.array([k[1] for k, _ in kept], dtype=np.int64),
        milli=np.array([k[2] for k, _ in kept], dtype=np.int64),
        num=np.array([k[3] for k, _ in kept], dtype=np.int64),
        models=tuple(k[4] for k, _ in kept),
        weight=np.array([w for _, w in kept], dtype=np.float64))


def home_value_batch(gpu_free: np.ndarray, cpu_free: np.ndarray, mem_free: np.ndarray,
                     homes: ScarceHomes, access: np.ndarray) -> np.ndarray:
    """Scarce capacity (milli-GPU, weighted) N nodes still offer: for each class of ``homes`` that
    could start on the node now, the free milli on the GPUs it could use, times its weight.

    A placement lowers it by what it takes from scarce classes (the GPUs it uses, or all of the
    node's free GPUs for a class it shuts out), so a task with homes elsewhere is charged for
    landing on the only home of another class. ``access``: (N, K) model access per node.
    """
    g = np.asarray(gpu_free, dtype=np.int64)
    if not len(homes.weight):
        return np.zeros(len(g))
    usable = g[:, None, :] >= homes.milli[None, :, None]  # (N, K, G)
    ok = ((usable.sum(axis=2) >= homes.num[None, :])
          & (np.asarray(cpu_free, dtype=np.int64)[:, None] >= homes.cpu[None, :])
          & (np.asarray(mem_free, dtype=np.int64)[:, None] >= homes.mem[None, :]) & access)
    offered = np.where(usable, g[:, None, :], 0).sum(axis=2)  # (N, K)
    return np.where(ok, offered, 0) @ homes.weight
