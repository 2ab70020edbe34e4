"""From wire bytes to index state: decode, check identity, sequence, apply.

The consumer is synchronous and transport-free: NATS subscriptions, offline replay and benchmarks all
call ``on_events`` / ``on_status`` with (subject, payload). Nothing a message contains can raise out of
these methods: a bad message is rejected whole (counted by reason and logged with its worker id) and
the index is left exactly as it was.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from time import time as _now
from typing import Any, Protocol

import msgspec
import structlog

from kvindex.fleet.registry import InstanceState, Registry, instance_id
from kvindex.index.base import Applied, KvBlockIndex
from kvindex.ingest.limits import (
    BLOCK_LIMIT,
    DEFAULT_INGEST_LIMITS,
    HELD_LIMIT,
    INSTANCE_LIMIT,
    MODEL_LIMIT,
    REPAIR_LIMIT,
    IngestLimits,
    LimitExceeded,
)
from kvindex.instance import InstanceKey
from kvindex.observability.counters import IngestCounters
from kvindex.observability.logs import RateLimitedLog
from kvindex.sequencer.cursor import Cursor, Sequencer, Verdict, decide
from kvindex.wire import errors
from kvindex.wire.codec import (
    DEFAULT_LIMITS,
    Limits,
    StatusMemory,
    StatusPeek,
    decode_batch,
    decode_status,
    decode_status_into,
    load_of,
    peek_decoder,
)
from kvindex.wire.errors import WireError
from kvindex.wire.reconcile import REPLAY_OK, Snapshot
from kvindex.wire.schema import (
    CLEARED,
    REMOVED,
    SHARED,
    STORED,
    TIER_NAMES,
    WIRE_VERSION,
    EventBatch,
    Load,
    StatusReport,
)
from kvindex.wire.subjects import EVENTS, STATUS, Subjects, valid_worker_id


class RepairScheduler(Protocol):
    """Runs replays and snapshots for the consumer; answers come back through Consumer.on_replay /
    on_snapshot / on_replay_failed. Requests for an instance with one already in flight are merged."""

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None: ...

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None: ...


class NoRepair:
    """For consumers with no transport to repair over (offline tools, benchmarks): a hole is counted
    and logged, and the batches after it are applied in order as if it had not been there."""

    def __init__(self) -> None:
        self.consumer: Consumer | None = None

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None:
        assert self.consumer is not None
        self.consumer.give_up(instance)

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None:
        assert self.consumer is not None
        self.consumer.give_up(instance)


REPLAY = "replay"
SNAPSHOT = "snapshot"
# A hole that survives this many repair rounds in a row is left to the periodic reconciliation:
# re-asking at once is how recovery loops start.
MAX_REPAIR_ROUNDS = 4


class Consumer:
    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        *,
        subjects: Subjects | None = None,
        sequencer: Sequencer | None = None,
        counters: IngestCounters | None = None,
        limits: Limits = DEFAULT_LIMITS,
        repair: RepairScheduler | None = None,
        ingest_limits: IngestLimits = DEFAULT_INGEST_LIMITS,
        log: Any = None,
        prefill_samples: Callable[[str, list[tuple[int, int, float]], str], Any] | None = None,
        on_forget: Callable[[InstanceKey], Any] | None = None,
        on_sync_change: Callable[[InstanceState, bool], Any] | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.subjects = subjects or Subjects()
        self.sequencer = sequencer or Sequencer()
        self.counters = counters or IngestCounters()
        self.limits = limits
        self.ingest_limits = ingest_limits
        self.log = log or structlog.get_logger("kvindex.ingest")
        self._reject_log = RateLimitedLog(self.log)
        # Refusals by a limit: once per (instance, reason) per minute, with the count suppressed.
        self._limit_log = RateLimitedLog(self.log, interval=60.0)
        self._events_head = f"{self.subjects.prefix}.{EVENTS}."
        self._status_head = f"{self.subjects.prefix}.{STATUS}."
        # Per status subject, the last heartbeat that changed nothing (see _Repeat): the next one
        # equal to it but for its timestamp only refreshes liveness.
        self._repeats: dict[str, _Repeat] = {}
        self._pending_repeat: tuple[bytes, str] | None = None  # (set by _apply_status)
        # Heartbeats drive repairs (tail loss, drift, discovery) unless the event source is still
        # replaying history; and when they do not share one ordered subscription with the batches,
        # a heartbeat ahead of the batches must be seen twice before it counts as a lost tail.
        self.heartbeat_repairs = True
        self.status_in_order = True
        # Where heartbeats' prefill samples go (model, [(prompt, cached, ms)], instance id): the
        # calibration (kvindex/scoring/calibration.py).
        self.prefill_samples = prefill_samples
        # Told when an instance is forgotten (routing state about it can go too).
        self.on_forget = on_forget
        # Told when an instance's repair state changes (sync, sync_cause, repair_failed) and when a
        # snapshot reconciled it: the router keeps its degraded instances (kvindex/scoring/outcomes.py).
        self.on_sync_change = on_sync_change
        self.repair: RepairScheduler = repair or NoRepair()
        if isinstance(self.repair, NoRepair):
            self.repair.consumer = self

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
                state = self._state_for(worker, batch.dp_rank, batch.model, batch.block_size, batch.epoch)
        except WireError as exc:
            if exc.reason == errors.SUBJECT_MISMATCH and not valid_worker_id(worker):
                exc = WireError(errors.BAD_SUBJECT, f"subject {subject!r} does not end in a valid worker id")
            self._reject(worker, subject, exc)
            return False
        key = state.key
        cursor = self.sequencer.cursor(key)
        verdict = decide(cursor, batch.epoch, batch.seq)
        if verdict is Verdict.APPLY:
            self._apply(state, batch, len(payload))
            cursor.applied = batch.seq  # type: ignore[union-attr]
            return True
        if verdict is Verdict.DUPLICATE:
            c.duplicates += 1
            return False
        if verdict is Verdict.STALE_EPOCH:
            c.stale_epochs += 1
            return False
        if verdict is Verdict.BUFFER:
            self._hold(state, cursor, batch)  # type: ignore[arg-type]
            return False
        if verdict is Verdict.GAP:
            assert cursor is not None
            self._gap(state, (cursor.applied + 1, batch.seq - 1), "seq jump")
            self._hold(state, cursor, batch)
            self._begin(state, cursor, REPLAY, "gap")
            return False
        # FIRST or NEW_EPOCH: a new history starts.
        if verdict is Verdict.NEW_EPOCH:
            self._restart(state, batch.epoch, "new epoch in event batch")
        cursor = self.sequencer.open(key, batch.epoch)
        if batch.seq == 1:
            self._apply(state, batch, len(payload))
            cursor.applied = 1
            return True
        # Joined mid-stream: what came before this batch is unknown here.
        self.counters.joins_mid_stream += 1
        self._hold(state, cursor, batch)
        self._begin(state, cursor, SNAPSHOT, "start" if verdict is Verdict.FIRST else "epoch")
        return False

    def _apply(self, state: InstanceState, batch: EventBatch, bound: int = -1) -> None:
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
        stored, removed, cleared, n_stored, n_removed, n_cleared, local = applied
        c.blocks_stored += stored
        applied = c.events_applied
        applied[STORED] += n_stored
        if n_removed or n_cleared:  # most batches only store
            c.blocks_removed += removed
            c.blocks_cleared += cleared
            state.removals += removed + cleared
            applied[REMOVED] += n_removed
            applied[CLEARED] += n_cleared
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
            new = [k for ev in batch.events if ev.op == STORED and ev.tier == name for k in ev.keys]
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
        if state.block_limits is None:
            state.block_limits = self.ingest_limits.block_limits(state.capacity)
        return state.block_limits

    def _refused_blocks(self, state: InstanceState, refused: dict[int, int], what: str) -> None:
        for tier, n in refused.items():
            state.capped |= 1 << tier
            self.counters.blocks_refused += n
        limits = {TIER_NAMES[t]: self.limits_of(state)[t] for t in refused}
        self._refuse(
            state.key,
            BLOCK_LIMIT,
            f"{what}: {sum(refused.values())} stored blocks beyond the limit dropped",
            limits=limits,
            capacity={TIER_NAMES[t]: n for t, n in state.capacity.items()},
        )

    def _refuse(self, instance: InstanceKey, reason: str, message: str, **kw: Any) -> None:
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

    # -- repair: buffering, replays, snapshots ---------------------------------------------------

    def _hold(self, state: InstanceState, cursor: Cursor, batch: EventBatch) -> None:
        """Keep a batch until the repair in progress lets it apply in order (bounded)."""
        cursor.buffer[batch.seq] = batch
        cursor.held_keys += _n_keys(batch)
        limits = self.ingest_limits
        if len(cursor.buffer) > limits.max_held_batches or cursor.held_keys > limits.max_held_keys:
            # A snapshot supersedes what is held; later batches are held again after it.
            held, keys = len(cursor.buffer), cursor.held_keys
            cursor.buffer.clear()
            cursor.held_keys = 0
            self.counters.buffer_overflows += 1
            self._refuse(state.key, HELD_LIMIT, f"{held} batches ({keys} keys) held: dropped for a snapshot")
            if cursor.repairing != SNAPSHOT:
                self._begin(state, cursor, SNAPSHOT, "overflow")

    def _begin(self, state: InstanceState, cursor: Cursor, how: str, cause: str, upto: int = 0) -> None:
        """Start (or escalate) a repair; ``upto`` is a seq the worker is known to have published."""
        if cursor.repairing is None and self._repairs_full():
            # Not now: accept the hole as NoRepair does; a later heartbeat's digest (or the
            # periodic check) asks again once repairs have drained.
            cursor.target = max(cursor.target, upto)
            self._refuse(
                state.key,
                REPAIR_LIMIT,
                f"{self.ingest_limits.max_pending_repairs} repairs pending: {how} ({cause}) not started",
            )
            self.give_up(state.key)
            return
        if cursor.repairing is None:
            cursor.repair_started = self.registry.clock()
            cursor.rounds = 0
            cursor.cause = cause
        self.sequencer.set_repairing(state.key, cursor, how)
        cursor.rounds += 1
        cursor.target = max(cursor.target, upto)
        state.sync = how
        state.sync_cause = cursor.cause
        self._sync_changed(state)
        c = self.counters
        if how == REPLAY:
            hole = cursor.hole()
            first, last = hole if hole else (cursor.applied + 1, max(cursor.target, cursor.applied + 1))
            c.replays_requested += 1
            self.log.info(
                "repair_replay",
                worker=state.worker,
                dp_rank=state.dp_rank,
                epoch=cursor.epoch,
                first=first,
                last=last,
                cause=cause,
            )
            self.repair.request_replay(state.key, cursor.epoch, first, last)
        else:
            c.snapshots_requested[cause] += 1
            self.log.info("repair_snapshot", worker=state.worker, dp_rank=state.dp_rank, cause=cause)
            self.repair.request_snapshot(state.key, cause)

    def _repairs_full(self) -> bool:
        return self.sequencer.repairs() >= self.ingest_limits.max_pending_repairs

    def _settle(self, state: InstanceState, cursor: Cursor) -> None:
        """Apply held batches that are now in order; finish the repair or start the next round."""
        buffer = cursor.buffer
        while buffer:
            seq = buffer.keys()[0]
            if seq <= cursor.applied:
                cursor.held_keys -= _n_keys(buffer.pop(seq))
                continue
            if seq != cursor.applied + 1:
                break
            batch = buffer.pop(seq)
            cursor.held_keys -= _n_keys(batch)
            self._apply(state, batch)
            cursor.applied = seq
        if not buffer and cursor.repairing is not None:
            took = self.registry.clock() - cursor.repair_started
            if cursor.cause != "periodic":  # routine checks are not repairs
                self.counters.converged(took)
            self.log.info(
                "repaired",
                worker=state.worker,
                dp_rank=state.dp_rank,
                seconds=round(took, 4),
                applied=cursor.applied,
            )
            self.sequencer.set_repairing(state.key, cursor, None)
            state.sync = "synced"
            self._sync_changed(state)
            return
        if buffer:
            if cursor.rounds >= MAX_REPAIR_ROUNDS:
                self.log.warning(
                    "repair_deferred", worker=state.worker, dp_rank=state.dp_rank, rounds=cursor.rounds
                )
                self.give_up(state.key)
            elif cursor.repairing == REPLAY:
                self._begin(state, cursor, SNAPSHOT, "replay_incomplete")
            else:
                self._begin(state, cursor, REPLAY, "after_snapshot")

    def on_replay(self, instance: InstanceKey, epoch: int, status: str, payloads: list[bytes]) -> None:
        """A replay answer: the original batches of the missing range (or why there are none)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.epoch != epoch or cursor.repairing != REPLAY:
            return  # the instance moved on (restart, snapshot) since the request
        c = self.counters
        if status != REPLAY_OK:
            c.replays_failed[status] += 1
            self._begin(state, cursor, SNAPSHOT, "gap")
            return
        c.replays_ok += 1
        limits = self.ingest_limits
        for payload in payloads:
            try:
                batch = decode_batch(payload, instance[0], self.limits)
            except WireError as exc:
                self._reject(instance[0], "replay", exc)
                continue
            seq = batch.seq
            if batch.epoch != cursor.epoch or batch.dp_rank != instance[1]:
                continue
            if seq <= cursor.applied or seq in cursor.buffer:
                continue
            n = _n_keys(batch)
            if len(cursor.buffer) >= limits.max_held_batches or cursor.held_keys + n > limits.max_held_keys:
                # What is left stays a hole: the next round asks for a snapshot instead.
                self._refuse(instance, HELD_LIMIT, f"replay answer holds more than the limit (at seq {seq})")
                break
            cursor.buffer[seq] = batch
            cursor.held_keys += n
        self._settle(state, cursor)

    def on_replay_failed(self, instance: InstanceKey, epoch: int, why: str) -> None:
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.epoch != epoch or cursor.repairing != REPLAY:
            return
        self.counters.replays_failed[why] += 1
        state.repair_failed = True
        self._begin(state, cursor, SNAPSHOT, "gap")

    def on_snapshot(
        self,
        instance: InstanceKey,
        snapshot: Snapshot,
        diffs: dict[int, tuple[list[int], list[int]]] | None = None,
    ) -> bool:
        """Make the instance's blocks equal the snapshot (as a diff), then apply what came after it.

        ``diffs`` (tier -> (missing, extra)) may be computed beforehand, in steps, by the caller
        (see index ``differ``); it is used only if the snapshot's epoch is the instance's.
        Returns False when the snapshot is stale (an epoch the instance already left).
        """
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None:
            return True  # forgotten meanwhile: nothing to repair
        if snapshot.epoch != cursor.epoch:
            if snapshot.epoch in cursor.retired:
                return False
            # The worker restarted and the snapshot says so first.
            self._restart(state, snapshot.epoch, "new epoch in snapshot")
            repairing = cursor.repairing
            cursor = self.sequencer.open(instance, snapshot.epoch)
            cursor.repairing, cursor.repair_started, cursor.rounds = repairing, self.registry.clock(), 1
            diffs = None
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
        cursor.applied = max(cursor.applied, snapshot.seq)
        state.epoch, state.last_seq = cursor.epoch, cursor.applied
        state.repair_failed = False  # whatever was lost before is reconciled now
        self._sync_changed(state, reconciled=True)
        if cursor.repairing is None:  # a periodic check: nothing was waiting on it
            return True
        self._settle(state, cursor)
        return True

    def _sync_changed(self, state: InstanceState, reconciled: bool = False) -> None:
        if self.on_sync_change is not None:
            self.on_sync_change(state, reconciled)

    def snapshot_failed(self, instance: InstanceKey, why: str) -> None:
        """A snapshot request got no usable answer (the repairer retries with back-off)."""
        self.counters.snapshots_failed += 1
        state = self.registry.get(instance)
        if state is not None and not state.repair_failed:
            state.repair_failed = True
            self._sync_changed(state)

    def reconcile(self, instance: InstanceKey, cause: str) -> None:
        """Ask for a snapshot of an instance that looks in sync (periodic check, reconnect)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.repairing is not None:
            return
        self._begin(state, cursor, SNAPSHOT, cause)

    def mark_stale(self, state: InstanceState) -> None:
        """No heartbeat for a while: keep the blocks but stop ranking the instance."""
        state.stale = True
        self.counters.stale_marked += 1
        self.log.warning("instance_stale", worker=state.worker, dp_rank=state.dp_rank)

    def forget(self, instance: InstanceKey) -> None:
        """Silent for long: drop the instance and its blocks (a heartbeat brings it back)."""
        self._repeats.pop(self._status_head + instance[0], None)
        dropped = self.index.drop_instance(instance)
        self.registry.remove(instance)
        self.sequencer.forget(instance)
        self.counters.instances_forgotten += 1
        if self.on_forget is not None:
            self.on_forget(instance)
        self.log.warning(
            "instance_forgotten", worker=instance[0], dp_rank=instance[1], dropped_blocks=dropped
        )

    def give_up(self, instance: InstanceKey) -> None:
        """Stop repairing: apply held batches in order across their holes (the loss stays counted)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None:
            return
        self.counters.repairs_abandoned += 1
        for seq in list(cursor.buffer):
            batch = cursor.buffer.pop(seq)
            if seq > cursor.applied:
                self._apply(state, batch)
                cursor.applied = seq
        cursor.held_keys = 0
        # What is known lost stays lost; do not ask for it again on every heartbeat.
        cursor.applied = max(cursor.applied, cursor.target)
        state.last_seq = cursor.applied
        self.sequencer.set_repairing(state.key, cursor, None)
        state.sync = "synced"
        state.repair_failed = True  # holes accepted: blocks may be missing until a snapshot
        self._sync_changed(state)

    # -- status heartbeats -----------------------------------------------------------------------

    def on_status(self, subject: str, payload: bytes) -> bool:
        """Handle one status heartbeat; True when accepted."""
        self.counters.status_received += 1
        repeat = self._repeats.get(subject)
        if repeat is not None:
            tail = repeat.tail_of(payload)
            if tail is not None and repeat.still(self):
                ts, load_raw = tail
                state = repeat.state
                # (A busy worker: its load moved, nothing else did.)
                load = state.load if load_raw == repeat.load_raw else load_of(load_raw)
                if load is not None:
                    if load is not state.load:
                        state.load = load
                        repeat.load_raw = load_raw
                    state.last_status_at = self.registry.clock()
                    state.last_status_ts = ts
                    return True
            del self._repeats[subject]
        # Steady state: a known instance whose heartbeat repeats the previous one's maps (all but
        # its load, mostly) takes them from the previous report instead of decoding them again.
        head = self._status_head
        if type(payload) is bytes:  # (codec.peek_status, inline)
            try:
                peek = _peek(payload)
            except msgspec.MsgspecError:
                peek = None
        else:
            peek = None
        if (
            peek is not None
            and peek.v == WIRE_VERSION
            and subject.startswith(head)
            # Equal to the envelope's worker, which the decoder validated: a valid subject.
            and peek.worker == subject[len(head) :]
        ):
            state = self.registry.get((peek.worker, peek.dp_rank))
            # A memo means decode_status accepted a heartbeat of this instance: the worker, rank,
            # model and block size the peek leaves unchecked are valid when they equal its own.
            if (
                state is not None
                and state.status_memo is not None
                and state.model == peek.model
                and state.block_size == peek.block_size
            ):
                memo: _StatusMemo = state.status_memo
                if decode_status_into(peek, memo):
                    report = memo.report
                    if report.endpoint_error is None and report.role_error is None:  # (else counted)
                        self._apply_status(state, report, payload)
                        return True
                    return self._accept_status(subject, state, report)
        worker = None
        try:
            worker = self.subjects.worker_of(subject, STATUS)
            report = decode_status(payload, worker)
            state = self._state_for(
                report.worker, report.dp_rank, report.model, report.block_size, report.epoch
            )
        except WireError as exc:
            self._reject(worker, subject, exc)
            return False
        memo = state.status_memo
        if peek is None:
            state.status_memo = None  # (a payload that is not bytes: nothing to compare the next with)
        elif memo is None:
            state.status_memo = _StatusMemo(peek, report)
        else:
            memo.renew(peek, report)
        return self._accept_status(subject, state, report)

    def _accept_status(self, subject: str, state: InstanceState, report: StatusReport) -> bool:
        if report.endpoint_error is not None:
            # The heartbeat still counts (load, digest, liveness); only the endpoint is dropped, so
            # routers never see an address they could not connect to.
            self._reject(state.worker, subject, WireError(errors.BAD_ENDPOINT, report.endpoint_error))
        if report.role_error is not None:
            # Likewise a role or group that cannot be read: the instance serves whole requests.
            self._reject(state.worker, subject, WireError(errors.BAD_ROLE, report.role_error))
        self._apply_status(state, report)
        return True

    def _apply_status(self, state: InstanceState, report: StatusReport, payload: bytes | None = None) -> None:
        key = state.key
        cursor = self.sequencer.cursor(key)
        state.last_status_at = self.registry.clock()
        state.last_status_ts = report.ts
        # A heartbeat whose capacity and digest repeat the previous one's: if it also changes
        # nothing below, the next one equal to it but for its ts and load takes the short path.
        unchanged = payload is not None and report.capacity is state.capacity
        self._pending_repeat = (payload, report.worker) if unchanged else None
        # The same objects as the previous report's when unchanged (codec.decode_status_into):
        # assigning them again would only notify the watchers a second time.
        if report.load is not state.load:
            state.load = report.load
        if report.capacity is not state.capacity:
            if report.capacity != state.capacity:
                state.block_limits = None  # from the new capacity, when next needed
            state.capacity = report.capacity
        if state.capped:
            # A capped tier whose worker now fits within the limit gets its digest checked again:
            # the drift it shows brings a snapshot, which makes the tier exact.
            for tier in range(4):
                held = report.digest.get(tier, (0, 0))[0]
                if state.capped & (1 << tier) and held <= self.limits_of(state)[tier]:
                    state.capped &= ~(1 << tier)
        state.reported_digest = report.digest
        state.reported_seq = report.seq
        if report.endpoint != state.endpoint:  # rare: announced, moved, or withdrawn
            self.log.info(
                "instance_endpoint", worker=state.worker, dp_rank=state.dp_rank, endpoint=report.endpoint
            )
            self.registry.set_endpoint(state, report.endpoint)
        if report.role != state.role or report.pd_group != state.pd_group:  # rare: announced or changed
            self.log.info(
                "instance_role",
                worker=state.worker,
                dp_rank=state.dp_rank,
                role=report.role,
                pd_group=report.pd_group,
            )
            self.registry.set_role(state, report.role, report.pd_group)
        if report.prefill and self.prefill_samples is not None:
            self.prefill_samples(state.model, report.prefill, state.instance_id)
        if state.stale:
            state.stale = False
            self.log.info("instance_alive_again", worker=state.worker, dp_rank=state.dp_rank)
        if state.approximate != (not report.events):
            state.approximate = not report.events
            if not state.approximate:
                # Now it reports events: predictions give way to the truth (its seq brings a snapshot).
                self.index.clear(key)
                if self.on_forget is not None:
                    self.on_forget(key)
            self.log.info(
                "instance_mode",
                worker=state.worker,
                dp_rank=state.dp_rank,
                mode="approximate" if state.approximate else "events",
            )
        if state.approximate or not self.heartbeat_repairs:
            # No events, so no sequence to check: its blocks are the index's own predictions.
            return
        if cursor is None or cursor.epoch != report.epoch:
            if cursor is not None:
                if report.epoch in cursor.retired:
                    return  # a late heartbeat from before the restart we already handled
                self._restart(state, report.epoch, "new epoch in status")
            cursor = self.sequencer.open(key, report.epoch)
            state.epoch, state.last_seq = report.epoch, 0
            if report.seq:
                # Discovered mid-stream (index start, restart seen first here): fetch the truth.
                self.counters.joins_mid_stream += 1
                self._begin(state, cursor, SNAPSHOT, "start", upto=report.seq)
            return
        if cursor.repairing is not None:
            return
        if report.seq > cursor.applied:
            if not self.status_in_order and cursor.behind <= cursor.applied:
                cursor.behind = report.seq  # maybe just overtaken: check again at the next heartbeat
                return
            # The worker published more than we received: the tail batches were lost.
            cursor.behind = 0
            self._gap(state, (cursor.applied + 1, report.seq), "behind heartbeat")
            self._begin(state, cursor, REPLAY, "tail", upto=report.seq)
            return
        if report.seq != cursor.applied:
            return
        memo = state.status_memo
        if memo is not None and memo.report is report and not state.capped:
            # Steady state: a digest found equal stays so until either side changes (the report's
            # digest is replaced by an unequal one, or the index's version moves).
            version = self.index.digest_version(key)
            if version == memo.matched:
                if unchanged and not report.prefill:
                    self._remember_repeat(state, cursor, report, version)
                return
            if self.index.digest_equals(key, *memo.digest_lists()):
                memo.matched = version
                return
        elif self._digest_matches(state, report):
            return
        self.counters.drift_detected += 1
        self.log.warning("digest_drift", worker=state.worker, dp_rank=state.dp_rank, seq=report.seq)
        self._begin(state, cursor, SNAPSHOT, "drift")

    def _remember_repeat(
        self, state: InstanceState, cursor: Cursor, report: StatusReport, version: int
    ) -> None:
        pending, self._pending_repeat = self._pending_repeat, None
        if pending is None or self.status_in_order is False or not self.heartbeat_repairs:
            return
        payload, worker = pending
        repeat = _Repeat.of(payload, report.ts, report.load, state, cursor, version)
        if repeat is not None:
            self._repeats[self._status_head + worker] = repeat

    def _digest_matches(self, state: InstanceState, report: StatusReport) -> bool:
        """Digests agree on every tier, except capped ones (the index keeps a subset there)."""
        reported, key, capped = report.digest, state.key, state.capped
        return all(
            reported.get(tier, (0, 0)) == self.index.digest(key, tier)
            for tier in range(4)
            if not capped & (1 << tier)
        )

    # -- shared helpers --------------------------------------------------------------------------

    def _state_for(self, worker: str, dp_rank: int, model: str, block_size: int, epoch: int) -> InstanceState:
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

    def _restart(self, state: InstanceState, epoch: int, why: str) -> None:
        dropped = self.index.clear(state.key)
        self.counters.restarts += 1
        self.counters.blocks_cleared += dropped
        state.restarts += 1
        state.capped = 0
        old, state.epoch, state.last_seq = state.epoch, epoch, 0
        # A repair of the old history ends with it; the new one starts in sync unless it begins its own.
        state.sync = "synced"
        state.repair_failed = False
        self._sync_changed(state, reconciled=True)
        self.log.info(
            "worker_restarted",
            worker=state.worker,
            dp_rank=state.dp_rank,
            old_epoch=old,
            new_epoch=epoch,
            dropped_blocks=dropped,
            why=why,
        )

    def _gap(self, state: InstanceState, missing: tuple[int, int], why: str) -> None:
        first, last = missing
        n = last - first + 1
        c = self.counters
        c.gaps += 1
        c.missing_batches += n
        state.gaps += 1
        state.missing_batches += n
        self.log.warning(
            "sequence_gap",
            worker=state.worker,
            dp_rank=state.dp_rank,
            epoch=state.epoch,
            missing_from=first,
            missing_to=last,
            missing=n,
            why=why,
        )

    def _reject(self, worker: str | None, subject: str, exc: WireError) -> None:
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


