"""Moves routing-sync messages over NATS: publishes this replica's on ``{prefix}.routing.{id}`` and
feeds every replica's (``{prefix}.routing.*``) to RoutingSync, which drops its own echo.

It uses the service's NATS connection (same servers, credentials and TLS) with a subscription of
its own. Publishing runs on one task woken when decisions are queued: it packs what accumulated
while the event loop was busy into one message, so a burst of Score calls costs few messages and a
lone decision goes out on the next loop turn (no timer). Best effort: while NATS is away nats-py
buffers what it can; beyond that messages are dropped and counted (``publish_error``), and peers see
the hole in ``seq`` (``lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvindex.routing_sync.sync import RoutingSync
from kvindex.wire.subjects import ROUTING, Subjects

_PENDING_MSGS = 100_000
_PENDING_BYTES = 256 << 20


class NatsRoutingLink:
    def __init__(self, sync: RoutingSync, subjects: Subjects, log: Any = None) -> None:
        self.sync = sync
        self.subjects = subjects
        self.subject = subjects.routing(sync.replica_id)
        self._head = f"{subjects.prefix}.{ROUTING}."
        self.log = log or structlog.get_logger("kvindex.routing_sync")
        self.nc: Client | None = None
        self._sub: Any = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error_logged = 0.0

    async def start(self, nc: Client) -> None:
        self.nc = nc
        if nc.max_payload:
            self.sync.max_message_bytes = min(self.sync.max_message_bytes, nc.max_payload // 2)
        self._sub = await nc.subscribe(
            self._head + "*",
            cb=self._on_msg,
            pending_msgs_limit=_PENDING_MSGS,
            pending_bytes_limit=_PENDING_BYTES,
        )
        await nc.flush()
        self.sync.wake = self._wake.set
        self._task = asyncio.create_task(self._run(), name="kvindex-routing-sync")
        if self.sync.pending():
            self._wake.set()
        self.log.info(
            "routing_sync_started", replica=self.sync.replica_id, epoch=self.sync.epoch, subject=self.subject
        )

    async def _on_msg(self, msg: Msg) -> None:
        self.sync.receive(msg.subject[len(self._head) :], msg.data)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.publish_pending()

    async def publish_pending(self) -> None:
        assert self.nc is not None
        while (taken := self.sync.take()) is not None:
            payload, n_ops = taken
            try:
                await self.nc.publish(self.subject, payload)
            except Exception as exc:  # disconnected beyond nats-py's buffer, closed, too large
                self.sync.publish_failed(n_ops)
                now = asyncio.get_running_loop().time()
                if now - self._error_logged >= 60.0:
                    self._error_logged = now
                    self.log.warning("routing_sync_publish_failed", error=str(exc) or type(exc).__name__)

    async def stop(self) -> None:
        self.sync.wake = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.publish_pending()  # the last decisions, best effort
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
        self._sub = None
