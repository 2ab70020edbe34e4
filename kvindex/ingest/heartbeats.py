"""Heartbeats through the consumer: liveness, load, capacity, endpoint and role, and what their
``seq`` and digest say about the instance's blocks (a lost tail, a restart, drift), which goes to the
repair machine (kvindex/repair/machine.py).

Three paths, cheapest first (kvindex/ingest/README.md): a heartbeat equal to the instance's last
no-change heartbeat but for its ``ts`` and load bytes only refreshes liveness and load (``_Repeat``);
one whose maps repeat the previous one's as bytes updates the previous report in place
(``decode_heartbeat_into``); anything else is decoded and checked in full (``decode_heartbeat``). The
first two are taken only where the full path would have found the same.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgspec

from kvindex.fleet.registry import InstanceState
from kvindex.ingest.instances import Instances
from kvindex.ingest.layouts import Layouts
from kvindex.ingest.limits import IngestLimits
from kvindex.ingest.rejects import Rejects
from kvindex.instance import InstanceKey
from kvindex.repair.machine import QUEUED, REPLAY, SNAPSHOT, IngestState, RepairMachine
from kvindex.sequencer.cursor import MAX_GAP, Cursor
from kvindex.wire import errors
from kvindex.wire.codec import (
    HeartbeatMemory,
    HeartbeatPeek,
    decode_heartbeat,
    decode_heartbeat_into,
    load_of,
    peek_decoder,
)
from kvindex.wire.errors import WireError
from kvindex.wire.schema import WIRE_VERSION, HeartbeatReport, Load
from kvindex.wire.subjects import HEARTBEAT, Subjects


class Heartbeats:
    """The heartbeat handling of ingest (``Consumer.on_heartbeat`` is this ``on_heartbeat``). What it
    needs is handed to it when it is built (kvindex/core.py): it does not hold the consumer."""

    def __init__(
        self,
        shared: IngestState,
        *,
        subjects: Subjects,
        instances: Instances,
        rejects: Rejects,
        limits: IngestLimits,
        layouts: Layouts,
        repairs: RepairMachine,
        prefill_samples: Callable[[str, list[tuple[int, int, float]], str], Any] | None = None,
        on_forget: Callable[[InstanceKey], Any] | None = None,
    ) -> None:
        self.index, self.registry, self.sequencer = shared.index, shared.registry, shared.sequencer
        self.counters, self.log = shared.counters, shared.log
        self.subjects = subjects
        self.instances = instances
        self.rejects = rejects
        self.limits = limits
        self.layouts = layouts
        self.repairs = repairs
        # Where prefill samples go (model, [(prompt, cached, ms)], instance id): the calibration
        # (kvindex/scoring/calibration.py).
        self.prefill_samples = prefill_samples
        # Told when an instance's predicted blocks give way to its events (routing state about them
        # can go too).
        self.on_forget = on_forget
        self._head = f"{self.subjects.prefix}.{HEARTBEAT}."
        # Per heartbeat subject, the last heartbeat that changed nothing (see _Repeat): the next one
        # equal to it but for its timestamp only refreshes liveness.
        self._repeats: dict[str, _Repeat] = {}
        self._pending_repeat: tuple[bytes, str] | None = None  # (set by _apply_heartbeat)
        # Heartbeats drive repairs (tail loss, drift, discovery) unless the event source is still
        # replaying history; and when they do not share one ordered subscription with the batches,
        # a heartbeat ahead of the batches must be seen twice before it counts as a lost tail.
        self.drive_repairs = True
        self.in_order = True

    def forget(self, worker: str) -> None:
        """The worker's instance is forgotten: its next heartbeat takes the full path."""
        self._repeats.pop(self._head + worker, None)

    def on_heartbeat(self, subject: str, payload: bytes) -> bool:
        """Handle one heartbeat; True when accepted."""
        state: InstanceState | None
        self.counters.heartbeats_received += 1
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
                    state.last_heartbeat_at = self.registry.clock()
                    state.heartbeat.ts = ts
                    if repeat.waiting and state.repair.sync == QUEUED:
                        self.repairs.start_queued()  # as the full path does for a queued instance
                    return True
            del self._repeats[subject]
        # Steady state: a known instance whose heartbeat repeats the previous one's maps (all but
        # its load, mostly) takes them from the previous report instead of decoding them again.
        head = self._head
        if type(payload) is bytes:  # (codec.peek_heartbeat, inline)
            try:
                peek = _peek(payload)
            except (msgspec.MsgspecError, RecursionError):  # (decode_heartbeat below says why)
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
            # A memo means decode_heartbeat accepted a heartbeat of this instance: the worker, rank,
            # model and block size the peek leaves unchecked are valid when they equal its own.
            if (
                state is not None
                and state.heartbeat.memo is not None
                and state.model == peek.model
                and state.block_size == peek.block_size
            ):
                memo: _HeartbeatMemo = state.heartbeat.memo
                if decode_heartbeat_into(peek, memo):
                    report = memo.report
                    if (
                        report.endpoint_error is None
                        and report.role_error is None
                        and report.groups_error is None
                    ):  # (else counted)
                        self._apply_heartbeat(state, report, payload)
                        return True
                    return self._accept_heartbeat(subject, state, report)
        worker = None
        try:
            worker = self.subjects.worker_of(subject, HEARTBEAT)
            report = decode_heartbeat(payload, worker)
            state = self.instances.state_for(
                report.worker, report.dp_rank, report.model, report.block_size, report.epoch
            )
        except WireError as exc:
            self.rejects.reject(worker, subject, exc)
            return False
        memo = state.heartbeat.memo
        if peek is None:
            state.heartbeat.memo = None  # (a payload that is not bytes: nothing to compare the next with)
        elif memo is None:
            state.heartbeat.memo = _HeartbeatMemo(peek, report)
        else:
            memo.renew(peek, report)
        return self._accept_heartbeat(subject, state, report)

    def _accept_heartbeat(self, subject: str, state: InstanceState, report: HeartbeatReport) -> bool:
        if report.endpoint_error is not None:
            # The heartbeat still counts (load, digest, liveness); only the endpoint is dropped, so
            # routers never see an address they could not connect to.
            self.rejects.reject(state.worker, subject, WireError(errors.BAD_ENDPOINT, report.endpoint_error))
        if report.role_error is not None:
            # Likewise a role or group that cannot be read: the instance serves whole requests.
            self.rejects.reject(state.worker, subject, WireError(errors.BAD_ROLE, report.role_error))
        self._apply_heartbeat(state, report)
        return True

    def _apply_heartbeat(
        self, state: InstanceState, report: HeartbeatReport, payload: bytes | None = None
    ) -> None:
        key = state.key
        cursor = self.sequencer.cursor(key)
        state.last_heartbeat_at = self.registry.clock()
        state.heartbeat.ts = report.ts
        # A heartbeat whose capacity and digest repeat the previous one's: if it also changes
        # nothing below, the next one equal to it but for its ts and load takes the short path.
        unchanged = payload is not None and report.capacity is state.capacity
        self._pending_repeat = (payload, report.worker) if unchanged and payload is not None else None
        # The same objects as the previous report's when unchanged (codec.decode_heartbeat_into):
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
                if state.capped & (1 << tier) and held <= self.limits.limits_of(state)[tier]:
                    state.capped &= ~(1 << tier)
        state.heartbeat.digest = report.digest
        state.heartbeat.seq = report.seq
        self._announcements(state, report)
        if state.approximate or state.layout_conflict or not self.drive_repairs:
            # No events, so no sequence to check: its blocks are the index's own predictions.
            return
        self._check_sequence(state, cursor, report, unchanged)

    def _announcements(self, state: InstanceState, report: HeartbeatReport) -> None:
        """What the heartbeat announces about the instance: endpoint, role, KV-cache groups, prefill
        samples, liveness and whether it reports events (each rare but the samples)."""
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
        groups = report.groups
        if report.groups_error is not None or (
            groups is not state.groups_announced and groups != state.groups_announced
        ):
            if self.layouts.announced(state, groups, report.groups_error):
                self._resync(state)
                self.layouts.judge(state)
        elif groups is None and state.top_group:
            self.layouts.judge(state)  # events of groups, and still no layout (rare)
        if report.prefill and self.prefill_samples is not None:
            self.prefill_samples(state.model, report.prefill, state.instance_id)
        if state.stale:
            state.stale = False
            self.log.info("instance_alive_again", worker=state.worker, dp_rank=state.dp_rank)
        if state.approximate != (not report.events):
            state.approximate = not report.events
            if not state.approximate:
                # Now it reports events: predictions give way to the truth (its seq brings a snapshot).
                self.index.clear(state.key)
                if self.on_forget is not None:
                    self.on_forget(state.key)
            self.log.info(
                "instance_mode",
                worker=state.worker,
                dp_rank=state.dp_rank,
                mode="approximate" if state.approximate else "events",
            )

    def _resync(self, state: InstanceState) -> None:
        """A snapshot of the instance (its blocks were dropped while its layout was in conflict)."""
        cursor = self.sequencer.cursor(state.key)
        if cursor is not None and cursor.repairing is None:
            self.repairs.begin(state, cursor, SNAPSHOT, "layout")

    def _check_sequence(
        self, state: InstanceState, cursor: Cursor | None, report: HeartbeatReport, unchanged: bool
    ) -> None:
        """The heartbeat's epoch, ``seq`` and digest against the instance's cursor and blocks: a
        restart, a lost tail or drift goes to the repair machine."""
        key = state.key
        if cursor is None or cursor.epoch != report.epoch:
            if cursor is not None:
                if report.epoch in cursor.retired:
                    return  # a late heartbeat from before the restart we already handled
                self.repairs.restart(state, report.epoch, "new epoch in heartbeat")
            cursor = self.sequencer.open(key, report.epoch)
            state.epoch, state.last_seq = report.epoch, 0
            if report.seq:
                # Discovered mid-stream (index start, restart seen first here): fetch the truth.
                self.counters.joins_mid_stream += 1
                self.repairs.begin(state, cursor, SNAPSHOT, "start", upto=report.seq)
            return
        if cursor.repairing is not None:
            self._remember_waiting(state, cursor, report, unchanged)
            return
        if state.repair.sync == QUEUED:  # its drift is known: its snapshot starts when there is room
            self.repairs.start_queued()
            self._remember_waiting(state, cursor, report, unchanged)
            return
        if report.seq > cursor.applied:
            if not self.in_order and cursor.behind <= cursor.applied:
                cursor.behind = report.seq  # maybe just overtaken: check again at the next heartbeat
                return
            if report.seq - cursor.applied > MAX_GAP:  # no tail that long was lost: a jump
                cursor.behind = 0
                if self.repairs.jump(state, cursor, report.seq, "heartbeat"):
                    cursor.applied = state.last_seq = report.seq  # no repair: taken as the position
                return
            # The worker published more than we received: the tail batches were lost.
            cursor.behind = 0
            self.repairs.gap(state, (cursor.applied + 1, report.seq), "behind heartbeat")
            self.repairs.begin(state, cursor, REPLAY, "tail", upto=report.seq)
            return
        if report.seq != cursor.applied:
            return
        memo = state.heartbeat.memo
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
        self.repairs.begin(state, cursor, SNAPSHOT, "drift")

    def _remember_repeat(
        self,
        state: InstanceState,
        cursor: Cursor,
        report: HeartbeatReport,
        version: int,
        waiting: bool = False,
    ) -> None:
        pending, self._pending_repeat = self._pending_repeat, None
        if pending is None or self.in_order is False or not self.drive_repairs:
            return
        payload, worker = pending
        repeat = _Repeat.of(payload, report.ts, report.load, state, cursor, version, waiting)
        if repeat is not None:
            self._repeats[self._head + worker] = repeat

    def _remember_waiting(
        self, state: InstanceState, cursor: Cursor, report: HeartbeatReport, unchanged: bool
    ) -> None:
        """An instance whose repair is pending or queued: its heartbeats change nothing but liveness
        and load until the repair ends (a cold start's thousands of them took the full path)."""
        memo = state.heartbeat.memo
        if (
            unchanged
            and not report.prefill
            and memo is not None
            and memo.report is report
            and not state.capped
        ):
            self._remember_repeat(state, cursor, report, -1, waiting=True)
        else:
            self._pending_repeat = None

    def _digest_matches(self, state: InstanceState, report: HeartbeatReport) -> bool:
        """Digests agree on every tier, except capped ones (the index keeps a subset there)."""
        reported, key, capped = report.digest, state.key, state.capped
        return all(
            reported.get(tier, (0, 0)) == self.index.digest(key, tier)
            for tier in range(4)
            if not capped & (1 << tier)
        )


