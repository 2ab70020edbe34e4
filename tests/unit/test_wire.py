"""Wire codec: round trips, published message vectors, and a precise rejection for each contract breach."""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.wire import (
    CLEARED,
    CPU,
    GPU,
    REMOVED,
    STORED,
    Limits,
    Subjects,
    WireError,
    codec,
    decode_batch,
    decode_heartbeat,
    encode_batch,
    encode_heartbeat,
)
from kvindex.wire import errors as E
from kvindex.wire.schema import Cleared, Removed, Stored
from tests.conftest import ROOT

MESSAGES = json.loads((ROOT / "proto" / "vectors" / "messages.json").read_text())


def batch(**over: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "v": 1,
        "worker": "w1",
        "model": "m",
        "epoch": 5,
        "seq": 1,
        "ts": 1.5,
        "block_size": 16,
        "dp_rank": 0,
        "events": [{"type": "stored", "tier": "gpu", "keys": [1, 2**64 - 1], "parent": None}],
    }
    msg.update(over)
    return {k: v for k, v in msg.items() if v is not DROP}


DROP = object()


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def test_published_batch_vector_decodes() -> None:
    vec = MESSAGES["event_batch"]
    b = decode_batch(bytes.fromhex(vec["hex"]), "gpu-node-3")
    assert (b.worker, b.model, b.epoch, b.seq, b.block_size, b.dp_rank) == (
        "gpu-node-3",
        "meta-llama/Llama-3.1-8B-Instruct",
        1764470000000000,
        7,
        4,
        0,
    )
    assert [(e.op, e.tier, list(e.keys), e.parent) for e in b.events] == [
        (STORED, "gpu", [1054398093816422409, 1522510627976988810], None),
        (REMOVED, "cpu", [18348074344553213496], None),
        (CLEARED, "disk", [], None),
    ]
    # The hex is exactly what the encoder produces for the decoded JSON form.
    d = vec["decoded"]
    assert encode_batch(
        **{k: d[k] for k in ("worker", "model", "epoch", "seq", "ts", "block_size", "dp_rank", "events")}
    ) == bytes.fromhex(vec["hex"])


def test_published_heartbeat_vector_decodes() -> None:
    s = decode_heartbeat(bytes.fromhex(MESSAGES["status"]["hex"]), "gpu-node-3")
    assert s.seq == 7 and s.load.running == 3 and s.load.waiting_prefill_tokens == 2048
    assert s.load.kv_usage == pytest.approx(0.42)
    assert s.capacity == {GPU: 24000, CPU: 100000}
    assert s.digest[GPU] == (2, 1054398093816422409 ^ 1522510627976988810)


def test_round_trip_all_event_types_and_unknown_fields_ignored() -> None:
    msg = batch(
        events=[
            {"type": "stored", "tier": "shared", "keys": [3], "parent": 7, "future_field": [1, 2]},
            {"type": "removed", "tier": "disk", "keys": []},
            {"type": "cleared", "tier": None},
            {"type": "cleared"},
        ],
        dp_rank=3,
        something_new={"x": 1},
    )
    b = decode_batch(pack(msg), "w1")
    assert b.instance == ("w1", 3)
    assert [(e.op, e.tier, list(e.keys), e.parent) for e in b.events] == [
        (STORED, "shared", [3], 7),
        (REMOVED, "disk", [], None),
        (CLEARED, None, [], None),
        (CLEARED, None, [], None),
    ]


def test_dp_rank_defaults_to_zero() -> None:
    assert decode_batch(pack(batch(dp_rank=DROP)), "w1").dp_rank == 0


