"""The repair state machine: what to do about a hole, a restart or a drift, and when an instance is
back in sync.

Synchronous and transport-free, like the consumer it serves (kvindex/ingest/consumer.py): the consumer
hands it the batches it cannot apply in order (``hold``, ``gap``, ``begin``, ``restart``, ``jump``),
the heartbeats hand it lost tails and drift, and a ``RepairScheduler`` (``NatsRepairer`` over NATS,
``NoRepair`` offline, the simulation's own) runs the replays and snapshots it asks for and hands
the answers back (``on_replay``, ``on_replay_failed``, ``on_snapshot``, ``snapshot_failed``).
The machine decides; applying what it held and the snapshots it got is the applier's
(``BlockApplier``, kvindex/ingest/applier.py) and counting refusals the rejecter's (``Rejecter``),
both handed to it when it is built (kvindex/core.py): it holds nothing that calls it, so the path
of a batch goes one way, consumer -> machine -> applier -> index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import KvBlockIndex
from kvindex.instance import InstanceKey
from kvindex.observability.counters import IngestCounters
from kvindex.sequencer.cursor import MAX_GAP, Cursor, Sequencer
from kvindex.wire.codec import Limits, decode_batch
from kvindex.wire.errors import WireError
from kvindex.wire.reconcile import REPLAY_OK, Snapshot
from kvindex.wire.schema import EventBatch

REPLAY: Final = "replay"
SNAPSHOT: Final = "snapshot"
# A hole that survives this many repair rounds in a row is left to the periodic reconciliation:
# re-asking at once is how recovery loops start.
MAX_REPAIR_ROUNDS: Final = 4
# At the repair limit, a repair of an instance whose snapshot requests have been answered takes the
# place of the pending repair whose worker failed the most of them in a row, if at least this many:
# a fleet of workers that never answer must not keep every other instance's repair from starting.
EVICT_STRIKES: Final = 1

# An instance waiting for a repair to end before its snapshot starts (RepairStatus.sync).
QUEUED: Final = "queued"

# The machine's refusals (metric labels, with the other limits in kvindex/ingest/limits.py).
HELD_LIMIT: Final = "held_limit"  # batches held during a repair overflowed: dropped, snapshot instead
REPAIR_LIMIT: Final = "repair_limit"  # too many repairs pending: this one is not started now
# A seq more than kvindex.sequencer.cursor.MAX_GAP past what the instance published: the message is
# dropped and the instance resynchronised from a snapshot (RepairMachine.jump).
SEQ_JUMP: Final = "seq_jump"


class RepairScheduler(Protocol):
    """Runs replays and snapshots for the machine; answers come back through RepairMachine.on_replay
    / on_snapshot / on_replay_failed. Requests for an instance with one already in flight are merged."""

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None: ...

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None: ...


class HeldLimits(Protocol):
    """The bounds the machine keeps (kvindex/ingest/limits.py IngestLimits has them)."""

    @property
    def max_held_batches(self) -> int: ...

    @property
    def max_held_keys(self) -> int: ...

    @property
    def max_pending_repairs(self) -> int: ...


@dataclass(frozen=True, slots=True)
class IngestState:
    """What the stages of ingest share (the consumer, the heartbeats, the instances, the applier, this
    machine): the index, the registry, the sequencer's cursors, the ingest counters and the log. Built
    once (kvindex/core.py ``build_consumer``) and handed to each stage, which copies what it uses into
    attributes of its own (read on hot paths: one attribute, not two). Defined here, with the lowest
    stage that takes it: kvindex/repair imports nothing of ingest."""

    index: KvBlockIndex
    registry: Registry
    sequencer: Sequencer
    counters: IngestCounters
    log: Any


class BlockApplier(Protocol):
    """Applies batches and snapshots to the index within the block limits (kvindex/ingest/applier.py)."""

    def apply(self, state: InstanceState, batch: EventBatch, bound: int = -1) -> None: ...

    def apply_snapshot(
        self,
        state: InstanceState,
        snapshot: Snapshot,
        diffs: dict[int, tuple[list[int], list[int]]] | None,
    ) -> None: ...


class Rejecter(Protocol):
    """Counts and logs refusals by a limit and rejected messages (kvindex/ingest/rejects.py)."""

    def refuse(self, instance: InstanceKey, reason: str, message: str, **kw: Any) -> None: ...

    def reject(self, worker: str | None, subject: str, exc: WireError) -> None: ...


# Makes the scheduler of a repair machine, which hands its answers back to that machine: the
# machine calls it once, when it is built (kvindex/core.py's CoreConfig.repair).
MakeScheduler = Callable[["RepairMachine"], RepairScheduler]


class NoRepair:
    """For consumers with no transport to repair over (offline tools, benchmarks): a hole is counted
    and logged, and the batches after it are applied in order as if it had not been there."""

    def __init__(self, machine: RepairMachine) -> None:
        self.machine = machine

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None:
        self.machine.give_up(instance)

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None:
        self.machine.give_up(instance)


class RepairMachine:
    """Per instance: synced -> replay / snapshot -> synced (kvindex/repair/README.md)."""

    def __init__(
        self,
        shared: IngestState,
        *,
        limits: HeldLimits,
        wire_limits: Limits,
        applier: BlockApplier,
        rejecter: Rejecter,
        on_sync_change: Callable[[InstanceState, bool], Any] | None = None,
        scheduler: MakeScheduler | None = None,
    ) -> None:
        self.index, self.registry, self.sequencer = shared.index, shared.registry, shared.sequencer
        self.counters, self.log = shared.counters, shared.log
        self.limits = limits  # held batches and keys, pending repairs
        self.wire_limits = wire_limits  # for decoding replayed batches
        self.applier = applier
        self.rejecter = rejecter
        # Told when an instance's repair state changes (its RepairStatus: sync, cause, failed) and
        # when a snapshot reconciled it: the rankers keep their degraded instances by it.
        self.on_sync_change = on_sync_change
        # Per instance, the snapshot requests that got no usable answer in a row (none: 0). Kept
        # across repairs and restarts, dropped when the instance is forgotten; the scheduler serves
        # and backs off by it (kvindex/repair/fair.py), and the repair limit gives way by it.
        self.strikes: dict[InstanceKey, int] = {}
        # Instances whose snapshot waits for a repair to end (the repair limit was reached), oldest
        # first, with the cause of the repair they wait for: started as repairs end (start_queued).
        self.queued: dict[InstanceKey, str] = {}
        self._starting = False
        # Made for this machine, here: NoRepair without a transport.
        self.scheduler: RepairScheduler = (scheduler or NoRepair)(self)

    # -- what the consumer and the heartbeats hand over ------------------------------------------

    def hold(self, state: InstanceState, cursor: Cursor, batch: EventBatch) -> None:
        """Keep a batch until the repair in progress lets it apply in order (bounded)."""
        cursor.buffer[batch.seq] = batch
        cursor.held_keys += _n_keys(batch)
        limits = self.limits
        if len(cursor.buffer) > limits.max_held_batches or cursor.held_keys > limits.max_held_keys:
            # A snapshot supersedes what is held; later batches are held again after it.
            held, keys = len(cursor.buffer), cursor.held_keys
            cursor.buffer.clear()
            cursor.held_keys = 0
            self.counters.buffer_overflows += 1
            self.rejecter.refuse(
                state.key, HELD_LIMIT, f"{held} batches ({keys} keys) held: dropped for a snapshot"
            )
            if cursor.repairing != SNAPSHOT:
                self.begin(state, cursor, SNAPSHOT, "overflow")

    def begin(self, state: InstanceState, cursor: Cursor, how: str, cause: str, upto: int = 0) -> None:
        """Start (or escalate) a repair; ``upto`` is a seq the worker is known to have published."""
        key = state.key
        if cursor.repairing is None and self._repairs_full() and not self._make_room(state):
            # Not now: accept the hole as NoRepair does (held batches apply across it) and queue a
            # snapshot for when a repair ends (counted once per wait, as `repair_limit`). Before,
            # the repair was refused and its next heartbeat's drift asked again: a fleet larger than
            # the limit (an index started into 7,000 workers) was refused at every heartbeat of
            # every waiting instance, and the refusals and drift warnings alone took the event loop
            # (issue 34: ~6,000 a second, 8 snapshots applied in 40 s).
            cursor.target = max(cursor.target, upto)
            queued = key in self.queued
            if not queued:
                self.counters.reject(REPAIR_LIMIT, key[0])
                # Info, as the repair it waits for: thousands at once are expected when an index
                # starts into a large fleet.
                self.log.info(
                    "repair_queued",
                    worker=state.worker,
                    dp_rank=state.dp_rank,
                    how=how,
                    cause=cause,
                    queued=len(self.queued) + 1,
                )
            # Queued first: the hooks give_up calls must see it (a degraded instance's check
            # would otherwise take a snapshot turn for nothing).
            cause = self.queued.setdefault(key, cause)
            self.give_up(key, counted=not queued)
            state.repair.sync = QUEUED
            state.repair.cause = cause
            self._sync_changed(state)
            return
        if key in self.queued:
            # What it waits for is a snapshot (its blocks before the hole it accepted are unknown),
            # whatever repair starts it now.
            how, cause = SNAPSHOT, self.queued.pop(key)
        if cursor.repairing is None:
            cursor.repair_started = self.registry.clock()
            cursor.rounds = 0
            cursor.cause = cause
        self.sequencer.set_repairing(state.key, cursor, how)
        cursor.rounds += 1
        cursor.target = max(cursor.target, upto)
        state.repair.sync = how
        state.repair.cause = cursor.cause
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
            self.scheduler.request_replay(state.key, cursor.epoch, first, last)
        else:
            c.snapshots_requested[cause] += 1
            self.log.info("repair_snapshot", worker=state.worker, dp_rank=state.dp_rank, cause=cause)
            self.scheduler.request_snapshot(state.key, cause)

    def _repairs_full(self) -> bool:
        return self.sequencer.repairs() >= self.limits.max_pending_repairs

    def _make_room(self, state: InstanceState) -> bool:
        """At the repair limit: give up the pending repair of the instance with the most strikes (at
        least EVICT_STRIKES) for one of ``state``, if ``state`` has none. True when room was made."""
        strikes = self.strikes
        if not strikes or strikes.get(state.key):
            return False  # (no strikes anywhere: no walk over the pending repairs)
        worst, most = None, EVICT_STRIKES - 1
        for key in self.sequencer.repairing():
            n = strikes.get(key, 0)
            if n > most:
                worst, most = key, n
        if worst is None:
            return False
        self.rejecter.refuse(
            worst,
            REPAIR_LIMIT,
            f"repair given up after {most} snapshot requests in a row failed,"
            f" for a repair of {state.worker}/{state.dp_rank}",
        )
        # The room is for ``state``: no queued instance may take it meanwhile.
        starting, self._starting = self._starting, True
        try:
            self.give_up(worst)
        finally:
            self._starting = starting
        return True

    def gap(self, state: InstanceState, missing: tuple[int, int], why: str) -> None:
        """Count and log a hole (first, last) in the instance's sequence."""
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

    def jump(self, state: InstanceState, cursor: Cursor, seq: int, what: str) -> bool:
        """A batch's or heartbeat's ``seq`` more than MAX_GAP past the last one the instance is known
        to have published (kvindex/sequencer): a restart that kept its epoch, or a lie. Neither a hole
        to replay nor batches to count missing: refused (``seq_jump``, logged with the worker id) and
        the instance resynchronised from a snapshot, whose seq says where the worker really is (a
        batch refused so is in it if the worker really published it).

        True when no snapshot could start (no repair transport, or ``--max-pending-repairs``
        reached): the caller then takes ``seq`` as the instance's position, as the batches after an
        unrepaired hole are applied across it."""
        known = cursor.known()
        self.rejecter.refuse(
            state.key,
            SEQ_JUMP,
            f"{what} seq {seq} is {seq - known} past seq {known}, the last known published (a hole may "
            f"miss at most {MAX_GAP} batches): resynchronised from a snapshot",
            epoch=cursor.epoch,
        )
        if cursor.repairing == SNAPSHOT:
            return False  # the snapshot being taken answers it
        self.begin(state, cursor, SNAPSHOT, "jump")
        return cursor.repairing is None

    def restart(self, state: InstanceState, epoch: int, why: str) -> None:
        """The worker restarted (a new epoch): its blocks are gone, and so is any repair of them."""
        dropped = self.index.clear(state.key)
        self.counters.restarts += 1
        self.counters.blocks_cleared += dropped
        state.restarts += 1
        state.capped = 0
        old, state.epoch, state.last_seq = state.epoch, epoch, 0
        # A repair of the old history ends with it; the new one starts in sync unless it begins its own.
        state.repair.sync = "synced"
        state.repair.failed = False
        self.queued.pop(state.key, None)
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
            self.applier.apply(state, batch)
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
            state.repair.sync = "synced"
            self._sync_changed(state)
            self.start_queued()
            return
        if buffer:
            if cursor.rounds >= MAX_REPAIR_ROUNDS:
                self.log.warning(
                    "repair_deferred", worker=state.worker, dp_rank=state.dp_rank, rounds=cursor.rounds
                )
                self.give_up(state.key)
            elif cursor.repairing == REPLAY:
                self.begin(state, cursor, SNAPSHOT, "replay_incomplete")
            else:
                self.begin(state, cursor, REPLAY, "after_snapshot")

    def _sync_changed(self, state: InstanceState, reconciled: bool = False) -> None:
        hook = self.on_sync_change
        if hook is not None:
            hook(state, reconciled)

    # -- answers from the scheduler ----------------------------------------------------------------

    def on_replay(self, instance: InstanceKey, epoch: int, status: str, payloads: list[bytes]) -> None:
        """A replay answer: the original batches of the missing range (or why there are none)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.epoch != epoch or cursor.repairing != REPLAY:
            return  # the instance moved on (restart, snapshot) since the request
        c = self.counters
        if status != REPLAY_OK:
            c.replays_failed[status] += 1
            self.begin(state, cursor, SNAPSHOT, "gap")
            return
        c.replays_ok += 1
        limits = self.limits
        for payload in payloads:
            try:
                batch = decode_batch(payload, instance[0], self.wire_limits)
            except WireError as exc:
                self.rejecter.reject(instance[0], "replay", exc)
                continue
            seq = batch.seq
            if batch.epoch != cursor.epoch or batch.dp_rank != instance[1]:
                continue
            if seq <= cursor.applied or seq in cursor.buffer:
                continue
            n = _n_keys(batch)
            if len(cursor.buffer) >= limits.max_held_batches or cursor.held_keys + n > limits.max_held_keys:
                # What is left stays a hole: the next round asks for a snapshot instead.
                self.rejecter.refuse(
                    instance, HELD_LIMIT, f"replay answer holds more than the limit (at seq {seq})"
                )
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
        state.repair.failed = True
        self.begin(state, cursor, SNAPSHOT, "gap")

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
        if snapshot.epoch != cursor.epoch and snapshot.epoch in cursor.retired:
            return False
        self.strikes.pop(instance, None)  # an answer that says something: the worker answers
        if snapshot.epoch != cursor.epoch:
            # The worker restarted and the snapshot says so first.
            self.restart(state, snapshot.epoch, "new epoch in snapshot")
            repairing = cursor.repairing
            cursor = self.sequencer.open(instance, snapshot.epoch)
            cursor.repairing, cursor.repair_started, cursor.rounds = repairing, self.registry.clock(), 1
            diffs = None
        self.applier.apply_snapshot(state, snapshot, diffs)
        cursor.applied = max(cursor.applied, snapshot.seq)
        state.epoch, state.last_seq = cursor.epoch, cursor.applied
        state.repair.failed = False  # whatever was lost before is reconciled now
        self._sync_changed(state, reconciled=True)
        if cursor.repairing is None:  # a periodic check: nothing was waiting on it
            return True
        self._settle(state, cursor)
        return True

    def snapshot_failed(self, instance: InstanceKey, why: str) -> None:
        """A snapshot request got no usable answer (the repairer retries with back-off)."""
        self.counters.snapshots_failed += 1
        state = self.registry.get(instance)
        if state is None:
            return
        self.strikes[instance] = self.strikes.get(instance, 0) + 1
        if not state.repair.failed:
            state.repair.failed = True
            self._sync_changed(state)

    def forget(self, instance: InstanceKey) -> None:
        """The instance was forgotten (its consumer's ``forget``): if it comes back, it starts clean."""
        self.strikes.pop(instance, None)
        self.queued.pop(instance, None)

    # -- decisions from timers ----------------------------------------------------------------------

    def reconcile(self, instance: InstanceKey, cause: str) -> None:
        """Ask for a snapshot of an instance that looks in sync (periodic check, reconnect)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None or cursor.repairing is not None:
            return
        self.begin(state, cursor, SNAPSHOT, cause)

    def give_up(self, instance: InstanceKey, counted: bool = True) -> None:
        """Stop repairing: apply held batches in order across their holes (the loss stays counted)."""
        state = self.registry.get(instance)
        cursor = self.sequencer.cursor(instance)
        if state is None or cursor is None:
            return
        if counted:
            self.counters.repairs_abandoned += 1
        for seq in list(cursor.buffer):
            batch = cursor.buffer.pop(seq)
            if seq > cursor.applied:
                self.applier.apply(state, batch)
                cursor.applied = seq
        cursor.held_keys = 0
        # What is known lost stays lost; do not ask for it again on every heartbeat.
        cursor.applied = max(cursor.applied, cursor.target)
        state.last_seq = cursor.applied
        was_repairing = cursor.repairing is not None
        self.sequencer.set_repairing(state.key, cursor, None)
        state.repair.sync = "synced"
        state.repair.failed = True  # holes accepted: blocks may be missing until a snapshot
        self._sync_changed(state)
        if was_repairing:
            self.start_queued()

    def start_queued(self) -> None:
        """Start the snapshots of queued instances, oldest first, while the repair limit allows.
        Called as repairs end, and by a queued instance's heartbeat (room can also come from an
        instance forgotten or restarted in the middle of its repair)."""
        if self._starting:
            return  # (begin -> give_up -> here: the outer loop goes on)
        self._starting = True
        try:
            queued = self.queued
            while queued and not self._repairs_full():
                key = next(iter(queued))
                cause = queued.pop(key)
                state = self.registry.get(key)
                cursor = self.sequencer.cursor(key)
                if state is None or cursor is None or cursor.repairing is not None:
                    continue
                self.begin(state, cursor, SNAPSHOT, cause)
        finally:
            self._starting = False


def _n_keys(batch: EventBatch) -> int:
    return sum([len(ev.keys) for ev in batch.events])
