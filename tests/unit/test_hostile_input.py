"""Hostile input (issue 32), the pure half: request deserializers that never raise, JSON nested beyond
the depth limit in prompt fields, msgpack nested beyond what the decoder follows in batches and
heartbeats, and sequence numbers at the ends of u64. The half over real gRPC and NATS is
tests/integration/test_hostile_input.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import structlog.testing

from kvindex.api.errors import BadRequest
from kvindex.api.handlers import Malformed, deserializer
from kvindex.api.servicer import U32_MAX, KvIndexServicer
from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.ingest.limits import SEQ_JUMP
from kvindex.observability.counters import IngestCounters
from kvindex.route.openai_body import BodyError, parse_body
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.ranker import build_ranker
from kvindex.sequencer.cursor import MAX_GAP, Sequencer
from kvindex.tokenize import TokenizeError, Tokenizers, bounded_json
from kvindex.tokenize.bounded_json import MAX_JSON_DEPTH, TooDeep
from kvindex.tokenize.chat import conversation
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire import encode_batch, encode_heartbeat
from kvindex.wire import errors as E
from kvindex.wire.reconcile import Snapshot
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir

# KvIndex's unary methods (the seventh, ScoreStream, is streamed).
UNARY_METHODS = ("Score", "Lookup", "Commit", "Release", "ListInstances", "Stats")
# Field 1 holding the bytes ff fe: a string in every request but StatsRequest (no fields: an unknown
# field there, which parses).
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def test_deserializer_returns_what_is_wrong_instead_of_raising() -> None:
    parse = deserializer(pb.ScoreRequest)
    bad = parse(b"\xff")
    assert isinstance(bad, Malformed)
    assert bad.message == (
        "the request is not a valid kvindex.v1.ScoreRequest message: Wire format was corrupt"
    )
    utf8 = parse(BAD_UTF8)
    assert isinstance(utf8, Malformed) and "bad UTF-8" in utf8.message
    good = pb.ScoreRequest(model="m", token_ids=[1])
    assert parse(good.SerializeToString()) == good


# -- item 3: JSON nested beyond the limit in prompt fields -------------------------------------------


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def test_bounded_json_takes_the_limit_and_refuses_one_more() -> None:
    assert bounded_json.loads(nested_list(MAX_JSON_DEPTH), "x") is not None
    assert bounded_json.loads(nested_object(MAX_JSON_DEPTH).encode(), "x") is not None
    for text in (
        nested_list(MAX_JSON_DEPTH + 1),
        nested_object(MAX_JSON_DEPTH + 1),
        "[" * 5000,
        '{"a":' * 1000,
    ):
        with pytest.raises(TooDeep, match=f"x is nested deeper than {MAX_JSON_DEPTH} levels"):
            bounded_json.loads(text, "x")
    # Brackets inside strings are no nesting.
    assert bounded_json.loads(json.dumps(["[" * 1000]), "x") == ["[" * 1000]


CHAT = '[{"role": "user", "content": "hello"}]'
DEEP_PROMPTS = {
    "messages": (pb.ScoreRequest(model="m", messages="[" * 5000), "messages"),
    "messages-500-deep": (
        pb.ScoreRequest(model="m", messages=f'[{{"role": "user", "content": "x", "x": {nested_list(500)}}}]'),
        "messages",
    ),
    "tools": (
        pb.ScoreRequest(model="m", messages=CHAT, prompt_options=pb.PromptOptions(tools="[" * 5000)),
        "prompt_options.tools",
    ),
    "documents": (
        pb.ScoreRequest(
            model="m", messages=CHAT, prompt_options=pb.PromptOptions(documents=nested_list(200))
        ),
        "prompt_options.documents",
    ),
    "chat_template_kwargs": (
        pb.ScoreRequest(
            model="m", messages=CHAT, prompt_options=pb.PromptOptions(chat_template_kwargs='{"a":' * 1000)
        ),
        "prompt_options.chat_template_kwargs",
    ),
}


@pytest.mark.parametrize(("request_", "field"), DEEP_PROMPTS.values(), ids=list(DEEP_PROMPTS))
def test_prompt_fields_nested_beyond_the_limit_are_bad_requests(
    request_: pb.ScoreRequest, field: str
) -> None:
    servicer = servicer_of(InvertedIndex(), Registry(), IngestCounters())
    for request in (request_, copy_as(request_, pb.LookupRequest), copy_as(request_, pb.CommitRequest)):
        with pytest.raises(BadRequest, match=f"^{field} is nested deeper than {MAX_JSON_DEPTH} levels"):
            servicer.resolve(request)


def servicer_of(
    index: InvertedIndex, registry: Registry, counters: IngestCounters, tokenizers: Tokenizers | None = None
) -> KvIndexServicer:
    router = build_ranker(index, registry, Calibrator.of(CostConfig()))
    return KvIndexServicer(index, registry, counters, None, router, tokenizers or Tokenizers())


def copy_as(request: pb.ScoreRequest, cls: type) -> Any:
    """The request's prompt fields in another request type (Lookup, Commit)."""
    out = cls(model=request.model, messages=request.messages)
    out.prompt_options.CopyFrom(request.prompt_options)
    return out


