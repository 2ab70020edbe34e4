"""Hostile input over real gRPC and a real nats-server (issue 32): request bytes that are not protobuf
or carry invalid UTF-8, prompt fields nested beyond the JSON depth limit, msgpack nested beyond what
the decoder follows, and sequence numbers at the ends of u64. Every call is answered, hostile ones
with INVALID_ARGUMENT; hostile messages are rejected and counted by reason; an honest worker stays
exact. The pure halves (consumer, codec, servicer) are in tests/unit/test_hostile_input.py."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import nats
import pytest
import structlog.testing
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.tokenize.bounded_json import MAX_JSON_DEPTH
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire import encode_batch, encode_heartbeat
from tests.conftest import wait_until
from tests.integration.test_e2e import settle
from tests.integration.test_ext_proc import FULL_DUPLEX, Envoy, body_chunks, fleet, headers_msg
from tests.unit.test_hostile_input import BAD_UTF8, UNARY_METHODS, with_field
from workers_shim.publisher import Publisher

MakePub = Callable[..., Awaitable[Publisher]]


def raw_unary(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
    """A call of ``method`` whose request is sent as the given bytes, unparsed."""
    return channel.unary_unary(
        f"/kvindex.v1.KvIndex/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


@pytest.fixture
async def channel(service: IndexService) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.grpc.address) as ch:
        yield ch


MALFORMED_CALLS = [(m, b"\xff", "Wire format was corrupt") for m in UNARY_METHODS] + [
    (m, BAD_UTF8, "String field had bad UTF-8") for m in UNARY_METHODS if m != "Stats"
]


@pytest.mark.parametrize(
    ("method", "body", "why"), MALFORMED_CALLS, ids=[f"{m}-{b.hex()}" for m, b, _ in MALFORMED_CALLS]
)
async def test_request_bytes_that_do_not_parse_are_invalid_argument(
    channel: grpc.aio.Channel, method: str, body: bytes, why: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_unary(channel, method)(body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert f"not a valid kvindex.v1.{method}Request message" in details and why in details
    # The server is fine: a well-formed call of the same method after it.
    stats = await pb_grpc.KvIndexStub(channel).Stats(pb.StatsRequest())
    assert stats.instances == 0


async def test_score_stream_answers_bytes_that_do_not_parse_and_goes_on(channel: grpc.aio.Channel) -> None:
    call = channel.stream_stream(
        "/kvindex.v1.KvIndex/ScoreStream",
        request_serializer=lambda b: b,
        response_deserializer=pb.ScoreResponse.FromString,
    )
    good = pb.ScoreRequest(model="m", token_ids=[1, 2, 3], request_id="ok").SerializeToString()
    replies = [r async for r in call(iter([b"\xff", BAD_UTF8, good]))]
    assert [r.request_id for r in replies] == ["", "", "ok"]
    assert "not a valid kvindex.v1.ScoreRequest message: Wire format was corrupt" in replies[0].error
    assert "bad UTF-8" in replies[1].error
    assert not replies[2].error


async def test_ext_proc_stream_bytes_that_do_not_parse_are_invalid_argument(
    make_service: Callable[..., Awaitable[IndexService]],
) -> None:
    svc = await make_service(ext_proc_port=0, ext_proc_host="127.0.0.1")
    assert svc.ext_proc is not None
    async with grpc.aio.insecure_channel(svc.ext_proc.address) as ch:
        call = ch.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in call(iter([b"\xff"]))]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid envoy.service.ext_proc.v3.ProcessingRequest message" in (info.value.details() or "")


async def test_prompt_fields_nested_beyond_the_limit_are_invalid_argument(
    stub: pb_grpc.KvIndexStub,
) -> None:
    chat = '[{"role": "user", "content": "hi"}]'
    cases = [
        ({"messages": "[" * 5000}, "messages"),
        ({"messages": chat, "prompt_options": pb.PromptOptions(tools="[" * 5000)}, "prompt_options.tools"),
        (
            {"messages": chat, "prompt_options": pb.PromptOptions(chat_template_kwargs='{"a":' * 1000)},
            "prompt_options.chat_template_kwargs",
        ),
    ]
    for fields, name in cases:
        why = f"{name} is nested deeper than {MAX_JSON_DEPTH} levels"
        calls = [
            stub.Score(pb.ScoreRequest(model="m", **fields)),
            stub.Lookup(pb.LookupRequest(model="m", **fields)),
            stub.Commit(pb.CommitRequest(model="m", request_id="r", instance_id="w/0", **fields)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert why in (info.value.details() or "")
        streamed = [
            r async for r in stub.ScoreStream(iter([pb.ScoreRequest(model="m", request_id="s", **fields)]))
        ]
        assert [r.request_id for r in streamed] == ["s"] and why in streamed[0].error


async def test_ext_proc_body_nested_beyond_the_limit_is_400(
    make_service: Callable[..., Awaitable[IndexService]], make_publisher: MakePub
) -> None:
    svc = await make_service(ext_proc_port=0, ext_proc_host="127.0.0.1")
    assert svc.ext_proc is not None
    await fleet(make_publisher, svc, 1)
    async with grpc.aio.insecure_channel(svc.ext_proc.address) as ch:
        envoy = Envoy(ep_grpc.ExternalProcessorStub(ch))
        body = b'{"model": "picker-model", "messages": ' + b"[" * 5000
        await envoy.send(headers_msg("/v1/chat/completions", False, FULL_DUPLEX), *body_chunks(body))
        bad = await envoy.recv()
    assert bad.immediate_response.status.code == 400
    assert f"the request body is nested deeper than {MAX_JSON_DEPTH} levels" in bad.immediate_response.details


# -- all of it at once, beside an honest worker ---------------------------------------------------------

MODEL = "hostile-test"
BS = 4
U64_MAX = (1 << 64) - 1
PROMPT = list(range(2000, 2000 + 24 * BS))
KEYS = block_keys(PROMPT, BS, MODEL)


def raw_batch(worker: str, seq: int, keys: list[int], epoch: int = 1, **kw: Any) -> bytes:
    fields: dict[str, Any] = {"model": MODEL, "block_size": BS, "ts": 0.0}
    fields.update(kw)
    events = [{"type": "stored", "tier": "gpu", "keys": keys, "parent": None}]
    return encode_batch(worker=worker, epoch=epoch, seq=seq, events=events, **fields)


def raw_heartbeat(worker: str, seq: int, epoch: int = 1) -> bytes:
    return encode_heartbeat(
        worker=worker,
        model=MODEL,
        epoch=epoch,
        seq=seq,
        ts=0.0,
        block_size=BS,
        load={},
        capacity={},
        digest={},
    )


def in_parent(payload: bytes, nested: bytes) -> bytes:
    """The batch with its (only) event's parent replaced by ``nested``."""
    assert payload.count(b"\xa6parent\xc0") == 1
    return payload.replace(b"\xa6parent\xc0", b"\xa6parent" + nested)


