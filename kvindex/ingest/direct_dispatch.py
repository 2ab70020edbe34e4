"""Hands our own subscription's messages straight from nats-py's parser to a plain function.

Why: nats-py delivers each message through a regex match, a ``Msg`` object, an ``asyncio.Queue``
and a task switch into an ``async`` callback: about 5.7 us of CPU per message on the reference VM,
which is 9 % of a core for the 16.4 K heartbeats per second of an 8,192-instance fleet before the
index has looked at one of them. The consumer needs only (subject, payload) and never awaits, so
for the index's own subscription the parser below splits ``MSG`` frames itself and calls the
handler synchronously, in stream order, from nats-py's read loop.

How it stays correct:
- Only plain ``MSG`` frames of a registered subscription take the short path, and only while that
  subscription's pending queue is empty. Anything else (PING, INFO, -ERR, HMSG, other
  subscriptions' messages such as repair replies) is handed, one frame at a time, to nats-py's own
  parser, so the library's semantics are untouched. A frame of ours that had to go the library's
  way (queued behind a message already queued) keeps every later one on that way until the queue
  is empty: the order a worker published in is the order the consumer sees.
- An incomplete frame waits in the buffer for the next read, as nats-py's parser does.
- The handler must not raise (the consumer never does); if it does anyway the error is logged with
  the message's subject (it names the worker) and reading goes on: an exception in nats-py's read
  loop would stop the connection's reading.
- It relies on three internals of nats-py (the client's ``_ps`` parser, the parser's ``buf`` and
  ``state``, a subscription's ``_pending_queue``). ``install`` checks them and returns None when
  they are not as expected, and the subscription then works the ordinary way (logged once).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, cast

import structlog

try:  # the frame loop in C (optional: without a compiler the Python loop below runs)
    from kvindex.ingest._frames import scan as _scan
except ImportError:  # pragma: no cover - built without a compiler
    _scan = None

try:  # the internals this relies on (checked again in ``install``)
    from nats.protocol import parser as _np
except ImportError:  # pragma: no cover - nats-py moved its parser: the ordinary path is used
    _np = None  # type: ignore[assignment]

Handler = Callable[[str, bytes], None]

_CRLF = b"\r\n"
_MSG = b"MSG "
_HMSG = b"HMSG "


class _Target:
    __slots__ = ("backlog", "handler", "queue", "sub")

    def __init__(self, sub: Any, handler: Handler) -> None:
        self.sub = sub
        self.handler = handler
        self.queue = sub._pending_queue
        # The queue's own deque when it has one (asyncio.Queue does): its truth value is a C-level
        # length check, a tenth of a qsize() call, paid on every message.
        backlog = getattr(self.queue, "_queue", None)
        self.backlog = backlog if isinstance(backlog, collections.deque) else _Sized(self.queue)


class _Sized:
    """Truthy while the queue holds messages (for a queue without the usual deque)."""

    __slots__ = ("queue",)

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __bool__(self) -> bool:
        return bool(self.queue.qsize())


def _frame_end(data: bytes, pos: int, eol: int) -> int:
    """Where the frame whose control line ends at ``eol`` ends (past its payload's CRLF)."""
    if data.startswith(_MSG, pos) or data.startswith(_HMSG, pos):
        return eol + 2 + int(data[pos:eol].split()[-1]) + 2  # total size is the line's last field
    return eol + 2


if _np is not None:

    class DirectParser(_np.Parser):
        """nats-py's parser with a short path for the registered subscriptions' ``MSG`` frames."""

        # Set by _init_direct (also on a parser whose class is switched to this one, in install).
        direct: dict[bytes, _Target]
        log: Any
        direct_msgs: int
        library_frames: int
        handler_errors: int

        def __init__(self, nc: Any = None) -> None:
            super().__init__(nc)
            _init_direct(self, structlog.get_logger("kvindex.nats"))

        async def parse(self, data: bytes = b"") -> None:
            if self.state != _np.AWAITING_CONTROL_LINE or not self.direct:
                await super().parse(data)
                return
            buf = self.buf
            buf.extend(data)
            whole = bytes(buf)  # one copy per read; slices of bytes are bytes (hashable, no copies back)
            n = len(whole)
            pos = 0
            direct = self.direct
            find, startswith = whole.find, whole.startswith
            taken = 0
            try:
                while pos < n:
                    if _scan is not None:
                        pos, k, more = _scan(whole, pos, direct, self._failed)
                        taken += k
                        if not more:
                            break  # the end, or a frame still incomplete
                        # A frame for the library (or malformed) at pos: the loop below, once.
                    eol = find(_CRLF, pos)
                    if eol < 0:
                        if n - pos > _np.MAX_CONTROL_LINE_SIZE:
                            await self._library(whole, pos, n)  # raises the library's ProtocolError
                            pos = n
                        break
                    if startswith(_MSG, pos):
                        parts = whole[pos + 4 : eol].split()
                        target = direct.get(parts[1]) if len(parts) in (3, 4) else None
                        if target is not None and not target.backlog and parts[-1].isdigit():
                            start = eol + 2
                            stop = start + int(parts[-1])
                            if stop + 2 > n:
                                break  # the payload is still on its way
                            pos = stop + 2
                            taken += 1
                            subject = parts[0].decode(errors="replace")
                            try:
                                target.handler(subject, whole[start:stop])
                            except Exception as exc:  # never let it stop nats-py's read loop
                                self._failed(exc, subject)
                            continue
                    try:
                        end = _frame_end(whole, pos, eol)
                    except ValueError:
                        end = n  # malformed: nats-py's parser says how
                    if end > n:
                        break
                    await self._library(whole, pos, end)
                    pos = end
            finally:
                self.direct_msgs += taken
                self.buf = buf
                del buf[:pos]

        def _failed(self, exc: Exception, subject: str | None = None) -> None:
            # The subject names the worker (its last token) even when the payload could not be read.
            self.handler_errors += 1
            self.log.error("direct_dispatch_handler_failed", subject=subject, error=repr(exc))

        async def _library(self, whole: bytes, start: int, end: int) -> None:
            """nats-py's own parsing of whole[start:end] (complete frames), on a buffer of their own."""
            self.library_frames += 1
            self.buf = bytearray(whole[start:end])
            await super().parse(b"")
            if self.buf or self.state != _np.AWAITING_CONTROL_LINE:
                raise _np.ProtocolError("nats: a frame did not end where its control line said")

else:  # pragma: no cover
    DirectParser = None  # type: ignore[misc]


def _init_direct(ps: Any, log: Any) -> None:
    ps.direct = {}
    ps.log = log
    ps.direct_msgs = 0  # messages that took the short path
    ps.library_frames = 0  # frames handed to nats-py's own parser
    ps.handler_errors = 0


def install(nc: Any, sub: Any, handler: Handler, log: Any = None) -> DirectParser | None:
    """Route ``sub``'s plain messages to ``handler(subject, payload)`` from the parser; the
    returned parser (shared by every subscription of ``nc`` installed this way) has counters.
    None when nats-py's internals are not what this relies on: ``sub`` then keeps its callback."""
    log = log or structlog.get_logger("kvindex.nats")
    ps = getattr(nc, "_ps", None)
    if (
        DirectParser is None
        or ps is None
        or not isinstance(ps, _np.Parser)
        or not isinstance(getattr(ps, "buf", None), bytearray)
        or not hasattr(sub, "_pending_queue")
        or not hasattr(sub, "_id")
    ):
        log.warning("nats_direct_dispatch_unavailable", reason="nats-py internals differ")
        return None
    if not isinstance(ps, DirectParser):
        # Same object, new behaviour: a parse in progress keeps its buffer and state.
        ps.__class__ = DirectParser
        _init_direct(ps, log)
    parser = cast("DirectParser", ps)  # (one already, or its class switched just above)
    parser.direct[str(sub._id).encode()] = _Target(sub, handler)
    return parser
