"""ZMQ transport of the engines' KV events: the live SUB stream and the replay (DEALER) client.

Live messages are ``[topic, seq (8-byte big-endian), payload]`` (a 2-frame ``[seq, payload]`` is
accepted too). Replays go to the engine's ROUTER socket: the request is ``[b"", start_seq]`` from a
DEALER; each reply arrives as ``[b"", topic, seq, payload]`` (vLLM ≥ 0.32) or ``[b"", seq, payload]``
(older vLLM, SGLang), and the answer ends with a message whose seq is eight 0xFF bytes
(``[b"", b"", END, b""]`` or ``[b"", END, b""]``). A fresh DEALER is used per request so a late answer to
an abandoned request can never be mistaken for the next one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

END_SEQ = b"\xff" * 8


class FrameError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise FrameError("bad_seq_frame")
    return int.from_bytes(raw, "big")


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a live message."""
    if len(frames) == 3:
        return frames[0], _seq(frames[1]), frames[2]
    if len(frames) == 2:
        return b"", _seq(frames[0]), frames[1]
    raise FrameError("bad_frame_count")


def parse_replay(frames: list[bytes]) -> tuple[int, bytes, int] | None:
    """``(seq, payload, layout)`` of one replay answer (layout 3 or 2 frames), None at the end marker."""
    if len(frames) >= 3 and frames[0] == b"":
        frames = frames[1:]  # the DEALER's empty delimiter
    if len(frames) == 3:
        seq_raw, payload, layout = frames[1], frames[2], 3
    elif len(frames) == 2:
        seq_raw, payload, layout = frames[0], frames[1], 2
    else:
        raise FrameError("bad_replay_frame_count")
    if seq_raw == END_SEQ:
        return None
    return _seq(seq_raw), payload, layout


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The engines' per-DP-rank endpoint convention: TCP port + rank, ``_dp{rank}`` for ipc/inproc."""
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"cannot offset endpoint {endpoint!r} by rank {rank}: no port")
    return f"{base}:{int(port) + rank}"


def connectable(endpoint: str) -> str:
    """An engine's bind address (``tcp://*:5557``) as an address to connect to."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint


class EventStream:
    """The live SUB socket of one engine endpoint."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        self.endpoint = connectable(endpoint)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(self.endpoint)

    async def recv(self, timeout: float | None) -> list[bytes] | None:
        """The next message, or None after ``timeout`` seconds without one."""
        if timeout is not None and not await self.sock.poll(timeout * 1000):
            return None
        return await self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)


@dataclass(slots=True)
class EngineReplay:
    batches: list[tuple[int, bytes]] = field(default_factory=list)  # (seq, payload) in arrival order
    complete: bool = False  # the end marker arrived
    error: str | None = None  # "timeout" when the engine stopped answering (or never did)
    layouts: set[int] = field(default_factory=set)
    bad_frames: int = 0

    @property
    def first(self) -> int | None:
        return self.batches[0][0] if self.batches else None


class ReplayClient:
    """Asks an engine's ROUTER replay socket for the batches from a sequence number on."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout: float = 2.0) -> None:
        self.ctx = ctx
        self.endpoint = connectable(endpoint)
        self.timeout = timeout

    async def request(self, start: int) -> EngineReplay:
        result = EngineReplay()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # The timeout bounds the wait for each answer message, not the whole replay.
                if not await sock.poll(self.timeout * 1000):
                    result.error = "timeout"
                    return result
                frames = await sock.recv_multipart()
                try:
                    parsed = parse_replay(frames)
                except FrameError:
                    result.bad_frames += 1
                    continue
                if parsed is None:
                    result.complete = True
                    return result
                seq, payload, layout = parsed
                result.layouts.add(layout)
                result.batches.append((seq, payload))
        finally:
            with contextlib.suppress(Exception):
                sock.close(linger=0)
