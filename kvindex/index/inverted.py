"""Inverted block index: per model, tier and 64-instance bank, a table ``key -> bitmask of holders``.

Why this shape (README.md in this folder has the measurements):
- Block keys are chained hashes, so a key already names its whole prefix: no tree is needed. A prefix
  match is one table probe per request block, ANDing bitmasks; an instance whose bit drops out at
  block i matched i blocks.
- Instances of a model get slots; slot s lives in bank s // 64 with bit 1 << (s % 64), so a value is
  one machine word. Most fleets have one bank per model; larger ones pay one more probe per bank.
- Each (instance, tier) keeps an append-only log of the keys it added, so clearing an instance costs
  O(its blocks), not O(index). Removed keys stay in the log until it is compacted; readers re-check
  the table, so stale log entries are harmless.
- The tables and loops are native (_native.pyx); _pytable.py is a pure-Python twin used when the
  extension is not built (``NATIVE`` tells which one runs).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvindex.index import _pytable
from kvindex.index.base import Applied, Differ, IndexStats, InstanceMatch, MatchGroup
from kvindex.index.hybrid import GroupLayout
from kvindex.instance import InstanceKey
from kvindex.keys import GROUP_MASKS
from kvindex.wire.schema import TIER_BY_NAME

try:
    from kvindex.index import _native as tables  # type: ignore[attr-defined]

    NATIVE = True
except ImportError:  # no compiler at install time: same API, pure Python
    tables = _pytable
    NATIVE = False

BANK_SLOTS = 64
_N_TIERS = 4
_SHARED = 3
_COMPACT_SLACK = 1024  # mirrored in _native.pyx (COMPACT_SLACK) and _pytable.py
_LAYOUTS = itertools.count(1)  # slot layouts, unique across models and their re-creation
# GPU bank-range tables (_Shard.ranges) from this bank_shift on (more than 128 banks: 8,192
# instances), up to 6 (64 banks a range, a bit each: 262,144 instances). Below, a range is one or
# two banks and its table would cost memory for little: the banks are walked.
RANGE_MIN_SHIFT = 2
RANGE_MAX_SHIFT = 6


def bank_shift(banks: int) -> int:
    """Summary bit of bank b: b >> this (the smallest shift with 64 << shift >= banks)."""
    shift = 0
    while BANK_SLOTS << shift < banks:
        shift += 1
    return shift


class _Bank:
    """Tables of one 64-slot bank of a model, one per tier."""

    __slots__ = ("tiers",)

    def __init__(self, impl: Any) -> None:
        self.tiers = [impl.BlockTable() for _ in range(_N_TIERS)]


class _Shard:
    """All instances of one model: slot allocation and the banks."""

    __slots__ = (
        "bank_masks",
        "bank_owners",
        "bank_tiers",
        "banks",
        "free_slots",
        "impl",
        "layout",
        "next_slot",
        "ranges",
        "slot_owner",
        "summaries",
    )

    def __init__(self, impl: Any) -> None:
        self.impl = impl
        # With more than one bank, per tier: key -> banks holding it (bit bank >> bank_shift), kept by the
        # banks' tables themselves; a match then walks only the banks that hold the first block.
        self.summaries: list[Any] | None = None
        # From RANGE_MIN_SHIFT on, per bank range (the banks of one summary bit), its GPU table: key
        # -> banks of the range holding it (bit b - first bank), with holder counts and the banks
        # whose every instance holds it. The banks report to it and it to the GPU summary. A match
        # answers the banks whose every instance holds a block without walking them (_native._Planner).
        self.ranges: list[Any] | None = None
        self.banks: list[_Bank] = []
        self.bank_tiers: list[list[Any]] = []  # per bank, its tables (banks[b].tiers), for the match
        self.bank_masks: list[int] = []  # occupied slots per bank
        self.bank_owners: list[list[InstanceKey | None]] = []  # per bank, the instance in each slot
        self.slot_owner: dict[int, InstanceKey] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.layout = next(_LAYOUTS)  # renewed whenever a slot changes owner (InvertedIndex.slot_layout)

    def allocate(self, instance: InstanceKey) -> int:
        # Reuse the lowest free slot so that instances stay packed in few banks under churn.
        if self.free_slots:
            self.free_slots.sort(reverse=True)
            slot = self.free_slots.pop()
        else:
            slot = self.next_slot
            self.next_slot += 1
        while len(self.banks) <= slot // BANK_SLOTS:
            self.banks.append(_Bank(self.impl))
            self.bank_tiers.append(self.banks[-1].tiers)
            self.bank_masks.append(0)
            self.bank_owners.append([None] * BANK_SLOTS)
            self._link_summaries()
        self.slot_owner[slot] = instance
        self.bank_owners[slot // BANK_SLOTS][slot % BANK_SLOTS] = instance
        self.bank_masks[slot // BANK_SLOTS] |= 1 << (slot % BANK_SLOTS)
        self.layout = next(_LAYOUTS)
        return slot

    def _link_summaries(self) -> None:
        """Banks came into being: the model's second bank starts the summaries (from what bank 0
        already holds); every bank reports to them, and banks sharing a bit know each other.

        A summary value has 64 bits: bank b reports under bit b >> shift, the smallest shift with
        64 << shift >= banks (``bank_shift``; _native computes the same from the bank count), so
        that a bit stands for a contiguous range of banks. Instances that joined together (one
        trace copy, one deployment) then share few bits, and a match walks their range, not one
        bank in 64 of the whole model. When the banks outgrow 64 << shift, the summaries are built
        again over every bank (O(the model's keys), once per doubling of its banks). From
        RANGE_MIN_SHIFT on, the GPU tables report to their range's table (``ranges``), which reports
        to the GPU summary."""
        n = len(self.banks)
        if n < 2:
            return
        shift = bank_shift(n)
        if self.summaries is None or shift != bank_shift(n - 1):
            self.summaries = [self.impl.BlockTable() for _ in range(_N_TIERS)]
            # The GPU summary also counts each key's holders: a match then skips the leading blocks
            # every instance holds (a fleet-wide system prompt) without walking each bank.
            self.summaries[0].enable_counts()
            self.ranges = [] if RANGE_MIN_SHIFT <= shift <= RANGE_MAX_SHIFT else None
            linked = 0
        else:
            linked = n - 1
        ranges = self.ranges
        for b in range(linked, n):
            for t, table in enumerate(self.banks[b].tiers):
                if t == 0 and ranges is not None:
                    r = b >> shift
                    while len(ranges) <= r:
                        rt = self.impl.BlockTable()
                        rt.enable_counts()
                        rt.enable_full()
                        rt.link_summary(self.summaries[0], 1 << len(ranges))
                        ranges.append(rt)
                    table.link_summary(ranges[r], 1 << (b - (r << shift)))
                else:
                    table.link_summary(self.summaries[t], 1 << (b >> shift))
        for b in range(linked, n):
            group = list(range((b >> shift) << shift, min(n, ((b >> shift) + 1) << shift)))
            if len(group) < 2:
                continue
            for t in range(_N_TIERS):
                for g in group:
                    # (a GPU table with a range table needs no siblings: the range table knows)
                    ranged = t == 0 and ranges is not None
                    sibs = [] if ranged else [self.banks[o].tiers[t] for o in group if o != g]
                    self.banks[g].tiers[t].set_siblings(sibs)

    def release(self, slot: int) -> None:
        del self.slot_owner[slot]
        self.bank_owners[slot // BANK_SLOTS][slot % BANK_SLOTS] = None
        self.bank_masks[slot // BANK_SLOTS] &= ~(1 << (slot % BANK_SLOTS))
        self.free_slots.append(slot)
        self.layout = next(_LAYOUTS)


class _Holder:
    """Per-instance bookkeeping: slot, per-tier counts, xor digests and key logs."""

    __slots__ = ("bank", "bit", "counts", "logs", "model", "shard", "slot", "version", "xors")

    def __init__(self, model: str, shard: _Shard, slot: int) -> None:
        self.model = model
        self.shard = shard
        self.slot = slot
        self.bank = shard.banks[slot // BANK_SLOTS]
        self.bit = 1 << (slot % BANK_SLOTS)
        self.counts = [0] * _N_TIERS
        self.xors = [0] * _N_TIERS
        self.logs = [shard.impl.KeyLog() for _ in range(_N_TIERS)]
        self.version = 0  # InvertedIndex.digest_version


class InvertedIndex:
    """The default KvBlockIndex backend (single-threaded: the service runs it on one event loop).

    Keys must be unsigned 64-bit integers; the wire decoder and the API guarantee it.
    """

    def __init__(self, impl: Any = None) -> None:
        # ``impl`` selects the table module (tests pass _pytable to check the twin); default native.
        self.impl = impl or tables
        self.native = self.impl is not _pytable
        self._shards: dict[str, _Shard] = {}
        self._holders: dict[InstanceKey, _Holder] = {}
        # Per model, its KV-cache groups (hybrid.py); a model without one is answered as one
        # full-attention group (every match before hybrid models).
        self._layouts: dict[str, GroupLayout] = {}
        # Stamped on a holder at each change of its blocks; one sequence for all, so that a version
        # is never seen twice, even across a drop and re-add (see digest_version).
        self._version = 0

    # -- instances ------------------------------------------------------------------------------

    def add_instance(self, instance: InstanceKey, model: str) -> None:
        holder = self._holders.get(instance)
        if holder is not None:
            if holder.model != model:
                raise ValueError(f"instance {instance} serves {holder.model!r}, not {model!r}")
            return
        shard = self._shards.get(model)
        if shard is None:
            shard = self._shards[model] = _Shard(self.impl)
        holder = self._holders[instance] = _Holder(model, shard, shard.allocate(instance))
        self._occupancy(shard, holder.slot // BANK_SLOTS, instance)
        self._version += 1
        holder.version = self._version

    def _occupancy(self, shard: _Shard, b: int, newcomer: InstanceKey | None = None) -> None:
        """Bank b's instances changed (a join or a leave): its GPU table knows their slots, so that
        its range table keeps per key the banks whose every instance holds it (a join makes none of
        them whole, a leave may make some). Such keys are held by every instance of the bank that
        stays: the shortest GPU key log among them names them all."""
        table = shard.banks[b].tiers[0]
        shortest = None
        if shard.ranges is None or not len(table):  # (nothing to tell, or nothing held)
            table.set_occupied(shard.bank_masks[b], None)
            return
        for owner in shard.bank_owners[b]:
            if owner is not None and owner != newcomer:
                log = self._holders[owner].logs[0]
                if shortest is None or len(log) < len(shortest):
                    shortest = log
        table.set_occupied(shard.bank_masks[b], shortest)

    def drop_instance(self, instance: InstanceKey) -> int:
        holder = self._holders.get(instance)
        if holder is None:
            return 0
        dropped = self.clear(instance)
        holder.shard.release(holder.slot)
        del self._holders[instance]
        self._occupancy(holder.shard, holder.slot // BANK_SLOTS)
        if not holder.shard.slot_owner:
            del self._shards[holder.model]
            self._layouts.pop(holder.model, None)
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

    def set_layout(self, model: str, layout: GroupLayout) -> None:
        """How ``model``'s KV-cache groups are matched (hybrid.py); kept while it has instances."""
        if model in self._shards:
            self._layouts[model] = layout

    def layout_of(self, model: str) -> GroupLayout | None:
        return self._layouts.get(model)

    # -- mutations (the ingest hot path) --------------------------------------------------------

    def store(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        holder = self._holders[instance]
        added: int
        added, x = holder.bank.tiers[tier].add_bit(keys, holder.bit, holder.logs[tier])
        if added:
            holder.counts[tier] += added
            holder.xors[tier] ^= x
            self._version += 1
            holder.version = self._version
        return added

    def remove(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        holder = self._holders[instance]
        table = holder.bank.tiers[tier]
        removed: int
        removed, x = table.remove_bit(keys, holder.bit)
        if removed:
            holder.counts[tier] -= removed
            holder.xors[tier] ^= x
            self._version += 1
            holder.version = self._version
            self._maybe_compact(holder, tier)
        return removed

    def apply(self, instance: InstanceKey, events: Sequence[Any]) -> Applied:
        holder = self._holders[instance]
        self._version += 1
        holder.version = self._version
        # One native call for the whole batch (clears and log compaction included).
        return self.impl.apply_events(  # type: ignore[no-any-return]
            events,
            TIER_BY_NAME,
            holder.bank.tiers,
            holder.logs,
            holder.bit,
            holder.counts,
            holder.xors,
            Applied,
            GROUP_MASKS,
        )

    def apply_within(
        self, instance: InstanceKey, events: Sequence[Any], bound: int, limits: Sequence[int]
    ) -> Applied | None:
        holder = self._holders[instance]
        c = holder.counts
        if (
            bound > limits[0] - c[0]
            or bound > limits[1] - c[1]
            or bound > limits[2] - c[2]
            or bound > limits[3] - c[3]
        ):
            return None
        return self.apply(instance, events)

    def _maybe_compact(self, holder: _Holder, tier: int) -> None:
        # Removals leave dead keys in the log; compact once they outnumber the live ones.
        log = holder.logs[tier]
        if len(log) > 2 * holder.counts[tier] + _COMPACT_SLACK:
            holder.bank.tiers[tier].compact_log(log, holder.bit)

    def clear(self, instance: InstanceKey, tier: int | None = None) -> int:
        holder = self._holders.get(instance)
        if holder is None:
            return 0
        self._version += 1
        holder.version = self._version
        cleared = 0
        for t in range(_N_TIERS) if tier is None else (tier,):
            if holder.counts[t]:
                holder.bank.tiers[t].clear_logged(holder.logs[t], holder.bit)
                cleared += holder.counts[t]
            holder.counts[t] = 0
            holder.xors[t] = 0
            holder.logs[t].reset()
        return cleared

    # -- queries --------------------------------------------------------------------------------

    def _alive(self, shard: _Shard, instances: Iterable[InstanceKey] | None) -> list[int]:
        if instances is None:
            return shard.bank_masks
        alive = [0] * len(shard.banks)
        holders = self._holders
        for inst in instances:
            holder = holders.get(inst)
            if holder is not None and holder.shard is shard:
                alive[holder.slot // BANK_SLOTS] |= holder.bit
        return alive

    @staticmethod
    def _pools(shard: _Shard) -> list[Any]:
        if shard.summaries is not None:  # the shared tier's summary: "in some bank's pool"
            pool = shard.summaries[_SHARED]
            return [pool] if len(pool) else []
        return [bank.tiers[_SHARED] for bank in shard.banks if len(bank.tiers[_SHARED])]

    def match(
        self,
        model: str,
        keys: list[int],
        instances: Iterable[InstanceKey] | None = None,
        limit: int | None = None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> dict[InstanceKey, InstanceMatch]:
        shard = self._shards.get(model)
        if shard is None or not keys:
            return {}
        layout = self._layouts.get(model)
        if layout is not None:
            if limit is not None and limit < len(keys) * layout.block_size:
                keys = keys[: max(limit, 0) // layout.block_size]
                if not keys:
                    return {}
            if layout.hybrid:
                return self._match_hybrid(shard, layout, keys, instances, limit, reach)
        alive = self._alive(shard, instances)
        pools = self._pools(shard)
        out: dict[InstanceKey, InstanceMatch] = {}
        # One native call: only the banks holding the first block (or all, if the pool does) can
        # match anything; each bank's walk stops at its first block that none of its instances
        # holds; the keys are converted to u64 once for every bank walked.
        self.impl.match_banks_into(
            shard.bank_tiers,
            alive,
            shard.bank_owners,
            shard.summaries,
            pools,
            self.impl.KeyArray(keys),
            out,
            {},  # matches of one length are equal and immutable: each GPU-only one is built once
            InstanceMatch,
            len(shard.slot_owner),
            shard.ranges,
        )
        return out

    def _match_hybrid(
        self,
        shard: _Shard,
        layout: GroupLayout,
        keys: list[int],
        instances: Iterable[InstanceKey] | None,
        limit: int | None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> dict[InstanceKey, InstanceMatch]:
        """``match`` by vLLM's hybrid rule (hybrid.py), in one native call: the full-attention
        group's prefix walk bounds each instance, then every other group lowers it; tier split of
        the walked group. ``keys`` are already cut to ``limit``; ``reach`` gets the walk's own
        prefix where the rules lowered it (``match``)."""
        impl = self.impl
        walked = None if layout.primary is None else impl.KeyArray(keys, layout.primary_mask)
        out: dict[InstanceKey, InstanceMatch] = {}
        impl.match_hybrid_into(
            shard.bank_tiers,
            self._alive(shard, instances),
            shard.bank_owners,
            shard.summaries,
            self._pools(shard),
            walked,
            impl.KeyArray(keys) if layout.rules else walked,
            layout.rule_tuples,
            len(keys) * layout.block_size if limit is None else limit,
            layout.block_size,
            out,
            InstanceMatch,
            len(shard.slot_owner),
            reach,
        )
        return out

    def match_groups(
        self,
        model: str,
        keys: list[int],
        instances: Iterable[InstanceKey] | None = None,
        listed: int = 16,
        limit: int | None = None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> tuple[dict[InstanceKey, InstanceMatch], list[MatchGroup]]:
        """``match`` grouped by answer, for rankings that treat many equal matches alike: the
        instances of answers that at most ``listed`` instances share, as ``match`` gives them, and
        the larger groups as slot masks (``MatchGroup``; rows through ``slot_layout``). A prompt
        every instance holds the start of costs per bank and per distinct answer, not per instance.
        ``reach`` as ``match`` (hybrid models' answers are all listed)."""
        shard = self._shards.get(model)
        if shard is None or not keys:
            return {}, []
        layout = self._layouts.get(model)
        if layout is not None and (layout.hybrid or limit is not None):
            # A hybrid model's answers depend on each instance's other groups: listed one by one.
            if layout.hybrid:
                return self.match(model, keys, instances, limit, reach), []
            if limit is not None and limit < len(keys) * layout.block_size:
                keys = keys[: max(limit, 0) // layout.block_size]
                if not keys:
                    return {}, []
        out: dict[InstanceKey, InstanceMatch] = {}
        large = self.impl.match_banks_grouped(
            shard.bank_tiers,
            self._alive(shard, instances),
            shard.bank_owners,
            shard.summaries,
            self._pools(shard),
            self.impl.KeyArray(keys),
            out,
            InstanceMatch,
            len(shard.slot_owner),
            listed,
            shard.ranges,
        )
        return out, [MatchGroup(m, count, masks) for m, count, masks in large]

    def slot_layout(self, model: str, known: int = -1) -> tuple[int, list[InstanceKey | None]]:
        """(a number that changes whenever a slot of ``model`` changes owner, the owner of each
        slot: bank b's slot s at b * 64 + s, None where free), to turn MatchGroup masks into
        instances; the list is empty when the number is ``known`` (the caller has it)."""
        shard = self._shards.get(model)
        if shard is None:
            return -1, []
        if shard.layout == known:
            return known, []
        return shard.layout, [owner for owners in shard.bank_owners for owner in owners]

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

    def digest_version(self, instance: InstanceKey) -> int:
        holder = self._holders.get(instance)
        return 0 if holder is None else holder.version

    def digest_equals(self, instance: InstanceKey, counts: list[int], xors: list[int]) -> bool:
        holder = self._holders.get(instance)
        if holder is None:
            return not any(counts) and not any(xors)
        return holder.counts == counts and holder.xors == xors

    def diff(self, instance: InstanceKey, tier: int, keys: list[int]) -> tuple[list[int], list[int]]:
        d = self.differ(instance, tier, keys)
        d.step(-1)
        return d.missing, d.extra

    def differ(self, instance: InstanceKey, tier: int, keys: list[int]) -> Differ:
        """A resumable diff (``step(budget) -> done``, then ``missing`` / ``extra``); ``keys`` must
        be distinct and the instance's own blocks must not change until it is done. No shortcut
        through the digest: the periodic check exists to catch what digests cannot."""
        holder = self._holders[instance]
        differ: Differ = holder.bank.tiers[tier].differ(
            holder.logs[tier], holder.bit, keys, holder.counts[tier]
        )
        return differ

    def keys_of(self, instance: InstanceKey, tier: int) -> Iterator[int]:
        holder = self._holders.get(instance)
        if holder is None:
            return iter(())
        log = holder.logs[tier]
        holder.bank.tiers[tier].compact_log(log, holder.bit)  # now each live key exactly once
        return iter(list(log))

    def stats(self) -> IndexStats:
        distinct = [0] * _N_TIERS
        nbytes = 0
        for shard in self._shards.values():
            for bank in shard.banks:
                for t, table in enumerate(bank.tiers):
                    if shard.summaries is None:
                        distinct[t] += len(table)
                    nbytes += table.nbytes()
            if shard.summaries is not None:  # a summary holds each of the model's keys once
                for t, table in enumerate(shard.summaries):
                    distinct[t] += len(table)
                    nbytes += table.nbytes()
            for table in shard.ranges or ():
                nbytes += table.nbytes()
        entries = [0] * _N_TIERS
        for holder in self._holders.values():
            for t in range(_N_TIERS):
                entries[t] += holder.counts[t]
                nbytes += holder.logs[t].nbytes()
        return IndexStats(
            models=len(self._shards),
            instances=len(self._holders),
            distinct_blocks=tuple(distinct),  # type: ignore[arg-type]
            entries=tuple(entries),  # type: ignore[arg-type]
            nbytes=nbytes,
        )


__all__ = ["BANK_SLOTS", "NATIVE", "InvertedIndex"]
