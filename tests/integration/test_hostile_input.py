"""Hostile input over real gRPC and a real nats-server (issue 32): request bytes that are not protobuf
or carry invalid UTF-8, prompt fields nested beyond the JSON depth limit, msgpack nested beyond what
the decoder follows, and sequence numbers at the ends of u64. Every call is answered, hostile ones
with INVALID_ARGUMENT; hostile messages are rejected and counted by reason; an honest worker stays
exact. The pure halves (consumer, codec, servicer) are in tests/unit/test_hostile_input.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvindex.service.app import IndexService
from kvindex.tokenize.bounded_json import MAX_JSON_DEPTH
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.integration.test_ext_proc import FULL_DUPLEX, Envoy, body_chunks, fleet, headers_msg
from tests.unit.test_hostile_input import BAD_UTF8, UNARY_METHODS
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
