"""Waiting for work with a deadline that holds even when the work swallows a cancellation.

``asyncio.wait_for`` and ``asyncio.timeout`` cancel the awaited work and then wait for it to end: a
coroutine that catches the ``CancelledError`` (nats-py's ``drain()`` does, and on Python 3.11
``asyncio.wait_for`` itself loses a cancellation that arrives as its inner future completes) keeps
the caller waiting past its deadline. Here the work runs in its own task, the caller only waits for
it, and an overdue task is cancelled again and again until it ends or the deadline passes; then it
is left behind rather than waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

import structlog

_RETRY = 0.05  # seconds between repeated cancellations of a task that did not end


async def finish(tasks: Iterable[asyncio.Future[Any]], timeout: float) -> bool:
    """Cancel ``tasks`` (again every 50 ms) until all are done or ``timeout`` passes; True if done.

    Use it instead of ``task.cancel(); await task``: a task whose cancellation is lost (a
    ``wait_for`` whose inner future completed at the same moment, on Python 3.11) keeps running its
    loop, and that ``await`` never returns. Errors the tasks ended with are retrieved, not raised.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(_RETRY, remaining))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return not pending


async def bounded(work: Awaitable[Any], timeout: float, what: str, log: Any = None) -> bool:
    """Run ``work`` for at most ``timeout`` seconds (then cancel it, bounded too); True if it completed.

    Errors of the work are logged, not raised: this is for shutdown steps, where one failing step
    must not keep the next ones from running.
    """
    log = log or structlog.get_logger("kvindex.lifecycle")
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(timeout, 0.0))
    except asyncio.CancelledError:
        await finish([task], 0.5)
        raise
    if not done:
        ended = await finish([task], min(1.0, max(timeout, 0.1)))
        log.warning("shutdown_step_overdue", step=what, timeout=round(timeout, 3), abandoned=not ended)
        return False
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("shutdown_step_failed", step=what, error=str(exc) or type(exc).__name__)
        return False
    return not task.cancelled()
