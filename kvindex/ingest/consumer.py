"""From wire bytes to index state: decode, check identity, sequence, apply.

The consumer is synchronous and transport-free: NATS subscriptions, offline replay and benchmarks all
call ``on_events`` / ``on_status`` with (subject, payload). Nothing a message contains can raise out of
these methods: a bad message is rejected whole (counted by reason and logged with its worker id) and
the index is left exactly as it was.
"""

from __future__ import annotations

from typing import Any

import structlog

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import InstanceKey, KvBlockIndex
from kvindex.observability.counters import IngestCounters
from kvindex.observability.logs import RateLimitedLog
from kvindex.sequencer.cursor import Admission, Sequencer, Verdict
from kvindex.wire import errors
from kvindex.wire.codec import DEFAULT_LIMITS, Limits, decode_batch, decode_status
from kvindex.wire.errors import WireError
from kvindex.wire.schema import CLEARED, SHARED, STORED, TIER_BY_NAME, EventBatch, StatusReport
from kvindex.wire.subjects import EVENTS, STATUS, Subjects, valid_worker_id


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
        log: Any = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.subjects = subjects or Subjects()
        self.sequencer = sequencer or Sequencer()
        self.counters = counters or IngestCounters()
        self.limits = limits
        self.log = log or structlog.get_logger("kvindex.ingest")
        self._reject_log = RateLimitedLog(self.log)
        self._events_head = f"{self.subjects.prefix}.{EVENTS}."

    # -- event batches ---------------------------------------------------------------------------

    def on_events(self, subject: str, payload: bytes) -> bool:
        """Handle one event batch; True when it changed (or was applied to) the index."""
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
        admission = self.sequencer.admit(state.key, batch.epoch, batch.seq)
        verdict = admission.verdict
        if verdict is not Verdict.APPLY:
            if verdict is Verdict.DUPLICATE:
                c.duplicates += 1
                return False
            if verdict is Verdict.STALE_EPOCH:
                c.stale_epochs += 1
                return False
            self._note_admission(state, batch, admission)
        self._apply(state, batch)
        return True

    def _apply(self, state: InstanceState, batch: EventBatch) -> None:
        c = self.counters
        index = self.index
        key = state.key
        applied = c.events_applied
        tiers = TIER_BY_NAME
        events = batch.events
        n = len(events)
        i = 0
        while i < n:
            ev = events[i]
            op = ev.op
            if op == CLEARED:
                c.blocks_cleared += index.clear(key, None if ev.tier is None else tiers[ev.tier])
                applied[CLEARED] += 1
                i += 1
                continue
            # One index call per run of same-kind events (an engine step stores many small chains);
            # within a run the order of keys does not matter.
            keys = ev.keys
            j = i + 1
            while j < n and events[j].op == op and events[j].tier == ev.tier:
                if j == i + 1:
                    keys = list(keys)
                keys.extend(events[j].keys)
                j += 1
            tier = tiers[ev.tier]
            if op == STORED:
                c.blocks_stored += index.store(key, tier, keys)
                if tier != SHARED:
                    state.local_blocks_seen = True
            else:
                c.blocks_removed += index.remove(key, tier, keys)
            applied[op] += j - i
            i = j
        state.epoch = batch.epoch
        state.last_seq = batch.seq
        state.last_event_ts = batch.ts
        state.batches += 1
        c.batches_applied += 1

    def _note_admission(self, state: InstanceState, batch: EventBatch, admission: Admission) -> None:
        verdict = admission.verdict
        if verdict is Verdict.NEW_EPOCH:
            self._restart(state, batch.epoch, "new epoch in event batch")
        elif verdict is Verdict.FIRST and admission.missing:
            self.counters.joins_mid_stream += 1
            self.log.info(
                "joined_mid_stream",
                worker=state.worker,
                dp_rank=state.dp_rank,
                epoch=batch.epoch,
                first_seq=batch.seq,
            )
        if verdict is Verdict.GAP and admission.missing:
            self._gap(state, admission.missing, "seq jump")

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
        self._apply_status(state, report)
        return True

    def _apply_status(self, state: InstanceState, report: StatusReport) -> None:
        key = state.key
        cursor = self.sequencer.cursor(key)
        if cursor is None:
            # First contact through a heartbeat: whatever the worker published so far is unknown here.
            self.sequencer.restart(key, report.epoch, report.seq)
            state.epoch, state.last_seq = report.epoch, report.seq
            if report.seq:
                self.counters.joins_mid_stream += 1
        elif cursor.epoch != report.epoch:
            if report.epoch in cursor.retired:
                return  # a late heartbeat from before the restart we already handled
            self.sequencer.restart(key, report.epoch, report.seq)
            self._restart(state, report.epoch, "new epoch in status")
            state.last_seq = report.seq
            if report.seq:
                self._gap(state, (1, report.seq), "restart seen first in heartbeat")
        else:
            # The worker published more than we received: the tail batches were lost.
            missing = self.sequencer.skip_to(key, report.seq)
            if missing is not None:
                self._gap(state, missing, "behind heartbeat")
                state.last_seq = report.seq
        state.last_status_at = self.registry.clock()
        state.last_status_ts = report.ts
        state.load = report.load
        state.capacity = report.capacity
        state.reported_digest = report.digest
        state.reported_seq = report.seq

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