_peek = peek_decoder.decode


class _HeartbeatMemo(HeartbeatMemory):
    """HeartbeatMemory (kept on the InstanceState), and the reported digest as the index compares it."""

    __slots__ = ("_lists", "matched")

    def __init__(self, peek: HeartbeatPeek, report: HeartbeatReport) -> None:
        self._lists: tuple[list[int], list[int]] | None = None
        # The index's digest_version when it last equalled report.digest (-1: not since it changed).
        self.matched = -1
        HeartbeatMemory.renew(self, peek, report)

    def renew(self, peek: HeartbeatPeek, report: HeartbeatReport) -> None:
        if report.digest != self.report.digest:
            self._lists = None
            self.matched = -1
        HeartbeatMemory.renew(self, peek, report)

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
    ``load`` last (wire/codec.encode_heartbeat), so a steady worker's next heartbeat is the same bytes
    up to the 8 of its ts value, then the load map to the end: as long as the instance, its cursor
    and its blocks are the ones it was checked against, it only refreshes liveness and, if its load
    bytes moved, the load (about 1.5 us, or 2.5 with a new load, instead of a peek decode and every
    check: 8,192 instances send 16.4 K heartbeats a second). Anything else, including a heartbeat
    encoded another way, takes the full path."""

    __slots__ = ("applied", "cursor", "head", "load_raw", "state", "version", "waiting")

    def __init__(
        self,
        head: bytes,
        load_raw: bytes,
        state: InstanceState,
        cursor: Cursor,
        version: int,
        waiting: bool = False,
    ) -> None:
        self.head, self.load_raw = head, load_raw
        self.state, self.cursor, self.applied, self.version = state, cursor, cursor.applied, version
        # An instance waiting for its repair (pending or queued): the full path would only refresh
        # its liveness and load (and start queued repairs) until the repair ends, whatever its seq
        # and digest say; its next heartbeat after that is checked in full.
        self.waiting = waiting

    @classmethod
    def of(
        cls,
        payload: bytes,
        ts: float,
        load: Load,
        state: InstanceState,
        cursor: Cursor,
        version: int,
        waiting: bool = False,
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
        except (msgspec.MsgspecError, RecursionError):
            return None
        if probe.ts != ts + 1.0 or msgspec.structs.replace(probe, ts=ts) != first:
            return None
        if load_of(load_raw) != load:
            return None
        return cls(head, load_raw, state, cursor, version, waiting)

    def tail_of(self, payload: bytes) -> tuple[float, bytes] | None:
        """(ts, the load map's bytes) when the heartbeat equals this one up to them."""
        head = self.head
        n = len(head)
        if type(payload) is bytes and payload.startswith(head) and payload.startswith(_LOAD_KEY, n + 8):
            return _unpack_ts(payload, n)[0], payload[n + 13 :]
        return None

    def still(self, heartbeats: Heartbeats) -> bool:
        """Nothing it was checked against moved: same instance, cursor (seq, no repair), blocks; or,
        for a waiting one, the instance still waits for its repair."""
        state, cursor = self.state, self.cursor
        if self.waiting:
            return (
                not state.stale
                and not state.capped
                and not state.removed
                and not cursor.closed
                and (cursor.repairing is not None or state.repair.sync == QUEUED)
                and heartbeats.drive_repairs
            )
        return (
            not state.stale
            and not state.capped
            and not state.removed
            and not cursor.closed
            and cursor.repairing is None
            and cursor.applied == self.applied
            and heartbeats.index.digest_version(state.key) == self.version
            and heartbeats.drive_repairs
        )
