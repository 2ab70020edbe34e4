"""Inverted block index: per model and tier, a dict ``key -> bitmask of instance slots``.

Why this shape (see README.md in this folder for the measurements):
- Block keys are chained hashes, so a key already names its whole prefix: no tree is needed, a
  prefix match is one dict probe per request block, and a bitmask AND tracks which instances are
  still matching.
- Keys are kept as their low 60 bits. CPython stores such ints in 32 bytes instead of 48, which is
  the difference between ~82 and ~98 bytes per distinct block; the chance that two distinct blocks
  of one model collide is about n^2 / 2^61 (1e-6 at 1.5 M blocks).
- Each instance gets a slot in its model's shard; its bit is one shared int object, so the common
  case "block held by exactly one instance" costs no memory for the value.
- Each (instance, tier) keeps an append-only log of the keys it added (8 bytes each) instead of a
  set (~30 bytes each), so clearing an instance costs O(its blocks), not O(index). Removed keys stay
  in the log until it is compacted; readers re-check the bitmask, so stale log entries are harmless.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from functools import reduce
from operator import xor

from kvindex.index.base import NO_MATCH, IndexStats, InstanceKey, InstanceMatch

KEY_BITS = 60
KEY_MASK = (1 << KEY_BITS) - 1
_N_TIERS = 4
_COMPACT_SLACK = 1024

# Canonical single-bit ints so that a bitmask value with one holder is one shared object.
_SINGLE_BITS: dict[int, int] = {}


def index_key(key: int) -> int:
    """The form in which the index holds a wire key (and in which digests are compared)."""
    return key & KEY_MASK


def _single_bit(slot: int) -> int:
    bit = 1 << slot
    return _SINGLE_BITS.setdefault(bit, bit)


def _bits(mask: int) -> Iterator[int]:
    """Slot numbers set in ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _Shard:
    """All instances of one model: slot allocation and the per-tier inverted maps."""

    __slots__ = ("all_mask", "free_slots", "next_slot", "slot_owner", "tiers")

    def __init__(self) -> None:
        self.tiers: list[dict[int, int]] = [{} for _ in range(_N_TIERS)]
        self.slot_owner: dict[int, InstanceKey] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.all_mask = 0

    def allocate(self, instance: InstanceKey) -> int:
        # Reuse the lowest free slot so bitmasks stay short in long-running fleets with churn.
        if self.free_slots:
            self.free_slots.sort(reverse=True)
            slot = self.free_slots.pop()
        else:
            slot = self.next_slot
            self.next_slot += 1
        self.slot_owner[slot] = instance
        self.all_mask |= 1 << slot
        return slot

    def release(self, slot: int) -> None:
        del self.slot_owner[slot]
        self.all_mask &= ~(1 << slot)
        self.free_slots.append(slot)


class _Holder:
    """Per-instance bookkeeping: slot, per-tier counts, xor digests and key logs."""

    __slots__ = ("bit", "counts", "logs", "model", "shard", "slot", "xors")

    def __init__(self, model: str, shard: _Shard, slot: int) -> None:
        self.model = model
        self.shard = shard
        self.slot = slot
        self.bit = _single_bit(slot)
        self.counts = [0] * _N_TIERS
        self.xors = [0] * _N_TIERS
        self.logs = [array("Q") for _ in range(_N_TIERS)]


