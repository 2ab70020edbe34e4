"""From wire bytes to index state: decode, check identity, sequence, apply, within the limits.

The consumer is synchronous and transport-free: NATS subscriptions, offline replay and benchmarks all
call ``on_events`` / ``on_heartbeat`` with (subject, payload). Nothing a message contains can raise out
of these methods: a bad message is rejected whole (counted by reason and logged with its worker id)
and the index is left exactly as it was.

This module is the batch path. Heartbeats are handled in kvindex/ingest/heartbeats.py (the consumer's
``on_heartbeat`` is theirs); what to do about holes, restarts and drift is decided by the repair
machine (``consumer.repairs``, kvindex/repair/machine.py), which applies what it holds through this
module's ``apply`` and ``apply_snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable
from time import time as _now
from typing import Any

import structlog

from kvindex.fleet.registry import InstanceState, Registry, instance_id
from kvindex.index.base import Applied, KvBlockIndex
from kvindex.ingest.heartbeats import Heartbeats
from kvindex.ingest.layouts import Layouts
from kvindex.ingest.limits import (
    BLOCK_LIMIT,
    DEFAULT_INGEST_LIMITS,
    INSTANCE_LIMIT,
    MODEL_LIMIT,
    SEQ_JUMP,
    IngestLimits,
    LimitExceeded,
)
from kvindex.instance import InstanceKey
from kvindex.keys import GROUP_MASKS
from kvindex.observability.counters import IngestCounters
from kvindex.observability.logs import RateLimitedLog
from kvindex.repair.machine import REPLAY, SNAPSHOT, MakeScheduler, RepairMachine
from kvindex.sequencer.cursor import MAX_GAP, Cursor, Sequencer, Verdict, decide
from kvindex.wire import errors
from kvindex.wire.codec import DEFAULT_LIMITS, Limits, decode_batch
from kvindex.wire.errors import WireError
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.schema import CLEARED, REMOVED, SHARED, STORED, TIER_NAMES, EventBatch
from kvindex.wire.subjects import EVENTS, Subjects, valid_worker_id


class Consumer:
    # Handle one heartbeat (subject, payload); True when accepted. The heartbeat handler's own bound
    # method (kvindex/ingest/heartbeats.py), set at construction: no call in between.
    on_heartbeat: Callable[[str, bytes], bool]

    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        *,
        sequencer: Sequencer,
        counters: IngestCounters,
        subjects: Subjects | None = None,
        limits: Limits = DEFAULT_LIMITS,
        repair: MakeScheduler | None = None,
        ingest_limits: IngestLimits = DEFAULT_INGEST_LIMITS,
        log: Any = None,
        prefill_samples: Callable[[str, list[tuple[int, int, float]], str], Any] | None = None,
        on_forget: Callable[[InstanceKey], Any] | None = None,
        on_sync_change: Callable[[InstanceState, bool], Any] | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.subjects = subjects or Subjects()
        self.sequencer = sequencer
        self.counters = counters
        self.limits = limits
        self.ingest_limits = ingest_limits
        self.log = log or structlog.get_logger("kvindex.ingest")
        self._reject_log = RateLimitedLog(self.log)
        # Refusals by a limit: once per (instance, reason) per minute, with the count suppressed.
        self._limit_log = RateLimitedLog(self.log, interval=60.0)
        self._events_head = f"{self.subjects.prefix}.{EVENTS}."
        # Where heartbeats' prefill samples go (model, [(prompt, cached, ms)], instance id): the
        # calibration (kvindex/scoring/calibration.py).
        self.prefill_samples = prefill_samples
        # Told when an instance is forgotten (routing state about it can go too).
        self.on_forget = on_forget
        # Told when an instance's repair state changes (its RepairStatus: sync, cause, failed) and when a
        # snapshot reconciled it: the router keeps its degraded instances (kvindex/scoring/outcomes.py).
        self.on_sync_change = on_sync_change
        # Holes, restarts and drift: decided there, repaired by the scheduler ``repair`` makes for
        # it (NoRepair when None).
        self.repairs = RepairMachine(self, repair)
        # Each model's KV-cache groups (hybrid attention), from its workers' heartbeats.
        self.layouts = Layouts(
            index,
            registry,
            self.log,
            lambda state, exc: self.refuse(state.key, exc.reason, exc.message),
            self._resync,
        )
        self.heartbeats = Heartbeats(self)
        self.on_heartbeat = self.heartbeats.on_heartbeat

    # -- event batches ---------------------------------------------------------------------------

    def on_events(self, subject: str, payload: bytes) -> bool:
        """Handle one event batch; True when it was applied to the index now."""
        c = self.counters
        c.batches_received += 1
        head = self._events_head
        # The subject's worker needs no validation of its own: it must equal the envelope's, which
        # the decoder validates.
        worker = subject[len(head) :] if subject.startswith(head) else None
        try:
            if not worker:
                raise WireError(errors.BAD_SUBJECT, f"subject {subject!r} is not under {head!r}")
            batch = decode_batch(payload, worker, self.limits)
            state = self.registry.get((worker, batch.dp_rank))
            if state is None or state.model != batch.model or state.block_size != batch.block_size:
                state = self.state_for(worker, batch.dp_rank, batch.model, batch.block_size, batch.epoch)
        except WireError as exc:
            if exc.reason == errors.SUBJECT_MISMATCH and not valid_worker_id(worker):
                exc = WireError(errors.BAD_SUBJECT, f"subject {subject!r} does not end in a valid worker id")
            self.reject(worker, subject, exc)
            return False
        key = state.key
        cursor = self.sequencer.cursor(key)
        verdict = decide(cursor, batch.epoch, batch.seq)
        if state.layout_conflict:
            # Its blocks would be read by another layout's rule (kvindex/ingest/layouts.py): refused,
            # but its seq is consumed, so that no repair brings them back.
            self.refuse(
                key, errors.GROUP_LAYOUT_MISMATCH, "batch of an instance whose KV-cache groups differ"
            )
            if cursor is None or cursor.epoch != batch.epoch:
                cursor = self.sequencer.open(key, batch.epoch)
            cursor.applied = max(cursor.applied, batch.seq)
            state.epoch, state.last_seq = batch.epoch, cursor.applied
            return False
        if verdict is Verdict.APPLY:
            self.apply(state, batch, len(payload))
            cursor.applied = batch.seq  # type: ignore[union-attr]
            return True
        if verdict is Verdict.DUPLICATE:
            c.duplicates += 1
            return False
        if verdict is Verdict.STALE_EPOCH:
            c.stale_epochs += 1
            return False
        if verdict is Verdict.JUMP:
            assert cursor is not None
            if not self.jumped(state, cursor, batch.seq, "batch"):
                return False
            self.apply(state, batch, len(payload))
            cursor.applied = batch.seq
            return True
        # The rest is the repair machine's (kvindex/repair/machine.py).
        repairs = self.repairs
        if verdict is Verdict.BUFFER:
            repairs.hold(state, cursor, batch)  # type: ignore[arg-type]
            return False
        if verdict is Verdict.GAP:
            assert cursor is not None
            repairs.gap(state, (cursor.applied + 1, batch.seq - 1), "seq jump")
            repairs.hold(state, cursor, batch)
            repairs.begin(state, cursor, REPLAY, "gap")
            return False
        # FIRST or NEW_EPOCH: a new history starts.
        if verdict is Verdict.NEW_EPOCH:
            repairs.restart(state, batch.epoch, "new epoch in event batch")
        cursor = self.sequencer.open(key, batch.epoch)
        if batch.seq == 1:
            self.apply(state, batch, len(payload))
            cursor.applied = 1
            return True
        # Joined mid-stream: what came before this batch is unknown here.
        self.counters.joins_mid_stream += 1
        repairs.hold(state, cursor, batch)
        repairs.begin(state, cursor, SNAPSHOT, "start" if verdict is Verdict.FIRST else "epoch")
        return False

    def _resync(self, state: InstanceState) -> None:
        """A snapshot of the instance (its blocks were dropped while its layout was in conflict)."""
        cursor = self.sequencer.cursor(state.key)
        if cursor is not None and cursor.repairing is None:
            self.repairs.begin(state, cursor, SNAPSHOT, "layout")

    def jumped(self, state: InstanceState, cursor: Cursor, seq: int, what: str) -> bool:
        """A batch's or heartbeat's ``seq`` more than MAX_GAP past the last one the instance is known
        to have published (kvindex/sequencer): a restart that kept its epoch, or a lie. Neither a hole
        to replay nor batches to count missing: refused (``seq_jump``, logged with the worker id) and
        the instance resynchronised from a snapshot, whose seq says where the worker really is (a
        batch refused so is in it if the worker really published it).

        True when no snapshot could start (no repair transport, or ``--max-pending-repairs``
        reached): the caller then takes ``seq`` as the instance's position, as the batches after an
        unrepaired hole are applied across it."""
        known = cursor.known()
        self.refuse(
            state.key,
            SEQ_JUMP,
            f"{what} seq {seq} is {seq - known} past seq {known}, the last known published (a hole may "
            f"miss at most {MAX_GAP} batches): resynchronised from a snapshot",
            epoch=cursor.epoch,
        )
        if cursor.repairing == SNAPSHOT:
            return False  # the snapshot being taken answers it
        self.repairs.begin(state, cursor, SNAPSHOT, "jump")
        return cursor.repairing is None

    def apply(self, state: InstanceState, batch: EventBatch, bound: int = -1) -> None:
        """Apply a batch; ``bound`` is an upper bound of its keys when known (its payload's size:
        a key takes at least one byte), which spares counting them."""
        c = self.counters
        events = batch.events
        # Fast check: even if every key were new, no tier would pass its limit.
        have = self.index.block_counts(state.key)
        limit = state.block_limits or self.limits_of(state)
        room = min(limit[0] - have[0], limit[1] - have[1], limit[2] - have[2], limit[3] - have[3])
        if bound > room or bound < 0:
            bound = sum([len(ev.keys) for ev in events])
        applied = self.index.apply(state.key, events) if bound <= room else self._apply_capped(state, batch)
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
        state.last_event_ts = batch.ts
        c.lag.observe(_now() - batch.ts)
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

    def heartbeat_order(self) -> tuple[bool, bool]:
        """(heartbeats drive repairs, heartbeats arrive in order with the batches): see
        ``set_heartbeat_order``."""
        return self.heartbeats.drive_repairs, self.heartbeats.in_order

    def set_heartbeat_order(self, *, drive_repairs: bool, in_order: bool) -> None:
        """What the event source says about heartbeats: whether they may drive repairs (not while
        it replays history, JetStream's catch-up) and whether they share one ordered subscription
        with the batches (else a heartbeat ahead of the batches counts as a lost tail only when
        seen twice). The source's and a replay's to say (kvindex/ingest/nats_source.py,
        kvindex/capture/replay.py)."""
        self.heartbeats.drive_repairs = drive_repairs
        self.heartbeats.in_order = in_order

    def limits_of(self, state: InstanceState) -> tuple[int, int, int, int]:
        """The instance's block limit per tier, from the capacity it announced last."""
        return self.ingest_limits.limits_of(state)

    def _refused_blocks(self, state: InstanceState, refused: dict[int, int], what: str) -> None:
        for tier, n in refused.items():
            state.capped |= 1 << tier
            self.counters.blocks_refused += n
        limits = {TIER_NAMES[t]: self.limits_of(state)[t] for t in refused}
        self.refuse(
            state.key,
            BLOCK_LIMIT,
            f"{what}: {sum(refused.values())} stored blocks beyond the limit dropped",
            limits=limits,
            capacity={TIER_NAMES[t]: n for t, n in state.capacity.items()},
        )

    def refuse(self, instance: InstanceKey, reason: str, message: str, **kw: Any) -> None:
        """Count a limit refusal and log it once per (instance, reason) per minute."""
        self.counters.reject(reason, instance[0])
        self._limit_log.warning(
            (instance_id(instance), reason),
            "limit_refused",
            worker=instance[0],
            dp_rank=instance[1],
            reason=reason,
            error=message,
            **kw,
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

    # -- liveness (decided by kvindex/fleet/liveness.py, driven by the service) -----------------

    def mark_stale(self, state: InstanceState) -> None:
        """No heartbeat for a while: keep the blocks but stop ranking the instance."""
        state.stale = True
        self.counters.stale_marked += 1
        self.log.warning("instance_stale", worker=state.worker, dp_rank=state.dp_rank)

    def forget(self, instance: InstanceKey) -> None:
        """Silent for long: drop the instance and its blocks (a heartbeat brings it back)."""
        self.heartbeats.forget(instance[0])
        dropped = self.index.drop_instance(instance)
        self.registry.remove(instance)
        self.sequencer.forget(instance)
        self.repairs.forget(instance)
        self.counters.instances_forgotten += 1
        if self.on_forget is not None:
            self.on_forget(instance)
        self.log.warning(
            "instance_forgotten", worker=instance[0], dp_rank=instance[1], dropped_blocks=dropped
        )

    # -- shared helpers --------------------------------------------------------------------------

    def state_for(self, worker: str, dp_rank: int, model: str, block_size: int, epoch: int) -> InstanceState:
        """The registry entry for an instance, created on first contact; WireError on conflicts."""
        key: InstanceKey = (worker, dp_rank)
        state = self.registry.get(key)
        if state is not None and state.model == model and state.block_size == block_size:
            return state
        if state is not None and state.epoch == epoch:
            # Same process claiming another model or block size: a misconfiguration, not a restart.
            reason = errors.MODEL_MISMATCH if state.model != model else errors.BLOCK_SIZE_MISMATCH
            raise WireError(
                reason,
                f"instance {state.instance_id} announced model={model!r} block_size={block_size} "
                f"but serves model={state.model!r} block_size={state.block_size} in the same epoch",
            )
        expected = self._model_block_size(model, exclude=key)
        if expected is not None and expected != block_size:
            raise WireError(
                errors.BLOCK_SIZE_MISMATCH,
                f"model {model!r} uses block_size={expected} on its other instances, "
                f"this worker announced {block_size}; keys would never match",
            )
        self._check_room(key, model, state)
        if state is not None:
            # Restarted with another model or block size: its old blocks are meaningless now.
            self.index.drop_instance(key)
            self.registry.remove(key)
            self.sequencer.forget(key)
        self.index.add_instance(key, model)
        state = self.registry.add(key, model, block_size)
        state.epoch = epoch
        self.log.info("instance_joined", worker=worker, dp_rank=dp_rank, model=model, block_size=block_size)
        return state

    def _check_room(self, key: InstanceKey, model: str, state: InstanceState | None) -> None:
        """LimitExceeded when a new instance (or one moving to ``model``) would pass a limit."""
        limits, registry = self.ingest_limits, self.registry
        members = registry.count(model)
        if state is not None and state.model == model:
            members -= 1  # the instance itself, restarting with another block size
        if members >= limits.max_instances_per_model:
            raise LimitExceeded(
                INSTANCE_LIMIT,
                f"model {model!r} already has {members} instances (limit {limits.max_instances_per_model})",
            )
        if members == 0:
            models = len(registry.models())
            if state is not None and registry.count(state.model) == 1:
                models -= 1  # the instance leaves its old model, which then goes away
            if models >= limits.max_models:
                raise LimitExceeded(
                    MODEL_LIMIT, f"{models} models known (limit {limits.max_models}): {model!r} refused"
                )

    def _model_block_size(self, model: str, exclude: InstanceKey) -> int | None:
        # The live view, not a copy: this runs at every join, and the first or second member answers.
        for key, other in self.registry.members(model).items():
            if key != exclude:
                return other.block_size
        return None

    def reject(self, worker: str | None, subject: str, exc: WireError) -> None:
        self.counters.reject(exc.reason, worker)
        # Limit refusals are logged once per minute per (instance, reason); other rejects by the
        # general rate limit.
        log, event = (
            (self._limit_log, "limit_refused")
            if isinstance(exc, LimitExceeded)
            else (self._reject_log, "message_rejected")
        )
        log.warning(
            (worker or subject, exc.reason),
            event,
            worker=worker,
            subject=subject,
            reason=exc.reason,
            error=exc.message,
        )
