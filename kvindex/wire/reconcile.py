"""Replay and snapshot: the request/reply half of the wire contract (docs/wire.md §6).

Both are NATS requests to ``{prefix}.replay.{worker}`` / ``{prefix}.snapshot.{worker}`` whose answer
may span several messages sent to the request's reply inbox; every answer message carries ``part``
(0, 1, 2, ...) and ``last``. Every rank of a worker listens on the worker's subjects; only the rank
named in the request answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
from msgspec import Struct

from kvindex.wire.schema import U64, WIRE_VERSION, DpRank, TierName, WorkerId

REPLAY_OK: Final = "ok"
REPLAY_TOO_OLD: Final = "too_old"  # the range starts before the oldest batch the worker kept
REPLAY_WRONG_EPOCH: Final = "wrong_epoch"  # the worker is in another epoch (it restarted)
ReplayStatus = Literal["ok", "too_old", "wrong_epoch"]

# Room left in each answer message for the envelope around the payload.
_ENVELOPE_BYTES: Final = 512


class ReplayRequest(Struct, gc=False):
    """Re-send batches ``from_seq`` .. ``to_seq`` (inclusive) of ``epoch``."""

    v: int
    dp_rank: DpRank
    epoch: U64
    from_seq: U64
    to_seq: U64


class ReplayReply(Struct, gc=False):
    v: int
    worker: WorkerId
    dp_rank: DpRank
    epoch: U64  # the worker's current epoch
    status: ReplayStatus
    part: U64  # 0, 1, 2, ...: a negative part number made an empty answer (found by fuzzing)
    last: bool
    batches: list[bytes] = []  # the original encoded batch payloads, in seq order
    oldest_seq: U64 = 0  # the oldest seq the worker still has (informational)


class SnapshotRequest(Struct, gc=False):
    v: int
    dp_rank: DpRank


class SnapshotPart(Struct, gc=False):
    """Part of a worker's full block set per tier, as of batch ``seq`` of ``epoch``.

    The union of all parts' ``tiers`` is the set: everything up to and including ``seq``, nothing
    after. A tier absent from every part holds no blocks.
    """

    v: int
    worker: WorkerId
    dp_rank: DpRank
    epoch: U64
    seq: U64
    part: U64  # 0, 1, 2, ...: a negative part number made an empty answer (found by fuzzing)
    last: bool
    tiers: dict[TierName, list[U64]] = {}


@dataclass(slots=True)
class Snapshot:
    """A whole snapshot, assembled from its parts: tier number -> keys, as of (epoch, seq)."""

    epoch: int
    seq: int
    tiers: dict[int, list[int]] = field(default_factory=dict)
    trimmed: int = 0  # tiers (bit 1 << tier) cut short by the receiver's block limit


_encoder = msgspec.msgpack.Encoder()
_replay_request = msgspec.msgpack.Decoder(ReplayRequest)
_replay_reply = msgspec.msgpack.Decoder(ReplayReply)
_snapshot_request = msgspec.msgpack.Decoder(SnapshotRequest)
_snapshot_part = msgspec.msgpack.Decoder(SnapshotPart)


def encode(message: Struct) -> bytes:
    return _encoder.encode(message)


def decode_replay_request(data: bytes) -> ReplayRequest:
    return _replay_request.decode(data)


def decode_replay_reply(data: bytes) -> ReplayReply:
    return _replay_reply.decode(data)


def decode_snapshot_request(data: bytes) -> SnapshotRequest:
    return _snapshot_request.decode(data)


def decode_snapshot_part(data: bytes) -> SnapshotPart:
    return _snapshot_part.decode(data)


def replay_request(dp_rank: int, epoch: int, from_seq: int, to_seq: int) -> bytes:
    return encode(ReplayRequest(WIRE_VERSION, dp_rank, epoch, from_seq, to_seq))


def snapshot_request(dp_rank: int) -> bytes:
    return encode(SnapshotRequest(WIRE_VERSION, dp_rank))


def replay_replies(
    worker: str,
    dp_rank: int,
    epoch: int,
    status: ReplayStatus,
    batches: list[bytes],
    max_payload: int,
    oldest_seq: int = 0,
) -> Iterator[bytes]:
    """The answer messages of one replay, each within ``max_payload`` bytes."""
    budget = max(1024, max_payload - _ENVELOPE_BYTES)
    chunks: list[list[bytes]] = [[]]
    size = 0
    for data in batches:
        if chunks[-1] and size + len(data) + 8 > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(data)
        size += len(data) + 8
    for i, chunk in enumerate(chunks):
        yield encode(
            ReplayReply(
                WIRE_VERSION, worker, dp_rank, epoch, status, i, i == len(chunks) - 1, chunk, oldest_seq
            )
        )


def snapshot_parts(
    worker: str, dp_rank: int, epoch: int, seq: int, tiers: dict[str, list[int]], max_payload: int
) -> Iterator[bytes]:
    """The answer messages of one snapshot, each within ``max_payload`` bytes (a key takes <= 9)."""
    per_part = max(64, (max_payload - _ENVELOPE_BYTES) // 9)
    parts: list[dict[str, list[int]]] = [{}]
    room = per_part
    for tier, keys in tiers.items():
        start = 0
        while start < len(keys):
            if room == 0:
                parts.append({})
                room = per_part
            take = keys[start : start + room]
            parts[-1][tier] = take
            room -= len(take)
            start += len(take)
    for i, chunk in enumerate(parts):
        last = i == len(parts) - 1
        # (tier names as given: the snapshot's reader checks them)
        yield encode(SnapshotPart(WIRE_VERSION, worker, dp_rank, epoch, seq, i, last, chunk))  # type: ignore[arg-type]
