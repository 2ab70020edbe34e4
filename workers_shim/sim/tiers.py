"""LRU block tiers below the GPU: an engine's CPU and disk offload tiers, and the shared pool.

Each tier is a set of block keys with a capacity in blocks and one LRU order. Inserting past the
capacity evicts the least recently used keys (emitting ``removed``) and hands them to the tier below,
if any (CPU → disk). Every change is reported to the tier's sink at once, so a sink that applies the
calls always equals ``holds()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

__all__ = ["EventSink", "LruTier", "SharedPool"]


class EventSink(Protocol):
    """Where block changes go; ``workers_shim.publisher.Publisher`` satisfies it. ``group`` is the
    KV-cache group of a hybrid engine's blocks (workers_shim/sim/hybrid.py); plain engines and these
    tiers leave it out (group 0)."""

    def stored(
        self, keys: list[int], tier: str = "gpu", parent: int | None = None, group: int = 0
    ) -> int: ...

    def removed(self, keys: list[int], tier: str = "gpu", group: int = 0) -> int: ...

    def cleared(self, tier: str | None = None) -> int: ...


class LruTier:
    def __init__(
        self, tier: str, capacity: int, sink: EventSink | None = None, lower: LruTier | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"{tier} capacity must be positive, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        self.sink = sink
        self.lower = lower
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.inserted = 0
        self.evicted = 0
        self.hits = 0

    def __contains__(self, key: int) -> bool:
        return key in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def holds(self) -> set[int]:
        return set(self.lru)

    def hit(self, key: int) -> None:
        """A block was read from this tier: it becomes the most recently used."""
        self.lru.move_to_end(key)
        self.hits += 1

    def put(self, keys: Iterable[int], parent: int | None = None, chain: bool = False) -> None:
        """Insert (or refresh) ``keys``; evict past capacity.

        With ``chain`` the keys are consecutive blocks of one sequence and ``parent`` precedes the
        first; new keys are then announced as runs with the right parent. Otherwise (victims of an
        upper tier) they are announced with no parent.
        """
        lru = self.lru
        sink = self.sink
        new: list[int] = []
        run_parent = parent
        prev = parent
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                if chain and new:
                    if sink is not None:
                        sink.stored(new, self.tier, run_parent)
                    new = []
            else:
                lru[k] = None
                self.inserted += 1
                if not new:
                    run_parent = prev if chain else None
                new.append(k)
            prev = k
        if new and sink is not None:
            sink.stored(new, self.tier, run_parent)
        over = len(lru) - self.capacity
        if over > 0:
            victims = [lru.popitem(last=False)[0] for _ in range(over)]
            self.evicted += over
            if sink is not None:
                sink.removed(victims, self.tier)
            if self.lower is not None:
                self.lower.put(victims)

    def clear(self) -> int:
        n = len(self.lru)
        self.lru.clear()
        if self.sink is not None:
            self.sink.cleared(self.tier)
        return n


class SharedPool(LruTier):
    """A Mooncake-store-like pool shared by several engines: one LRU, one capacity (in blocks).

    Engines write the blocks they compute into it (write-through) and load from it on a GPU/CPU/disk
    miss. It reports its contents with tier ``"shared"`` through its own sink: in a fleet the pool is
    one publisher of its own (``capacity={"shared": N}``), not part of any engine.
    """

    def __init__(self, capacity_blocks: int, sink: EventSink | None = None, name: str = "pool") -> None:
        super().__init__("shared", capacity_blocks, sink)
        self.name = name
        # Virtual time of the last write, set by the writing engine (for sinks that timestamp events).
        self.now = 0.0
