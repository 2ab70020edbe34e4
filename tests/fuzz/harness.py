"""Fuzz targets: every decoder that reads bytes a worker, an engine or a router controls.

Each target is ``one_input(data: bytes) -> None``: it raises only on a real failure (a crash, an
exception other than the documented rejection, or a broken invariant). The documented rejections:

- ``batch`` / ``heartbeat``: ``Consumer.on_events`` / ``on_heartbeat`` never raise; a message rejected
  whole (a wire reason, or a new instance or model beyond its limit) leaves the index, the registry
  and the cursors exactly as they were.
- ``replay`` / ``snapshot``: the answer decoders raise ``msgspec.MsgspecError``; a decoded answer
  handed to the consumer never raises, and the index stays within its limits and self-consistent.
- ``grpc``: the request bytes go through the method as the server registers it
  (kvindex/api/handlers.py): any request, parsed or not, either answers or aborts with
  INVALID_ARGUMENT and a message (a ScoreStream answers with ``error``), and never changes the index.
- ``wire_values`` (structure-aware): well-formed batches and heartbeats built from the input's
  choices, with extreme numbers and deep nesting: as ``batch``, and Stats, ListInstances, Score and
  Lookup replies always build.
- ``grpc_strings`` (structure-aware): well-typed requests with hostile strings (deep JSON, invalid
  UTF-8 in the bytes, surrogates): as ``grpc``.
- ``bridge_vllm`` / ``bridge_sglang`` / ``bridge_trtllm``: frames raise ``FrameError``, a batch
  ``DecodeError``; a bad event inside a good batch becomes an ``EventError``; translating the events
  never raises.

Seeds come from proto/vectors, the real vLLM captures shipped in kvtools/data/vllm_capture and
messages built here for the shapes the captures lack (SGLang arrays, TRT-LLM pull API).
"""

from __future__ import annotations

import asyncio
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

