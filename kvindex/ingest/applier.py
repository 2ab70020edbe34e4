"""Applying batches and snapshots to the index, within the block limits (kvindex/ingest/limits.py).

The consumer applies the batches that arrive in order; the repair machine (kvindex/repair/machine.py)
applies the ones it held back and the snapshots it asked for. Both are handed this one applier when
they are built (kvindex/core.py), so the limits and the counters are kept in one place and the
machine never reaches back to the consumer that drives it.
"""

from __future__ import annotations

from bisect import bisect_left
from time import time as _now

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import Applied
from kvindex.ingest.layouts import Layouts
from kvindex.ingest.limits import BLOCK_LIMIT, IngestLimits
from kvindex.ingest.rejects import Rejects
from kvindex.keys import GROUP_MASKS
from kvindex.observability.counters import LAG_BUCKETS
from kvindex.repair.machine import IngestState
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.schema import CLEARED, REMOVED, SHARED, STORED, TIER_NAMES, EventBatch


class Applier:
    """``apply`` (a batch) and ``apply_snapshot``; blocks beyond an instance's limit are dropped,
    counted and logged, and its tier marked capped."""

    def __init__(self, shared: IngestState, limits: IngestLimits, rejects: Rejects, layouts: Layouts) -> None:
        self.index, self.counters, self.log = shared.index, shared.counters, shared.log
        self.ingest_limits, self.rejects, self.layouts = limits, rejects, layouts
        self._apply_within = self.index.apply_within

    def apply(self, state: InstanceState, batch: EventBatch, bound: int = -1) -> None:
        """Apply a batch; ``bound`` is an upper bound of its keys when known (its payload's size:
        a key takes at least one byte), which spares counting them."""
        c = self.counters
        events = batch.events
        limit = state.block_limits or self.limits_of(state)
        # Fast check, in the index's call: even if every key were new, no tier would pass its limit.
        applied = self._apply_within(state.key, events, bound, limit) if bound >= 0 else None
        if applied is None:
            have = self.index.block_counts(state.key)
            room = min(limit[0] - have[0], limit[1] - have[1], limit[2] - have[2], limit[3] - have[3])
            if sum([len(ev.keys) for ev in events]) <= room:
                applied = self.index.apply(state.key, events)
            else:
                applied = self._apply_capped(state, batch)
        stored, removed, cleared, n_stored, n_removed, n_cleared, local, top_group = applied
        if top_group > state.top_group:
            self.layouts.events_named(state, top_group)
        c.blocks_stored += stored
        tally = c.events_applied
        tally[STORED] += n_stored
        if n_removed or n_cleared:  # most batches only store
            c.blocks_removed += removed
            c.blocks_cleared += cleared
            state.removals += removed + cleared
            tally[REMOVED] += n_removed
            tally[CLEARED] += n_cleared
        if local:
            state.local_blocks_seen = True
        state.epoch = batch.epoch
        state.last_seq = batch.seq
        ts = state.last_event_ts = batch.ts
        # LagHistogram.observe, inline (a call a batch)
        lag, seconds = c.lag, _now() - ts
        lag.counts[bisect_left(LAG_BUCKETS, seconds)] += 1
        lag.count += 1
        lag.sum += seconds
        state.batches += 1
        c.batches_applied += 1

    def _apply_capped(self, state: InstanceState, batch: EventBatch) -> Applied:
        """Apply a batch that may take a tier past its limit: all of it, then drop the blocks it
        stored beyond the limit, newest first.

        The limit holds for what a batch leaves, not inside it: engines store before they evict (an
        offload tier takes its victims, then trims to capacity), so an honest batch may pass the
        limit on the way. Its removals and clears all apply, so the index keeps a subset of what the
        worker holds (a missed hit, never a wrong route), and its seq is consumed: refusing the
        batch whole would only come back as a gap, a replay of the same batch and a snapshot just
        as large.
        """
        index, key = self.index, state.key
        applied = index.apply(key, batch.events)
        counts = index.block_counts(key)
        refused: dict[int, int] = {}
        for tier, (held, limit) in enumerate(zip(counts, self.limits_of(state), strict=True)):
            excess = held - limit
            if excess <= 0:
                continue
            name = TIER_NAMES[tier]
            new = [
                k ^ GROUP_MASKS[ev.group]  # the index holds group keys (docs/wire.md §8)
                for ev in batch.events
                if ev.op == STORED and ev.tier == name
                for k in ev.keys
            ]
            dropped, end = 0, len(new)
            while excess > 0 and end > 0:  # keys stored and removed within the batch remove nothing
                chunk = new[max(0, end - excess) : end]
                end -= len(chunk)
                n = index.remove(key, tier, chunk)
                excess -= n
                dropped += n
            if dropped:
                refused[tier] = dropped
        if refused:
            self._refused_blocks(state, refused, f"batch seq {batch.seq}")
            applied = applied._replace(stored=applied.stored - sum(refused.values()))
        return applied

    def _store_capped(self, state: InstanceState, tier: int, keys: list[int]) -> tuple[int, int]:
        """Store ``keys`` up to the tier's limit: (blocks added, keys dropped unstored)."""
        index, key = self.index, state.key
        room = self.limits_of(state)[tier] - index.block_counts(key)[tier]
        if len(keys) <= room:
            return index.store(key, tier, keys), 0
        added = done = 0
        # Keys already held cost no room, so store in chunks of the room left until it is gone.
        while room > 0 and done < len(keys):
            n = index.store(key, tier, keys[done : done + room])
            done += room
            added += n
            room -= n
        return added, max(0, len(keys) - done)

    def limits_of(self, state: InstanceState) -> tuple[int, int, int, int]:
        """The instance's block limit per tier, from the capacity it announced last."""
        return self.ingest_limits.limits_of(state)

    def _refused_blocks(self, state: InstanceState, refused: dict[int, int], what: str) -> None:
        for tier, n in refused.items():
            state.capped |= 1 << tier
            self.counters.blocks_refused += n
        limits = {TIER_NAMES[t]: self.limits_of(state)[t] for t in refused}
        self.rejects.refuse(
            state.key,
            BLOCK_LIMIT,
            f"{what}: {sum(refused.values())} stored blocks beyond the limit dropped",
            limits=limits,
            capacity={TIER_NAMES[t]: n for t, n in state.capacity.items()},
        )

    def apply_snapshot(
        self,
        state: InstanceState,
        snapshot: Snapshot,
        diffs: dict[int, tuple[list[int], list[int]]] | None,
    ) -> None:
        """Make the instance's blocks equal the snapshot's, per tier, within its limits (for the
        repair machine, which checked its epoch). ``diffs`` (tier -> (missing, extra)), when given,
        were computed beforehand in steps (index ``differ``)."""
        instance = state.key
        c = self.counters
        added = removed = 0
        refused: dict[int, int] = {}
        for tier in range(4):
            if diffs is not None and tier in diffs:
                missing, extra = diffs[tier]
            else:
                missing, extra = self.index.diff(instance, tier, snapshot.tiers.get(tier, []))
            if extra:
                removed += self.index.remove(instance, tier, extra)
            dropped = 0
            if missing:
                n, dropped = self._store_capped(state, tier, missing)
                added += n
                if tier != SHARED:
                    state.local_blocks_seen = True
            if dropped or snapshot.trimmed & (1 << tier):
                refused[tier] = dropped
            else:
                state.capped &= ~(1 << tier)  # the tier is exact again
        if refused:
            self._refused_blocks(state, refused, f"snapshot at seq {snapshot.seq}")
        c.snapshots_applied += 1
        c.snapshot_blocks_added += added
        c.snapshot_blocks_removed += removed
        if added or removed:
            self.log.info(
                "snapshot_diff",
                worker=state.worker,
                dp_rank=state.dp_rank,
                added=added,
                removed=removed,
                seq=snapshot.seq,
            )
