"""Runs the repair machine's requests over NATS: replay and snapshot requests, retries, periodic
reconciliation, and resynchronisation after a reconnect.

Decisions (what to repair, when a repair is done) stay in the synchronous repair machine
(kvindex/repair/machine.py); this module only does the I/O and the timing. At most one repair task
runs per instance; snapshot requests take turns at a fair gate (kvindex/repair/fair.py) so that an
index with many workers, or many index replicas, never floods a worker (workers also coalesce
simultaneous snapshot requests, see workers_shim/publisher.py), and so that no worker's silence
makes another's repair wait.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client

from kvindex.fleet.registry import InstanceState
from kvindex.instance import InstanceKey
from kvindex.lifecycle.bounded import finish
from kvindex.repair.fair import FairGate, Slot
from kvindex.repair.machine import SNAPSHOT, RepairMachine
from kvindex.wire import reconcile
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.schema import TIER_BY_NAME
from kvindex.wire.subjects import Subjects


@dataclass
class RepairConfig:
    replay_timeout: float = 2.0
    snapshot_timeout: float = 5.0
    # Snapshot requests holding a turn at once (kvindex/repair/fair.py). 16: with 4, an index started
    # into 7,000 workers was idle on their round trips (~3 s of CPU in ~4.5 s; benchmarks/README.md,
    # "Cold start"); answers in flight stay within 16 workers' blocks.
    max_concurrent_snapshots: int = 16
    # A snapshot request gives its turn back after this long even if its answer has not come (it
    # goes on waiting for it): a worker that never answers must not hold the others' turns for
    # its whole timeout (kvindex/repair/fair.py).
    snapshot_slot_hold: float = 1.0
    reconcile_interval: float = 60.0  # periodic snapshot per instance, jittered +-20 %; 0 disables
    # ... and at most this many periodic snapshots a second over the whole fleet (0: no cap): each
    # costs the index ~0.3 ms plus ~0.1 us per block, so 8,192 instances checked every 60 s would
    # cost several % of a core with small caches and several cores with large ones. The heartbeats'
    # digests catch drift within a heartbeat; the periodic check is the backstop for the rare drift
    # a digest cannot see, so it may come less often in a large fleet.
    reconcile_rate: float = 8.0
    tick: float = 0.25  # how often periodic checks that are due are started (s)
    max_backoff: float = 5.0  # the most a failed snapshot request waits before the next (s)
    diff_step: int = 16384  # snapshot keys compared per event-loop turn (~1-2 ms each)


class RequestFailed(Exception):
    """No usable answer: timeout, no responders, or a malformed answer."""


class NatsRepairer:
    def __init__(
        self,
        machine: RepairMachine,
        subjects: Subjects,
        limits_of: Callable[[InstanceState], tuple[int, int, int, int]],
        config: RepairConfig,
        *,
        log: Any = None,
        rng: random.Random | None = None,
        recorder: Any = None,
    ) -> None:
        """The scheduler of ``machine`` (made by its ``MakeScheduler``: answers go back to it);
        ``subjects`` say where workers answer, ``limits_of`` an instance's block limits per tier
        (a snapshot is trimmed to them, as the consumer would apply it)."""
        self.machine = machine
        self.subjects = subjects
        self.limits_of = limits_of
        self.config = config
        self.log = log or structlog.get_logger("kvindex.repair")
        self.rng = rng or random.Random()
        self.nc: Client | None = None
        self._tasks: dict[InstanceKey, asyncio.Task[None]] = {}
        cfg = self.config
        self.gate = FairGate(
            cfg.max_concurrent_snapshots, cfg.snapshot_slot_hold, max_backoff=cfg.max_backoff, rng=self.rng
        )
        # Checks of instances in sync (periodic, reconnect, degraded) waiting for their turn: the
        # machine is told only when it comes, so the instance's live batches apply meanwhile instead
        # of being held while other instances' requests go first.
        self._checks: dict[InstanceKey, asyncio.Future[Slot]] = {}
        self._granted: dict[InstanceKey, Slot] = {}  # a check's turn, for the request it starts
        self._next_reconcile: dict[InstanceKey, float] = {}
        # (due, instance) in due order; an entry whose due no longer matches _next_reconcile is old.
        # A tick then costs what is due, not a walk over every instance (8,192 of them 4 times a
        # second cost ~1 % of a core).
        self._due: list[tuple[float, InstanceKey]] = []
        self._loop_task: asyncio.Task[None] | None = None
        # Answers come on one wildcard inbox subscription ("{inbox}.*"), each request its own token:
        # a subscription per request (subscribe, its task, SUB and UNSUB) cost more than the rest
        # of a periodic snapshot's round trip, 137 times a second at 8,192 instances.
        self._replies: asyncio.Task[str] | None = None
        self._waiting: dict[str, Callable[[Any], None]] = {}
        self._request_no = 0
        # Told every answer, failure and timer decision just before the consumer is (kvindex/capture:
        # a replay of the log then repairs exactly as this process did); None: not recording.
        self.recorder = recorder

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, nc: Client) -> None:
        self.nc = nc
        self._loop_task = asyncio.create_task(self._maintain(), name="kvindex-maintenance")

    async def stop(self) -> None:
        for waiting in self._checks.values():
            waiting.cancel()
        self._checks.clear()
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t is not None]
        await finish(tasks, 1.0)  # not cancel-and-await: a lost cancellation must not hang the stop
        self._tasks.clear()
        self._loop_task = None

    def on_reconnect(self) -> None:
        """Whatever was published while we were away is lost to us: check every instance."""
        for key in list(self.machine.sequencer.cursors()):
            self._check(key, "reconnect")

    def reconcile_now(self, instance: InstanceKey, cause: str) -> None:
        """Ask for a snapshot of ``instance`` at its next turn (the router found it degraded),
        unless a repair is already under way then."""
        if instance in self.machine.queued:
            return  # its snapshot starts when a repair ends (a turn now would be wasted)
        self._check(instance, cause)

    def _check(self, instance: InstanceKey, cause: str) -> None:
        """A snapshot of an instance that looks in sync, once its turn comes."""
        if instance in self._checks:
            return  # one check waiting is enough
        waiting = self.gate.wait(instance, self.machine.strikes.get(instance, 0))
        self._checks[instance] = waiting
        waiting.add_done_callback(functools.partial(self._checked, instance, cause))

    def _checked(self, instance: InstanceKey, cause: str, waiting: asyncio.Future[Slot]) -> None:
        if self._checks.get(instance) is waiting:
            del self._checks[instance]
        if waiting.cancelled():
            return
        slot = waiting.result()
        taken = False
        try:
            cursor = self.machine.sequencer.cursor(instance)
            state = self.machine.registry.get(instance)
            if cursor is None or cursor.repairing is not None or state is None:
                return  # forgotten, or a repair started meanwhile: it checks the instance anyway
            if cause == "periodic" and state.stale:
                return
            self._granted[instance] = slot
            if self.recorder is not None:
                self.recorder.timer("reconcile", instance, cause)
            self.machine.reconcile(instance, cause)
            taken = instance not in self._granted  # request_snapshot took the turn
        except Exception as exc:  # a callback: nobody else would see it
            self.log.error("check_failed", worker=instance[0], dp_rank=instance[1], error=repr(exc))
        finally:
            if not taken:  # no request took the turn (the repair limit, or nothing to do)
                self._granted.pop(instance, None)
                slot.release()

    # -- RepairScheduler ------------------------------------------------------------------------

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None:
        self._run(instance, self._replay(instance, epoch, first, last))

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None:
        self._run(instance, self._snapshot(instance, self._granted.pop(instance, None)))

    def _run(self, instance: InstanceKey, work: Any) -> None:
        # The newest request supersedes an older one still running for the same instance.
        old = self._tasks.get(instance)
        if old is not None and not old.done():
            old.cancel()
        task = asyncio.get_running_loop().create_task(work, name=f"kvindex-repair-{instance[0]}")
        self._tasks[instance] = task
        task.add_done_callback(functools.partial(self._done, instance))

    def _done(self, instance: InstanceKey, task: asyncio.Task[None]) -> None:
        if self._tasks.get(instance) is task:  # (not a newer one that replaced it)
            del self._tasks[instance]

    # -- replay ---------------------------------------------------------------------------------

    async def _replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None:
        worker, rank = instance
        subject = self.subjects.replay(worker)
        request = reconcile.replay_request(rank, epoch, first, last)
        try:
            replies = await self._request(
                subject, request, self.config.replay_timeout, reconcile.decode_replay_reply
            )
        except RequestFailed as exc:
            if self.recorder is not None:
                self.recorder.replay_failed(instance, epoch, str(exc))
            self.machine.on_replay_failed(instance, epoch, str(exc))
            return
        status = replies[-1].status
        payloads = [data for reply in replies for data in reply.batches]
        if self.recorder is not None:
            self.recorder.replay_reply(instance, epoch, status, payloads)
        self.machine.on_replay(instance, epoch, status, payloads)

    # -- snapshot -------------------------------------------------------------------------------

    async def _snapshot(self, instance: InstanceKey, slot: Slot | None = None) -> None:
        """Ask until the instance has a usable snapshot (or no longer needs one), each request at
        the instance's turn (``slot``: the turn a check already waited for)."""
        worker, rank = instance
        subject = self.subjects.snapshot(worker)
        machine, gate = self.machine, self.gate
        try:
            while self._wants_snapshot(instance):
                if slot is None or not slot.held:
                    # After a failure this also waits out the instance's backoff.
                    slot = await gate.acquire(instance, machine.strikes.get(instance, 0))
                    continue  # still wanted?
                state = machine.registry.get(instance)
                trim = _Trim(None if state is None else self.limits_of(state))
                try:
                    parts = await self._request(
                        subject,
                        reconcile.snapshot_request(rank),
                        self.config.snapshot_timeout,
                        trim.decode,
                    )
                except RequestFailed as exc:
                    self._snapshot_failed(instance, str(exc))
                    continue
                finally:
                    slot.release()
                snapshot = _assemble(parts)
                snapshot.trimmed = trim.trimmed
                diffs = await self._diff(instance, snapshot)
                if not self._wants_snapshot(instance):
                    return  # given up or forgotten meanwhile
                if self.recorder is not None:
                    self.recorder.snapshot(instance, snapshot)
                if machine.on_snapshot(instance, snapshot, diffs):
                    gate.answered(instance)
                    return
                # A snapshot of an epoch the worker already left: no better than no answer.
                self._snapshot_failed(instance, "stale epoch")
        finally:
            if slot is not None:
                slot.release()

    def _snapshot_failed(self, instance: InstanceKey, why: str) -> None:
        if self.recorder is not None:
            self.recorder.snapshot_failed(instance, why)
        machine = self.machine
        machine.snapshot_failed(instance, why)
        strikes = machine.strikes.get(instance, 0)
        retry_in = self.gate.backoff(instance, strikes)
        self.log.info(
            "snapshot_failed",
            worker=instance[0],
            dp_rank=instance[1],
            error=why,
            strikes=strikes,
            retry_in=round(retry_in, 3),
        )

    async def _diff(
        self, instance: InstanceKey, snapshot: Snapshot
    ) -> dict[int, tuple[list[int], list[int]]] | None:
        """Compare the snapshot with the index in steps, letting the event loop run in between.

        The instance's batches are held while its snapshot repair is pending, so its blocks cannot
        change under the comparison. None when the snapshot is of another epoch (nothing to diff).
        """
        cursor = self.machine.sequencer.cursor(instance)
        index = self.machine.index
        if cursor is None or cursor.epoch != snapshot.epoch or not index.has_instance(instance):
            return None
        diffs = {}
        for tier in range(4):
            differ = index.differ(instance, tier, snapshot.tiers.get(tier, []))
            while not differ.step(self.config.diff_step):
                await asyncio.sleep(0)
                if not self._wants_snapshot(instance) or not index.has_instance(instance):
                    return None
            diffs[tier] = (differ.missing, differ.extra)
        return diffs

    def _wants_snapshot(self, instance: InstanceKey) -> bool:
        cursor = self.machine.sequencer.cursor(instance)
        return cursor is not None and cursor.repairing == SNAPSHOT

    # -- request/reply with multi-part answers --------------------------------------------------

    async def _reply_base(self, nc: Client) -> str:
        """The inbox every answer comes under, subscribed once (nats-py renews it on reconnect)."""
        if self._replies is None:
            self._replies = asyncio.ensure_future(self._subscribe_replies(nc))
        try:
            return await asyncio.shield(self._replies)
        except Exception:
            self._replies = None  # try again at the next request
            raise

    async def _subscribe_replies(self, nc: Client) -> str:
        base = nc.new_inbox()
        waiting = self._waiting

        async def route(msg: Any) -> None:
            deliver = waiting.get(msg.subject)
            if deliver is not None:  # else: an answer to a request that gave up (timeout)
                deliver(msg)

        await nc.subscribe(base + ".*", cb=route)
        return base

    async def _request(
        self, subject: str, payload: bytes, timeout: float, decode: Callable[[bytes], Any]
    ) -> list[Any]:
        nc = self.nc
        if nc is None or not nc.is_connected:
            raise RequestFailed("not connected")
        try:
            base = await self._reply_base(nc)
        except Exception as exc:
            raise RequestFailed(f"no reply subscription: {exc}") from None
        self._request_no += 1
        inbox = f"{base}.{self._request_no}"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._waiting[inbox] = queue.put_nowait
        try:
            await nc.publish(subject, payload, reply=inbox)
            parts = _Parts()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise RequestFailed("timeout")
                try:
                    msg = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    raise RequestFailed("timeout") from None
                if msg.headers and msg.headers.get("Status") == "503":
                    raise RequestFailed("no_responders")
                try:
                    part = decode(msg.data)
                except Exception as exc:
                    raise RequestFailed(f"malformed answer: {exc}") from None
                if parts.add(part):
                    return parts.ordered()
        finally:
            self._waiting.pop(inbox, None)

    # -- periodic work --------------------------------------------------------------------------

    async def _maintain(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.tick)
            if cfg.reconcile_interval <= 0:
                continue
            try:
                self._periodic(self.machine.registry.clock())
            except Exception as exc:  # keep maintaining whatever one round ran into
                self.log.error("maintenance_failed", error=str(exc), error_type=type(exc).__name__)

    def forget(self, instance: InstanceKey) -> None:
        """The instance was forgotten (the service's liveness sweep): no periodic check is due for it,
        and if it comes back it is scheduled anew."""
        self._next_reconcile.pop(instance, None)
        waiting = self._checks.pop(instance, None)
        if waiting is not None:
            waiting.cancel()
        self.gate.forget(instance)

    def reconcile_every(self) -> float:
        """Seconds between an instance's periodic checks: the interval, longer in a fleet too large
        to check each that often within ``reconcile_rate``."""
        cfg = self.config
        n = len(self.machine.sequencer.cursors())
        return max(cfg.reconcile_interval, n / cfg.reconcile_rate if cfg.reconcile_rate > 0 else 0.0)

    def _periodic(self, now: float) -> None:
        interval = self.reconcile_every()
        cursors = self.machine.sequencer.cursors()
        nxt, due_heap, rng = self._next_reconcile, self._due, self.rng
        for key in self.machine.sequencer.take_opened():
            if key not in nxt and key in cursors:
                # Spread first checks over a whole interval so that instances do not align.
                nxt[key] = due = now + interval * rng.random()
                heapq.heappush(due_heap, (due, key))
        while due_heap and due_heap[0][0] <= now:
            due, key = heapq.heappop(due_heap)
            if nxt.get(key) != due:
                continue  # rescheduled or forgotten since
            cursor = cursors.get(key)
            if cursor is None:
                del nxt[key]
                continue
            nxt[key] = later = now + interval * (0.8 + 0.4 * rng.random())
            heapq.heappush(due_heap, (later, key))
            state = self.machine.registry.get(key)
            if cursor.repairing is None and state is not None and not state.stale:
                self._check(key, "periodic")
        if len(due_heap) > 2 * len(nxt) + 64:  # old entries pile up only with churn: rebuild
            self._due = [(d, k) for k, d in nxt.items()]
            heapq.heapify(self._due)


