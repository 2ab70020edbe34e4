"""Feeds the consumer from NATS: one subscription on ``{prefix}.>`` for events and heartbeats.

One subscription, not one per kind, because nats-py runs each subscription's callbacks on its own
task: with two, a worker's heartbeat could be handled before the event batch it was published
after, and the heartbeat's seq would look like a lost batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvindex.ingest.consumer import Consumer
from kvindex.wire.subjects import EVENTS, STATUS

# Generous client-side buffer: a burst must wait in memory rather than be dropped as a slow consumer.
_PENDING_MSGS = 1_000_000
_PENDING_BYTES = 1 << 30


class NatsSource:
    def __init__(
        self,
        consumer: Consumer,
        url: str,
        name: str = "kvindex",
        log: Any = None,
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.url = url
        self.name = name
        self.log = log or structlog.get_logger("kvindex.nats")
        self.nc: Client | None = None
        self._head = consumer.subjects.prefix + "."
        self.reconnects = 0
        self._on_reconnect_hook = on_reconnect

    async def start(self) -> None:
        self.nc = await nats.connect(
            self.url,
            name=self.name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        await self.nc.subscribe(
            self._head + ">",
            cb=self._on_msg,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )
        await self.nc.flush()
        self.log.info("nats_subscribed", url=self.url, subject=self._head + ">")

    async def _on_msg(self, msg: Msg) -> None:
        subject = msg.subject
        kind = subject[len(self._head) :].partition(".")[0]
        if kind == EVENTS:
            self.consumer.on_events(subject, msg.data)
        elif kind == STATUS:
            self.consumer.on_status(subject, msg.data)
        # snapshot/replay requests between other parties are not ours to handle.

    async def _on_error(self, exc: Exception) -> None:
        self.log.warning("nats_error", error=str(exc), error_type=type(exc).__name__)

    async def _on_disconnected(self) -> None:
        self.log.warning("nats_disconnected", url=self.url)

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        self.log.info("nats_reconnected", url=self.url)
        if self._on_reconnect_hook is not None:
            self._on_reconnect_hook()

    async def stop(self) -> None:
        if self.nc is not None:
            nc, self.nc = self.nc, None
            if nc.is_closed:
                return
            try:
                await nc.drain()
            except Exception:  # reconnecting or already gone: nothing left to drain
                await nc.close()
