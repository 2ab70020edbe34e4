"""Running an entry point until it is asked to stop, and making sure it then ends.

``run(main, grace=...)`` replaces ``asyncio.run(main())`` for every long-running entry point
(``kvindex serve``, ``kvindex capture``, ``kvshim`` bridges, ``kvsim``, the demo):

- SIGTERM, SIGINT and SIGHUP request a stop, and so does the parent process exiting (its pid is
  polled: a process started by ``make run`` or a test harness must not outlive it). SIGHUP is left
  alone when it was ignored at start (``nohup``): then the parent is not watched either, since the
  user asked the process to outlive its terminal. Started by init (parent pid 1), nothing is watched.
- ``main(stop)`` sees the request through ``stop``: ``await stop.wait()`` while serving, and
  ``await stop.run_or_stop(start())`` around a start that can block (connecting to a NATS server
  that is down retries for ever): a request cancels it, repeatedly if the cancellation is lost.
- From the request on, ``main`` has ``grace`` seconds to return (its clean shutdown); then it is
  cancelled; ``force_after`` seconds after the request the process exits (code 1) whatever still
  runs, from a watchdog thread, even if the event loop itself is stuck.
- After ``main`` returns, leftover tasks are cancelled with a bound, unlike ``asyncio.run``, which
  waits for them for ever (a third-party task that loses its cancellation must not keep the process
  alive).

Exit code: what ``main`` returns (None: 0), 1 if it raised or had to be forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from kvindex.lifecycle.bounded import finish

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PARENT_POLL = 0.25  # seconds between checks that the parent is still there


class Stop:
    """A stop request: why (``reason``: the signal's name or ``parent_exited``) and when."""

    def __init__(self) -> None:
        self.reason = ""
        self._event = asyncio.Event()
        self._listeners: list[Callable[[str], Any]] = []

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str) -> None:
        if self._event.is_set():
            return
        self.reason = reason
        self._event.set()
        for listener in self._listeners:
            listener(reason)

    def on_request(self, listener: Callable[[str], Any]) -> None:
        """Call ``listener(reason)`` at the request (synchronously: e.g. flip readiness at once)."""
        self._listeners.append(listener)

    async def wait(self) -> str:
        await self._event.wait()
        return self.reason

    async def run_or_stop(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None if a stop was requested first (then the work is cancelled).

        Errors of ``work`` propagate. The cancellation is repeated until the work ends: nats-py
        connecting to an unreachable server can lose one (see nats_close.py).
        """
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not task.done():
                while not await finish([task], 1.0):
                    pass  # the run() deadline bounds this loop
        if task.cancelled():
            return None
        return task.result()  # or raise its error


def _sighup_ignored() -> bool:
    return signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def run(
    main: Callable[[Stop], Awaitable[int | None]],
    *,
    grace: float = 10.0,
    force_after: float | None = None,
    name: str = "kvindex",
    watch_parent: bool = True,
    log: Any = None,
) -> int:
    """Run ``main(stop)`` on a new event loop (see the module docstring); returns the exit code."""
    log = log or structlog.get_logger("kvindex.lifecycle")
    force_after = grace + 3.0 if force_after is None else force_after
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    handled = [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and _sighup_ignored())]
    stop = Stop()
    outcome: dict[str, Any] = {"forced": False}
    helpers: set[asyncio.Task[Any]] = set()  # strong references to our own background tasks

    def on_request(reason: str) -> None:
        log.info("stop_requested", process=name, reason=reason, grace=grace)
        loop.call_later(grace, overdue)
        watchdog = threading.Timer(force_after, _force_exit, args=(name, force_after))
        watchdog.daemon = True
        watchdog.start()

    def overdue() -> None:
        if not main_task.done():
            outcome["forced"] = True
            log.warning("shutdown_grace_exceeded", process=name, grace=grace)
            helpers.add(loop.create_task(finish([main_task], max(force_after - grace - 0.5, 0.1))))

    stop.on_request(on_request)

    async def body() -> int | None:
        for sig in handled:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.request, signal.Signals(sig).name)
        if watch_parent and signal.SIGHUP in handled and os.getppid() != 1:
            helpers.add(loop.create_task(_watch_parent(stop, os.getppid()), name="kvindex-parent-watch"))
        return await main(stop)

    main_task = loop.create_task(body(), name=f"{name}-main")
    code = 0
    try:
        try:
            result = loop.run_until_complete(main_task)
            code = int(result or 0)
        except asyncio.CancelledError:
            code = 1
        except Exception as exc:
            log.error("process_failed", process=name, error=str(exc), error_type=type(exc).__name__)
            code = 1
        except KeyboardInterrupt:  # a SIGINT before the handlers were installed
            code = 130
        if outcome["forced"]:
            code = 1
    finally:
        for sig in handled:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        _close_loop(loop)
    return code


async def _watch_parent(stop: Stop, parent: int) -> None:
    while not stop.requested:
        await asyncio.sleep(PARENT_POLL)
        if os.getppid() != parent:
            stop.request("parent_exited")


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Like asyncio.run's cleanup, but bounded: leftover tasks get a second to end, then are left."""
    try:
        leftover = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if leftover:
            loop.run_until_complete(finish(leftover, 1.0))
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 1.0))
        executor = getattr(loop, "_default_executor", None)
        if executor is not None:  # threads stuck in blocking calls must not hold the exit either
            executor.shutdown(wait=False, cancel_futures=True)
    finally:
        asyncio.set_event_loop(None)
        with contextlib.suppress(Exception):
            loop.close()


def _force_exit(name: str, after: float) -> None:
    sys.stderr.write(f"{name}: still running {after:.1f} s after the stop request; exiting now\n")
    sys.stderr.flush()
    os._exit(1)