BAD_BATCHES: list[tuple[str, bytes, str, str]] = [
    ("garbage", b"\xc1\xff\x00", E.MALFORMED, "not valid msgpack"),
    ("truncated", pack(batch())[:-3], E.MALFORMED, "not valid msgpack"),
    ("array", pack([1, 2, 3]), E.NOT_A_MAP, "Expected `object`, got `array`"),
    ("version", pack(batch(v=2)), E.UNSUPPORTED_VERSION, "wire version 2"),
    ("future version with other fields", pack({"v": 2, "seq": "x"}), E.UNSUPPORTED_VERSION, "wire version 2"),
    ("no version", pack(batch(v=DROP)), E.MISSING_FIELD, "missing required field `v`"),
    ("no seq", pack(batch(seq=DROP)), E.MISSING_FIELD, "missing required field `seq`"),
    ("no events", pack(batch(events=DROP)), E.MISSING_FIELD, "missing required field `events`"),
    ("seq zero", pack(batch(seq=0)), E.BAD_VALUE, "`int` >= 1 - at `$.seq`"),
    ("seq str", pack(batch(seq="1")), E.BAD_TYPE, "Expected `int`, got `str` - at `$.seq`"),
    ("seq bool", pack(batch(seq=True)), E.BAD_TYPE, "Expected `int`, got `bool` - at `$.seq`"),
    ("epoch negative", pack(batch(epoch=-1)), E.BAD_VALUE, "`int` >= 0 - at `$.epoch`"),
    ("ts str", pack(batch(ts="now")), E.BAD_TYPE, "got `str` - at `$.ts`"),
    ("block size 0", pack(batch(block_size=0)), E.BAD_VALUE, "at `$.block_size`"),
    ("model empty", pack(batch(model="")), E.BAD_VALUE, "length >= 1 - at `$.model`"),
    ("model int", pack(batch(model=3)), E.BAD_TYPE, "Expected `str`, got `int` - at `$.model`"),
    ("worker bad chars", pack(batch(worker="w 1")), E.BAD_VALUE, "at `$.worker`"),
    ("subject mismatch", pack(batch(worker="w2")), E.SUBJECT_MISMATCH, "differs from subject worker 'w1'"),
    (
        "events not list",
        pack(batch(events={"a": 1})),
        E.BAD_TYPE,
        "Expected `array`, got `object` - at `$.events`",
    ),
    ("event not map", pack(batch(events=[["stored"]])), E.NOT_A_MAP, "at `$.events[0]`"),
    (
        "event type",
        pack(batch(events=[{"type": "evicted", "tier": "gpu", "keys": []}])),
        E.BAD_VALUE,
        "'evicted' - at `$.events[0].type`",
    ),
    (
        "tier",
        pack(batch(events=[{"type": "stored", "tier": "hbm", "keys": [1]}])),
        E.BAD_VALUE,
        "'hbm' - at `$.events[0].tier`",
    ),
    (
        "no tier",
        pack(batch(events=[{"type": "removed", "keys": [1]}])),
        E.MISSING_FIELD,
        "field `tier` - at `$.events[0]`",
    ),
    (
        "no keys",
        pack(batch(events=[{"type": "removed", "tier": "gpu"}])),
        E.MISSING_FIELD,
        "field `keys` - at `$.events[0]`",
    ),
    (
        "keys str",
        pack(batch(events=[{"type": "stored", "tier": "gpu", "keys": "abc"}])),
        E.BAD_TYPE,
        "at `$.events[0].keys`",
    ),
    (
        "key float",
        pack(batch(events=[{"type": "stored", "tier": "gpu", "keys": [1, 2.0]}])),
        E.BAD_TYPE,
        "got `float` - at `$.events[0].keys[1]`",
    ),
    (
        "key negative",
        pack(batch(events=[{"type": "stored", "tier": "gpu", "keys": [1, -2]}])),
        E.BAD_VALUE,
        ">= 0 - at `$.events[0].keys[1]`",
    ),
    (
        "key null",
        pack(batch(events=[{"type": "removed", "tier": "gpu", "keys": [None]}])),
        E.BAD_TYPE,
        "got `None` - at `$.events[0].keys[0]`",
    ),
    (
        "parent str",
        pack(batch(events=[{"type": "stored", "tier": "gpu", "keys": [1], "parent": "p"}])),
        E.BAD_TYPE,
        "at `$.events[0].parent`",
    ),
]


@pytest.mark.parametrize(("name", "payload", "reason", "text"), BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_bad_batches_rejected_with_reason(name: str, payload: bytes, reason: str, text: str) -> None:
    with pytest.raises(WireError) as info:
        decode_batch(payload, "w1")
    assert info.value.reason == reason
    assert text in str(info.value)


def test_oversize_batches() -> None:
    limits = Limits(max_events=2, max_keys=5)
    ev = {"type": "stored", "tier": "gpu", "keys": [1, 2, 3], "parent": None}
    with pytest.raises(WireError) as info:
        decode_batch(pack(batch(events=[ev, ev, ev])), "w1", limits)
    assert info.value.reason == E.OVERSIZE and "3 events" in info.value.message
    with pytest.raises(WireError) as info:
        decode_batch(pack(batch(events=[ev, ev])), "w1", limits)
    assert info.value.reason == E.OVERSIZE and "6 keys" in info.value.message
    assert len(decode_batch(pack(batch(events=[ev])), "w1", limits).events) == 1


def heartbeat(**over: Any) -> bytes:
    msg: dict[str, Any] = {
        "v": 1,
        "worker": "w1",
        "model": "m",
        "epoch": 5,
        "seq": 0,
        "ts": 2.0,
        "block_size": 16,
        "load": {"running": 1, "waiting": 2, "waiting_prefill_tokens": 300, "kv_usage": 0.5, "gpu_util": 0.9},
        "capacity": {"gpu": 100},
        "digest": {"gpu": [0, 0]},
    }
    msg.update(over)
    return pack({k: v for k, v in msg.items() if v is not DROP})


def test_heartbeat_decodes_and_keeps_extra_load() -> None:
    s = decode_heartbeat(heartbeat(), "w1")
    assert s.load.extra == {"gpu_util": 0.9}
    assert s.capacity == {GPU: 100} and s.digest == {GPU: (0, 0)}
    assert decode_heartbeat(heartbeat(load=DROP, capacity=DROP, digest=DROP), "w1").load.running == 0


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"load": {"kv_usage": 1.5}}, E.BAD_VALUE),
        ({"load": {"running": -1}}, E.BAD_VALUE),
        ({"load": [1]}, E.NOT_A_MAP),
        ({"load": {"running": 1.5}}, E.BAD_TYPE),
        ({"digest": {"gpu": [1]}}, E.BAD_VALUE),
        ({"digest": {"gpu": [1, "x"]}}, E.BAD_TYPE),
        ({"v": 3}, E.UNSUPPORTED_VERSION),
        (b"not msgpack", E.MALFORMED),
        ({"digest": {"vram": [1, 1]}}, E.BAD_VALUE),
        ({"capacity": {"gpu": "lots"}}, E.BAD_TYPE),
        ({"seq": DROP}, E.MISSING_FIELD),
        ({"worker": "other"}, E.SUBJECT_MISMATCH),
    ],
)
def test_bad_heartbeat_rejected(over: dict | bytes, reason: str) -> None:
    payload = over if isinstance(over, bytes) else heartbeat(**over)
    with pytest.raises(WireError) as info:
        decode_heartbeat(payload, "w1")
    assert info.value.reason == reason


