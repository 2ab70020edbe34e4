"""Fuzz targets: every decoder that reads bytes a worker, an engine or a router controls.

Each target is ``one_input(data: bytes) -> None``: it raises only on a real failure (a crash, an
exception other than the documented rejection, or a broken invariant). The documented rejections:

- ``batch`` / ``heartbeat``: ``Consumer.on_events`` / ``on_heartbeat`` never raise; a message rejected
  whole (a wire reason, or a new instance or model beyond its limit) leaves the index, the registry
  and the cursors exactly as they were.
- ``replay`` / ``snapshot``: the answer decoders raise ``msgspec.MsgspecError``; a decoded answer
  handed to the consumer never raises, and the index stays within its limits and self-consistent.
- ``grpc``: a request whose bytes do not parse is the transport's rejection (protobuf
  ``DecodeError``); a parsed Score/Lookup/Commit/Release either answers or aborts with
  INVALID_ARGUMENT and a message, and never changes the index.
- ``bridge_vllm`` / ``bridge_sglang`` / ``bridge_trtllm``: frames raise ``FrameError``, a batch
  ``DecodeError``; a bad event inside a good batch becomes an ``EventError``; translating the events
  never raises.

Seeds come from proto/vectors, the real vLLM captures shipped in kvtools/data/vllm_capture and
messages built here for the shapes the captures lack (SGLang arrays, TRT-LLM pull API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import msgspec
from google.protobuf.message import DecodeError as ProtoDecodeError

from kvindex.api.servicer import KvIndexServicer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.ingest.limits import INSTANCE_LIMIT, LIMIT_REASONS, MODEL_LIMIT, IngestLimits
from kvindex.keys import block_keys
from kvindex.observability.counters import IngestCounters
from kvindex.repair.nats_repair import _assemble, _Parts, _Trim
from kvindex.scoring.ranker import Ranker
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire import encode_batch, encode_heartbeat
from kvindex.wire import errors as wire_errors
from kvindex.wire.reconcile import decode_replay_reply, replay_replies, snapshot_parts
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir
from workers_shim.bridges.engines import ENGINES
from workers_shim.bridges.native import DecodeError, Decoder
from workers_shim.bridges.stats import BridgeStats
from workers_shim.bridges.stream import FrameError, parse_live, parse_replay
from workers_shim.bridges.translate import NullSink, Translator

ROOT = Path(__file__).resolve().parents[2]  # tests/fuzz/ -> the repository
MODEL = "fuzz-model"
BS = 4
# Small limits, so that fuzzing reaches every refusal path.
LIMITS = IngestLimits(
    default_tier_blocks=64,
    max_instances_per_model=4,
    max_models=3,
    max_held_batches=8,
    max_held_keys=256,
    max_pending_repairs=2,
)
# (bad_endpoint and bad_role drop one field of a heartbeat that is otherwise applied.)
WHOLE_REJECTIONS = {*wire_errors.REASONS, INSTANCE_LIMIT, MODEL_LIMIT} - {
    wire_errors.BAD_ENDPOINT,
    wire_errors.BAD_ROLE,
}
KNOWN_REASONS = {*wire_errors.REASONS, *LIMIT_REASONS}
WORKERS = ("w1", "w2", "w3", "w4", "new", "a b", "", "w1.x")


class FuzzFailure(AssertionError):
    """A broken invariant (not a documented rejection)."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise FuzzFailure(what)


class _Quiet:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class _Pending:
    """Repairs are asked for and never answered (the targets answer by hand)."""

    def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
        pass

    def request_snapshot(self, instance: Any, cause: str) -> None:
        pass


class _Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- a small fleet in every state a message can meet ----------------------------------------------


def _batch(worker: str, seq: int, events: list[dict], epoch: int = 1) -> bytes:
    return encode_batch(
        worker=worker, model=MODEL, epoch=epoch, seq=seq, ts=1.0, block_size=BS, events=events
    )


def _stored(keys: list[int] | range, tier: str = "gpu") -> dict:
    return {"type": "stored", "tier": tier, "keys": list(keys), "parent": None}