def nats_hostile(round_: int) -> list[tuple[str, bytes]]:
    """One round of hostile NATS messages (items 1 and 4), from workers of their own."""
    deep, deeper = b"\x91" * 1000 + b"\x00", b"\x91" * 5000 + b"\x00"
    w = f"r{round_}"
    return [
        # item 1: two instances send seq 1, then 2**64 - 1 (a jump each)
        (f"kvindex.events.{w}a", raw_batch(f"{w}a", 1, [round_ * 100 + 1])),
        (f"kvindex.events.{w}b", raw_batch(f"{w}b", 1, [round_ * 100 + 2])),
        (f"kvindex.events.{w}a", raw_batch(f"{w}a", U64_MAX, [round_ * 100 + 3])),
        (f"kvindex.events.{w}b", raw_batch(f"{w}b", U64_MAX, [round_ * 100 + 4])),
        # ... one jumps, restarts and jumps to 2**63 (two jumps); a heartbeat jumps too
        (f"kvindex.events.{w}c", raw_batch(f"{w}c", 1, [round_ * 100 + 5])),
        (f"kvindex.events.{w}c", raw_batch(f"{w}c", U64_MAX, [round_ * 100 + 6])),
        (f"kvindex.events.{w}c", raw_batch(f"{w}c", 1, [round_ * 100 + 7], epoch=2)),
        (f"kvindex.events.{w}c", raw_batch(f"{w}c", 1 << 63, [round_ * 100 + 8], epoch=2)),
        (f"kvindex.events.{w}d", raw_batch(f"{w}d", 1, [round_ * 100 + 9])),
        (f"kvindex.status.{w}d", raw_heartbeat(f"{w}d", U64_MAX)),
        # item 4: nesting 1,000 and 5,000 deep, in unknown fields, an event, a heartbeat's endpoint
        (f"kvindex.events.{w}e", with_field(raw_batch(f"{w}e", 1, [1]), "x", deep)),
        (f"kvindex.events.{w}e", in_parent(raw_batch(f"{w}e", 1, [1]), deeper)),
        (f"kvindex.status.{w}e", with_field(raw_heartbeat(f"{w}e", 0), "endpoint", deep)),
        (f"kvindex.status.{w}e", with_field(raw_heartbeat(f"{w}e", 0), "x", deeper)),
    ]


# Per round: five jumps (two instances, two of a third's, a heartbeat's), four messages too deep.
NATS_REJECTS_PER_ROUND = {"seq_jump": 5, "too_deep": 4}


