"""The short path from nats-py's parser to the consumer (kvindex/ingest/direct_dispatch.py), against
a real nats-server and real nats-py clients: the stream as it comes off a socket (split reads, headers,
other subscriptions, request/reply on the same connection), with the C and the Python frame loop. The
parser fed by hand: tests/unit/test_direct_dispatch.py.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvindex.ingest.direct_dispatch import DirectParser, install
from kvindex.service.natsd import EmbeddedNats
from tests.unit.test_direct_dispatch import frame_loop  # noqa: F401 (autouse: both frame loops)

# -- against a real server ------------------------------------------------------------------------


@pytest.fixture
def natsd(nats_server: EmbeddedNats) -> EmbeddedNats:
    """tests/integration/conftest.py's nats-server (a test here kills and restarts it)."""
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
