"""Recording: what the service consumes (``serve --capture``) or what the wire carries (``capture``).

``Recorder`` is fed at the boundaries of the consumer: the NATS source's tap (every events/status
message, before the consumer sees it) and the repairer (every replay/snapshot answer or failure it
hands over, every timer decision). Each record is written just before the consumer call it
describes, on the same event-loop turn, so the log's order is the order the consumer saw. Recording
never stops the service: a write error disables the recorder (logged once) and ingestion goes on.

``Capture`` is the standalone recorder (``kvindex capture``): its own NATS subscription, no consumer.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from kvindex.api.methods import RELEASE, Method
from kvindex.api.servicer import KvIndexServicer
from kvindex.capture import records as R
from kvindex.capture.digest import state_digest
from kvindex.capture.format import LogWriter
from kvindex.config.nats import NatsSettings
from kvindex.config.nats import connect as nats_connect
from kvindex.instance import InstanceKey
from kvindex.lifecycle import close_nats
from kvindex.lifecycle.bounded import finish
from kvindex.scoring.pick import SOFTMAX
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.subjects import EVENTS, HEARTBEAT

if TYPE_CHECKING:
    from kvindex.ingest.consumer import Consumer
    from kvindex.scoring.calibration import Calibrator

FLUSH_INTERVAL = 0.2  # seconds of records a kill can lose
CHECK_INTERVAL = 5.0  # seconds between live-state digests in the log


@dataclass
class CaptureConfig:
    path: str
    max_bytes: int = 0  # rotate to PATH.1, PATH.2 ... beyond this many bytes per segment; 0: never
    zstd: bool = False
    flush_interval: float = FLUSH_INTERVAL
    check_interval: float = CHECK_INTERVAL


def log_meta(source: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "source": source,
        "prefix": prefix,
        "session": uuid.uuid4().hex,
        "created_wall": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "kvindex": "0.1.0",
        **extra,
    }


def service_meta(
    prefix: str,
    *,
    jetstream: bool,
    repair: dict[str, float],
    router: dict[str, Any],
    limits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Header of a ``serve --capture`` log: enough to rebuild the consumer the way it was set up.

    Plain values, built by the service (``kvindex.service.app``): the recorder must not import the
    service that imports it. ``repair`` holds the timings the replay reads: the
    ``LivenessConfig``'s stale_after and forget_after, the ``RepairConfig``'s reconcile_interval,
    replay_timeout and snapshot_timeout; ``router`` the
    ``RankerConfig`` default_policy and seed, ``limits`` the ``IngestLimits`` fields.
    """
    return log_meta(
        R.SOURCE_SERVE,
        prefix,
        jetstream=jetstream,
        repair=dict(repair),
        router=dict(router),
        limits=dict(limits or {}),
    )


