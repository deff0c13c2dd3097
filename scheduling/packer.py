"""Best-fit placement inside one target (a shape's nodes, or an offer variant's instances).

Indexed so each placement costs about O(log n) instead of a scan of every node:
- nodes are bucketed by how many whole GPUs they have free; a gang of k GPUs goes to the fullest
  node that still has k (best fit keeps big holes for big gangs, the FGD lesson), preferring one
  where its CPU and memory strand no GPU (`strands`, when given);
- shared GPUs sit in one list sorted by free milli; a fractional job goes to the node of the
  tightest GPU that fits, and only opens a whole GPU (on the node with the fewest whole GPUs left)
  when none does; inside the node, the GPU its capacity's share choice prefers (best fit without one);
- CPU-only jobs go to the nodes with the fewest free GPUs, where their CPU use strands least,
  and among those to the one with the most free CPU (spread, not piled onto one node).
"""

from __future__ import annotations

import bisect
from typing import Callable, Protocol

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import WHOLE_GPU_MILLI


class Stranding(Protocol):
    """Would a part raise a node's CPU/memory-stranded GPUs (`book.StrandingCheck`)."""

    def possible(self, part: PartDemand) -> bool:
        """False when the part strands no GPU on any node: the stranding pass is skipped."""

    def for_part(self, part: PartDemand) -> Callable[[NodeCapacity], bool]:
        """For one part, node by node: would it raise the node's stranded GPUs?"""


# Nodes tried per bucket before moving on (CPU or memory may be short on many of them).
LOOKAHEAD = 32