def _heartbeat(worker: str, seq: int, capacity: dict, digest: dict | None = None, epoch: int = 1) -> bytes:
    return encode_heartbeat(
        worker=worker,
        model=MODEL,
        epoch=epoch,
        seq=seq,
        ts=1.0,
        block_size=BS,
        load={"running": 1, "waiting": 0, "kv_usage": 0.5},
        capacity=capacity,
        digest=digest or {},
    )


def world() -> Consumer:
    """w1 in sync near its limit (capacity 32 -> 40 blocks), w2 repairing by replay (seq 2 lost,
    3 held), w3 discovered mid-stream and waiting for a snapshot of seq 5."""
    c = Consumer(
        InvertedIndex(), Registry(clock=_Clock()), repair=_Pending(), ingest_limits=LIMITS, log=_Quiet()
    )
    c.on_heartbeat("kvindex.status.w1", _heartbeat("w1", 0, {"gpu": 32}))
    c.on_events(
        "kvindex.events.w1", _batch("w1", 1, [_stored(range(1, 31)), _stored(range(500, 505), "cpu")])
    )
    c.on_events("kvindex.events.w1", _batch("w1", 2, [{"type": "removed", "tier": "gpu", "keys": [1, 2, 3]}]))
    c.on_events("kvindex.events.w2", _batch("w2", 1, [_stored(range(100, 110))]))
    c.on_events("kvindex.events.w2", _batch("w2", 3, [_stored(range(110, 112))]))
    c.on_heartbeat("kvindex.status.w3", _heartbeat("w3", 5, {"gpu": 16, "shared": 8}))
    return c


def fingerprint(c: Consumer) -> Any:
    ix = c.index
    out: list[Any] = [ix.stats()]
    for key in sorted(ix.instances()):  # type: ignore[attr-defined]
        out.append((key, ix.block_counts(key), [ix.digest(key, t) for t in range(4)]))
    for s in sorted(c.registry.all(), key=lambda s: s.key):
        out.append((s.key, s.model, s.block_size, s.epoch, s.last_seq, s.sync, dict(s.capacity), s.capped))
    for key, cur in sorted(c.sequencer.cursors().items()):
        out.append((key, cur.epoch, cur.applied, cur.repairing, tuple(cur.buffer.keys()), cur.held_keys))
    return out


def invariants(c: Consumer, capacity_fixed: bool = True) -> None:
    """What must hold after any input: limits kept, bookkeeping consistent, reasons known."""
    ix = c.index
    for state in c.registry.all():
        counts = ix.block_counts(state.key)
        if capacity_fixed:  # a heartbeat may lower a limit below what is held (kept, not trimmed)
            check(
                all(n <= lim for n, lim in zip(counts, c.limits_of(state), strict=True)), "over a block limit"
            )
        for t in range(4):
            keys = list(ix.keys_of(state.key, t))
            x = 0
            for k in keys:
                x ^= k
            check(ix.digest(state.key, t) == (len(keys), x), "digest disagrees with the keys held")
    for cur in c.sequencer.cursors().values():
        held = sum(len(ev.keys) for b in cur.buffer.values() for ev in b.events)
        check(cur.held_keys == held, f"held_keys {cur.held_keys} != {held}")
        check(
            len(cur.buffer) <= LIMITS.max_held_batches and held <= LIMITS.max_held_keys, "held beyond limits"
        )
    check(not any(s.removed for s in c.registry.all()), "a registered instance marked removed")
    check(not any(cur.closed for cur in c.sequencer.cursors().values()), "a live cursor marked closed")
    repairing = sum(1 for cur in c.sequencer.cursors().values() if cur.repairing is not None)
    check(c.sequencer.repairs() == repairing, f"repairs() {c.sequencer.repairs()} != {repairing} cursors")
    check(set(c.counters.rejects) <= KNOWN_REASONS, f"unknown reject reason {set(c.counters.rejects)}")
    check(len(c.registry.models()) <= LIMITS.max_models, "too many models")


def records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """[header byte][length u16 LE][payload] ..."""
    i = 0
    while i + 3 <= len(data):
        n = data[i + 1] | data[i + 2] << 8
        yield data[i], data[i + 3 : i + 3 + n]
        i += 3 + n


