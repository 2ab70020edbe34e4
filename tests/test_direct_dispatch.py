"""The short path from nats-py's parser to the consumer (kvindex/ingest/direct_dispatch.py).

A real nats-server and real nats-py clients for the stream as it comes off a socket (split reads,
headers, other subscriptions, request/reply on the same connection); a parser fed by hand for every
split point of a byte stream and for the queue-ordering rule.
"""

from __future__ import annotations

import asyncio
import os

import nats
import pytest

from kvindex.ingest import direct_dispatch
from kvindex.ingest.direct_dispatch import DirectParser, install
from kvindex.service.natsd import EmbeddedNats


@pytest.fixture(autouse=True, params=["c", "python"])
def frame_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the C frame loop (kvindex/ingest/_frames.pyx) and with the Python one (what
    an install without a compiler runs)."""
    if request.param == "python":
        monkeypatch.setattr(direct_dispatch, "_scan", None)
    else:
        assert direct_dispatch._scan is not None, "the C frame loop was not built"
    return request.param


# -- against a real server ------------------------------------------------------------------------


@pytest.fixture
def natsd(nats_server: EmbeddedNats) -> EmbeddedNats:
    """tests/conftest.py's nats-server (a test here kills and restarts it)."""
    return nats_server


def _payload(i: int) -> bytes:
    # Sizes from empty to larger than nats-py's read buffer, so frames arrive split across reads;
    # CRLF inside payloads must not confuse the frame boundaries.
    size = (0, 1, 17, 300, 4_000, 70_000)[i % 6]
    return (f"{i}:".encode() + b"\r\nMSG x 1 2\r\n" * (size // 12 + 1))[:size] if size else b""


async def test_messages_arrive_once_in_order_through_both_paths(natsd: EmbeddedNats) -> None:
    sub_nc = await nats.connect(natsd.url)
    pub_nc = await nats.connect(natsd.url)
    seen: list[tuple[str, str, bytes]] = []
    others: list[bytes] = []

    async def cb(msg) -> None:  # the library's path: frames with headers, or queued behind one
        seen.append(("cb", msg.subject, msg.data))

    def raw(subject: str, payload: bytes) -> None:
        seen.append(("direct", subject, payload))

    async def other_cb(msg) -> None:
        others.append(msg.data)

    async def responder(msg) -> None:
        await msg.respond(b"pong:" + msg.data)

    sub = await sub_nc.subscribe("t.>", cb=cb)
    parser = install(sub_nc, sub, raw)
    assert isinstance(parser, DirectParser)
    await sub_nc.subscribe("other.>", cb=other_cb)
    await pub_nc.subscribe("svc", cb=responder)
    await sub_nc.flush()
    await pub_nc.flush()

    sent: list[tuple[str, bytes]] = []
    for i in range(1_200):
        subject, data = f"t.{i % 7}.w{i}", _payload(i)
        if i % 97 == 0:
            await pub_nc.publish(subject, data, headers={"k": str(i)})
        else:
            await pub_nc.publish(subject, data)
        sent.append((subject, data))
        if i % 50 == 0:
            await pub_nc.publish("other.x", str(i).encode())
            # A request/reply on the subscribing connection, in the middle of the stream.
            reply = await sub_nc.request("svc", str(i).encode(), timeout=5)
            assert reply.data == b"pong:" + str(i).encode()
    await pub_nc.flush()
    for _ in range(500):
        if len(seen) == len(sent):
            break
        await asyncio.sleep(0.01)
    assert [(s, d) for _, s, d in seen] == sent  # exactly once, in the order published
    paths = {p for p, _, _ in seen}
    assert paths == {"cb", "direct"}, paths
    assert parser.direct_msgs > 1_000
    assert parser.library_frames >= 1_200 // 97  # the frames with headers went the library's way
    assert len(others) == 24
    assert parser.handler_errors == 0
    await pub_nc.close()
    await sub_nc.close()


async def test_a_failing_handler_is_counted_and_reading_goes_on(natsd: EmbeddedNats) -> None:
    nc = await nats.connect(natsd.url)
    got: list[str] = []

    def raw(subject: str, payload: bytes) -> None:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        got.append(subject)

    async def cb(msg) -> None:
        got.append(msg.subject)

    sub = await nc.subscribe("t.>", cb=cb)
    parser = install(nc, sub, raw)
    assert parser is not None
    await nc.flush()
    for i, data in enumerate([b"a", b"boom", b"c"]):
        await nc.publish(f"t.{i}", data)
    await nc.flush()
    for _ in range(200):
        if len(got) == 2:
            break
        await asyncio.sleep(0.01)
    assert got == ["t.0", "t.2"]
    assert parser.handler_errors == 1
    assert nc.is_connected
    await nc.close()


async def test_reconnect_keeps_the_short_path(natsd: EmbeddedNats) -> None:
    port = natsd.port
    nc = await nats.connect(natsd.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1)
    got: list[bytes] = []

    async def cb(msg) -> None:
        got.append(msg.data)

    sub = await nc.subscribe("t.>", cb=cb)
    parser = install(nc, sub, lambda s, p: got.append(p))
    assert parser is not None
    await nc.publish("t.a", b"1")
    await nc.flush()
    for _ in range(200):  # delivered before the server goes away
        if got:
            break
        await asyncio.sleep(0.01)
    await natsd.kill()
    restarted = EmbeddedNats(port=port)
    await restarted.start()
    try:
        for _ in range(200):
            if nc.is_connected and not nc.is_reconnecting:
                break
            await asyncio.sleep(0.05)
        before = parser.direct_msgs
        await nc.publish("t.b", b"2")
        await nc.flush()
        for _ in range(200):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        assert got == [b"1", b"2"]
        assert nc._ps is parser and parser.direct_msgs == before + 1
        await nc.close()
    finally:
        await restarted.stop()


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