class TargetPacker:
    def __init__(self, caps: list[NodeCapacity], grow: Callable[[], NodeCapacity | None] | None = None,
                 strands: Stranding | None = None) -> None:
        # strands.for_part(part)(cap): would the part raise the node's CPU/memory-stranded GPUs? Gangs
        # then go to the fullest node where it would not, if the first nodes of a bucket have one.
        self.strands = strands
        # Parts for which no node without stranding was found: capacity only shrinks within a
        # cycle, so the look is not repeated for them (it cost a fifth of a 5,000-job cycle).
        self.stranding_everywhere: set[PartDemand] = set()
        self.caps: list[NodeCapacity] = []
        self.buckets: dict[int, list[int]] = {}
        self.whole: list[int] = []
        self.shared: list[tuple[int, int, int]] = []  # (free milli, node, GPU position)
        self.grow = grow  # launches one more instance (offer targets), None for shapes
        for cap in caps:
            self.add(cap)

    def add(self, cap: NodeCapacity) -> int:
        index = len(self.caps)
        self.caps.append(cap)
        self.whole.append(cap.whole_free())
        bisect.insort(self.buckets.setdefault(self.whole[index], []), index)
        for position, milli in enumerate(cap.free_milli):
            if 0 < milli < WHOLE_GPU_MILLI:
                bisect.insort(self.shared, (milli, index, position))
        return index

    def touch(self, index: int, positions: tuple[int, ...] = ()) -> None:
        """Re-index node `index` after its capacity changed on `positions`."""
        cap = self.caps[index]
        now = cap.whole_free()
        if now != self.whole[index]:
            bucket = self.buckets[self.whole[index]]
            del bucket[bisect.bisect_left(bucket, index)]
            self.whole[index] = now
            bisect.insort(self.buckets.setdefault(now, []), index)
        for position in positions:
            milli = cap.free_milli[position]
            if 0 < milli < WHOLE_GPU_MILLI:
                bisect.insort(self.shared, (milli, index, position))

    def index_of(self, cap: NodeCapacity) -> int | None:
        for index, known in enumerate(self.caps):
            if known is cap:
                return index
        return None

    def find(self, part: PartDemand, exclude: set[int] = frozenset()) -> tuple[int, tuple[int, ...]] | None:  # type: ignore[assignment]
        found = self._find_existing(part, exclude)
        if found is None and self.grow is not None:
            cap = self.grow()
            if cap is not None:
                index = self.add(cap)
                positions = cap.choose(part)
                if positions is not None:
                    return index, positions
        return found

    def peek(self, part: PartDemand) -> tuple[int, tuple[int, ...]] | None:
        """Where `find` would put the part among the nodes it has (no launch), changing nothing."""
        return self._find_existing(part, set(), take=False)

    def _find_existing(self, part: PartDemand, exclude: set[int],
                       take: bool = True) -> tuple[int, tuple[int, ...]] | None:
        if part.fractional:
            found = self._find_shared(part, exclude, take)
            if found is not None:
                return found
            return self._find_in_buckets(part, exclude, minimum=1)
        return self._find_in_buckets(part, exclude, minimum=part.gpus)

    def _find_shared(self, part: PartDemand, exclude: set[int],
                     take: bool = True) -> tuple[int, tuple[int, ...]] | None:
        start = bisect.bisect_left(self.shared, (part.milli, -1, -1))
        checked = 0
        offset = start
        while offset < len(self.shared) and checked < LOOKAHEAD:
            milli, index, position = self.shared[offset]
            cap = self.caps[index]
            if cap.free_milli[position] != milli:  # stale entry: drop it
                del self.shared[offset]
                continue
            checked += 1
            if index not in exclude and cap.schedulable and cap.free_cpu >= part.cpu_milli \
                    and cap.free_mem >= part.memory_mb and cap.free_memory[position] >= part.min_gpu_memory_mb \
                    and (not part.allowed_models or cap.node.gpus[position].model in part.allowed_models) \
                    and cap.node.gpus[position].healthy:
                if cap.share_choice is not None:
                    # The node with the tightest fit, and there the GPU its share choice prefers (this
                    # entry stays filed unless that is its GPU; `touch` files the chosen one again).
                    chosen = cap.choose(part)
                    if chosen is not None and chosen[0] != position:
                        return index, chosen
                if take:  # the caller places it: `touch` files the GPU again with what is left
                    del self.shared[offset]
                return index, (position,)
            offset += 1
        return None

    def _find_in_buckets(self, part: PartDemand, exclude: set[int], minimum: int) -> tuple[int, tuple[int, ...]] | None:
        levels = sorted(w for w in self.buckets if w >= minimum)
        if part.gpus == 0:
            return self._find_cpu_only(part, exclude, levels)
        if self.strands is not None and part not in self.stranding_everywhere and self.strands.possible(part):
            # Best fit among the nodes where the gang's CPU strands no GPU (a bounded look).
            strands = self.strands.for_part(part)
            for whole in levels:
                for index in self.buckets[whole][:LOOKAHEAD]:
                    cap = self.caps[index]
                    if index in exclude or cap.free_cpu < part.cpu_milli or cap.free_mem < part.memory_mb \
                            or strands(cap):
                        continue
                    positions = cap.choose(part)
                    if positions is not None:
                        return index, positions
            if not exclude:
                self.stranding_everywhere.add(part)
        # Fast pass: the first few nodes of each bucket; full pass only when that finds nothing,
        # so a job that fits somewhere is never refused.
        for limit in (LOOKAHEAD, None):
            for whole in levels:
                bucket = self.buckets[whole]
                for index in bucket if limit is None else bucket[:limit]:
                    cap = self.caps[index]
                    # Inline CPU/memory check: most misses are there, and a call costs more.
                    if index in exclude or cap.free_cpu < part.cpu_milli or cap.free_mem < part.memory_mb:
                        continue
                    positions = cap.choose(part)
                    if positions is not None:
                        return index, positions
            if all(len(self.buckets[w]) <= LOOKAHEAD for w in levels):
                break
        return None

    def _find_cpu_only(self, part: PartDemand, exclude: set[int], levels: list[int]) -> tuple[int, tuple[int, ...]] | None:
        """Fewest whole free GPUs first; among those, the node with the most free CPU (the first
        such on ties). Stranding is convex per node: piling CPU-only jobs onto one node of a
        shape strands its GPUs, spreading them over equal nodes does not (or less)."""
        for limit in (LOOKAHEAD, None):
            for whole in levels:
                bucket = self.buckets[whole]
                best, best_cpu = None, -1
                for index in bucket if limit is None else bucket[:limit]:
                    cap = self.caps[index]
                    if index in exclude or cap.free_cpu < part.cpu_milli or cap.free_mem < part.memory_mb \
                            or not cap.schedulable:
                        continue
                    if cap.free_cpu > best_cpu:
                        best, best_cpu = index, cap.free_cpu
                if best is not None:
                    positions = self.caps[best].choose(part)
                    if positions is not None:
                        return best, positions
            if all(len(self.buckets[w]) <= LOOKAHEAD for w in levels):
                break
        return None
