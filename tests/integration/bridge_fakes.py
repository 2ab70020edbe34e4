"""Support for the bridge tests (no tests here): a fake engine speaking real ZMQ, msgspec structs that
mirror each engine's own event definitions, a /metrics page, and helpers that run the real bridge and
read the real index over gRPC.

The fake engine binds an XPUB socket (a PUB that also reports subscriptions, so a test can wait until
the shim is subscribed instead of sleeping) and a ROUTER replay socket that answers like the engines:
``[identity, b"", topic, seq, payload]`` (layout 3, vLLM >= 0.32) or ``[identity, b"", seq, payload]``
(layout 2, older vLLM and SGLang), then the end marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from collections.abc import AsyncIterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.data import vllm_captures
from tests.conftest import wait_until
from workers_shim.bridges import Bridge, BridgeConfig

CAPTURES = vllm_captures()
END = b"\xff" * 8


# -- msgspec mirrors of the engines' structs (vllm/distributed/kv_events.py,
#    sglang/srt/disaggregation/kv_events.py, TensorRT-LLM streaming batches) -------------------------


class VllmStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """Newer vLLM: events are maps tagged with "type"."""

    block_hashes: list[int] | list[bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int] | list[bytes]
    medium: str | None
    group_idx: int | None = None


class VllmCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class OldVllmStored(msgspec.Struct, array_like=True, tag="BlockStored", omit_defaults=True, gc=False):
    """Older vLLM (<= 0.23): tagged arrays, trailing default fields omitted."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class OldVllmRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class OldVllmCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class SgStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    """SGLang: tagged arrays, hashes are the first 8 bytes of a SHA-256 as signed int64."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SgMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SgStoredWithMetadata(SgStored, tag="BlockStored", kw_only=True):
    metadata: SgMetadata


class SgRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class SgCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class SgBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class TrtMmKey(msgspec.Struct, gc=False):
    hash: bytes
    start_offset: int


class TrtStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """TensorRT-LLM streaming events: vLLM-style maps plus locality and per-block mm_keys."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "GPU"
    lora_name: str | None = None
    cache_salt: str | None = None
    locality: str | None = None
    mm_keys: list[list[TrtMmKey]] | None = None


class TrtRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str = "GPU"


class TrtBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int = 0


def encode(batch: Any) -> bytes:
    return msgspec.msgpack.encode(batch)


def signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def fake_hash(*parts: object) -> int:
    """An engine-like 64-bit block hash (the bridge never interprets it)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


# -- the fake engine ------------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, *, topic: bytes = b"kv-events", layout: int = 3, port: int = 0, replay_port: int = 0):
        self.topic = topic
        self.layout = layout
        self.port = port
        self.replay_port = replay_port
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_size = 10_000
        self.answer_replays = True
        self.ignore_next = 0  # leave this many upcoming replay requests unanswered
        self.canned: dict[int, list[list[bytes]]] = {}  # replay start -> exact answer frames
        self.replay_requests: list[int] = []
        self.subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> FakeEngine:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if self.port:
            self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        if self.replay_port:
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        else:
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._serve())]
        return self

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def _watch(self) -> None:
        while True:
            msg = await self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscribed.set()

    async def _serve(self) -> None:
        while True:
            msg = await self.router.recv_multipart()
            ident, start = msg[0], int.from_bytes(msg[-1], "big")
            self.replay_requests.append(start)
            if not self.answer_replays or self.ignore_next > 0:
                self.ignore_next = max(0, self.ignore_next - 1)
                continue
            if start in self.canned:
                for frames in self.canned[start]:
                    await self.router.send_multipart([ident, *frames])
                continue
            for seq, payload in list(self.buffer):
                if seq >= start:
                    seq_b = seq.to_bytes(8, "big")
                    body = [self.topic, seq_b, payload] if self.layout == 3 else [seq_b, payload]
                    await self.router.send_multipart([ident, b"", *body])
            end = [b"", END, b""] if self.layout == 3 else [END, b""]
            await self.router.send_multipart([ident, b"", *end])

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self.subscribed.wait(), timeout)

    async def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Number, buffer and (unless ``send`` is False: a batch lost on the way) publish a batch."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        del self.buffer[: -self.buffer_size]
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        await self.pub.send_multipart(list(frames))

    def restart(self) -> None:
        """The engine process restarted: its counter and replay buffer start over."""
        self.seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


async def rank_engines(n: int, **kwargs: Any) -> list[FakeEngine]:
    """``n`` engines on consecutive ports (rank r at base + r, replay at replay base + r)."""
    import socket

    for _ in range(50):
        with socket.socket() as s1, socket.socket() as s2:
            s1.bind(("127.0.0.1", 0))
            s2.bind(("127.0.0.1", 0))
            base, rbase = s1.getsockname()[1], s2.getsockname()[1]
        if abs(base - rbase) < n or base + n > 65535 or rbase + n > 65535:
            continue
        engines: list[FakeEngine] = []
        try:
            for r in range(n):
                engines.append(await FakeEngine(port=base + r, replay_port=rbase + r, **kwargs).start())
            return engines
        except zmq.ZMQError:
            for engine in engines:
                await engine.close()
    raise RuntimeError("no free consecutive ports")