_peek = peek_decoder.decode


class _StatusMemo(StatusMemory):
    """StatusMemory (kept on the InstanceState), and the reported digest as the index compares it."""

    __slots__ = ("_lists", "matched")

    def __init__(self, peek: StatusPeek, report: StatusReport) -> None:
        self._lists: tuple[list[int], list[int]] | None = None
        # The index's digest_version when it last equalled report.digest (-1: not since it changed).
        self.matched = -1
        StatusMemory.renew(self, peek, report)

    def renew(self, peek: StatusPeek, report: StatusReport) -> None:
        if report.digest != self.report.digest:
            self._lists = None
            self.matched = -1
        StatusMemory.renew(self, peek, report)

    def digest_lists(self) -> tuple[list[int], list[int]]:
        """The report's digest as (counts, xors) per tier, (0, 0) for the tiers it leaves out."""
        if self._lists is None:
            get = self.report.digest.get
            pairs = [get(tier, (0, 0)) for tier in range(4)]
            self._lists = ([p[0] for p in pairs], [p[1] for p in pairs])
        return self._lists


_TS_KEY = b"\xa2ts\xcb"  # msgpack: the key "ts", then a float64
_LOAD_KEY = b"\xa4load"  # the key "load"
_unpack_ts = struct.Struct(">d").unpack_from


