"""The Envoy ext_proc endpoint picker over real gRPC, driven exactly as Envoy drives it: request
headers, body chunks (the last with end_of_stream), response headers, body chunks and trailers, on one
``ExternalProcessor/Process`` stream per HTTP request; subset hints and served-endpoint metadata in
``metadata_context``; the picker's health services on its own port."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvindex.keys import block_keys
from kvindex.route.envoy import DESTINATION, LB_NAMESPACE, SERVED, SERVICE_NAME, SUBSET, SUBSET_NAMESPACE
from kvindex.service.app import IndexService
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MODEL = "picker-model"
BS = 16
MakePub = Callable[..., Awaitable[Publisher]]
FULL_DUPLEX = mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = mode_pb2.ProcessingMode.BUFFERED


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


@pytest.fixture
async def picker_service(make_service: Callable[..., Awaitable[IndexService]]) -> IndexService:
    return await make_service(ext_proc_port=0, ext_proc_host="127.0.0.1")


@pytest.fixture
async def picker(picker_service: IndexService) -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    assert picker_service.ext_proc is not None
    async with grpc.aio.insecure_channel(picker_service.ext_proc.address) as channel:
        yield ep_grpc.ExternalProcessorStub(channel)


async def fleet(make_publisher: MakePub, svc: IndexService, n: int = 3) -> list[Publisher]:
    pubs = [
        await make_publisher(
            worker=f"w{i}",
            model=MODEL,
            block_size=BS,
            capacity={"gpu": 1000},
            endpoint=f"10.0.0.{i + 1}:8000",
        )
        for i in range(n)
    ]
    for p in pubs:
        await p.heartbeat()
    await wait_until(lambda: sum(1 for s in svc.registry.all() if s.endpoint) == n, what="endpoints known")
    return pubs


def headers_msg(
    path: str, end_of_stream: bool, mode: int, subset: list[str] | None = None
) -> ep.ProcessingRequest:
    hdrs = core_pb2.HeaderMap(
        headers=[
            core_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            core_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            core_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            core_pb2.HeaderValue(key="x-request-id", raw_value=f"req-{random.random()}".encode()),
        ]
    )
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=hdrs, end_of_stream=end_of_stream),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.get_or_create_list(SUBSET).extend(subset)
        msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return msg


def body_chunks(body: bytes, n: int = 3) -> list[ep.ProcessingRequest]:
    step = max(1, len(body) // n + 1)
    pieces = [body[i : i + step] for i in range(0, len(body), step)]
    return [
        ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
        for i, p in enumerate(pieces)
    ]


def usage_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int = 2) -> dict[str, Any]:
    """An engine's OpenAI ``usage`` (what the picker reports to the index)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def answer_with_usage(prompt_tokens: int, cached_tokens: int) -> list[bytes]:
    """An engine's streamed completion whose last chunk carries its usage."""
    usage = usage_of(prompt_tokens, cached_tokens)
    return [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n",
        b"data: [DONE]\n\n",
    ]


def destination(resp: ep.ProcessingResponse, phase: str) -> tuple[str, str]:
    """(header value, dynamic metadata value) of the pick in a headers or body answer."""
    common = getattr(resp, phase).response
    values = [
        h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == DESTINATION
    ]
    assert len(values) == 1 and common.clear_route_cache
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value
    return values[0], meta