# -- the real bridge, in process --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_bridge(nats_url: str, *engines: FakeEngine, **kwargs: Any) -> AsyncIterator[Bridge]:
    """The real bridge, in process. With ``engines`` it reads them (rank 0's endpoints, unless
    ``zmq`` / ``replay`` are given) and is yielded once every engine has seen it subscribe."""
    if engines:
        kwargs.setdefault("zmq", engines[0].endpoint)
        kwargs.setdefault("replay", engines[0].replay_endpoint)
    kwargs.setdefault("heartbeat_interval", 0.2)
    kwargs.setdefault("stats_log_interval", 0)
    kwargs.setdefault("replay_timeout", 1.0)
    bridge = Bridge(BridgeConfig(nats_url=nats_url, **kwargs))
    await bridge.start()
    try:
        for engine in engines:
            await engine.wait_subscribed()
        yield bridge
    finally:
        await bridge.stop()


async def settle(bridge: Bridge, service: IndexService, engines: Sequence[FakeEngine] = ()) -> None:
    """Wait until the bridge applied every batch the engines published and the index applied every
    batch the bridge's publishers sent."""
    for engine, link in zip(engines, bridge.links, strict=False):
        await wait_until(
            lambda link=link, engine=engine: link.applied >= engine.seq - 1, what="engine batches applied"
        )
    for rank in bridge.ranks.values():
        assert rank.publisher is not None
        await rank.publisher.flush()

    def done() -> bool:
        for rank in bridge.ranks.values():
            p = rank.publisher
            assert p is not None
            state = service.registry.get((p.worker, p.dp_rank))
            if state is None or state.epoch != p.epoch or state.last_seq < p.seq:
                return False
        return True

    await wait_until(done, what="index caught up with the bridge")


Match = tuple[int, tuple[int, int, int, int]]


async def lookup(stub: pb_grpc.KvIndexStub, model: str, **kw: Any) -> dict[str, Match]:
    reply = await stub.Lookup(pb.LookupRequest(model=model, **kw))
    return {
        m.instance_id: (m.matched_blocks, (m.matched.gpu, m.matched.cpu, m.matched.disk, m.matched.shared))
        for m in reply.matches
    }


async def expect(
    stub: pb_grpc.KvIndexStub, model: str, expected: dict[str, Match], timeout: float = 5.0, **kw: Any
) -> None:
    """Lookup until the index reports ``expected`` (a state reached asynchronously), else fail."""
    deadline = time.monotonic() + timeout
    got = await lookup(stub, model, **kw)
    while got != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        got = await lookup(stub, model, **kw)
    assert got == expected


# -- a /metrics page ------------------------------------------------------------------------------


class MetricsPage:
    """A real HTTP server serving ``text`` on /metrics (set ``text`` to change what it says)."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.hits = 0
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page.hits += 1
                body = page.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the real vLLM captures -----------------------------------------------------------------------


def read_capture(name: str) -> list[list[bytes]]:
    """Messages of ``{name}.frames.bin``: per message a BE u32 frame count, then BE u32 length + bytes."""
    data = (CAPTURES / f"{name}.frames.bin").read_bytes()
    out, off = [], 0
    while off < len(data):
        (count,) = struct.unpack_from(">I", data, off)
        off += 4
        frames = []
        for _ in range(count):
            (length,) = struct.unpack_from(">I", data, off)
            off += 4
            frames.append(data[off : off + length])
            off += length
        out.append(frames)
    return out


class WireTap:
    """Records the project's event batches a worker publishes on NATS (docs/wire.md §3)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    async def start(self, nats_url: str, worker: str, prefix: str = "kvindex") -> WireTap:
        import msgpack
        import nats

        self.nc = await nats.connect(nats_url)

        async def on_msg(msg: Any) -> None:
            self.batches.append(msgpack.unpackb(msg.data))

        await self.nc.subscribe(f"{prefix}.events.{worker}", cb=on_msg)
        await self.nc.flush()
        return self

    def events(self) -> list[dict[str, Any]]:
        return [ev for b in self.batches for ev in b["events"]]

    def keys(self, kind: str, tier: str = "gpu") -> set[int]:
        return {k for ev in self.events() if ev["type"] == kind and ev["tier"] == tier for k in ev["keys"]}

    def cleared(self) -> list[str | None]:
        return [ev["tier"] for ev in self.events() if ev["type"] == "cleared"]

    async def close(self) -> None:
        await self.nc.close()