def frame(header: int, payload: bytes) -> bytes:
    return bytes([header]) + struct.pack("<H", len(payload)) + payload


def _messages(c: Consumer, data: bytes, kind: str) -> None:
    for header, payload in records(data):
        worker = WORKERS[header % len(WORKERS)]
        subject = f"kvindex.{kind}.{worker}"
        before = fingerprint(c)
        rejects = c.counters.rejects.copy()
        handle = c.on_events if kind == "events" else c.on_heartbeat
        ok = handle(subject, payload)
        new = set((c.counters.rejects - rejects).keys())
        if new & WHOLE_REJECTIONS:
            check(not ok and fingerprint(c) == before, f"rejected ({new}) but the state changed")
        invariants(c, capacity_fixed=kind == "events")


def batch_target(data: bytes) -> None:
    _messages(world(), data, "events")


def heartbeat_target(data: bytes) -> None:
    _messages(world(), data, "status")


def replay_target(data: bytes) -> None:
    c = world()
    w2 = ("w2", 0)
    for _header, payload in records(data):
        try:
            reply = decode_replay_reply(payload)
        except msgspec.MsgspecError:
            continue  # documented rejection: the repairer counts a malformed answer as a failure
        cursor = c.sequencer.cursor(w2)
        c.repairs.on_replay(w2, cursor.epoch if cursor else 1, reply.status, list(reply.batches))
        invariants(c)


def snapshot_target(data: bytes) -> None:
    c = world()
    w3 = ("w3", 0)
    state = c.registry.get(w3)
    trim = _Trim(None if state is None else c.limits_of(state))
    parts = _Parts()
    for _header, payload in records(data):
        try:
            part = trim.decode(payload)
        except msgspec.MsgspecError:
            return  # documented rejection: the whole answer fails, the repairer retries later
        if parts.add(part):
            break
    else:
        return  # never finished: a timeout in the repairer
    snapshot = _assemble(parts.ordered())
    snapshot.trimmed = trim.trimmed
    c.repairs.on_snapshot(w3, snapshot)
    invariants(c)


# -- gRPC requests through the servicer -----------------------------------------------------------


class Aborted(Exception):
    pass