class InvertedIndex:
    """The default KvBlockIndex backend (single-threaded; the service runs it on one event loop)."""

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        self._holders: dict[InstanceKey, _Holder] = {}

    # -- instances ------------------------------------------------------------------------------

    def add_instance(self, instance: InstanceKey, model: str) -> None:
        holder = self._holders.get(instance)
        if holder is not None:
            if holder.model != model:
                raise ValueError(f"instance {instance} serves {holder.model!r}, not {model!r}")
            return
        shard = self._shards.get(model)
        if shard is None:
            shard = self._shards[model] = _Shard()
        self._holders[instance] = _Holder(model, shard, shard.allocate(instance))

    def drop_instance(self, instance: InstanceKey) -> int:
        holder = self._holders.get(instance)
        if holder is None:
            return 0
        dropped = self.clear(instance)
        holder.shard.release(holder.slot)
        del self._holders[instance]
        if not holder.shard.slot_owner:
            del self._shards[holder.model]
        return dropped

    def has_instance(self, instance: InstanceKey) -> bool:
        return instance in self._holders

    def model_of(self, instance: InstanceKey) -> str | None:
        holder = self._holders.get(instance)
        return None if holder is None else holder.model

    def instances(self, model: str | None = None) -> list[InstanceKey]:
        if model is None:
            return list(self._holders)
        shard = self._shards.get(model)
        return [] if shard is None else list(shard.slot_owner.values())

    def models(self) -> list[str]:
        return list(self._shards)

    # -- mutations (the ingest hot path) --------------------------------------------------------

    def store(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        holder = self._holders[instance]
        table = holder.shard.tiers[tier]
        get = table.get
        bit = holder.bit
        added: list[int] = []
        add = added.append
        for key in keys:
            key &= KEY_MASK
            held = get(key)
            if held is None:
                table[key] = bit
                add(key)
            elif not held & bit:
                table[key] = held | bit
                add(key)
        if added:
            holder.counts[tier] += len(added)
            holder.xors[tier] = reduce(xor, added, holder.xors[tier])
            holder.logs[tier].extend(added)
        return len(added)

    def remove(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        holder = self._holders[instance]
        table = holder.shard.tiers[tier]
        get = table.get
        bit = holder.bit
        removed = 0
        digest = holder.xors[tier]
        for key in keys:
            key &= KEY_MASK
            held = get(key)
            if held is not None and held & bit:
                rest = held ^ bit
                if rest:
                    table[key] = _SINGLE_BITS.get(rest, rest)
                else:
                    del table[key]
                digest ^= key
                removed += 1
        if removed:
            holder.xors[tier] = digest
            holder.counts[tier] -= removed
            log = holder.logs[tier]
            if len(log) > 2 * holder.counts[tier] + _COMPACT_SLACK:
                holder.logs[tier] = array("Q", self._live_keys(holder, tier))
        return removed

    def clear(self, instance: InstanceKey, tier: int | None = None) -> int:
        holder = self._holders.get(instance)
        if holder is None:
            return 0
        cleared = 0
        for t in range(_N_TIERS) if tier is None else (tier,):
            if not holder.counts[t]:
                holder.logs[t] = array("Q")
                continue
            table = holder.shard.tiers[t]
            get = table.get
            bit = holder.bit
            for key in holder.logs[t]:
                held = get(key)
                if held is not None and held & bit:
                    rest = held ^ bit
                    if rest:
                        table[key] = _SINGLE_BITS.get(rest, rest)
                    else:
                        del table[key]
            cleared += holder.counts[t]
            holder.counts[t] = 0
            holder.xors[t] = 0
            holder.logs[t] = array("Q")
        return cleared

    # -- queries --------------------------------------------------------------------------------

    def match(
        self, model: str, keys: list[int], instances: Iterable[InstanceKey] | None = None
    ) -> dict[InstanceKey, InstanceMatch]:
        shard = self._shards.get(model)
        if shard is None:
            return {}
        owner = shard.slot_owner
        if instances is None:
            start = shard.all_mask
        else:
            start = 0
            for inst in instances:
                holder = self._holders.get(inst)
                if holder is not None and holder.shard is shard:
                    start |= holder.bit
        if not start:
            return {}
        gpu, cpu, disk, shared = shard.tiers
        if cpu or disk or shared:
            found = _match_tiered(keys, start, gpu, cpu, disk, shared)
        else:
            found = {slot: InstanceMatch(n, (n, 0, 0, 0)) for slot, n in _match_gpu(keys, start, gpu)}
        return {owner[slot]: found.get(slot, NO_MATCH) for slot in _bits(start)}

    def block_counts(self, instance: InstanceKey) -> tuple[int, int, int, int]:
        holder = self._holders.get(instance)
        if holder is None:
            return (0, 0, 0, 0)
        c = holder.counts
        return (c[0], c[1], c[2], c[3])

    def digest(self, instance: InstanceKey, tier: int) -> tuple[int, int]:
        holder = self._holders.get(instance)
        if holder is None:
            return (0, 0)
        return (holder.counts[tier], holder.xors[tier])

    def keys_of(self, instance: InstanceKey, tier: int) -> Iterator[int]:
        holder = self._holders.get(instance)
        if holder is None:
            return iter(())
        return iter(self._live_keys(holder, tier))

    def stats(self) -> IndexStats:
        distinct = [0] * _N_TIERS
        for shard in self._shards.values():
            for t, table in enumerate(shard.tiers):
                distinct[t] += len(table)
        entries = [0] * _N_TIERS
        for holder in self._holders.values():
            for t in range(_N_TIERS):
                entries[t] += holder.counts[t]
        return IndexStats(
            models=len(self._shards),
            instances=len(self._holders),
            distinct_blocks=tuple(distinct),  # type: ignore[arg-type]
            entries=tuple(entries),  # type: ignore[arg-type]
        )

    @staticmethod
    def _live_keys(holder: _Holder, tier: int) -> list[int]:
        table = holder.shard.tiers[tier]
        bit = holder.bit
        seen: set[int] = set()
        live = []
        for key in holder.logs[tier]:
            if key not in seen and table.get(key, 0) & bit:
                seen.add(key)
                live.append(key)
        return live


def _match_gpu(keys: list[int], alive: int, gpu: dict[int, int]) -> Iterator[tuple[int, int]]:
    """Fast path when the model has only GPU-tier blocks: yields (slot, matched length)."""
    get = gpu.get
    i = 0
    for i, key in enumerate(keys):
        held = get(key & KEY_MASK)
        if held is None:
            break
        still = alive & held
        if still != alive:
            for slot in _bits(alive ^ still):
                if i:
                    yield slot, i
            alive = still
            if not alive:
                return
    else:
        i = len(keys)
    if i:
        for slot in _bits(alive):
            yield slot, i


def _match_tiered(
    keys: list[int],
    alive: int,
    gpu: dict[int, int],
    cpu: dict[int, int],
    disk: dict[int, int],
    shared: dict[int, int],
) -> dict[int, InstanceMatch]:
    """General path: a block counts for an instance if it is on any of its tiers or in the pool.

    Per-tier counts are accumulated over runs of identical (gpu, cpu, disk, shared) holder patterns,
    so the per-instance work happens only where the pattern changes, not per block.
    """
    lengths: dict[int, int] = {}
    per_tier: dict[int, list[int]] = {}
    run = 0
    prev = (0, 0, 0, 0)

    def flush(pattern: tuple[int, int, int, int], count: int) -> None:
        for tier, mask in enumerate(pattern):
            for slot in _bits(mask):
                counts = per_tier.get(slot)
                if counts is None:
                    counts = per_tier[slot] = [0, 0, 0, 0]
                counts[tier] += count

    i = 0
    for i, key in enumerate(keys):
        key &= KEY_MASK
        on_gpu = alive & gpu.get(key, 0)
        rest = alive ^ on_gpu
        on_cpu = rest & cpu.get(key, 0) if rest and cpu else 0
        rest ^= on_cpu
        on_disk = rest & disk.get(key, 0) if rest and disk else 0
        rest ^= on_disk
        in_pool = rest if rest and key in shared else 0
        still = alive ^ rest ^ in_pool
        pattern = (on_gpu, on_cpu, on_disk, in_pool)
        if pattern != prev:
            if run:
                flush(prev, run)
            prev, run = pattern, 0
        run += 1
        if still != alive:
            for slot in _bits(alive ^ still):
                lengths[slot] = i
            alive = still
            if not alive:
                break
    else:
        i = len(keys)
    if run:
        flush(prev, run)
    for slot in _bits(alive):
        lengths[slot] = i
    out = {}
    for slot, n in lengths.items():
        if n:
            c = per_tier[slot]
            out[slot] = InstanceMatch(n, (c[0], c[1], c[2], c[3]))
    return out


__all__ = ["KEY_MASK", "InvertedIndex", "index_key"]