class Envoy:
    """One HTTP request's ext_proc stream, written and read in Envoy's order."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, *msgs: ep.ProcessingRequest) -> None:
        for m in msgs:
            await self.call.write(m)

    async def recv(self) -> ep.ProcessingResponse:
        resp = await asyncio.wait_for(self.call.read(), 5)
        assert resp is not grpc.aio.EOF
        return resp

    async def request(
        self,
        body: dict[str, Any],
        path: str = "/v1/completions",
        mode: int = FULL_DUPLEX,
        subset: list[str] | None = None,
    ) -> tuple[ep.ProcessingResponse, bytes]:
        """Send headers and body; return the answer carrying the pick and the body Envoy gets back."""
        raw = json.dumps(body).encode()
        await self.send(headers_msg(path, False, mode, subset))
        if mode == BUFFERED:
            first = await self.recv()  # buffered: the headers are answered before the body is sent
            assert first.HasField("request_headers")
            assert not first.request_headers.response.header_mutation.set_headers
            await self.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True)))
            return await self.recv(), raw
        await self.send(*body_chunks(raw))
        pick = await self.recv()
        if pick.HasField("immediate_response"):
            return pick, b""
        echoed = b""
        while True:
            part = await self.recv()
            assert part.HasField("request_body")
            streamed = part.request_body.response.body_mutation.streamed_response
            echoed += streamed.body
            if streamed.end_of_stream:
                return pick, echoed

    async def response(
        self, served: str, chunks: list[bytes], end: bool = True, content_type: str = ""
    ) -> list[bytes]:
        meta = core_pb2.Metadata()
        served_md = struct_pb2.Struct()
        served_md[SERVED] = served
        meta.filter_metadata[LB_NAMESPACE].CopyFrom(served_md)
        hdrs = core_pb2.HeaderMap(headers=[core_pb2.HeaderValue(key=":status", raw_value=b"200")])
        if content_type:
            hdrs.headers.append(core_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()))
        await self.send(
            ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hdrs), metadata_context=meta)
        )
        assert (await self.recv()).HasField("response_headers")
        out = []
        for i, chunk in enumerate(chunks):
            await self.send(
                ep.ProcessingRequest(
                    response_body=ep.HttpBody(body=chunk, end_of_stream=end and i == len(chunks) - 1)
                )
            )
            resp = await self.recv()
            assert resp.HasField("response_body")
            out.append(resp.response_body.response.body_mutation.streamed_response.body)
        return out

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF


async def test_picks_the_holder_with_fallbacks_and_releases_at_the_response(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    svc = picker_service
    pubs = await fleet(make_publisher, svc)
    prompt = tokens(20 * BS, seed=1)
    pubs[1].stored(block_keys(prompt, BS, MODEL))
    await pubs[1].flush()
    await wait_until(lambda: svc.index.block_counts(("w1", 0))[0] == 20, what="blocks indexed")

    envoy = Envoy(picker)
    body = {"model": MODEL, "prompt": prompt + tokens(3 * BS, seed=2), "max_tokens": 8, "stream": True}
    pick, echoed = await envoy.request(body)
    header, meta = destination(pick, "request_headers")
    assert header == meta  # never two different values
    endpoints = header.split(",")
    assert endpoints[0] == "10.0.0.2:8000" and sorted(endpoints) == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
    ]
    assert echoed == json.dumps(body).encode()  # the body goes upstream unchanged
    ledger = svc.ranker.ledger
    (entry,) = list(ledger.of(("w1", 0)))
    assert not entry.prefill_done

    sse = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[{"text":"b"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    got = []
    got += await envoy.response("10.0.0.2:8000", sse[:1], end=False)  # headers + first chunk (not the last)
    # ... the first bytes of the answer: prefill done, still in flight
    assert entry.prefill_done and len(ledger) == 1
    await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=sse[1])))
    got.append((await envoy.recv()).response_body.response.body_mutation.streamed_response.body)
    await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=sse[2], end_of_stream=True)))
    got.append((await envoy.recv()).response_body.response.body_mutation.streamed_response.body)
    assert got == sse
    assert len(ledger) == 0  # released at the end of the response
    await envoy.close()


async def test_buffered_mode_sets_the_destination_in_the_body_answer(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    await fleet(make_publisher, picker_service)
    envoy = Envoy(picker)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    # No tokenizer for this model: a chat body cannot be keyed and is refused, saying why.
    pick, _ = await envoy.request(chat, path="/v1/chat/completions", mode=BUFFERED)
    assert pick.immediate_response.status.code == 400
    assert "tokenizer" in pick.immediate_response.details
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": tokens(4 * BS, 3)}, mode=BUFFERED)
    header, meta = destination(pick, "request_body")
    assert header == meta and len(header.split(",")) == 3
    assert len(picker_service.ranker.ledger) == 1
    await envoy.call.done_writing()
    await wait_until(lambda: len(picker_service.ranker.ledger) == 0, what="release at stream end")


async def test_subset_hint_restricts_the_pick_and_503_when_nothing_in_it_is_eligible(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    pubs = await fleet(make_publisher, picker_service)
    prompt = tokens(10 * BS, seed=4)
    pubs[0].stored(block_keys(prompt, BS, MODEL))
    await pubs[0].flush()
    await wait_until(lambda: picker_service.index.block_counts(("w0", 0))[0] == 10, what="blocks indexed")
    envoy = Envoy(picker)
    pick, _ = await envoy.request(
        {"model": MODEL, "prompt": prompt}, subset=["10.0.0.2:8000", "10.0.0.3:8000", "10.9.9.9:1"]
    )
    header, _ = destination(pick, "request_headers")
    assert sorted(header.split(",")) == ["10.0.0.2:8000", "10.0.0.3:8000"]  # the holder is outside the subset
    await envoy.close()

    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": prompt}, subset=["10.9.9.9:1"])
    assert pick.immediate_response.status.code == 503
    assert "subset" in pick.immediate_response.details


async def test_no_ready_instance_is_503_and_bad_body_is_400(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": [1, 2, 3]})
    assert pick.immediate_response.status.code == 503
    await fleet(make_publisher, picker_service)
    envoy = Envoy(picker)
    await envoy.send(
        headers_msg("/v1/completions", False, FULL_DUPLEX), *body_chunks(b'{"model": "m", "prompt": ')
    )
    bad = await envoy.recv()
    assert bad.immediate_response.status.code == 400
    assert "not valid JSON" in bad.immediate_response.details
    assert json.loads(bad.immediate_response.body)["error"]["code"] == 400
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"prompt": [1, 2]})
    assert pick.immediate_response.status.code == 400 and "'model'" in pick.immediate_response.details
    assert len(picker_service.ranker.ledger) == 0


async def test_client_gone_mid_response_releases_the_ledger(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    await fleet(make_publisher, picker_service)
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": tokens(6 * BS, 5), "stream": True})
    assert pick.HasField("request_headers")
    await envoy.response("10.0.0.1:8000", [b"data: x\n\n"], end=False)  # not the end of the response
    assert len(picker_service.ranker.ledger) == 1
    envoy.call.cancel()  # the downstream client disconnected: Envoy resets the stream
    await wait_until(lambda: len(picker_service.ranker.ledger) == 0, what="release on reset")


async def test_served_on_a_fallback_moves_the_ledger_entry(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    await fleet(make_publisher, picker_service)
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": tokens(6 * BS, 6), "stream": True})
    first, *rest = destination(pick, "request_headers")[0].split(",")
    ledger = picker_service.ranker.ledger
    primary = picker_service.registry.at_endpoint(first)[0].key
    fallback = picker_service.registry.at_endpoint(rest[0])[0].key
    assert len(list(ledger.of(primary))) == 1
    await envoy.response(rest[0], [b"data: x\n\n"], end=False)  # Envoy retried on the next endpoint
    assert not list(ledger.of(primary))
    (moved,) = list(ledger.of(fallback))
    assert moved.prefill_done
    await envoy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
    await envoy.recv()
    assert len(ledger) == 0
    await envoy.close()


async def test_a_request_served_on_a_fallback_is_no_evidence_against_where_it_ran(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    """Regression: the picker learns of Envoy's fallback at the response headers and commits the
    request there then, once the engine has prefilled it and its KV events may be in the index: the
    engine's report (what it held before) was compared with a prediction counting the request's own
    blocks, an ``over`` against the healthy instance that served it. Such a report is not sent."""
    svc = picker_service
    pubs = {p.worker: p for p in await fleet(make_publisher, svc)}
    seen: list[Any] = []
    svc.ranker.outcomes.subscribe(seen.append)
    prompt = tokens(6 * BS, 7)
    sse = answer_with_usage(len(prompt), 0)
    envoy = Envoy(picker)
    body = {"model": MODEL, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
    pick, _ = await envoy.request(body)
    fallback = destination(pick, "request_headers")[0].split(",")[1]
    (state,) = svc.registry.at_endpoint(fallback)
    pub = pubs[state.worker]  # Envoy retried there; that engine prefilled the prompt, and says so
    pub.stored(block_keys(prompt, BS, MODEL))
    await pub.flush()
    await wait_until(lambda: svc.index.block_counts(state.key)[0] == 6, what="the fallback's events applied")
    assert await envoy.response(fallback, sse, content_type="text/event-stream") == sse
    await envoy.close()
    assert len(svc.ranker.ledger) == 0
    assert not seen and not any(any(i.recent) for i in svc.ranker.outcomes.instances.values())
    assert all(svc.ranker.state_of(s)[0] == "exact" for s in svc.registry.all())


async def test_health_services_on_the_picker_port(picker_service: IndexService) -> None:
    assert picker_service.ext_proc is not None
    # Readiness follows the service's (kvindex/service/readiness.py): after the first heartbeat window.
    await wait_until(lambda: picker_service.grpc.ready, 5.0, "the service ready")
    async with grpc.aio.insecure_channel(picker_service.ext_proc.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


async def test_the_engine_usage_in_the_response_is_reported(
    picker_service: IndexService, picker: ep_grpc.ExternalProcessorStub, make_publisher: MakePub
) -> None:
    """Where the gateway sends the response body, the engine's cached tokens and the time from the
    pick to the first byte go to the index with the release (docs/feedback.md)."""
    svc = picker_service
    pubs = await fleet(make_publisher, svc)
    prompt = tokens(20 * BS, seed=5)
    pubs[2].stored(block_keys(prompt, BS, MODEL))
    await pubs[2].flush()
    await wait_until(lambda: svc.index.block_counts(("w2", 0))[0] == 20, what="blocks indexed")
    seen: list[Any] = []
    svc.ranker.outcomes.subscribe(seen.append)
    full = prompt + tokens(3 * BS, seed=6)
    sse = answer_with_usage(len(full), 320)
    envoy = Envoy(picker)
    body = {"model": MODEL, "prompt": full, "stream": True, "stream_options": {"include_usage": True}}
    pick, _ = await envoy.request(body)
    assert destination(pick, "request_headers")[0].startswith("10.0.0.3:8000")
    assert await envoy.response("10.0.0.3:8000", sse, content_type="text/event-stream") == sse
    await envoy.close()
    assert len(seen) == 1 and seen[0].outcome == "exact" and seen[0].report.cached_tokens == 320
    assert seen[0].report.ttft_ms is not None and seen[0].report.ttft_ms >= 0
    # Buffered, not streamed: a one-token answer's time is its TTFT; the engine had nothing cached.
    envoy = Envoy(picker)
    pick, _ = await envoy.request({"model": MODEL, "prompt": full, "max_tokens": 1}, mode=BUFFERED)
    one = usage_of(len(full), 0, completion_tokens=1)
    answer = json.dumps({"choices": [{"text": "a"}], "usage": one}).encode()
    await envoy.response("10.0.0.3:8000", [answer[:10], answer[10:]], content_type="application/json")
    await envoy.close()
    assert len(seen) == 2 and seen[1].outcome == "over" and seen[1].report.ttft_ms is not None
    assert svc.metrics.registry.get_sample_value("kvindex_ext_proc_reports_total", {"result": "applied"}) == 2


async def test_pd_mode_returns_the_decode_pick_and_the_prefiller_in_a_header(
    make_service: Callable[..., Awaitable[IndexService]], make_publisher: MakePub
) -> None:
    """llm-d's disaggregation profile: the destination is the decode instance, the prefill instance
    goes in x-prefiller-host-port (a client's own value is removed); a short prompt gets no prefiller."""
    from kvindex.route.envoy import PREFILLER
    from kvindex.route.pd import PdConfig

    svc = await make_service(
        ext_proc_port=0, ext_proc_host="127.0.0.1", ext_proc_pd=PdConfig(min_input_tokens=256)
    )
    roles = [("p0", "prefill", "10.0.1.1:8000"), ("p1", "prefill", "10.0.1.2:8000"),
             ("d0", "decode", "10.0.2.1:8000"), ("d1", "decode", "10.0.2.2:8000")]  # fmt: skip
    pubs = {
        w: await make_publisher(
            worker=w, model=MODEL, block_size=BS, capacity={"gpu": 1000}, endpoint=ep_, role=role
        )
        for w, role, ep_ in roles
    }
    # p1 already holds the prompt's first 30 blocks: it prefills cheapest. d1 holds a short prompt.
    prompt = tokens(32 * BS, seed=9)
    pubs["p1"].stored(block_keys(prompt, BS, MODEL)[:30])
    short = tokens(4 * BS, seed=10)
    pubs["d1"].stored(block_keys(short, BS, MODEL)[:3])
    for p in pubs.values():
        await p.flush()
        await p.heartbeat()
    await wait_until(
        lambda: sum(1 for s in svc.registry.all() if s.endpoint and s.role != "both") == 4, what="roles known"
    )
    await wait_until(
        lambda: svc.index.block_counts(("p1", 0))[0] == 30 and svc.index.block_counts(("d1", 0))[0] == 3,
        what="blocks indexed",
    )
    assert svc.ext_proc is not None
    async with grpc.aio.insecure_channel(svc.ext_proc.address) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        envoy = Envoy(stub)
        pick, _ = await envoy.request({"model": MODEL, "prompt": prompt, "max_tokens": 4})
        header, meta = destination(pick, "request_headers")
        assert header == meta and header.split(",")[0] in ("10.0.2.1:8000", "10.0.2.2:8000")
        assert all(e.startswith("10.0.2.") for e in header.split(","))  # only decode instances
        common = pick.request_headers.response
        prefiller = [
            h.header.raw_value.decode()
            for h in common.header_mutation.set_headers
            if h.header.key == PREFILLER
        ]
        assert prefiller == ["10.0.1.2:8000"]
        ledger = svc.ranker.ledger
        assert len(ledger) == 2  # the decode entry and <id>:prefill on p1
        assert len(list(ledger.of(("p1", 0)))) == 1
        await envoy.response(header.split(",")[0], [b'{"choices":[]}'])
        assert len(ledger) == 0
        await envoy.close()

        envoy = Envoy(stub)
        pick, _ = await envoy.request({"model": MODEL, "prompt": short})
        # Served whole by a decode instance: the one the TTFT ranking prefers (d1 holds the prefix;
        # by KV headroom alone the two decode instances tie and d0 would come first).
        header, _ = destination(pick, "request_headers")
        assert header.split(",") == ["10.0.2.2:8000", "10.0.2.1:8000"]
        common = pick.request_headers.response
        assert PREFILLER not in [h.header.key for h in common.header_mutation.set_headers]
        assert PREFILLER in list(common.header_mutation.remove_headers)
        assert len(svc.ranker.ledger) == 1
        await envoy.call.done_writing()
        await wait_until(lambda: len(svc.ranker.ledger) == 0, what="release at stream end")