class _Context:
    """What the servicer uses of grpc.aio.ServicerContext: abort, which raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        check(code == grpc.StatusCode.INVALID_ARGUMENT, f"aborted with {code}")
        check(bool(details), "abort without a message")
        raise Aborted(details)


_loop = asyncio.new_event_loop()
_REQUESTS = (
    ("Score", pb.ScoreRequest),
    ("Lookup", pb.LookupRequest),
    ("Commit", pb.CommitRequest),
    ("Release", pb.ReleaseRequest),
)


_tokenizers: Tokenizers | None = None


def _fuzz_tokenizers() -> Tokenizers:
    """Text prompts for MODEL: a small Llama-3-style tokenizer (with a chat template) made once."""
    global _tokenizers
    if _tokenizers is None:
        folder = Path(tempfile.gettempdir()) / "kvindex-fuzz-tokenizer" / str(os.getpid())
        make_tokenizer_dir(folder, "llama3", vocab_size=256)
        _tokenizers = Tokenizers.from_dirs({MODEL: str(folder)}, cache_bytes=1 << 20)
        shutil.rmtree(folder, ignore_errors=True)  # loaded: the files are not needed any more
    return _tokenizers


def grpc_target(data: bytes) -> None:
    if not data:
        return
    c = world()
    router = Ranker(c.index, c.registry)
    servicer = KvIndexServicer(c.index, c.registry, IngestCounters(), None, router, _fuzz_tokenizers())
    name, cls = _REQUESTS[data[0] % len(_REQUESTS)]
    try:
        request = cls.FromString(data[1:])
    except ProtoDecodeError:
        return  # the transport's rejection
    before = fingerprint(c)
    with contextlib.suppress(Aborted):
        _loop.run_until_complete(getattr(servicer, name)(request, _Context()))
    check(fingerprint(c) == before, f"{name} changed the index")


# -- engine frames through the bridge's decoder and translator ------------------------------------


def _bridge_target(engine: str) -> Callable[[bytes], None]:
    decoder = Decoder(ENGINES[engine].media)

    def one_input(data: bytes) -> None:
        if not data:
            return
        translator = Translator(MODEL, BS, NullSink(), BridgeStats(log=_Quiet()))
        mode, rest = data[0], data[1:]
        if mode & 1:  # a ZMQ message: frames, then its payload
            frames = [payload for _h, payload in records(rest)]
            try:
                payload = parse_live(frames)[2] if mode & 2 else (parse_replay(frames) or (0, b""))[1]
            except FrameError:
                return
        else:
            payload = rest
        try:
            batch = decoder.decode(payload)
        except DecodeError:
            return
        for ev in batch.events:
            translator.apply(ev, recover=False)

    return one_input


TARGETS: dict[str, Callable[[bytes], None]] = {
    "batch": batch_target,
    "heartbeat": heartbeat_target,
    "replay": replay_target,
    "snapshot": snapshot_target,
    "grpc": grpc_target,
    "bridge_vllm": _bridge_target("vllm"),
    "bridge_sglang": _bridge_target("sglang"),
    "bridge_trtllm": _bridge_target("trtllm"),
}


# -- seeds ----------------------------------------------------------------------------------------

# libFuzzer dictionary entries: msgpack-encoded names and values the decoders look for.
_WORDS = [
    "v",
    "worker",
    "model",
    "epoch",
    "seq",
    "ts",
    "block_size",
    "dp_rank",
    "events",
    "type",
    "tier",
    "keys",
    "parent",
    "stored",
    "removed",
    "cleared",
    "load",
    "capacity",
    "digest",
    "prefill",
    "running",
    "waiting",
    "waiting_prefill_tokens",
    "kv_usage",
    "gpu",
    "cpu",
    "disk",
    "shared",
    "status",
    "part",
    "last",
    "batches",
    "oldest_seq",
    "tiers",
    "ok",
    "too_old",
    "wrong_epoch",
    "w1",
    "w2",
    "w3",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "BlockStoredWithMetadata",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "lora_id",
    "lora_name",
    "medium",
    "GPU",
    "CPU",
    "CPU_PINNED",
    "DISK",
    "EXTERNAL",
    "data_parallel_rank",
    "attn_dp_rank",
    "event_id",
    "data",
    "blocks",
    "block_hash",
    "tokens",
    "token_id",
    "cache_level",
    "attention_dp_rank",
    "updated",
    "created",
    "mm_keys",
]


def dictionary() -> list[bytes]:
    words = [msgpack.packb(w) for w in _WORDS]
    numbers = [msgpack.packb(n) for n in (-1, 0, 1, 2**31, 2**63, 2**64 - 1, -(2**63))]
    return [*words, *numbers, b"\xc0", b"\xc2", b"\xc3", b"\x90", b"\x80"]


def _vectors() -> dict[str, bytes]:
    data = json.loads((ROOT / "proto" / "vectors" / "messages.json").read_text())
    return {k: bytes.fromhex(v["hex"]) for k, v in data.items() if isinstance(v, dict) and "hex" in v}


def _capture_messages() -> list[list[bytes]]:
    """Every ZMQ message of the real vLLM captures (frames), shipped in kvtools/data."""
    from kvtools.data import vllm_captures

    folder = vllm_captures()
    out = []
    for path in sorted(folder.glob("*.frames.bin")):
        raw = path.read_bytes()
        i = 0
        while i + 4 <= len(raw):
            (n,) = struct.unpack_from(">I", raw, i)
            i += 4
            frames = []
            for _ in range(n):
                (size,) = struct.unpack_from(">I", raw, i)
                frames.append(raw[i + 4 : i + 4 + size])
                i += 4 + size
            out.append(frames)
    return out


def seeds(target: str) -> list[bytes]:
    vec = _vectors()
    w1_next = _batch("w1", 3, [_stored(range(31, 45)), {"type": "cleared", "tier": "cpu"}])
    if target == "batch":
        return [
            frame(0, w1_next),
            frame(0, w1_next) + frame(1, _batch("w2", 2, [_stored(range(200, 300))])),
            frame(4, _batch("new", 1, [_stored([1, 2])])) + frame(2, _batch("w3", 6, [_stored([7])])),
            frame(0, _batch("w1", 1, [_stored([9])], epoch=2)),
            frame(0, vec["event_batch"]),
        ]
    if target == "heartbeat":
        return [
            frame(0, _heartbeat("w1", 2, {"gpu": 8}, {"gpu": (27, 0)})),
            frame(1, _heartbeat("w2", 4, {"gpu": 8, "cpu": 4})) + frame(3, _heartbeat("w4", 0, {})),
            frame(0, vec["status"]),
        ]
    if target == "replay":
        batches = [_batch("w2", 2, [_stored(range(150, 160))]), _batch("w2", 3, [_stored([1])])]
        return [
            b"".join(frame(0, m) for m in replay_replies("w2", 0, 1, "ok", batches, 1 << 20)),
            b"".join(frame(0, m) for m in replay_replies("w2", 0, 1, "too_old", [], 1 << 20)),
        ]
    if target == "snapshot":
        tiers = {"gpu": list(range(1000, 1030)), "shared": [5, 6, 7]}
        return [
            b"".join(frame(0, m) for m in snapshot_parts("w3", 0, 1, 5, tiers, 1024)),
            b"".join(frame(0, m) for m in snapshot_parts("w3", 0, 2, 0, {}, 1024)),
        ]
    if target == "grpc":
        keys = block_keys(list(range(40)), BS, MODEL)
        return [
            bytes([0])
            + pb.ScoreRequest(model=MODEL, block_keys=[4, 5, 6], top_k=2, explain=True).SerializeToString(),
            bytes([0])
            + pb.ScoreRequest(
                model=MODEL, token_ids=list(range(40)), commit=True, request_id="r"
            ).SerializeToString(),
            bytes([1])
            + pb.LookupRequest(model=MODEL, block_keys=keys, candidates=["w1/0"]).SerializeToString(),
            bytes([2])
            + pb.CommitRequest(
                model=MODEL, request_id="r", instance_id="w1/0", block_keys=keys
            ).SerializeToString(),
            bytes([3]) + pb.ReleaseRequest(request_id="r", phase="finished").SerializeToString(),
            bytes([0]) + pb.ScoreRequest(model=MODEL, prompt="The quick brown fox " * 8).SerializeToString(),
            bytes([1])
            + pb.LookupRequest(
                model=MODEL,
                messages=json.dumps(
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
                ),
                prompt_options=pb.PromptOptions(add_generation_prompt=True),
            ).SerializeToString(),
        ]
    engine = target.removeprefix("bridge_")
    payloads = [msgs[-1] for msgs in _capture_messages() if msgs and msgs[-1]]
    out = [bytes([0]) + p for p in payloads[:64]]
    out += [bytes([1 | 2]) + b"".join(frame(0, f) for f in m) for m in _capture_messages()[:16]]
    h = [-(i * 7919 + 3) for i in range(4)]
    if engine == "sglang":
        out.append(
            bytes([0])
            + msgpack.packb(
                [
                    1.0,
                    [
                        ["BlockStored", [h[0]], None, list(range(BS)), BS, None, "GPU"],
                        ["BlockStored", [h[1]], h[0], list(range(BS, 2 * BS)), BS, None, "CPU_PINNED"],
                        ["BlockRemoved", [h[0]], "GPU"],
                        ["AllBlocksCleared"],
                    ],
                    0,
                ]
            )
        )
    if engine == "trtllm":
        out.append(
            bytes([0])
            + msgpack.packb(
                [
                    1.0,
                    [
                        {
                            "event_id": 1,
                            "data": {
                                "type": "stored",
                                "parent_hash": None,
                                "blocks": [
                                    {
                                        "block_hash": h[0],
                                        "tokens": [{"token_id": t} for t in range(BS)],
                                        "cache_level": 0,
                                    }
                                ],
                            },
                            "attention_dp_rank": 0,
                        },
                        {
                            "event_id": 2,
                            "data": {
                                "type": "updated",
                                "block_hash": h[0],
                                "cache_level": {"old_value": 0, "new_value": 1},
                            },
                        },
                        {"event_id": 3, "data": {"type": "removed", "block_hashes": [h[0]]}},
                    ],
                ]
            )
        )
    return out