def test_tool_call_arguments_nested_beyond_the_limit_are_refused() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(TokenizeError, match=r"function\.arguments is nested deeper than 128 levels"):
        conversation(messages, "string")


def test_openai_body_nested_beyond_the_limit_is_a_body_error() -> None:
    for body in (
        b'{"model": "m", "messages": ' + b"[" * 5000,
        b'{"model": "m", "prompt": "x", "extra": ' + nested_list(200).encode() + b"}",
    ):
        with pytest.raises(BodyError, match="the request body is nested deeper than 128 levels"):
            parse_body(body, "/v1/chat/completions")


def test_a_chat_at_the_depth_limit_renders(tmp_path: Path) -> None:
    # Nesting the limit lets through must not fail later, in the template (tojson recursing): a tool
    # whose parameters take the whole depth, rendered with the Llama 3 template's tojson(indent=4).
    tokenizers = Tokenizers.from_dirs({"m": str(make_tokenizer_dir(tmp_path / "llama3", "llama3"))})
    servicer = servicer_of(InvertedIndex(), Registry(), IngestCounters(), tokenizers)
    params: Any = {}  # one level, and three around it: [ {function: {parameters: ...}} ]
    for _ in range(MAX_JSON_DEPTH - 4):
        params = {"a": params}
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": params}}])
    request = pb.ScoreRequest(model="m", messages=CHAT, prompt_options=pb.PromptOptions(tools=tools))
    assert servicer.resolve(request).tokens > MAX_JSON_DEPTH
    deeper = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"a": params}}}])
    request.prompt_options.tools = deeper
    with pytest.raises(BadRequest, match=r"prompt_options\.tools is nested deeper"):
        servicer.resolve(request)


# -- item 4: msgpack nested beyond what the decoder follows, in batches and heartbeats --------------


def nested_msgpack(depth: int) -> bytes:
    """``depth`` arrays of one element each around a 0: valid msgpack, as deep as asked."""
    return b"\x91" * depth + b"\x00"


def with_field(payload: bytes, name: str, raw: bytes) -> bytes:
    """A msgpack map (fixmap) with one more field, ``name`` = the already encoded ``raw``."""
    assert 0x80 <= payload[0] < 0x8F
    return bytes([payload[0] + 1]) + payload[1:] + msgpack.packb(name) + raw


def batch(seq: int, keys: list[int], worker: str = "w1", epoch: int = 1) -> bytes:
    events = [{"type": "stored", "tier": "gpu", "keys": keys, "parent": None}]
    return encode_batch(worker=worker, model="m", epoch=epoch, seq=seq, ts=0.0, block_size=4, events=events)


def heartbeat(seq: int, worker: str = "w1", epoch: int = 1, ts: float = 0.0) -> bytes:
    return encode_heartbeat(
        worker=worker, model="m", epoch=epoch, seq=seq, ts=ts, block_size=4, load={}, capacity={}, digest={}
    )


def view(c: Consumer) -> Any:
    """What a rejected message must leave unchanged."""
    ix = c.index
    return (
        ix.stats(),
        {i: (ix.block_counts(i), ix.digest(i, 0)) for i in ix.instances()},
        {s.key: (s.epoch, s.last_seq, s.batches, s.heartbeat.ts) for s in c.registry.all()},
    )


