"""From wire bytes to index state: decode, check identity, sequence, apply, within the limits.

The consumer is synchronous and transport-free: NATS subscriptions, offline replay and benchmarks all
call ``on_events`` / ``on_heartbeat`` with (subject, payload). Nothing a message contains can raise out
of these methods: a bad message is rejected whole (counted by reason and logged with its worker id)
and the index is left exactly as it was.

This module is the batch path, the top of ingest; the stages below it are handed to it built
(kvindex/core.py ``build_consumer``) and none of them holds it: heartbeats (kvindex/ingest/heartbeats.py,
the consumer's ``on_heartbeat`` is theirs), instances on first contact (instances.py), the repair
machine (``consumer.repairs``, kvindex/repair/machine.py) for holes, restarts and jumps, the applier
(applier.py) that puts batches and snapshots in the index within the limits, and the rejects
(rejects.py) that count and log what is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvindex.fleet.registry import InstanceState
from kvindex.ingest.applier import Applier
from kvindex.ingest.heartbeats import Heartbeats
from kvindex.ingest.instances import Instances
from kvindex.ingest.rejects import Rejects
from kvindex.instance import InstanceKey
from kvindex.repair.machine import REPLAY, SNAPSHOT, IngestState, RepairMachine
from kvindex.sequencer.cursor import Cursor, Verdict, decide
from kvindex.wire import errors
from kvindex.wire.codec import Limits, batch_fast_path, decode_batch
from kvindex.wire.errors import WireError
from kvindex.wire.schema import WIRE_VERSION, EventBatch
from kvindex.wire.subjects import EVENTS, Subjects, valid_worker_id


class Consumer:
    # Handle one heartbeat (subject, payload); True when accepted. The heartbeat handler's own bound
    # method (kvindex/ingest/heartbeats.py), set at construction: no call in between.
    on_heartbeat: Callable[[str, bytes], bool]

    def __init__(
        self,
        shared: IngestState,
        *,
        subjects: Subjects,
        limits: Limits,
        instances: Instances,
        applier: Applier,
        rejects: Rejects,
        repairs: RepairMachine,
        heartbeats: Heartbeats,
        on_forget: Callable[[InstanceKey], Any] | None = None,
    ) -> None:
        self.index, self.registry, self.sequencer = shared.index, shared.registry, shared.sequencer
        self.counters, self.log = shared.counters, shared.log
        self.subjects, self.limits = subjects, limits  # (the wire decoder's limits)
        self.instances, self.applier, self.rejects = instances, applier, rejects
        # Holes, restarts and drift: decided there, repaired by the scheduler it was built with.
        self.repairs = repairs
        self.heartbeats = heartbeats
        self.on_heartbeat = heartbeats.on_heartbeat
        # A batch in order is applied by the applier's own bound method: no call in between.
        self._apply = applier.apply
        # Told when an instance is forgotten (routing state about it can go too).
        self.on_forget = on_forget
        self._events_head = f"{self.subjects.prefix}.{EVENTS}."
        # The registry's and the sequencer's dicts' own lookups: no Python call in between.
        self._state_of = self.registry.getter()
        self._cursor_of = self.sequencer.cursors().get
        self._decode, self._valid_workers = batch_fast_path()
        self._max_events, self._max_keys = limits.max_events, limits.max_keys

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
            # decode_batch's common case inline (see batch_fast_path); anything else decoded again
            # by decode_batch, which raises what is wrong.
            try:
                batch = self._decode(payload)
            except Exception:
                batch = None
            if (
                batch is None
                or batch.worker != worker
                or worker not in self._valid_workers
                or batch.v != WIRE_VERSION
                or len(batch.events) > self._max_events
                or len(payload) > self._max_keys
            ):
                batch = decode_batch(payload, worker, self.limits)
            state = self._state_of((worker, batch.dp_rank))
            if state is None or state.model != batch.model or state.block_size != batch.block_size:
                state = self.instances.state_for(
                    worker, batch.dp_rank, batch.model, batch.block_size, batch.epoch
                )
        except WireError as exc:
            if exc.reason == errors.SUBJECT_MISMATCH and not valid_worker_id(worker):
                exc = WireError(errors.BAD_SUBJECT, f"subject {subject!r} does not end in a valid worker id")
            self.rejects.reject(worker, subject, exc)
            return False
        key = state.key
        cursor = self._cursor_of(key)
        seq = batch.seq
        # The common case first: the next batch of the instance's history, nothing held or being
        # repaired (decide's APPLY, tested in the same order; everything else goes on below).
        if (
            cursor is not None
            and batch.epoch == cursor.epoch
            and seq == cursor.applied + 1
            and cursor.repairing is None
            and not state.layout_conflict
            and seq not in cursor.buffer
        ):
            self._apply(state, batch, len(payload))
            cursor.applied = seq
            return True
        return self._sequence(state, cursor, batch, len(payload))

    def _sequence(self, state: InstanceState, cursor: Cursor | None, batch: EventBatch, size: int) -> bool:
        """A batch that is not simply the next one: what the sequencer's verdict says to do with it
        (a duplicate, a gap, a restart, a batch held during a repair, ...); True when applied now."""
        key = state.key
        c = self.counters
        verdict = decide(cursor, batch.epoch, batch.seq)
        if state.layout_conflict:
            # Its blocks would be read by another layout's rule (kvindex/ingest/layouts.py): refused,
            # but its seq is consumed, so that no repair brings them back.
            self.rejects.refuse(
                key, errors.GROUP_LAYOUT_MISMATCH, "batch of an instance whose KV-cache groups differ"
            )
            if cursor is None or cursor.epoch != batch.epoch:
                cursor = self.sequencer.open(key, batch.epoch)
            cursor.applied = max(cursor.applied, batch.seq)
            state.epoch, state.last_seq = batch.epoch, cursor.applied
            return False
        if verdict is Verdict.APPLY:
            self._apply(state, batch, size)
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
            if not self.repairs.jump(state, cursor, batch.seq, "batch"):
                return False
            self._apply(state, batch, size)
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
            self._apply(state, batch, size)
            cursor.applied = 1
            return True
        # Joined mid-stream: what came before this batch is unknown here.
        self.counters.joins_mid_stream += 1
        repairs.hold(state, cursor, batch)
        repairs.begin(state, cursor, SNAPSHOT, "start" if verdict is Verdict.FIRST else "epoch")
        return False

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
