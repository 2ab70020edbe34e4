"""From wire bytes to index state: decode, check identity, sequence, apply.

The consumer is synchronous and transport-free: NATS subscriptions, offline replay and benchmarks all
call ``on_events`` / ``on_status`` with (subject, payload). Nothing a message contains can raise out of
these methods: a bad message is rejected whole (counted by reason and logged with its worker id) and
the index is left exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from time import time as _now
from typing import Any, Protocol

import structlog

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import InstanceKey, KvBlockIndex
from kvindex.observability.counters import IngestCounters
from kvindex.observability.logs import RateLimitedLog
from kvindex.sequencer.cursor import Cursor, Sequencer, Verdict, decide
from kvindex.wire import errors
from kvindex.wire.codec import DEFAULT_LIMITS, Limits, decode_batch, decode_status
from kvindex.wire.errors import WireError
from kvindex.wire.reconcile import REPLAY_OK, Snapshot
from kvindex.wire.schema import CLEARED, REMOVED, SHARED, STORED, EventBatch, StatusReport
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
        max_buffer: int = 4096,
        log: Any = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.subjects = subjects or Subjects()
        self.sequencer = sequencer or Sequencer()
        self.counters = counters or IngestCounters()
        self.limits = limits
        self.max_buffer = max_buffer
        self.log = log or structlog.get_logger("kvindex.ingest")
        self._reject_log = RateLimitedLog(self.log)
        self._events_head = f"{self.subjects.prefix}.{EVENTS}."
        # Heartbeats drive repairs (tail loss, drift, discovery) unless the event source is still
        # replaying history; and when they do not share one ordered subscription with the batches,
        # a heartbeat ahead of the batches must be seen twice before it counts as a lost tail.
        self.heartbeat_repairs = True
        self.status_in_order = True
        # Where heartbeats' prefill samples go (model, [(prompt, cached, ms)]): the calibration.
        self.prefill_samples: Callable[[str, list[tuple[int, int, float]]], Any] | None = None
        # Told when an instance is forgotten (routing state about it can go too).
        self.on_forget: Callable[[InstanceKey], Any] | None = None
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
            self._apply(state, batch)
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
            self._apply(state, batch)
            cursor.applied = 1
            return True
        # Joined mid-stream: what came before this batch is unknown here.
        self.counters.joins_mid_stream += 1
        self._hold(state, cursor, batch)
        self._begin(state, cursor, SNAPSHOT, "start" if verdict is Verdict.FIRST else "epoch")
        return False

    def _apply(self, state: InstanceState, batch: EventBatch) -> None:
        c = self.counters
        stored, removed, cleared, n_stored, n_removed, n_cleared, local = self.index.apply(
            state.key, batch.events
        )
        c.blocks_stored += stored
        applied = c.events_applied
        applied[STORED] += n_stored
        if n_removed or n_cleared:  # most batches only store
            c.blocks_removed += removed
            c.blocks_cleared += cleared
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

    # -- repair: buffering, replays, snapshots ---------------------------------------------------

    def _hold(self, state: InstanceState, cursor: Cursor, batch: EventBatch) -> None:
        """Keep a batch until the repair in progress lets it apply in order (bounded)."""
        cursor.buffer[batch.seq] = batch
        if len(cursor.buffer) > self.max_buffer:
            # A snapshot supersedes what is held; later batches are held again after it.
            cursor.buffer.clear()
            self.counters.buffer_overflows += 1
            self.log.warning("repair_buffer_overflow", worker=state.worker, dp_rank=state.dp_rank)
            if cursor.repairing != SNAPSHOT:
                self._begin(state, cursor, SNAPSHOT, "overflow")

    def _begin(self, state: InstanceState, cursor: Cursor, how: str, cause: str, upto: int = 0) -> None:
        """Start (or escalate) a repair; ``upto`` is a seq the worker is known to have published."""
        if cursor.repairing is None:
            cursor.repair_started = self.registry.clock()
            cursor.rounds = 0
            cursor.cause = cause
        cursor.repairing = how
        cursor.rounds += 1
        cursor.target = max(cursor.target, upto)
        state.sync = how
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

    def _settle(self, state: InstanceState, cursor: Cursor) -> None:
        """Apply held batches that are now in order; finish the repair or start the next round."""
        buffer = cursor.buffer
        while buffer:
            seq = buffer.keys()[0]
            if seq <= cursor.applied:
                del buffer[seq]
                continue
            if seq != cursor.applied + 1:
                break
            self._apply(state, buffer.pop(seq))
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
            cursor.repairing = None
            state.sync = "synced"
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
        for payload in payloads:
            try:
                batch = decode_batch(payload, instance[0], self.limits)
            except WireError as exc:
                self._reject(instance[0], "replay", exc)
                continue
            if batch.epoch == cursor.epoch and batch.dp_rank == instance[1]:
                cursor.buffer.setdefault(batch.seq, batch)
        self._settle(state, cursor)

    def on_replay_failed(self, instance: InstanceKey, epoch: int, why: str) -> None:
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.epoch != epoch or cursor.repairing != REPLAY:
            return
        self.counters.replays_failed[why] += 1
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
        for tier in range(4):
            if diffs is not None and tier in diffs:
                missing, extra = diffs[tier]
            else:
                missing, extra = self.index.diff(instance, tier, snapshot.tiers.get(tier, []))
            if extra:
                removed += self.index.remove(instance, tier, extra)
            if missing:
                added += self.index.store(instance, tier, missing)
                if tier != SHARED:
                    state.local_blocks_seen = True
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
        if cursor.repairing is None:  # a periodic check: nothing was waiting on it
            return True
        self._settle(state, cursor)
        return True

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
        # What is known lost stays lost; do not ask for it again on every heartbeat.
        cursor.applied = max(cursor.applied, cursor.target)
        state.last_seq = cursor.applied
        cursor.repairing = None
        state.sync = "synced"

    # -- status heartbeats -----------------------------------------------------------------------

    def on_status(self, subject: str, payload: bytes) -> bool:
        """Handle one status heartbeat; True when accepted."""
        self.counters.status_received += 1
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
        if report.endpoint_error is not None:
            # The heartbeat still counts (load, digest, liveness); only the endpoint is dropped, so
            # routers never see an address they could not connect to.
            self._reject(worker, subject, WireError(errors.BAD_ENDPOINT, report.endpoint_error))
        self._apply_status(state, report)
        return True

    def _apply_status(self, state: InstanceState, report: StatusReport) -> None:
        key = state.key
        cursor = self.sequencer.cursor(key)
        state.last_status_at = self.registry.clock()
        state.last_status_ts = report.ts
        state.load = report.load
        state.capacity = report.capacity
        state.reported_digest = report.digest
        state.reported_seq = report.seq
        if report.endpoint != state.endpoint:  # rare: announced, moved, or withdrawn
            self.log.info(
                "instance_endpoint", worker=state.worker, dp_rank=state.dp_rank, endpoint=report.endpoint
            )
            self.registry.set_endpoint(state, report.endpoint)
        if report.prefill and self.prefill_samples is not None:
            self.prefill_samples(state.model, report.prefill)
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
        if report.seq == cursor.applied and not self._digest_matches(key, report):
            self.counters.drift_detected += 1
            self.log.warning("digest_drift", worker=state.worker, dp_rank=state.dp_rank, seq=report.seq)
            self._begin(state, cursor, SNAPSHOT, "drift")

    def _digest_matches(self, key: InstanceKey, report: StatusReport) -> bool:
        reported = report.digest
        return all(reported.get(tier, (0, 0)) == self.index.digest(key, tier) for tier in range(4))

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

    def _model_block_size(self, model: str, exclude: InstanceKey) -> int | None:
        for other in self.registry.of_model(model):
            if other.key != exclude:
                return other.block_size
        return None

    def _restart(self, state: InstanceState, epoch: int, why: str) -> None:
        dropped = self.index.clear(state.key)
        self.counters.restarts += 1
        self.counters.blocks_cleared += dropped
        state.restarts += 1
        old, state.epoch, state.last_seq = state.epoch, epoch, 0
        # A repair of the old history ends with it; the new one starts in sync unless it begins its own.
        state.sync = "synced"
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
        self._reject_log.warning(
            (worker or subject, exc.reason),
            "message_rejected",
            worker=worker,
            subject=subject,
            reason=exc.reason,
            error=exc.message,
        )