class _Parts:
    """The parts of one multi-part answer, collected until every part up to the last has come."""

    def __init__(self) -> None:
        self.parts: dict[int, Any] = {}
        self.total: int | None = None

    def add(self, part: Any) -> bool:
        """Keep ``part``; True when every part up to the last one has come.

        Parts numbered beyond the last are ignored: counting them made an answer look complete
        while a part was missing (found by fuzzing).
        """
        if part.last:
            self.total = part.part + 1
            for extra in [i for i in self.parts if i >= self.total]:
                del self.parts[extra]
        if self.total is not None and part.part >= self.total:
            return False
        self.parts[part.part] = part
        return self.total is not None and len(self.parts) == self.total

    def ordered(self) -> list[Any]:
        assert self.total is not None
        return [self.parts[i] for i in range(self.total)]


class _Trim:
    """Decodes snapshot parts keeping at most the instance's block limit per tier, so a worker
    announcing more blocks than it may hold cannot make the answer itself take the memory."""

    def __init__(self, limits: tuple[int, int, int, int] | None) -> None:
        self.limits = limits
        self.kept = [0, 0, 0, 0]
        self.trimmed = 0

    def decode(self, data: bytes) -> reconcile.SnapshotPart:
        part = reconcile.decode_snapshot_part(data)
        if self.limits is not None:
            for name, keys in part.tiers.items():
                tier = TIER_BY_NAME[name]
                room = max(0, self.limits[tier] - self.kept[tier])
                if len(keys) > room:
                    part.tiers[name] = keys[:room]
                    self.trimmed |= 1 << tier
                self.kept[tier] += min(room, len(keys))
        return part


def _assemble(parts: list[reconcile.SnapshotPart]) -> Snapshot:
    first = parts[0]
    snap = Snapshot(first.epoch, first.seq)
    for part in parts:
        for tier, keys in part.tiers.items():
            snap.tiers.setdefault(TIER_BY_NAME[tier], []).extend(keys)
    return snap