async def grpc_hostile(channel: grpc.aio.Channel, stub: pb_grpc.KvIndexStub) -> int:
    """Hostile calls (items 2 and 3), concurrently; each must be INVALID_ARGUMENT (ScoreStream: an
    error response). Returns how many were made."""
    chat = '[{"role": "user", "content": "hi"}]'
    deep_fields: list[dict[str, Any]] = [
        {"messages": "[" * 5000},
        {"messages": chat, "prompt_options": pb.PromptOptions(tools="[" * 5000)},
        {"messages": chat, "prompt_options": pb.PromptOptions(chat_template_kwargs='{"a":' * 1000)},
    ]
    calls = [raw_unary(channel, method)(body) for method, body, _ in MALFORMED_CALLS]
    for fields in deep_fields:
        calls += [
            stub.Score(pb.ScoreRequest(model=MODEL, **fields)),
            stub.Lookup(pb.LookupRequest(model=MODEL, **fields)),
            stub.Commit(pb.CommitRequest(model=MODEL, request_id="r", instance_id="honest/0", **fields)),
        ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT and result.details()
    stream = channel.stream_stream(
        "/kvindex.v1.KvIndex/ScoreStream",
        request_serializer=lambda b: b,
        response_deserializer=pb.ScoreResponse.FromString,
    )
    bodies = [b"\xff", BAD_UTF8] + [
        pb.ScoreRequest(model=MODEL, **f).SerializeToString() for f in deep_fields
    ]
    replies = [r async for r in stream(iter(bodies))]
    assert len(replies) == len(bodies) and all(r.error for r in replies)
    return len(results) + len(bodies)


async def test_hostile_traffic_beside_an_honest_worker(
    make_service: Callable[..., Awaitable[IndexService]], nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    svc = await make_service(metrics_port=0, metrics_host="127.0.0.1")
    honest = await make_publisher(worker="honest", model=MODEL, block_size=BS)
    # A worker whose block size (the wire's largest) times a prompt's blocks passes uint32.
    big = await make_publisher(worker="big", model="big-model", block_size=1 << 20)
    big_keys = list(range(1, 5001))
    big.stored(big_keys)
    nc = await nats.connect(nats_server.url)
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        held = 0
        with structlog.testing.capture_logs() as logs:
            for round_ in range(3):
                # The honest worker stores the next blocks of its prompt while the others attack.
                honest.stored(KEYS[held : held + 8], parent=KEYS[held - 1] if held else None)
                held += 8
                for subject, payload in nats_hostile(round_):
                    await nc.publish(subject, payload)
                await nc.flush()
                hostile = asyncio.ensure_future(grpc_hostile(channel, stub))
                await settle(svc, honest, big)
                assert await hostile > 0
                # The honest worker's lookups stay exact, and every RPC answers.
                reply = await stub.Lookup(pb.LookupRequest(model=MODEL, block_keys=KEYS))
                matches = {m.instance_id: m.matched_blocks for m in reply.matches}
                assert matches.pop("honest/0") == held and not any(matches.values())
                score = await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=KEYS))
                # (Score counts the blocks of requests committed to an instance too: the Lookup is exact.)
                assert score.ranked[0].instance_id == "honest/0" and score.ranked[0].matched_blocks >= held
                rid = f"req-{round_}"
                committed = await stub.Score(
                    pb.ScoreRequest(model=MODEL, block_keys=KEYS, commit=True, request_id=rid)
                )
                assert committed.committed_instance_id == "honest/0"
                assert (await stub.Release(pb.ReleaseRequest(request_id=rid, phase="finished"))).found
                expected = {r: n * (round_ + 1) for r, n in NATS_REJECTS_PER_ROUND.items()}
                await wait_until(
                    lambda e=expected: dict(svc.counters.rejects) == e, what=f"round {round_} rejected"
                )
                stats = await stub.Stats(pb.StatsRequest())
                assert dict(stats.rejects_by_reason) == expected and stats.missing_batches == 0
                listed = await stub.ListInstances(pb.ListInstancesRequest())
                by_id = {i.instance_id: i for i in listed.instances}
                assert by_id["honest/0"].sync == "synced" and by_id["honest/0"].last_seq == honest.seq
                assert all(i.missing_batches == 0 for i in listed.instances)
                assert (by_id[f"r{round_}c/0"].epoch, by_id[f"r{round_}c/0"].last_seq) == (2, 1)
                assert by_id[f"r{round_}a/0"].last_seq == 1  # the jump refused, resynchronising
        # uint32 reply fields saturate instead of failing the call.
        big_score = await stub.Score(pb.ScoreRequest(model="big-model", block_keys=big_keys))
        assert big_score.prompt_tokens == (1 << 32) - 1 and big_score.ranked[0].matched_blocks == 5000
        big_lookup = await stub.Lookup(pb.LookupRequest(model="big-model", block_keys=big_keys))
        assert big_lookup.prompt_tokens == (1 << 32) - 1
    await nc.close()
    # Every reject is logged with its worker id; the metric counts them by reason.
    rejected = [e for e in logs if e["event"] in ("message_rejected", "limit_refused")]
    assert rejected and all(e["worker"] and e["worker"].startswith("r") for e in rejected)
    assert not [e for e in logs if e["event"] == "direct_dispatch_handler_failed"]
    url = f"http://127.0.0.1:{svc.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'kvindex_rejects_total{reason="too_deep"} 12.0' in text
    assert 'kvindex_rejects_total{reason="seq_jump"} 15.0' in text