from kvindex.api.handlers import Malformed, method_handlers
from kvindex.api.servicer import KvIndexServicer
from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.ingest.limits import INSTANCE_LIMIT, LIMIT_REASONS, MODEL_LIMIT, IngestLimits
from kvindex.keys import block_keys
from kvindex.observability.counters import IngestCounters
from kvindex.repair.nats_repair import _assemble, _Parts, _Trim
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.ranker import build_ranker
from kvindex.sequencer.cursor import MAX_GAP, Sequencer
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire import encode_batch, encode_heartbeat
from kvindex.wire import errors as wire_errors
from kvindex.wire.reconcile import Snapshot, decode_replay_reply, replay_replies, snapshot_parts
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
    c = build_consumer(
        InvertedIndex(),
        Registry(clock=_Clock()),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=lambda _machine: _Pending(),
        ingest_limits=LIMITS,
        log=_Quiet(),
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
        out.append(
            (s.key, s.model, s.block_size, s.epoch, s.last_seq, s.repair.sync, dict(s.capacity), s.capped)
        )
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
                all(n <= lim for n, lim in zip(counts, c.applier.limits_of(state), strict=True)),
                "over a block limit",
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
    trim = _Trim(None if state is None else c.applier.limits_of(state))
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
# The header byte's method (the first four kept their numbers when the others were added).
_METHODS = ("Score", "Lookup", "Commit", "Release", "ListInstances", "Stats", "ScoreStream")
_SERVICE = pb.DESCRIPTOR.services_by_name["KvIndex"]


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


def _servicer(c: Consumer) -> KvIndexServicer:
    router = build_ranker(c.index, c.registry, Calibrator.of(CostConfig()))
    return KvIndexServicer(c.index, c.registry, c.counters, None, router, _fuzz_tokenizers())


async def _stream(handler: Any, request: Any) -> list[pb.ScoreResponse]:
    async def one() -> Any:
        yield request

    return [response async for response in handler.stream_stream(one(), _Context())]


def call(servicer: KvIndexServicer, name: str, data: bytes) -> Any:
    """The request bytes through the method as the server registers it (kvindex/api/handlers.py):
    bytes that do not parse abort with INVALID_ARGUMENT (a ScoreStream answers them with an error);
    any other exception or abort code is a failure. The answer, or None when aborted."""
    handler = method_handlers(_SERVICE, servicer)[name]
    request = handler.request_deserializer(data)
    malformed = isinstance(request, Malformed)
    if name == "ScoreStream":
        (response,) = _loop.run_until_complete(_stream(handler, request))
        check(not malformed or bool(response.error), "a malformed stream message answered without an error")
        return response
    try:
        response = _loop.run_until_complete(handler.unary_unary(request, _Context()))
    except Aborted:
        return None
    check(not malformed, f"{name} answered bytes that do not parse")
    return response


def grpc_target(data: bytes) -> None:
    if not data:
        return
    c = world()
    name = _METHODS[data[0] % len(_METHODS)]
    before = fingerprint(c)
    call(_servicer(c), name, data[1:])
    check(fingerprint(c) == before, f"{name} changed the index")


# -- structure-aware: well-formed msgpack with extreme values and deep nesting --------------------


class _Choices:
    """The fuzzer's bytes read as choices (0 once they run out)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.i = data, 0

    def more(self) -> bool:
        return self.i < len(self.data)

    def byte(self) -> int:
        self.i += 1
        return self.data[self.i - 1] if self.i <= len(self.data) else 0

    def pick(self, options: Any) -> Any:
        return options[self.byte() % len(options)]

    def u64(self) -> int:
        return int.from_bytes(bytes(self.byte() for _ in range(8)), "little")


U64_MAX = (1 << 64) - 1
# Values at the edges: of u64, of the signed and float-exact ranges, of a uint32 reply field, of the
# widest hole the sequencer accepts (around which a gap becomes a jump).
EXTREMES = (
    0, 1, 2, 3, 255, 65_535, (1 << 31) - 1, 1 << 32, (1 << 32) + 1, 1 << 53, (1 << 63) - 1, 1 << 63,
    U64_MAX - 1, U64_MAX, -1, -(1 << 63), MAX_GAP, MAX_GAP + 1, MAX_GAP + 2,
)  # fmt: skip
# Nesting depths: within the JSON limit, at it, around where Python's recursion stops, far beyond.
DEPTHS = (0, 1, 4, 127, 128, 129, 500, 990, 995, 1000, 1005, 2000, 5000, 20_000)
_NEST_OPEN = (b"\x91", b"\x81\xa1a", b"\xdc\x00\x01")  # array of 1, map {"a": ...}, array16 of 1
_HOLE = "\x00nested\x00"  # a string no message has: replaced by the nested bytes


def _value(ch: _Choices) -> int:
    kind = ch.byte() % 4
    if kind == 0:
        return ch.pick(EXTREMES)
    if kind == 1:
        return ch.byte()
    if kind == 2:
        return ch.u64()
    return min(U64_MAX, ch.pick(EXTREMES) + ch.byte())


def _nested(ch: _Choices) -> bytes:
    depth = ch.pick(DEPTHS)
    return ch.pick(_NEST_OPEN) * depth + ch.pick((b"\x00", b"\xc0", b"\x90", b"\xa1x"))


def _pack(message: dict[str, Any], nested: bytes | None) -> bytes:
    packed = msgpack.packb(message)
    return packed if nested is None else packed.replace(msgpack.packb(_HOLE), nested)


def _wire_batch(ch: _Choices, c: Consumer, worker: str) -> bytes:
    cursor = c.sequencer.cursor((worker, 0))
    applied = cursor.applied if cursor is not None else 0
    seq = ch.pick(
        (lambda: _value(ch), lambda: min(U64_MAX, applied + 1), lambda: min(U64_MAX, applied + _value(ch)))
    )()
    epoch = ch.pick((lambda: 1, lambda: _value(ch), lambda: 2))()
    keys = [_value(ch) for _ in range(ch.byte() % 4)]
    event: dict[str, Any] = {"type": ch.pick(("stored", "removed")), "tier": "gpu", "keys": keys}
    message: dict[str, Any] = {
        "v": 1, "worker": worker, "model": MODEL, "epoch": epoch, "seq": seq, "ts": 1.0,
        "block_size": BS, "dp_rank": 0, "events": [event],
    }  # fmt: skip
    nested = None
    if ch.byte() % 2:  # nest somewhere: an unknown field, inside an event, as a key or the parent
        nested = _nested(ch)
        where = ch.byte() % 4
        if where == 0:
            message["x"] = _HOLE
        elif where == 1:
            event["x"] = _HOLE
        elif where == 2:
            keys.append(_HOLE)  # type: ignore[arg-type]
        else:
            event["parent"] = _HOLE
    return _pack(message, nested)


def _wire_heartbeat(ch: _Choices, c: Consumer, worker: str) -> bytes:
    cursor = c.sequencer.cursor((worker, 0))
    applied = cursor.applied if cursor is not None else 0
    seq = ch.pick((lambda: _value(ch), lambda: applied, lambda: min(U64_MAX, applied + _value(ch))))()
    message: dict[str, Any] = {
        "v": 1, "worker": worker, "model": MODEL, "epoch": ch.pick((lambda: 1, lambda: _value(ch)))(),
        "seq": seq, "ts": 1.0, "block_size": BS, "dp_rank": 0,
        "load": {"running": _value(ch), "waiting": _value(ch), "waiting_prefill_tokens": _value(ch)},
        "capacity": {"gpu": _value(ch)}, "digest": {"gpu": [_value(ch), _value(ch)]},
        "prefill": [[_value(ch), _value(ch), 1.0]] if ch.byte() % 2 else [],
    }  # fmt: skip
    nested = None
    if ch.byte() % 2:
        nested = _nested(ch)
        field = ch.pick(("x", "endpoint", "role", "pd_group", "load", "capacity", "digest", "prefill"))
        message[field] = _HOLE
    return _pack(message, nested)


def _replies(c: Consumer, servicer: KvIndexServicer) -> None:
    """Whatever the workers sent, the replies that carry their numbers build: Stats, ListInstances,
    and a Score and Lookup of the blocks they hold."""
    stats = call(servicer, "Stats", b"")
    check(stats is not None and stats.rejects_total == min(U64_MAX, c.counters.rejects_total), "Stats")
    listed = call(servicer, "ListInstances", b"")
    check(listed is not None and len(listed.instances) == len(c.registry), "ListInstances")
    keys = sorted({k for key in c.index.instances() for k in c.index.keys_of(key, 0)})[:64]  # type: ignore[attr-defined]
    if keys:
        for name in ("Score", "Lookup"):
            cls = pb.ScoreRequest if name == "Score" else pb.LookupRequest
            request = cls(model=MODEL, block_keys=keys).SerializeToString()
            check(call(servicer, name, request) is not None, name)
    # A hole counts at most MAX_GAP missing batches: a jump is refused, never counted as missing.
    check(c.counters.missing_batches <= c.counters.gaps * MAX_GAP, "missing batches beyond MAX_GAP per gap")


def wire_values_target(data: bytes) -> None:
    """Well-formed batches and heartbeats with extreme numbers (seq and epoch at the ends of u64,
    jumps just past the widest hole, capacities and loads beyond uint32) and nesting at every depth
    (unknown fields included), from the small fleet's workers, with snapshot answers at extreme seqs;
    after each, the invariants, whole rejections unchanged, and the replies built."""
    c = world()
    servicer = _servicer(c)
    ch = _Choices(data)
    heartbeats = False
    while ch.more():
        worker = ch.pick(("w1", "w2", "w3", "w4"))
        op = ch.byte() % 4
        if op == 3:  # the snapshot a jump or a join asked for, answered at some seq
            cursor = c.sequencer.cursor((worker, 0))
            if cursor is not None:
                # (As decoded: the wire's seq and keys are u64.)
                keys = [_value(ch) % (U64_MAX + 1) for _ in range(3)]
                snapshot = Snapshot(cursor.epoch, _value(ch) % (U64_MAX + 1), {0: keys})
                c.repairs.on_snapshot((worker, 0), snapshot)
                invariants(c, capacity_fixed=not heartbeats)
                _replies(c, servicer)
            continue
        kind = "status" if op == 1 else "events"
        payload = _wire_heartbeat(ch, c, worker) if op == 1 else _wire_batch(ch, c, worker)
        before = fingerprint(c)
        rejects = c.counters.rejects.copy()
        ok = (c.on_heartbeat if op == 1 else c.on_events)(f"kvindex.{kind}.{worker}", payload)
        new = set((c.counters.rejects - rejects).keys())
        if new & WHOLE_REJECTIONS:
            check(not ok and fingerprint(c) == before, f"rejected ({new}) but the state changed")
        heartbeats |= op == 1  # (one may lower a limit below what is held: kept, not trimmed)
        invariants(c, capacity_fixed=not heartbeats)
        _replies(c, servicer)


# -- structure-aware: well-typed protobuf with hostile strings -------------------------------------

_BAD_UTF8 = "\x01\x02\x03"  # replaced in the request's bytes by ff fe fd: invalid UTF-8, same length


_CHAT = '[{"role": "user", "content": "hi"}]'


def _hostile_json(ch: _Choices) -> str:
    depth = ch.pick(DEPTHS)
    kind = ch.byte() % 7
    if kind == 0:
        return "[" * depth  # unterminated
    if kind == 1:
        return "[" * depth + "]" * depth
    if kind == 2:
        return '{"a":' * depth
    if kind == 3:
        return '{"a":' * depth + "1" + "}" * depth
    if kind == 4:  # a valid chat whose message carries the nesting
        inner = "[" * depth + "]" * depth
        return f'[{{"role": "user", "content": "hi", "x": {inner}}}]'
    if kind == 5:  # a tool call whose arguments string is nested
        args = json.dumps("[" * depth + "]" * depth)
        call_ = f'{{"type": "function", "function": {{"name": "f", "arguments": {args}}}}}'
        assistant = f'{{"role": "assistant", "content": "", "tool_calls": [{call_}]}}'
        return f'[{{"role": "user", "content": "x"}}, {assistant}]'
    return ch.pick(('"\\ud800"', "\x00" * 64, "x" * 70_000, _BAD_UTF8, '["\u2028", 1e999]', "{}", _CHAT))


def grpc_strings_target(data: bytes) -> None:
    """Score, ScoreStream, Lookup and Commit requests that parse as protobuf, with hostile strings in
    their text fields: JSON nested at every depth (unterminated, balanced, in a message, in a tool
    call's arguments), invalid UTF-8 at the byte level, lone surrogates, NULs, 70 KB strings. Each
    answers or aborts with INVALID_ARGUMENT and a message, and changes nothing."""
    ch = _Choices(data)
    c = world()
    servicer = _servicer(c)
    before = fingerprint(c)
    while ch.more():
        name = ch.pick(("Score", "ScoreStream", "Lookup", "Commit"))
        cls = {"Lookup": pb.LookupRequest, "Commit": pb.CommitRequest}.get(name, pb.ScoreRequest)
        request = cls(model=ch.pick((MODEL, MODEL, "", "m" * 600, _BAD_UTF8)))
        form = ch.byte() % 3
        if form == 0:
            request.messages = _hostile_json(ch)
            options = request.prompt_options
            for field in ("tools", "documents", "chat_template_kwargs"):
                if ch.byte() % 3 == 0:
                    setattr(options, field, _hostile_json(ch))
        elif form == 1:
            texts = (
                lambda: "hello " * 8,
                lambda: _BAD_UTF8,
                lambda: "\x00\ud7ff" * 100,
                lambda: _hostile_json(ch),
            )
            request.prompt = ch.pick(texts)()
        else:
            request.block_keys.extend(_value(ch) % (U64_MAX + 1) for _ in range(ch.byte() % 8))
        if name == "Commit":
            request.request_id, request.instance_id = ch.pick((("r", "w1/0"), (_BAD_UTF8, "w1/" + "9" * 30)))
        raw = request.SerializeToString().replace(_BAD_UTF8.encode(), b"\xff\xfe\xfd")
        call(servicer, name, raw)
    check(fingerprint(c) == before, "a request changed the index")


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
    "wire_values": wire_values_target,
    "grpc_strings": grpc_strings_target,
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


def _with_field(payload: bytes, name: str, raw: bytes) -> bytes:
    """A msgpack map (fixmap) with one more field, ``name`` = the already encoded ``raw``."""
    return bytes([payload[0] + 1]) + payload[1:] + msgpack.packb(name) + raw


# Structure-aware seeds, as the choices the targets read (see _Choices; EXTREMES and DEPTHS indices).
_X = {v: i for i, v in enumerate(EXTREMES)}
_D = {v: i for i, v in enumerate(DEPTHS)}


def _wv_batch(
    worker: int, seq: int | None = None, epoch: int = 0, nest: tuple[int, int] | None = None
) -> list[int]:
    """wire_values choices for a batch: ``seq`` an extreme value (None: the next in order), ``epoch``
    0 -> 1, 2 -> 2; ``nest`` (depth, where: 0 unknown field, 1 in the event, 2 as a key, 3 as parent)."""
    out = [worker, 0] + ([1] if seq is None else [0, 0, _X[seq]]) + [epoch, 0, 0]
    return out + ([1, _D[nest[0]], 0, 0, nest[1]] if nest else [0])


def _wv_heartbeat(worker: int, seq: int, nest: tuple[int, int] | None = None) -> list[int]:
    """wire_values choices for a heartbeat at an extreme ``seq``, epoch 1, loads and capacity u64 max;
    ``nest`` (depth, field: 0 unknown, 1 endpoint, 2 role, 3 pd_group, 4 load, ...)."""
    biggest = [0, _X[U64_MAX]]
    out = [worker, 1, 0, 0, _X[seq], 0, *biggest * 3, *biggest, *biggest * 2, 0]
    return out + ([1, _D[nest[0]], 0, 0, nest[1]] if nest else [0])


_WIRE_VALUES_SEEDS = [
    # The first case: two instances send seq 1 then 2**64 - 1 (w4 joins, w1 is at seq 2).
    bytes(_wv_batch(3) + _wv_batch(3, U64_MAX) + _wv_batch(0, U64_MAX)),
    # Its second: a jump, a restart, a jump to 2**63; then the snapshot the jump asked for, at seq 5.
    bytes(
        _wv_batch(3) + _wv_batch(3, U64_MAX) + _wv_batch(3, 1, 2) + _wv_batch(3, 1 << 63, 2) + [3, 3, 1, 5]
    ),
    # Holes just within and just past the widest (w1 is at seq 2); a heartbeat at the end of u64.
    bytes(_wv_batch(0, MAX_GAP + 1) + _wv_batch(0, MAX_GAP + 2) + _wv_heartbeat(0, U64_MAX)),
    # Nesting: 5,000 levels in an unknown field, 2,000 in an event, 1,000 in a heartbeat's endpoint
    # and role, 129 (past the JSON limit, well within the decoder's) as a key.
    bytes(
        _wv_batch(0, nest=(5000, 0))
        + _wv_batch(0, nest=(2000, 1))
        + _wv_heartbeat(0, 2, (1000, 1))
        + _wv_heartbeat(0, 2, (1000, 2))
        + _wv_batch(0, nest=(129, 2))
    ),
]


def _gs(method: int, form: int, *rest: int, model: int = 0) -> list[int]:
    """grpc_strings choices: method (0 Score, 1 ScoreStream, 2 Lookup, 3 Commit), model, form (0
    messages, 1 prompt, 2 block keys), then what the form reads."""
    return [method, model, form, *rest]


_GRPC_STRINGS_SEEDS = [
    # The cases: messages of "[" x 5,000; a chat with tools of "[" x 5,000, another with
    # chat_template_kwargs of '{"a":' x 1,000.
    bytes(
        _gs(0, 0, _D[5000], 0, 1, 1, 1)
        + _gs(0, 0, 0, 6, 6, 0, _D[5000], 0, 1, 1)
        + _gs(2, 0, 0, 6, 6, 1, 1, 0, _D[1000], 2)
    ),
    bytes(_gs(1, 0, _D[5000], 0, 1, 1, 1) + _gs(2, 0, _D[1000], 2, 1, 1, 0, _D[5000], 0)),
    # Past the JSON limit inside a chat's message (129 and 130 levels); a tool call's arguments
    # nested 1,005 deep.
    bytes(
        _gs(0, 0, _D[128], 4, 1, 1, 1) + _gs(0, 0, _D[129], 4, 1, 1, 1) + _gs(3, 0, _D[1005], 5, 1, 1, 1, 0)
    ),
    # Invalid UTF-8 in the model, the prompt and a Commit's request_id; a lone surrogate in JSON.
    bytes(_gs(2, 1, 1, model=4) + _gs(0, 1, 1) + _gs(3, 2, 0, 1) + _gs(0, 0, 0, 6, 0, 1, 1, 1)),
]


def seeds(target: str) -> list[bytes]:
    vec = _vectors()
    w1_next = _batch("w1", 3, [_stored(range(31, 45)), {"type": "cleared", "tier": "cpu"}])
    deep = b"\x91" * 5000 + b"\x00"  # (issue 32: nesting the decoder does not follow)
    if target == "batch":
        return [
            frame(0, w1_next),
            frame(0, w1_next) + frame(1, _batch("w2", 2, [_stored(range(200, 300))])),
            frame(4, _batch("new", 1, [_stored([1, 2])])) + frame(2, _batch("w3", 6, [_stored([7])])),
            frame(0, _batch("w1", 1, [_stored([9])], epoch=2)),
            frame(0, vec["event_batch"]),
            # issue 32: a seq at the end of u64, then the next one; nesting in an unknown field
            frame(0, _batch("w1", U64_MAX, [_stored([9])])) + frame(0, _batch("w1", 3, [_stored([8])])),
            frame(0, _with_field(w1_next, "x", deep)),
        ]
    if target == "heartbeat":
        return [
            frame(0, _heartbeat("w1", 2, {"gpu": 8}, {"gpu": (27, 0)})),
            frame(1, _heartbeat("w2", 4, {"gpu": 8, "cpu": 4})) + frame(3, _heartbeat("w4", 0, {})),
            frame(0, vec["status"]),
            frame(0, _heartbeat("w1", U64_MAX, {"gpu": U64_MAX}, {"gpu": (U64_MAX, U64_MAX)})),
            frame(0, _with_field(_heartbeat("w1", 2, {}), "endpoint", deep)),
        ]
    if target == "wire_values":
        return _WIRE_VALUES_SEEDS
    if target == "grpc_strings":
        return _GRPC_STRINGS_SEEDS
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
            # issue 32: not protobuf (Stats, ScoreStream), a string that is not UTF-8 (Score)
            bytes([5]) + b"\xff",
            bytes([6]) + b"\xff",
            bytes([0]) + b"\x0a\x02\xff\xfe",
            bytes([4]) + pb.ListInstancesRequest(model=MODEL).SerializeToString(),
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