DEEP = {
    "batch-unknown-field-1000": ("events", lambda: with_field(batch(2, [9]), "x", nested_msgpack(1000))),
    "batch-unknown-field-5000": ("events", lambda: with_field(batch(2, [9]), "x", nested_msgpack(5000))),
    "batch-event-field": (
        "events",
        lambda: encode_batch(worker="w1", model="m", epoch=1, seq=2, ts=0.0, block_size=4, events=[]).replace(
            b"\xa6events\x90", b"\xa6events\x91\x81\xa1x" + nested_msgpack(2000)
        ),
    ),
    "heartbeat-unknown-field": ("status", lambda: with_field(heartbeat(1), "x", nested_msgpack(1000))),
    "heartbeat-endpoint": ("status", lambda: with_field(heartbeat(1), "endpoint", nested_msgpack(5000))),
    "heartbeat-role": ("status", lambda: with_field(heartbeat(1), "role", nested_msgpack(5000))),
}


@pytest.mark.parametrize(("kind", "make_payload"), DEEP.values(), ids=list(DEEP))
def test_msgpack_nested_too_deep_is_rejected_counted_and_logged_with_the_worker(
    kind: str, make_payload: Callable[[], bytes]
) -> None:
    with structlog.testing.capture_logs() as logs:
        c = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
        assert c.on_events("kvindex.events.w1", batch(1, [1, 2]))
        assert c.on_heartbeat("kvindex.status.w1", heartbeat(1))
        before = view(c)
        handle = c.on_events if kind == "events" else c.on_heartbeat
        assert handle(f"kvindex.{kind}.w1", make_payload()) is False
    assert view(c) == before
    assert c.counters.rejects == {E.TOO_DEEP: 1} and c.counters.rejects_by_worker == {"w1": 1}
    (rejected,) = [e for e in logs if e["event"] == "message_rejected"]
    assert rejected["worker"] == "w1" and rejected["reason"] == E.TOO_DEEP
    assert "nested deeper than the decoder follows" in rejected["error"]
    # Nothing else is hurt: the next batch applies.
    assert c.on_events("kvindex.events.w1", batch(2, [3]))


def test_deep_heartbeat_of_an_unknown_worker_is_rejected_under_its_subject() -> None:
    c = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    assert not c.on_heartbeat("kvindex.status.w9", with_field(heartbeat(0, "w9"), "x", nested_msgpack(5000)))
    assert not c.on_events("kvindex.events.w8", with_field(batch(1, [1], "w8"), "x", nested_msgpack(5000)))
    assert c.counters.rejects == {E.TOO_DEEP: 2}
    assert c.counters.rejects_by_worker == {"w9": 1, "w8": 1} and len(c.registry) == 0


# -- item 1: sequence numbers at the ends of u64 -------------------------------------------------------

U64_MAX = (1 << 64) - 1


