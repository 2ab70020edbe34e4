"""Calling the servicer's handlers in the same process, without gRPC: what they use of a
``grpc.aio.ServicerContext`` (``abort``), and running a handler that never suspends to its result.
The in-process client (kvindex/client/local.py) and the replay (kvindex/capture/replay.py) call
the servicer this way."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, NoReturn

import grpc


class Aborted(Exception):
    """A handler's ``context.abort``: the status gRPC would have answered."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class InProcessContext:
    """What the servicer's unary methods use of a ``grpc.aio.ServicerContext``: abort raises."""

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise Aborted(code, details)


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the servicer's handlers) to its result."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("servicer call suspended; it cannot run outside an event loop")