class _Repeat:
    """A heartbeat that changed nothing but its load, as bytes. The publishers here put ``ts`` and
    ``load`` last (wire/codec.encode_status), so a steady worker's next heartbeat is the same bytes
    up to the 8 of its ts value, then the load map to the end: as long as the instance, its cursor
    and its blocks are the ones it was checked against, it only refreshes liveness and, if its load
    bytes moved, the load (about 1.5 us, or 2.5 with a new load, instead of a peek decode and every
    check: 8,192 instances send 16.4 K heartbeats a second). Anything else, including a heartbeat
    encoded another way, takes the full path."""

    __slots__ = ("applied", "cursor", "head", "load_raw", "state", "version")

    def __init__(
        self, head: bytes, load_raw: bytes, state: InstanceState, cursor: Cursor, version: int
    ) -> None:
        self.head, self.load_raw = head, load_raw
        self.state, self.cursor, self.applied, self.version = state, cursor, cursor.applied, version

    @classmethod
    def of(
        cls, payload: bytes, ts: float, load: Load, state: InstanceState, cursor: Cursor, version: int
    ) -> _Repeat | None:
        at = payload.rfind(_TS_KEY)
        if at < 0 or payload[at + 12 : at + 17] != _LOAD_KEY or _unpack_ts(payload, at + 4)[0] != ts:
            return None
        head, load_raw = payload[: at + 4], payload[at + 17 :]
        # Proof that these are the ts field's value and the load map (not look-alikes inside a
        # string): with another ts there the decoder reads that ts and the same everything else,
        # and the tail alone decodes to the heartbeat's load.
        try:
            probe = peek_decoder.decode(head + struct.pack(">d", ts + 1.0) + _LOAD_KEY + load_raw)
            first = peek_decoder.decode(payload)
        except msgspec.MsgspecError:
            return None
        if probe.ts != ts + 1.0 or msgspec.structs.replace(probe, ts=ts) != first:
            return None
        if load_of(load_raw) != load:
            return None
        return cls(head, load_raw, state, cursor, version)

    def tail_of(self, payload: bytes) -> tuple[float, bytes] | None:
        """(ts, the load map's bytes) when the heartbeat equals this one up to them."""
        head = self.head
        n = len(head)
        if type(payload) is bytes and payload.startswith(head) and payload.startswith(_LOAD_KEY, n + 8):
            return _unpack_ts(payload, n)[0], payload[n + 13 :]
        return None

    def still(self, consumer: Consumer) -> bool:
        """Nothing it was checked against moved: same instance, cursor (seq, no repair), blocks."""
        state, cursor = self.state, self.cursor
        return (
            not state.stale
            and not state.capped
            and not state.removed
            and not cursor.closed
            and cursor.repairing is None
            and cursor.applied == self.applied
            and consumer.index.digest_version(state.key) == self.version
            and consumer.heartbeat_repairs
        )


def _n_keys(batch: EventBatch) -> int:
    return sum([len(ev.keys) for ev in batch.events])