def test_subjects() -> None:
    s = Subjects("prod.kv")
    assert s.events("w-1") == "prod.kv.events.w-1"
    assert s.heartbeat("w_1") == "prod.kv.status.w_1"
    assert s.snapshot("w") == "prod.kv.snapshot.w" and s.replay("w") == "prod.kv.replay.w"
    assert s.worker_of("prod.kv.events.w-1", "events") == "w-1"
    for bad in ("prod.kv.events.", "prod.kv.events.a.b", "prod.kv.status.w1", "other.events.w1"):
        with pytest.raises(WireError):
            s.worker_of(bad, "events")
    with pytest.raises(ValueError):
        s.events("bad id")
    with pytest.raises(ValueError):
        s.events("x" * 129)
    with pytest.raises(ValueError):
        Subjects("bad prefix")


def test_encode_heartbeat_round_trip() -> None:
    data = encode_heartbeat(
        worker="w1",
        model="m",
        epoch=1,
        seq=3,
        ts=0.0,
        block_size=8,
        load={"running": 2},
        capacity={"cpu": 10},
        digest={"cpu": (1, 99)},
        dp_rank=2,
    )
    s = decode_heartbeat(data, "w1")
    assert (s.dp_rank, s.seq, s.digest, s.capacity) == (2, 3, {CPU: (1, 99)}, {CPU: 10})


# The worker id's pattern is checked once per distinct id (kvindex/wire/codec.py decode_batch): what a
# batch decodes to, or why it is rejected, must be what decoding with the whole schema says, checked
# here against that schema written out (the worker typed by its pattern, as before the cache).
class _WholeSchema(msgspec.Struct, gc=False):
    v: int
    worker: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    seq: Annotated[int, msgspec.Meta(ge=1)]
    ts: float
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    events: list[Stored | Removed | Cleared]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0


def _whole_schema(payload: bytes) -> Any:
    """(fields) or (reason, message): decode_batch before the cache, for a batch of the subject's worker."""
    try:
        msg = msgspec.msgpack.Decoder(_WholeSchema).decode(payload)
    except msgspec.MsgspecError as exc:
        err = codec._decode_error(exc, payload)
        return (err.reason, str(err))
    if msg.v != 1:
        return (E.UNSUPPORTED_VERSION, str(codec._unsupported(msg.v)))
    return msgspec.structs.asdict(msg)


def _decoded(payload: bytes) -> Any:
    try:
        return msgspec.structs.asdict(decode_batch(payload))
    except WireError as err:
        return (err.reason, str(err))


_WORKERS = st.sampled_from(["w1", "w-2_X", "", "a b", "w1\n", "é", "x" * 128, "x" * 129, 7, None])
_ANY = st.one_of(st.integers(-3, 3), st.text(max_size=3), st.none(), st.floats(allow_nan=False))


@st.composite
def wire_batches(draw: st.DrawFn) -> bytes:
    msg = batch(worker=draw(_WORKERS))
    for name in draw(st.lists(st.sampled_from(sorted(msg)), max_size=3)):  # some fields bad or gone
        msg[name] = draw(st.one_of(st.just(DROP), _ANY))
    msg = {k: v for k, v in msg.items() if v is not DROP}
    order = draw(st.permutations(sorted(msg)))  # the first error in the payload's order is named
    return pack({k: msg[k] for k in order})


@settings(max_examples=400, deadline=None)
@given(st.lists(wire_batches(), min_size=1, max_size=6), st.booleans())
def test_worker_ids_checked_once_decode_as_the_whole_schema(payloads: list[bytes], full: bool) -> None:
    if full:  # the set of ids seen valid emptied at each batch: every id checked again
        codec._valid_workers.clear()
    for payload in payloads:
        assert _decoded(payload) == _whole_schema(payload)
        if full:
            codec._valid_workers.clear()


def test_the_ids_seen_valid_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "VALID_WORKERS_MAX", 2)
    codec._valid_workers.clear()
    for worker in ("a", "b", "c", "a"):
        assert decode_batch(pack(batch(worker=worker))).worker == worker
        assert len(codec._valid_workers) <= 2
    with pytest.raises(WireError, match="matching regex"):  # a bad id after the set was emptied
        decode_batch(pack(batch(worker="a b")))
