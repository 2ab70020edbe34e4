"""Closing a nats-py connection in bounded time, whatever state it is in (issue 15).

With ``max_reconnect_attempts=-1`` nats-py reconnects forever in a background task, and only
cancelling that task stops it. ``Client.close()`` cancels it, waits ``reconnect_time_wait`` for it,
and returns either way. On Python 3.11 the cancellation can be lost: nats-py opens the TCP connection
inside ``asyncio.wait_for``, which returns the inner result instead of raising ``CancelledError``
when the cancellation arrives just as the connection attempt fails (server gone: refused), and
nats-py's server-selection loop catches that error and tries again, never checking that the client
was closed. The loop then retries every ``reconnect_time_wait`` for ever, and ``asyncio.run`` waits
for it at exit: the process never ends. ``drain()`` has its own trap: when the server vanishes while
draining, it waits up to ``drain_timeout`` (30 s) and then a 10 s flush, and it swallows the
cancellation that would end the wait.

So here: drain only a connected client, in its own task and for part of the budget; close, also in
its own task; then cancel nats-py's background tasks again and again until they end (a lost
cancellation is followed by another one), with an empty server pool so that a reconnect loop that
still runs ends on its own at its next attempt (nats-py closes itself when no server is left).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from kvindex.lifecycle.bounded import finish

# nats-py's background tasks (private attributes of nats.aio.client.Client; read defensively).
_TASKS = ("_reconnection_task", "_reading_task", "_ping_interval_task", "_flusher_task")


def _background_tasks(nc: Any) -> list[asyncio.Future[Any]]:
    tasks = [getattr(nc, name, None) for name in _TASKS]
    for sub in list(getattr(nc, "_subs", {}).values()):
        tasks.append(getattr(sub, "_wait_for_msgs_task", None))
    return [t for t in tasks if isinstance(t, asyncio.Future) and not t.done()]


async def close_nats(nc: Any, timeout: float = 2.0, *, drain: bool = True, log: Any = None) -> bool:
    """Drain (if connected and ``drain``) and close ``nc``, and make sure nothing of it keeps running.

    Returns within about ``timeout`` seconds whatever the connection's state (connected,
    reconnecting, closed, server gone mid-drain). True when every background task of the client
    ended; False when one had to be left behind (logged).
    """
    if nc is None:
        return True
    log = log or structlog.get_logger("kvindex.lifecycle")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    helpers: list[asyncio.Future[Any]] = []
    if drain and nc.is_connected:
        task = asyncio.ensure_future(nc.drain())
        helpers.append(task)
        await asyncio.wait({task}, timeout=timeout / 2)
    if not nc.is_closed:
        task = asyncio.ensure_future(nc.close())
        helpers.append(task)
        await asyncio.wait({task}, timeout=max(deadline - loop.time(), 0.05))
    with contextlib.suppress(Exception):  # no server left: a reconnect loop still running closes itself
        nc._server_pool.clear()
    left = [*(h for h in helpers if not h.done()), *_background_tasks(nc)]
    ended = await finish(left, max(deadline - loop.time(), 0.2))
    for helper in helpers:  # retrieve outcomes so that none is reported as never retrieved
        if helper.done() and not helper.cancelled():
            helper.exception()
    if not ended:
        log.warning("nats_close_incomplete", left=[t.get_name() for t in left if not t.done()])  # type: ignore[attr-defined]
    return ended
