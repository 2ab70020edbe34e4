"""The short path from nats-py's parser to the consumer (kvindex/ingest/direct_dispatch.py): a parser
fed by hand for every split point of a byte stream and for the queue-ordering rule, with the C and the
Python frame loop. Against a real nats-server: tests/integration/test_direct_dispatch.py.
"""

from __future__ import annotations

import asyncio
import os

import nats
import pytest
import structlog.testing

from kvindex.ingest import direct_dispatch
from kvindex.ingest.direct_dispatch import DirectParser, install


@pytest.fixture(autouse=True, params=["c", "python"])
def frame_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the C frame loop (kvindex/ingest/_frames.pyx) and with the Python one (what
    an install without a compiler runs)."""
    if request.param == "python":
        monkeypatch.setattr(direct_dispatch, "_scan", None)
    else:
        assert direct_dispatch._scan is not None, "the C frame loop was not built"
    return request.param


def test_install_declines_when_the_library_is_not_what_it_expects() -> None:
    class Sub:
        _id = 1

    class Client:
        _ps = object()

    assert install(Client(), Sub(), lambda s, p: None) is None
    assert install(object(), Sub(), lambda s, p: None) is None


# -- the parser fed by hand ---------------------------------------------------------------------------


class _Sub:
    def __init__(self, sid: int) -> None:
        self._id = sid
        self._pending_queue: asyncio.Queue = asyncio.Queue()


class _Client:
    """What nats-py's parser calls on its client, recorded."""

    def __init__(self, subs: dict[int, _Sub]) -> None:
        self._subs = subs
        self.calls: list[tuple] = []

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        self.calls.append(("msg", sid, subject.decode(), data, headers))
        sub = self._subs.get(sid)
        if sub is not None:
            sub._pending_queue.put_nowait((subject.decode(), data))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, err) -> None:
        self.calls.append(("err", err))


def _stream() -> tuple[bytes, list[tuple[str, bytes]]]:
    ours = [("a.1", b"x"), ("a.2", b""), ("a.3", b"hello\r\nMSG a.9 1 3\r\nabc"), ("a.4", b"y" * 50)]
    wire = (
        b"MSG a.1 1 1\r\nx\r\n"
        b"PING\r\n"
        b"MSG a.2 1 0\r\n\r\n"
        b"MSG other 2 5\r\nhello\r\n"
        b'INFO {"server_id":"s"}\r\n'
        b"MSG a.3 1 _INBOX.r 23\r\nhello\r\nMSG a.9 1 3\r\nabc\r\n"
        b"+OK\r\n"
        b"MSG a.4 1 50\r\n" + b"y" * 50 + b"\r\n"
    )
    return wire, ours


def _recording(mine: _Sub, *others: _Sub) -> tuple[DirectParser, _Client, list[tuple[str, bytes]]]:
    """A parser whose client knows ``mine`` (sid 1, registered for the short path, its messages
    recorded in the returned list) and ``others`` (the library's way)."""
    client = _Client({s._id: s for s in (mine, *others)})
    parser = DirectParser(client)
    got: list[tuple[str, bytes]] = []
    parser.direct[b"1"] = direct_dispatch._Target(mine, lambda s, p: got.append((s, p)))
    return parser, client, got


@pytest.mark.parametrize("cut", range(0, 203))
async def test_every_split_point(cut: int) -> None:
    wire, ours = _stream()
    parser, client, got = _recording(_Sub(1), _Sub(2))
    assert len(wire) == 202  # every split point, both ends included
    await parser.parse(wire[:cut])
    await parser.parse(wire[cut:])
    assert got == ours
    assert [c[0] for c in client.calls] == ["ping", "msg", "info"]
    assert client.calls[1][2:4] == ("other", b"hello")
    assert not parser.buf


async def test_byte_at_a_time() -> None:
    wire, ours = _stream()
    parser, _, got = _recording(_Sub(1), _Sub(2))
    for i in range(len(wire)):
        await parser.parse(wire[i : i + 1])
    assert got == ours


async def test_a_message_queued_keeps_the_next_ones_behind_it() -> None:
    # A message of ours already waiting in the library's queue (e.g. parsed before install): the
    # next ones must queue behind it, not overtake it.
    mine = _Sub(1)
    mine._pending_queue.put_nowait(("a.0", b"early"))
    parser, _, got = _recording(mine)
    await parser.parse(b"MSG a.1 1 1\r\nx\r\nMSG a.2 1 1\r\ny\r\n")
    assert got == []
    assert [mine._pending_queue.get_nowait() for _ in range(3)] == [
        ("a.0", b"early"),
        ("a.1", b"x"),
        ("a.2", b"y"),
    ]
    await parser.parse(b"MSG a.3 1 1\r\nz\r\n")  # the queue is empty again: the short path
    assert got == [("a.3", b"z")]


async def test_a_malformed_frame_is_the_library_s_protocol_error() -> None:
    with pytest.raises(nats.errors.ProtocolError):
        await _recording(_Sub(1))[0].parse(b"MSG a.1 1 notanumber\r\nx\r\n")
    with pytest.raises(nats.errors.ProtocolError):
        await _recording(_Sub(1))[0].parse(b"BOGUS " + os.urandom(8).hex().encode() + b"\r\n")


async def test_a_subject_that_is_not_utf8_reaches_the_handler_replaced() -> None:
    parser, _, got = _recording(_Sub(1))
    await parser.parse(b"MSG a.\xff 1 1\r\nx\r\nMSG a.ok 1 1\r\ny\r\n")
    assert got == [("a.\ufffd", b"x"), ("a.ok", b"y")]


async def test_tabs_and_extra_spaces_in_the_control_line() -> None:
    parser, _, got = _recording(_Sub(1))
    await parser.parse(b"MSG  a.1\t1   _INBOX.x\t 3\r\nabc\r\n")
    assert got == [("a.1", b"abc")]


async def test_a_failing_handler_is_logged_with_its_subject() -> None:
    # The subject names the worker, which a payload that could not be read cannot (issue 32).
    def failing(subject: str, payload: bytes) -> None:
        raise RuntimeError("handler bug")

    with structlog.testing.capture_logs() as logs:
        parser = DirectParser(_Client({1: _Sub(1)}))
        parser.direct[b"1"] = direct_dispatch._Target(_Sub(1), failing)
        await parser.parse(b"MSG kvindex.events.w7 1 1\r\nx\r\n")
    (failed,) = [e for e in logs if e["event"] == "direct_dispatch_handler_failed"]
    assert failed["subject"] == "kvindex.events.w7" and "handler bug" in failed["error"]
    assert parser.handler_errors == 1