class Recorder:
    def __init__(
        self,
        writer: LogWriter,
        clock: Callable[[], float],
        log: Any = None,
        config: CaptureConfig | None = None,
    ) -> None:
        self.writer = writer
        self.config = config or CaptureConfig(str(writer.path))
        self.clock = clock
        # The consumer whose input is recorded, from ``start`` on (None: a capture without one).
        # Not a constructor argument: the repairer the consumer is built with records through this
        # recorder, so the recorder exists first.
        self.consumer: Consumer | None = None
        self.log = log or structlog.get_logger("kvindex.capture")
        self.failed = False
        self.messages = 0
        self.checks = 0
        self._flags: tuple[bool, bool] | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def open(
        cls,
        config: CaptureConfig,
        meta: dict[str, Any],
        clock: Callable[[], float],
    ) -> Recorder:
        writer = LogWriter(
            config.path,
            {**meta, "created_mono": clock()},
            zstd=config.zstd,
            max_bytes=config.max_bytes,
        )
        return cls(writer, clock, config=config)

    # -- writing --------------------------------------------------------------------------------

    def _add(self, record: list[Any]) -> None:
        if self.failed:
            return
        consumer = self.consumer
        if consumer is not None and record[0] != R.FLAGS:
            # How the source lets heartbeats drive repairs (JetStream catch-up) changes between
            # records: log the change before the record it first applies to.
            flags = consumer.heartbeat_order()
            if flags != self._flags:
                self._flags = flags
                self._add(
                    [
                        R.FLAGS,
                        record[1],
                        record[2],
                        {"heartbeat_repairs": flags[0], "status_in_order": flags[1]},
                    ]
                )
        try:
            self.writer.add(record)
        except Exception as exc:  # disk full, file removed...: the service matters more than the log
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        self.log.error("capture_failed", path=str(self.writer.path), error=str(exc) or type(exc).__name__)

    def _head(self, kind: int, wall: float | None = None) -> list[Any]:
        return [kind, self.clock(), time.time() if wall is None else wall]

    # -- the source's tap -----------------------------------------------------------------------

    def message(self, subject: str, payload: bytes, received: float | None = None) -> None:
        """An events/heartbeat message about to be handed to the consumer (NatsSource.tap)."""
        self.messages += 1
        clock = self.clock
        mono = clock.pin() if isinstance(clock, PinnableClock) else clock()
        self._add([R.MSG, mono, time.time() if received is None else received, subject, payload])

    # -- the repairer's answers and decisions ---------------------------------------------------

    def replay_reply(self, instance: InstanceKey, epoch: int, status: str, payloads: list[bytes]) -> None:
        self._add([*self._head(R.REPLAY_REPLY), instance[0], instance[1], epoch, status, payloads])

    def replay_failed(self, instance: InstanceKey, epoch: int, why: str) -> None:
        self._add([*self._head(R.REPLAY_FAILED), instance[0], instance[1], epoch, why])

    def snapshot(self, instance: InstanceKey, snapshot: Snapshot) -> None:
        tiers = {t: R.pack_keys(keys) for t, keys in snapshot.tiers.items()}
        self._add([*self._head(R.SNAPSHOT), instance[0], instance[1], snapshot.epoch, snapshot.seq, tiers])

    def snapshot_failed(self, instance: InstanceKey, why: str) -> None:
        self._add([*self._head(R.SNAPSHOT_FAILED), instance[0], instance[1], why])

    def timer(self, what: str, instance: InstanceKey, cause: str = "") -> None:
        self._add([*self._head(R.TIMER), what, instance[0], instance[1], cause])

    # -- service state --------------------------------------------------------------------------

    def calibration(self, calibrator: Calibrator) -> None:
        snap = calibrator.snapshot()
        # The models' shared fits as before; the instances' own fits after them.
        self._add([*self._head(R.CALIBRATION), snap["models"], snap["instances"]])

    def route(self, method: str, request: bytes, instance: str = "", mono: float | None = None) -> None:
        """``mono``: when the call started (a Score's ranking read the clock then), default now."""
        head = self._head(R.ROUTE)
        if mono is not None:
            head[1] = mono
        self._add([*head, method, request, instance])

    def check(self) -> None:
        """The live state's digest: a replay compares its own at this point in the stream."""
        consumer = self.consumer
        if consumer is None:
            return
        stats = consumer.index.stats()
        self.checks += 1
        self._add([*self._head(R.CHECK), state_digest(consumer), len(consumer.registry), list(stats.entries)])

    def flush(self) -> None:
        if self.failed:
            return
        try:
            self.writer.flush()
        except Exception as exc:
            self._fail(exc)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, consumer: Consumer | None = None) -> None:
        """Flush periodically; with ``consumer``, record its heartbeat flags before every record
        they apply to and check its state every ``check_interval`` (and at the close)."""
        self.consumer = consumer
        self._task = asyncio.create_task(self._run(), name="kvindex-capture")

    async def _run(self) -> None:
        cfg = self.config
        next_check = time.monotonic() + cfg.check_interval
        while not self.failed:
            await asyncio.sleep(cfg.flush_interval)
            if self.consumer is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + cfg.check_interval
                self.check()
            self.flush()

    async def stop(self, reason: str = "stopped") -> None:
        if self._task is not None:
            await finish([self._task], 1.0)
            self._task = None
        self.close(reason)

    def close(self, reason: str = "stopped") -> None:
        if self.writer.closed:
            return
        self.check()
        self._add([*self._head(R.CLOSE), reason])
        try:
            self.writer.close()
        except Exception as exc:
            self._fail(exc)
        self.log.info(
            "capture_closed",
            path=str(self.writer.path),
            records=self.writer.records,
            bytes=self.writer.bytes_written,
            segments=self.writer.segment + 1,
        )


class PinnableClock:
    """The service's monotonic clock while it captures. The code a record describes runs with the
    clock pinned at the record's time: a consumer call from the moment its message is recorded to
    the end of that event-loop turn (``pin``), a routing call for its duration. Every clock read of
    that code (heartbeat times, the ranking, the pick, the commit) returns the record's ``mono``,
    so a replay on a virtual clock set to it reads exactly the times the live service read."""

    __slots__ = ("_unpin_scheduled", "pinned")

    def __init__(self) -> None:
        self.pinned: float | None = None
        self._unpin_scheduled = False

    def __call__(self) -> float:
        pinned = self.pinned
        return time.monotonic() if pinned is None else pinned

    def pin(self) -> float:
        """Pin the clock at the real time until the end of the current loop turn; that time."""
        now = time.monotonic()
        if not self._unpin_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self._unpin)
            except RuntimeError:  # no loop (a test driving the recorder directly): no pinning
                return now
            self._unpin_scheduled = True
        self.pinned = now
        return now

    def _unpin(self) -> None:
        self.pinned = None
        self._unpin_scheduled = False


