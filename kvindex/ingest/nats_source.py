"""Feeds the consumer from NATS.

Core NATS (default): one subscription on ``{prefix}.>`` for events and heartbeats. One, not one per
kind, because nats-py runs each subscription's callbacks on its own task: with two, a worker's
heartbeat could be handled before the event batch it was published after, and the heartbeat's seq
would look like a lost batch.

JetStream (optional): event batches are kept in a stream; the index reads it with an ordered
consumer from the start, so a restarted index rebuilds from the stream instead of asking every
worker for a snapshot, and a reconnect resumes exactly where it left off. Heartbeats stay on core
NATS (they are only useful live); until the stream is caught up they update load but start no
repair, and afterwards a lost tail must show in two heartbeats in a row (the two arrive on separate
subscriptions, so one heartbeat may overtake the batch before it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from kvindex.config.nats import NatsSettings, redact_url
from kvindex.config.nats import connect as nats_connect
from kvindex.ingest import direct_dispatch
from kvindex.ingest.consumer import Consumer
from kvindex.lifecycle import close_nats
from kvindex.wire.subjects import EVENTS, HEARTBEAT

# Generous client-side buffer: a burst must wait in memory rather than be dropped as a slow consumer.
_PENDING_MSGS = 1_000_000
_PENDING_BYTES = 1 << 30
# JetStream's "no suitable peers for placement": a replicated stream asked of a cluster still forming.
_NO_PLACEMENT = 10005
_PLACEMENT_WAIT = 20.0


@dataclass
class JetStreamConfig:
    max_age: float = 3600.0  # seconds of history a restarted index can rebuild from
    max_bytes: int = 1 << 30
    stream: str | None = None  # default: KVINDEX_<prefix with dots as underscores>
    replicas: int = 1  # copies of the stream in a NATS cluster (JetStream R1..R5)


class NatsSource:
    def __init__(
        self,
        consumer: Consumer,
        url: str | NatsSettings,
        name: str = "kvindex",
        log: Any = None,
        on_reconnect: Callable[[], None] | None = None,
        jetstream: JetStreamConfig | None = None,
        tap: Callable[[str, bytes, float], None] | None = None,
        on_connection_change: Callable[[], None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.settings = NatsSettings.coerce(url)
        self.url = self.settings.redacted_servers()  # for logs: no secret
        self.name = name
        self.log = log or structlog.get_logger("kvindex.nats")
        self.nc: Client | None = None
        self._head = consumer.subjects.prefix + "."
        self._head_len = len(self._head)
        self.direct: direct_dispatch.DirectParser | None = None  # the short path's counters
        self.reconnects = 0
        self._on_reconnect_hook = on_reconnect
        self.jetstream = jetstream
        self.stream = ""
        self.caught_up = jetstream is None
        # Called with (subject, payload, receive wall time) for every events/heartbeat message, just
        # before the consumer gets it: event-log capture (kvindex/capture) records here.
        self.tap = tap
        # Called when the connection drops or comes back (the service re-evaluates readiness).
        self.on_connection_change = on_connection_change
        self._closing = False  # stop() began: the disconnection that follows is ours

    async def connect(self) -> None:
        """Connect only (a shard front: it consumes nothing, kvindex/shards/front.py)."""
        self.nc = await nats_connect(
            self.settings,
            name=self.name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )

    async def start(self) -> None:
        await self.connect()
        assert self.nc is not None
        if self.jetstream is not None:
            await self._start_jetstream(self.jetstream)
            return
        sub = await self.nc.subscribe(
            self._head + ">",
            cb=self._on_msg,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )
        self.direct = direct_dispatch.install(self.nc, sub, self._on_raw, self.log)
        await self.nc.flush()
        self.log.info(
            "nats_subscribed", url=self.url, subject=self._head + ">", direct=self.direct is not None
        )

    async def _ensure_stream(self, js: Any, config: StreamConfig) -> Any:
        """Create or update the stream. A cluster still forming (a node just started, peers not yet
        known to the meta leader, a node restarting) answers "no suitable peers for placement" for a
        replicated stream, or nothing in time: that is retried for a while instead of failing the start."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _PLACEMENT_WAIT
        while True:
            try:
                try:
                    await js.stream_info(self.stream)
                    return await js.update_stream(config)
                except NotFoundError:
                    return await js.add_stream(config)
            except (BadRequestError, ServiceUnavailableError, NatsTimeoutError) as exc:
                forming = not isinstance(exc, BadRequestError) or exc.err_code == _NO_PLACEMENT
                if not forming or loop.time() > deadline:
                    raise
                self.log.warning("jetstream_placement_waiting", stream=self.stream, error=str(exc))
                await asyncio.sleep(0.25)

    async def _start_jetstream(self, cfg: JetStreamConfig) -> None:
        assert self.nc is not None
        prefix = self.consumer.subjects.prefix
        self.stream = cfg.stream or "KVINDEX_" + prefix.replace(".", "_")
        events = f"{prefix}.{EVENTS}.>"
        js = self.nc.jetstream()
        config = StreamConfig(
            name=self.stream,
            subjects=[events],
            max_age=cfg.max_age,
            max_bytes=cfg.max_bytes,
            storage=StorageType.FILE,
            num_replicas=cfg.replicas,
        )
        info = await self._ensure_stream(js, config)
        # Until the stream is read to its end, heartbeats are ahead of the batches being replayed.
        self.caught_up = info.state.messages == 0
        self.consumer.set_heartbeat_order(drive_repairs=self.caught_up, in_order=False)
        sub = await self.nc.subscribe(
            self._head + HEARTBEAT + ".*",
            cb=self._on_msg,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )
        # Heartbeats only: the stream's messages carry JetStream metadata and flow control that
        # only nats-py's own path handles.
        self.direct = direct_dispatch.install(self.nc, sub, self._on_raw, self.log)
        await js.subscribe(
            events,
            stream=self.stream,
            cb=self._on_stream_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )
        await self.nc.flush()
        self.log.info(
            "jetstream_subscribed", url=self.url, stream=self.stream, retained_batches=info.state.messages
        )

    async def _on_stream_msg(self, msg: Msg) -> None:
        if self.tap is not None:
            self.tap(msg.subject, msg.data, time.time())
        self.consumer.on_events(msg.subject, msg.data)
        if not self.caught_up and msg.metadata.num_pending == 0:
            self.caught_up = True
            self.consumer.set_heartbeat_order(drive_repairs=True, in_order=False)
            self.log.info("jetstream_caught_up", stream=self.stream, stream_seq=msg.metadata.sequence.stream)

    async def _on_msg(self, msg: Msg) -> None:
        """nats-py's ordinary delivery: messages that could not take the direct path (see
        kvindex/ingest/direct_dispatch.py), or all of them when it is unavailable."""
        self._on_raw(msg.subject, msg.data)

    def _on_raw(self, subject: str, payload: bytes) -> None:
        kind = subject[self._head_len :].partition(".")[0]
        if self.tap is not None and kind in (EVENTS, HEARTBEAT):
            self.tap(subject, payload, time.time())
        if kind == EVENTS:
            self.consumer.on_events(subject, payload)
        elif kind == HEARTBEAT:
            self.consumer.on_heartbeat(subject, payload)
        # snapshot/replay requests between other parties are not ours to handle.

    async def _on_error(self, exc: Exception) -> None:
        # Our own orderly close (stop) is expected: info. Anything else is worth a warning.
        say = self.log.info if self._closing else self.log.warning
        say("nats_error", error=str(exc), error_type=type(exc).__name__, closing=self._closing)

    async def _on_disconnected(self) -> None:
        say = self.log.info if self._closing else self.log.warning
        say("nats_disconnected", url=self.url, closing=self._closing)
        if self.on_connection_change is not None:
            self.on_connection_change()

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        server = self.nc.connected_url if self.nc is not None else None
        self.log.info("nats_reconnected", url=redact_url(server.geturl()) if server else self.url)
        if self.on_connection_change is not None:
            self.on_connection_change()
        # With JetStream the ordered consumer resumes where it was: nothing was lost.
        if self._on_reconnect_hook is not None and self.jetstream is None:
            self._on_reconnect_hook()

    async def stop(self, timeout: float = 2.0) -> None:
        """Drain and close within ``timeout`` whatever the connection's state (kvindex/lifecycle)."""
        self._closing = True
        nc, self.nc = self.nc, None
        await close_nats(nc, timeout, log=self.log)