class Requests:
    """A repair transport that records what is asked and answers by hand."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, str]] = []

    def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
        self.asked.append((instance, "replay"))

    def request_snapshot(self, instance: Any, cause: str) -> None:
        self.asked.append((instance, f"snapshot:{cause}"))


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: Any, message: str) -> None:
        raise Aborted(code, message)


def answer(servicer: KvIndexServicer, method: str, request: Any) -> Any:
    reply = asyncio.run(getattr(servicer, method)(request, Context()))
    if isinstance(reply, bytes):  # Lookup answers with its encoded bytes (kvindex/api/lookup.py)
        reply = pb.LookupResponse.FromString(reply)
    return reply


def test_seqs_at_the_ends_of_u64_leave_stats_and_list_instances_working() -> None:
    # The issue's two cases: two instances send seq 1 then 2**64 - 1 (Stats summed their "missing
    # batches" past u64); one jumps, restarts and jumps to 2**63 (its own sum broke ListInstances).
    c = build_consumer(
        InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters()
    )  # no repair transport: jumps are taken as positions
    sent = [(w, 1, 1) for w in "abc"] + [(w, 1, U64_MAX) for w in "abc"] + [("c", 2, 1), ("c", 2, 1 << 63)]
    for worker, epoch, seq in sent:
        c.on_events(f"kvindex.events.{worker}", batch(seq, [seq % 1000], worker, epoch))
    servicer = servicer_of(c.index, c.registry, c.counters)
    stats = answer(servicer, "Stats", pb.StatsRequest())
    assert stats.rejects_by_reason == {SEQ_JUMP: 4} and stats.missing_batches == 0 and stats.gaps == 0
    listed = answer(servicer, "ListInstances", pb.ListInstancesRequest())
    assert {i.instance_id: (i.epoch, i.last_seq, i.missing_batches) for i in listed.instances} == {
        "a/0": (1, U64_MAX, 0),
        "b/0": (1, U64_MAX, 0),
        "c/0": (2, 1 << 63, 0),
    }
    assert c.index.block_counts(("c", 0)) == (2, 0, 0, 0)  # the new epoch's blocks, applied


def test_a_jump_is_refused_logged_with_the_worker_and_resynchronised_from_a_snapshot() -> None:
    requests = Requests()
    with structlog.testing.capture_logs() as logs:
        c = build_consumer(
            InvertedIndex(),
            Registry(),
            sequencer=Sequencer(),
            counters=IngestCounters(),
            repair=lambda _machine: requests,
        )
        assert c.on_events("kvindex.events.w1", batch(1, [1]))
        assert not c.on_events("kvindex.events.w1", batch(U64_MAX, [2]))
        assert not c.on_events("kvindex.events.w1", batch(U64_MAX - 1, [3]))  # while the snapshot runs
    key = ("w1", 0)
    assert requests.asked == [(key, "snapshot:jump")]  # one snapshot, no replay of 2**64 batches
    cursor = c.sequencer.cursor(key)
    assert cursor is not None and not cursor.buffer and cursor.applied == 1
    assert c.counters.rejects == {SEQ_JUMP: 2} and c.counters.rejects_by_worker == {"w1": 2}
    assert c.counters.missing_batches == 0 and c.counters.gaps == 0
    (logged,) = [e for e in logs if e.get("reason") == SEQ_JUMP]  # once a minute per instance
    assert logged["worker"] == "w1" and f"batch seq {U64_MAX} is" in logged["error"]
    # The snapshot says where the worker really is: seq 2 (it lied). Its next batch applies.
    c.repairs.on_snapshot(key, Snapshot(epoch=1, seq=2, tiers={0: [1, 5]}))
    assert c.on_events("kvindex.events.w1", batch(3, [6]))
    assert sorted(c.index.keys_of(key, 0)) == [1, 5, 6] and c.registry.get(key).repair.sync == "synced"  # type: ignore[union-attr]


def test_a_heartbeat_jump_asks_a_snapshot_not_a_replay_of_its_tail() -> None:
    requests = Requests()
    c = build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=lambda _machine: requests,
    )
    assert c.on_events("kvindex.events.w1", batch(1, [1]))
    assert c.on_heartbeat("kvindex.status.w1", heartbeat(U64_MAX))
    assert requests.asked == [(("w1", 0), "snapshot:jump")]
    assert c.counters.rejects == {SEQ_JUMP: 1} and c.counters.missing_batches == 0
    # A tail within the widest hole is still a lost tail: replayed, its batches counted missing.
    c2 = build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=lambda _machine: requests,
    )
    assert c2.on_events("kvindex.events.w1", batch(1, [1]))
    assert c2.on_heartbeat("kvindex.status.w1", heartbeat(1 + MAX_GAP))
    assert requests.asked[-1] == (("w1", 0), "replay") and c2.counters.missing_batches == MAX_GAP


def test_replies_saturate_what_does_not_fit_their_fields() -> None:
    # Counters are Python ints; the reply's fields are uint64 (uint32 for token counts). A block
    # size of 2**20 (the wire's largest) times 5,000 block keys is 5.2e9 tokens.
    c = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    keys = list(range(1, 5001))
    big = encode_batch(
        worker="w1", model="m", epoch=1, seq=1, ts=0.0, block_size=1 << 20,
        events=[{"type": "stored", "tier": "gpu", "keys": keys, "parent": None}],
    )  # fmt: skip
    assert c.on_events("kvindex.events.w1", big)
    c.counters.missing_batches = c.counters.gaps = 1 << 70
    c.counters.rejects["x"] = 1 << 65
    c.registry.get(("w1", 0)).missing_batches = 1 << 66  # type: ignore[union-attr]
    servicer = servicer_of(c.index, c.registry, c.counters)
    stats = answer(servicer, "Stats", pb.StatsRequest())
    assert stats.missing_batches == stats.gaps == stats.rejects_total == U64_MAX
    assert stats.rejects_by_reason["x"] == U64_MAX
    listed = answer(servicer, "ListInstances", pb.ListInstancesRequest())
    assert listed.instances[0].missing_batches == U64_MAX
    score = answer(servicer, "Score", pb.ScoreRequest(model="m", block_keys=keys))
    assert score.prompt_tokens == U32_MAX and score.ranked[0].matched_tokens == U32_MAX
    lookup = answer(servicer, "Lookup", pb.LookupRequest(model="m", block_keys=keys))
    assert lookup.prompt_tokens == U32_MAX and lookup.matches[0].matched_blocks == 5000