class RecordingServicer(KvIndexServicer):
    """The gRPC servicer, plus a ROUTE record for every call that changed routing state (the methods
    with ``changes`` in kvindex/api/methods.py: a Score with commit, a Commit, a Release that found
    its request), written as the call ends, on the same event-loop turn, with what it decided. A
    replay re-applies the decision (not the ranking): the in-flight ledger and speculative keys come
    out as they were."""

    def __init__(self, recorder: Recorder, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder
        self._score_started: float | None = None  # the running Score's start on the recorder's clock

    def score_request(self, request: Any) -> Any:  # Score and ScoreStream
        clock = self.recorder.clock
        started = self._score_started = clock()
        pinned = clock if isinstance(clock, PinnableClock) and clock.pinned is None else None
        if pinned is not None:
            pinned.pinned = started
        try:
            return super().score_request(request)
        finally:
            self._score_started = None
            if pinned is not None:
                pinned.pinned = None

    def _done(self, method: Method, request: Any, response: Any, started: float) -> None:
        super()._done(method, request, response, started)
        instance = method.changed(request, response) if method.changed is not None else None
        if instance is None:
            return
        if method.changes == RELEASE:
            self.recorder.route(method.name, request.SerializeToString())
            return
        compact = self._compact(request)
        mono = None
        if isinstance(response, pb.ScoreResponse):
            # The pick as applied (the server's defaults filled in, the draw's seed): a replay
            # re-ranking this request draws the same instance. (A Score's ranking read the clock
            # at its start.)
            compact.pick = response.pick
            if response.pick == SOFTMAX:
                compact.temperature = response.temperature
            if response.pick_seed:
                compact.pick_seed = response.pick_seed
            mono = self._score_started
        self.recorder.route(method.name, compact.SerializeToString(), instance, mono=mono)

    def _compact(self, request: Any) -> Any:
        """A copy of the request with its prompt as block keys (and the token count) instead of token
        ids or text: the same request to the router, several times smaller (one key per block)."""
        compact = type(request)()
        compact.CopyFrom(request)
        if not (len(request.token_ids) or request.prompt or request.messages):
            return compact
        prompt = self.resolve(request)  # text prompts: the tokenizer cache makes this a lookup
        for name in ("token_ids", "prompt", "messages", "prompt_options"):
            compact.ClearField(name)
        compact.lora = compact.salt = ""  # already folded into the keys
        compact.block_keys.extend(prompt.keys)
        compact.prompt_tokens = prompt.tokens
        return compact


class Capture:
    """``kvindex capture``: record every events/heartbeat message under a prefix, with no index.

    It cannot see a service's replay/snapshot answers (they go to that service's inbox), so a replay
    of its log runs the consumer without repairs: holes are counted and accepted.
    """

    def __init__(
        self, url: str | NatsSettings, config: CaptureConfig, prefix: str = "kvindex", log: Any = None
    ) -> None:
        self.settings = NatsSettings.coerce(url)
        self.url = self.settings.redacted_servers()  # for logs: no secret
        self.prefix = prefix
        self.config = config
        self.log = log or structlog.get_logger("kvindex.capture")
        self.recorder = Recorder.open(config, log_meta(R.SOURCE_CAPTURE, prefix), time.monotonic)
        self.nc: Any = None
        self._head = prefix + "."

    async def start(self) -> None:
        self.nc = await nats_connect(self.settings, name="kvindex-capture", max_reconnect_attempts=-1)
        await self.nc.subscribe(
            self._head + ">", cb=self._on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30
        )
        await self.nc.flush()
        self.recorder.start()
        self.log.info("capture_started", url=self.url, subject=self._head + ">", path=self.config.path)

    async def _on_msg(self, msg: Any) -> None:
        kind = msg.subject[len(self._head) :].partition(".")[0]
        if kind in (EVENTS, HEARTBEAT):
            self.recorder.message(msg.subject, msg.data)

    async def stop(self) -> None:
        """Drain what NATS already delivered (bounded, whatever its state), then close the log."""
        nc, self.nc = self.nc, None
        await close_nats(nc, 2.0, log=self.log)
        await self.recorder.stop()
