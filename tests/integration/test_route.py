"""``kvindex route`` against fake OpenAI engines that announce their endpoints in real heartbeats to a
real index (IndexService on a real nats-server, gRPC over a socket): routing by the index, bytes
passed through unchanged (streaming or not), the in-flight ledger released however a request ends,
retry on an unreachable engine, the fallback when the index is down, errors, metrics, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.server import GrpcServer
from kvindex.client.local import LocalKvIndexClient
from kvindex.keys import block_keys
from kvindex.route.proxy import RouteConfig, RouteProxy
from kvindex.security import ClientTLS
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from tests.conftest import ROOT, mtls_token_config, wait_until
from tests.integration.fake_openai import FakeOpenAIEngine, sse_chunks
from workers_shim.publisher import Publisher

MODEL = "route-model"
BS = 4
PROMPT = list(range(700, 700 + 8 * BS))
KEYS = block_keys(PROMPT, BS, MODEL)


MakePub = Callable[..., Awaitable[Publisher]]


@dataclass
class Fleet:
    service: IndexService
    engines: dict[str, FakeOpenAIEngine]
    pubs: dict[str, Publisher]
    proxy: RouteProxy
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def ledger(self) -> int:
        return len(self.service.ranker.ledger)

    async def post(self, body: object, path: str = "/v1/completions", **kw: object) -> aiohttp.ClientResponse:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
        return await self.http.post(self.url + path, data=data, headers=headers, **kw)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with self.http.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def sample(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def start_fleet(
    service: IndexService, make_publisher: MakePub, in_process: bool = False, **config: object
) -> Fleet:
    """Three engines w1..w3 with endpoints; w1 holds the prompt's first 6 blocks, w2 the first 2.
    ``in_process``: the proxy calls the servicer directly (serve --route-port), not over gRPC."""
    engines = {w: await FakeOpenAIEngine(w, MODEL).start() for w in ("w1", "w2", "w3")}
    pubs = {
        w: await make_publisher(
            worker=w, model=MODEL, block_size=BS, capacity={"gpu": 1000}, endpoint=e.endpoint
        )
        for w, e in engines.items()
    }
    pubs["w1"].stored(KEYS[:6])
    pubs["w2"].stored(KEYS[:2])
    for p in pubs.values():
        await p.flush()
    await wait_until(
        lambda: (
            service.index.block_counts(("w1", 0))[0] == 6
            and all(service.registry.endpoint(f"{w}/0") for w in engines)
        ),
        what="fleet indexed with endpoints",
    )
    settings: dict[str, object] = {"score_timeout": 2.0, "refresh_interval": 0.2, "grace": 5.0}
    settings.update(config)
    cfg = RouteConfig(index=service.grpc.address, host="127.0.0.1", port=0, **settings)  # type: ignore[arg-type]
    client = None
    if in_process:
        client = LocalKvIndexClient(
            service.servicer, timeout=cfg.score_timeout, refresh_interval=cfg.refresh_interval
        )
    proxy = RouteProxy(cfg, client=client)
    await proxy.start()
    return Fleet(service, engines, pubs, proxy, aiohttp.ClientSession(auto_decompress=False))


@contextlib.asynccontextmanager
async def running_fleet(
    service: IndexService, make_publisher: MakePub, in_process: bool
) -> AsyncIterator[Fleet]:
    f = await start_fleet(service, make_publisher, in_process=in_process)
    try:
        yield f
    finally:
        await f.http.close()
        await f.proxy.stop()
        for e in f.engines.values():
            await e.close()


@pytest.fixture(params=["grpc", "in_process"])
async def fleet(
    service: IndexService, make_publisher: MakePub, request: pytest.FixtureRequest
) -> AsyncIterator[Fleet]:
    """Every test on it runs twice: the proxy as its own process would (gRPC to the index), and
    inside the index (serve --route-port: calls on the servicer)."""
    async with running_fleet(service, make_publisher, request.param == "in_process") as f:
        yield f


@pytest.fixture
async def grpc_fleet(service: IndexService, make_publisher: MakePub) -> AsyncIterator[Fleet]:
    async with running_fleet(service, make_publisher, in_process=False) as f:
        yield f


async def test_non_streaming_routed_by_the_index_bytes_unchanged_and_released(fleet: Fleet) -> None:
    body = b'{"model": "%s", "prompt": %s, "max_tokens": 3,   "extra": "\\u00e9"}' % (
        MODEL.encode(),
        json.dumps(PROMPT).encode(),
    )
    async with await fleet.post(body, headers={"x-request-id": "req-1"}) as resp:
        got = await resp.read()
        assert resp.status == 200
        assert resp.headers["x-kvindex-instance"] == "w1/0" and resp.headers["x-kvindex-decision"] == "index"
        assert float(resp.headers["x-kvindex-est-ttft-ms"]) > 0  # the index's estimate for w1
    w1 = fleet.engines["w1"]
    assert w1.bodies == [body]  # the request body reached the engine byte for byte
    assert got == w1.sent[0]  # and the engine's answer the client
    assert w1.headers[0]["x-request-id"] == "req-1"
    await wait_until(lambda: fleet.ledger() == 0, what="ledger released")
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_releases_total", phase="prefill", result="found") == 1
    assert sample(m, "kvindex_route_releases_total", phase="finished", result="found") == 1
    assert sample(m, "kvindex_route_decisions_total", reason="index") == 1
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="200") == 1
    assert sample(m, "kvindex_route_ttft_seconds_count", stream="false") == 1


async def test_streaming_bytes_unchanged_prefill_released_at_first_chunk(fleet: Fleet) -> None:
    w1 = fleet.engines["w1"]
    w1.gate = asyncio.Event()
    resp = await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    await asyncio.wait_for(w1.holding.wait(), 5)
    first = await resp.content.readuntil(b"\n\n")
    assert first == sse_chunks("w1", w1.tokens)[0]
    # Held after the first token: the request is in the ledger, its prefill released.
    await wait_until(
        lambda: [e.prefill_done for e in fleet.service.ranker.ledger._entries.values()] == [True],
        what="prefill released while the stream is open",
    )
    w1.gate.set()
    rest = await resp.read()
    resp.release()
    # The engine was asked for its usage chunk (for the index), and the client got exactly the
    # events it asked for: the same stream without it.
    assert first + rest == b"".join(sse_chunks("w1", w1.tokens))
    assert b'"usage"' in w1.sent[0] and b'"usage"' not in first + rest
    await wait_until(lambda: fleet.ledger() == 0, what="ledger released at the end")
    # The proxy counts the release when the index's answer is back, a moment after the index applied it.
    for _ in range(500):
        m = await fleet.metrics()
        if sample(m, "kvindex_route_releases_total", phase="finished", result="found"):
            break
        await asyncio.sleep(0.01)
    assert sample(m, "kvindex_route_ttft_seconds_count", stream="true") == 1
    assert sample(m, "kvindex_route_releases_total", phase="finished", result="found") == 1


async def test_chat_stream_is_served(fleet: Fleet) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with await fleet.post(body, path="/v1/chat/completions") as resp:
        assert resp.status == 200
        got = await resp.read()
        served = fleet.engines[resp.headers["x-kvindex-instance"].split("/")[0]]
    # No tokenizer for the text here: routed by the fallback, nothing committed, nothing to learn
    # from the engine's usage, so the body goes unchanged.
    assert got == served.sent[0] and served.bodies == [json.dumps(body).encode()]
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")


async def test_client_cancel_mid_stream_releases_and_aborts_the_engine(fleet: Fleet) -> None:
    w1 = fleet.engines["w1"]
    w1.gate = asyncio.Event()
    resp = await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True})
    await asyncio.wait_for(w1.holding.wait(), 5)
    await resp.content.readuntil(b"\n\n")
    assert fleet.ledger() == 1
    resp.close()  # the client goes away mid-stream
    await wait_until(lambda: w1.aborted == 1, what="the engine's request aborted")
    await wait_until(lambda: fleet.ledger() == 0, what="ledger released after the cancel")
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="499") == 1
    assert sample(m, "kvindex_route_in_flight") == 0


async def test_many_concurrent_requests_half_cancelled_leave_no_ledger_entry(fleet: Fleet) -> None:
    for e in fleet.engines.values():
        e.tokens = 40  # long enough streams to be cut in the middle

    async def one(i: int) -> bool:
        prompt = [i] * (4 * BS) + PROMPT  # different prefixes: spread over the fleet
        async with await fleet.post({"model": MODEL, "prompt": prompt, "stream": True}) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            if i % 2:
                return False  # leaves mid-stream: the connection is closed
            await resp.read()
            return True

    done = await asyncio.gather(*(one(i) for i in range(20)))
    assert done.count(True) == 10
    await wait_until(lambda: fleet.ledger() == 0, what="every ledger entry released")
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_releases_total", phase="finished", result="found") == 20
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="200") == 10
    await wait_until(lambda: sum(e.aborted for e in fleet.engines.values()) == 10, what="10 engine aborts")


async def test_unreachable_engine_retries_the_next_and_moves_the_ledger(fleet: Fleet) -> None:
    await fleet.engines["w1"].close()  # still announced (its shim heartbeats on), nobody listening
    w2 = fleet.engines["w2"]
    w2.gate = asyncio.Event()
    resp = await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert resp.status == 200
    assert resp.headers["x-kvindex-instance"] == "w2/0" and resp.headers["x-kvindex-decision"] == "retry"
    await asyncio.wait_for(w2.holding.wait(), 5)
    # While it runs, the ledger entry counts against w2, which serves it, not w1.
    await wait_until(
        lambda: [e.instance for e in fleet.service.ranker.ledger._entries.values()] == [("w2", 0)],
        what="ledger entry moved to w2",
    )
    w2.gate.set()
    assert await resp.read() == b"".join(sse_chunks("w2", w2.tokens))  # (usage stripped)
    resp.release()
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_retries_total") == 1
    assert sample(m, "kvindex_route_upstream_errors_total", kind="connect") == 1
    assert sample(m, "kvindex_route_decisions_total", reason="retry") == 1
    assert sample(m, "kvindex_route_recommits_total", result="committed") == 1


async def test_a_retried_request_is_judged_against_the_prediction_for_where_it_ran(fleet: Fleet) -> None:
    """Regression: the entry moved to the retry's instance was priced after that engine had answered
    (a non-streamed answer comes after the prefill, whose KV events the index had applied by then),
    so the request's own blocks were its predicted hit: the engine's exact report counted as an
    ``over`` against the healthy instance that served it, and two such retries degraded it."""
    await fleet.engines["w1"].close()  # the index's first choice, unreachable
    w2, pub = fleet.engines["w2"], fleet.pubs["w2"]
    w2.cached_tokens = 8  # the 2 blocks w2 held when the request reached it

    async def prefilled() -> None:  # the engine caches the whole prompt and says so before answering
        pub.stored(KEYS[2:])
        await pub.flush()
        await wait_until(
            lambda: fleet.service.index.block_counts(("w2", 0))[0] == len(KEYS), what="w2's events applied"
        )

    w2.before_answer = prefilled
    outcomes = fleet.service.ranker.outcomes
    seen: list[Any] = []
    outcomes.subscribe(seen.append)
    async with await fleet.post({"model": MODEL, "prompt": PROMPT}) as resp:
        assert resp.status == 200
        assert resp.headers["x-kvindex-instance"] == "w2/0" and resp.headers["x-kvindex-decision"] == "retry"
        await resp.read()
    await wait_until(lambda: len(seen) == 1 and fleet.ledger() == 0, what="the report compared")
    (outcome,) = seen
    assert outcome.instance == ("w2", 0) and outcome.prediction.cached_tokens == 8
    assert outcome.outcome == "exact" and outcome.evidence
    assert not any(any(inst.recent) for inst in outcomes.instances.values())  # no evidence against anyone
    for key in (("w1", 0), ("w2", 0)):
        state = fleet.service.registry.get(key)
        assert state is not None and fleet.service.ranker.state_of(state)[0] == "exact"


async def test_engine_failing_mid_stream_cuts_the_client_and_releases(fleet: Fleet) -> None:
    w1 = fleet.engines["w1"]
    w1.gate = asyncio.Event()
    resp = await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True})
    await asyncio.wait_for(w1.holding.wait(), 5)
    assert await resp.content.readuntil(b"\n\n") == sse_chunks("w1", w1.tokens)[0]
    w1.cut()
    with pytest.raises(aiohttp.ClientPayloadError):  # cut, never a stream that looks complete
        await resp.read()
    resp.release()
    await wait_until(lambda: fleet.ledger() == 0, what="ledger released after the engine failed")
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_upstream_errors_total", kind="stream") == 1
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="502") == 1
    w1.gate.set()


async def test_every_engine_unreachable_is_a_502_and_leaves_no_ledger_entry(fleet: Fleet) -> None:
    for e in fleet.engines.values():
        await e.close()
    async with await fleet.post({"model": MODEL, "prompt": PROMPT}) as resp:
        assert resp.status == 502
        err = (await resp.json())["error"]
    assert "could be reached" in err["message"] and err["code"] == "upstream_unreachable"
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")


async def test_index_down_the_fallback_serves_consistently_and_is_counted(grpc_fleet: Fleet) -> None:
    fleet = grpc_fleet  # in the index's own process the index cannot be down while the proxy serves
    port = fleet.service.grpc.port
    await fleet.service.grpc.stop(grace=0)
    served = []
    sibling = PROMPT[: 4 * BS] + [1] * (4 * BS)  # the same first 4 blocks
    for prompt in (PROMPT, sibling, PROMPT):
        async with await fleet.post({"model": MODEL, "prompt": prompt}) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvindex-decision"] == "fallback"
            assert "x-kvindex-est-ttft-ms" not in resp.headers  # nothing was estimated
            served.append(resp.headers["x-kvindex-instance"])
    assert len(set(served)) == 1  # one prefix, one instance, without the index
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_fallbacks_total", reason="unavailable") == 3
    assert sample(m, "kvindex_route_decisions_total", reason="fallback") == 3
    async with fleet.http.get(fleet.url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["fallbacks"] == 3
    # The index comes back: routing by it resumes.
    fleet.service.grpc = GrpcServer(fleet.service.servicer, "127.0.0.1", port)
    await fleet.service.grpc.start()
    for _ in range(100):
        async with await fleet.post({"model": MODEL, "prompt": PROMPT}) as resp:
            if resp.headers["x-kvindex-decision"] == "index":
                break
        await asyncio.sleep(0.05)
    assert resp.headers["x-kvindex-instance"] == "w1/0"
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")


async def test_slow_index_past_the_deadline_falls_back(
    service: IndexService, make_publisher: MakePub
) -> None:
    f = await start_fleet(service, make_publisher, score_timeout=0.05)
    try:
        original = service.ranker.score

        def slow(*args: object, **kwargs: object) -> object:
            import time

            time.sleep(0.2)  # the index's event loop stalls past the proxy's deadline
            return original(*args, **kwargs)

        service.ranker.score = slow  # type: ignore[method-assign]
        async with await f.post({"model": MODEL, "prompt": PROMPT}) as resp:
            assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "fallback"
        service.ranker.score = original  # type: ignore[method-assign]
        m = await f.metrics()
        assert sample(m, "kvindex_route_fallbacks_total", reason="deadline") == 1
        # The late Score committed anyway: the proxy released it, without the engine's usage (the
        # fallback's instance need not be the one the index committed it to).
        await wait_until(lambda: len(service.ranker.ledger) == 0, what="late commit released")
        assert service.ranker.outcomes.outcomes == {"exact": 0, "over": 0, "under": 0}
        assert not service.ranker.outcomes.ignored
    finally:
        await f.http.close()
        await f.proxy.stop()
        for e in f.engines.values():
            await e.close()


async def test_bad_requests_are_clear_openai_errors(fleet: Fleet) -> None:
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": PROMPT}).encode(), 400, "'model'"),
        (json.dumps({"model": MODEL}).encode(), 400, "'prompt' is required"),
        (json.dumps({"model": "no-such-model", "prompt": PROMPT}).encode(), 503, "no instance serves"),
    ]
    for body, status, says in cases:
        async with await fleet.post(body) as resp:
            assert resp.status == status, body
            err = (await resp.json())["error"]
            assert says in err["message"] and err["type"], err
    assert all(not e.bodies for e in fleet.engines.values())  # nothing forwarded
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="400") == 4
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="503") == 1
    assert fleet.ledger() == 0


async def test_instances_without_endpoints_are_a_503(service: IndexService, make_publisher: MakePub) -> None:
    pub = await make_publisher(worker="old", model="old-model", block_size=BS, capacity={"gpu": 10})
    await pub.flush()
    await wait_until(lambda: service.registry.get(("old", 0)) is not None, what="old worker")
    proxy = RouteProxy(RouteConfig(index=service.grpc.address, host="127.0.0.1", port=0, score_timeout=2.0))
    await proxy.start()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{proxy.port}/v1/completions", json={"model": "old-model", "prompt": [1, 2]}
            ) as resp,
        ):
            assert resp.status == 503
            assert "announces an endpoint" in (await resp.json())["error"]["message"]
        await wait_until(lambda: len(service.ranker.ledger) == 0, what="ledger empty")
    finally:
        await proxy.stop()


async def test_static_instances_without_events_are_routed_by_predicted_caches(
    make_service: Callable[..., Awaitable[IndexService]],
) -> None:
    """Engines that publish nothing, listed with serve --instance: the proxy routes to them, and a
    sibling prompt follows the one before it to the cache the index predicts it left, although an
    idle fleet would otherwise send it elsewhere."""
    engines = {w: await FakeOpenAIEngine(w, MODEL).start() for w in ("s1", "s2")}
    svc = await make_service(
        static_instances=[(w, e.endpoint) for w, e in engines.items()],
        static_model=MODEL,
        static_block_size=BS,
    )
    proxy = RouteProxy(RouteConfig(index=svc.grpc.address, host="127.0.0.1", port=0, score_timeout=2.0))
    await proxy.start()
    url = f"http://127.0.0.1:{proxy.port}/v1/completions"

    async def send(http: aiohttp.ClientSession, prompt: list[int]) -> aiohttp.ClientResponse:
        resp = await http.post(url, json={"model": MODEL, "prompt": prompt, "stream": True})
        assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "index"
        return resp

    def other(prompt_id: int) -> list[int]:
        return [prompt_id] * (8 * BS)

    try:
        async with aiohttp.ClientSession() as http:
            for e in engines.values():
                e.gate, e.gate_before_first = asyncio.Event(), True
            held = await send(http, other(1))  # where an idle fleet sends a request, kept prefilling
            busy = held.headers["x-kvindex-instance"].split("/")[0]
            (free,) = set(engines) - {busy}
            engines[free].gate = None
            first = await send(http, PROMPT)  # goes to the free one
            assert first.headers["x-kvindex-instance"] == f"{free}/0"
            await first.read()
            engines[busy].gate.set()  # type: ignore[union-attr]
            await held.read()
            await wait_until(lambda: len(svc.ranker.ledger) == 0, what="both idle again")
            engines[busy].gate = None
            # The sibling is held in its prefill, so the unrelated request cannot go where it went
            # merely because that instance is idle again (a race with the sibling's release).
            engines[free].gate, engines[free].gate_before_first = asyncio.Event(), True
            sibling = await send(http, PROMPT[: 6 * BS] + [3] * (2 * BS))
            unrelated = await send(http, other(2))
            assert sibling.headers["x-kvindex-instance"] == f"{free}/0"  # the predicted cache
            assert unrelated.headers["x-kvindex-instance"] == f"{busy}/0"  # the idle one
            engines[free].gate.set()  # type: ignore[union-attr]
            for resp in (sibling, unrelated):
                await resp.read()
                resp.release()
        await wait_until(lambda: len(svc.ranker.ledger) == 0, what="ledger empty")
    finally:
        await proxy.stop()
        for e in engines.values():
            await e.close()


async def test_models_health_and_metrics(fleet: Fleet) -> None:
    async with fleet.http.get(fleet.url + "/v1/models") as resp:
        assert resp.status == 200
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    async with fleet.http.get(fleet.url + "/health") as resp:
        health = await resp.json()
    assert resp.status == 200 and health["status"] == "ok" and health["instances_known"] == 3
    async with await fleet.post({"model": MODEL, "prompt": PROMPT}) as resp:
        await resp.read()
    m = await fleet.metrics()
    for name in (
        "kvindex_route_ttft_seconds_bucket",
        "kvindex_route_score_seconds_count",
        "kvindex_route_stage_seconds_count",
        "kvindex_route_request_seconds_count",
        "kvindex_route_index_streams_opened_total",
    ):
        assert any(key[0] == name for key in m), name
    assert sample(m, "kvindex_route_requests_total", path="/v1/models", code="200") == 1


async def test_shutdown_lets_an_in_flight_stream_finish(fleet: Fleet) -> None:
    w1 = fleet.engines["w1"]
    w1.gate = asyncio.Event()
    resp = await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True})
    await asyncio.wait_for(w1.holding.wait(), 5)
    stopping = asyncio.create_task(fleet.proxy.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # waiting for the stream
    w1.gate.set()
    assert await resp.read() == b"".join(sse_chunks("w1", w1.tokens))  # the whole stream, not cut
    resp.release()
    await asyncio.wait_for(stopping, 5)
    assert fleet.ledger() == 0  # its last release went out before the proxy closed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post_when_up(
    http: aiohttp.ClientSession, port: int, prompt: list[int] = PROMPT
) -> aiohttp.ClientResponse:
    """The proxy's answer to a completion, once it listens (read, released)."""
    for _ in range(300):
        try:
            async with http.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": prompt}
            ) as resp:
                await resp.read()
                return resp
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.05)
    raise AssertionError("kvindex route did not start")


def _reap(proc: subprocess.Popen[bytes]) -> str:
    """Kill ``proc`` if it still runs (a failed test); what it wrote on stderr."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    assert proc.stderr is not None
    return proc.stderr.read().decode()


async def test_cli_serves_and_exits_0_on_sigterm(grpc_fleet: Fleet) -> None:
    fleet = grpc_fleet
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex.cli", "route", "--index", fleet.service.grpc.address,
         "--host", "127.0.0.1", "--port", str(port), "--log-format", "json"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        resp = await _post_when_up(fleet.http, port)
        assert resp.status == 200 and resp.headers["x-kvindex-instance"] == "w1/0"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stderr = _reap(proc)
    assert "route_started" in stderr and "route_stopped" in stderr
    assert "serving_without_protection" not in stderr  # loopback: nobody else can reach it
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")


def test_cli_warns_when_other_machines_can_reach_it() -> None:
    """As ``kvindex serve`` does for its listeners (docs/deploy.md): the proxy has no TLS and no
    authentication, so binding beyond loopback is said, with what to do instead."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex.cli", "route", "--index", "127.0.0.1:1", "--host", "0.0.0.0",
         "--port", str(port), "--log-format", "json"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        events = []
        while not events or events[-1]["event"] != "route_started":
            line = proc.stderr.readline()
            assert line, f"kvindex route exited ({proc.poll()}) before it started"
            events.append(json.loads(line))
        (warning,) = [e for e in events if e["event"] == "serving_without_protection"]
        assert warning["level"] == "warning"
        assert warning["listeners"] == [
            f"route 0.0.0.0:{port} (plain HTTP, no authentication: anyone can send requests)"
        ]
        assert "bind 127.0.0.1" in warning["fix"] and "--host" in warning["fix"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_cli_over_mutual_tls_and_a_token(
    nats_server: EmbeddedNats, tmp_path: Path, make_publisher: MakePub
) -> None:
    config = mtls_token_config(nats_server.url, tmp_path)
    svc = IndexService(config)
    await svc.start()
    f = await start_fleet(svc, make_publisher, tls=ClientTLS(ca=tmp_path / "ca.pem"), token="s3cret")
    try:
        # In-process: a TLS client without a client certificate is refused by mutual TLS, so the
        # proxy knows no instance and says so (503), never routes blind.
        async with await f.post({"model": MODEL, "prompt": PROMPT}) as resp:
            assert resp.status == 503
        port = _free_port()
        args = ["--tls-ca", "ca.pem", "--tls-cert", "client.pem", "--tls-key", "client.key"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvindex.cli", "route", "--index", svc.grpc.address, "--host", "127.0.0.1",
             "--port", str(port), *args, "--auth-token-file", "token", "--log-format", "json"],
            cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            resp = await _post_when_up(f.http, port)
            assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "index"
            assert resp.headers["x-kvindex-instance"] == "w1/0"
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await wait_until(lambda: len(svc.ranker.ledger) == 0, what="released over TLS")
        bad = subprocess.run(
            [sys.executable, "-m", "kvindex.cli", "route", "--tls-ca", "missing.pem"],
            cwd=tmp_path, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert bad.returncode != 0 and "missing.pem" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        await f.http.close()
        await f.proxy.stop()
        for e in f.engines.values():
            await e.close()
        await svc.stop()


async def test_chat_without_a_tokenizer_is_said_once_per_model(fleet: Fleet) -> None:
    """The index (no --tokenizer) rejects text: chat is routed by hash, and the proxy says so once
    per model, naming the fix, instead of only counting fallbacks."""
    from structlog.testing import capture_logs

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    with capture_logs() as logs:
        for _ in range(3):
            async with await fleet.post(body, path="/v1/chat/completions") as resp:
                assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "fallback"
    said = [r for r in logs if r["event"] == "chat_routing_hash_only"]
    assert len(said) == 1 and said[0]["model"] == MODEL
    assert f"--tokenizer {MODEL}=DIR" in said[0]["fix"]
    assert not [r for r in logs if r["event"] == "index_rejected_request"]
    assert sample(await fleet.metrics(), "kvindex_route_fallbacks_total", reason="rejected") == 3
    await wait_until(lambda: fleet.ledger() == 0, what="ledger empty")


async def test_the_engine_usage_is_reported_with_the_release(fleet: Fleet) -> None:
    """The engine's cached tokens (usage.prompt_tokens_details) and the TTFT measured here reach the
    index with the final release, and are compared with what it predicted (docs/feedback.md)."""
    w1 = fleet.engines["w1"]
    w1.cached_tokens = 24  # the 6 blocks the index says w1 holds (32-token prompt, last block recomputed)
    outcomes = fleet.service.ranker.outcomes
    seen: list[object] = []
    outcomes.subscribe(seen.append)
    # A stream whose client did not ask for usage: asked for it, read, taken out again.
    async with await fleet.post({"model": MODEL, "prompt": PROMPT, "stream": True}) as resp:
        assert resp.headers["x-kvindex-instance"] == "w1/0"
        assert await resp.read() == b"".join(sse_chunks("w1", w1.tokens))
    await wait_until(lambda: outcomes.outcomes["exact"] == 1, what="stream report compared")
    assert outcomes.instances[("w1", 0)].ratio_n == 1  # a stream: its TTFT measured too
    # A client that asked for usage itself gets the engine's chunk as sent.
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    async with await fleet.post(body) as resp:
        got = await resp.read()
    assert got == w1.sent[-1] and b'"cached_tokens": 24' in got and w1.bodies[-1] == json.dumps(body).encode()
    await wait_until(lambda: len(seen) == 2, what="second report")
    # The first request's blocks now count speculatively (this fake engine publishes no events):
    # the index promised 7 blocks, the engine had 6; an over that is no evidence of a stale index.
    assert seen[1].outcome == "over" and seen[1].error_tokens == -4 and not seen[1].evidence  # type: ignore[attr-defined]
    # A non-streamed answer: its usage is in the body; 4 tokens long, so no TTFT is claimed.
    w1.cached_tokens = 0  # the engine lost the blocks the index still lists: an over
    async with await fleet.post({"model": MODEL, "prompt": PROMPT}) as resp:
        assert resp.status == 200 and resp.headers["x-kvindex-instance"] == "w1/0"
        await resp.read()
    await wait_until(lambda: len(seen) == 3, what="non-stream report")
    assert seen[2].outcome == "over" and seen[2].evidence  # type: ignore[attr-defined]
    assert outcomes.instances[("w1", 0)].ratio_n == 2
    m = await fleet.metrics()
    assert sample(m, "kvindex_route_reports_total", result="applied") == 3
    assert len(seen) == 3 and fleet.ledger() == 0


async def test_serve_route_port_routes_in_the_index_process_and_reports_outcomes(
    nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    """``kvindex serve --route-port``: the proxy inside the index process, on a real nats-server
    with engines announcing themselves in heartbeats; requests are ranked by the index (no gRPC),
    released, their outcomes compared; SIGTERM stops both listeners with exit 0."""
    engines = {w: await FakeOpenAIEngine(w, MODEL).start() for w in ("w1", "w2")}
    for e in engines.values():
        e.cached_tokens = 6 * BS - 1  # what w1 holds, less the recomputed last token
    route_port, metrics_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex.cli", "serve", "--nats", nats_server.url, "--grpc-host", "127.0.0.1",
         "--grpc-port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
         "--route-host", "127.0.0.1", "--route-port", str(route_port), "--log-format", "json"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def routed() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{route_port}/health") as resp:
                        return resp.status == 200 and (await resp.json())["instances_known"] == 2
                return False

            pubs = [
                await make_publisher(
                    worker=w, model=MODEL, block_size=BS, capacity={"gpu": 1000}, endpoint=e.endpoint
                )
                for w, e in engines.items()
            ]
            pubs[0].stored(KEYS[:6])
            await pubs[0].flush()
            for _ in range(300):
                if await routed():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the in-process proxy never knew both engines")
            await asyncio.sleep(0.3)  # the stored blocks follow the heartbeat that announced w1
            body = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with http.post(f"http://127.0.0.1:{route_port}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvindex-decision"] == "index"
                assert resp.headers["x-kvindex-instance"] == "w1/0"  # the one holding the prefix
                assert float(resp.headers["x-kvindex-est-ttft-ms"]) > 0
                streamed = await resp.read()
            assert streamed == b"".join(sse_chunks("w1", 4))  # the usage chunk asked for, taken out
            assert json.loads(engines["w1"].bodies[0])["stream_options"] == {"include_usage": True}

            async def exact() -> float:
                async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                    text = await resp.text()
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name == "kvindex_prediction_outcomes_total" and s.labels == {"outcome": "exact"}:
                            return s.value
                return 0.0

            for _ in range(100):  # the release and its report run after the answer
                if await exact() == 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the engine's cached tokens never reached the index as exact")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        stderr = _reap(proc)
        for e in engines.values():
            await e.close()
    serving = next(json.loads(ln) for ln in stderr.splitlines() if '"kvindex_serving"' in ln)
    assert serving["route"] == f"127.0.0.1:{route_port}"
    assert "route_started" in stderr and "route_stopped" in stderr
    assert "serving_without_protection" not in stderr  # every listener on loopback


def test_serve_route_port_taken_is_a_clear_error(nats_server: EmbeddedNats) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvindex.cli", "serve", "--nats", nats_server.url,
             "--grpc-host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
             "--route-host", "127.0.0.1", "--route-port", str(port), "--log-format", "json"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} for route" in done.stderr
    assert "--route-host/--route-port" in done.stderr


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def test_index_down_from_the_start_is_said_plainly_ready_tells_the_truth_logged_once(
    nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    """A proxy started while its index is down: each request is a 503 saying the index is
    unreachable and since when (no gRPC internals), /ready is 503 and /health 200, and the log says
    it once. The index comes up: routed by it, ready, said once. It goes down again: the proxy knows
    the fleet now, so the fallback routes and it stays ready; said once more."""
    from structlog.testing import capture_logs

    port = _free_port()
    address = f"127.0.0.1:{port}"
    engine = await FakeOpenAIEngine("w1", MODEL).start()
    svc: IndexService | None = None
    with capture_logs() as logs:
        proxy = RouteProxy(
            RouteConfig(index=address, host="127.0.0.1", port=0, score_timeout=2.0, refresh_interval=0.2)
        )
        await proxy.start()
        url = f"http://127.0.0.1:{proxy.port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.post(
                        url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT}
                    ) as resp:
                        assert resp.status == 503
                        err = (await resp.json())["error"]
                    assert err["code"] == "index_unreachable"
                    message = err["message"]
                    assert f"the index at {address} has been unreachable since 20" in message
                    assert "no answer since this process started" in message
                    assert f"no instance of model {MODEL!r} is known" in message
                    for internal in ("AioRpcError", "debug_error_string", "StatusCode", "UNAVAILABLE"):
                        assert internal not in message
                # A chat request alike: the index being down is the reason given, not a tokenizer.
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url + "/v1/chat/completions", json=chat) as resp:
                    assert resp.status == 503
                    assert (await resp.json())["error"]["code"] == "index_unreachable"
                status, ready = await _get(http, url + "/ready")
                assert status == 503 and ready["status"] == "unready" and ready["routing"] == "none"
                assert ready["index_reachable"] is False and ready["index_changed_at"]
                assert f"the index at {address} has been unreachable" in ready["message"]
                status, health = await _get(http, url + "/health")
                assert status == 200 and health["status"] == "ok" and health["index_reachable"] is False
                assert sample(await _metrics(http, url), "kvindex_route_index_reachable") == 0
                assert [r["event"] for r in logs].count("index_unreachable") == 1

                # The index comes up, and an engine announces itself.
                svc = IndexService(
                    ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=port)
                )
                await svc.start()
                await make_publisher(
                    worker="w1", model=MODEL, block_size=BS, capacity={"gpu": 100}, endpoint=engine.endpoint
                )
                for _ in range(200):
                    status, ready = await _get(http, url + "/ready")
                    if ready["instances_known"]:
                        break
                    await asyncio.sleep(0.05)
                assert status == 200 and ready["status"] == "ready" and ready["routing"] == "index"
                async with http.post(
                    url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT}
                ) as resp:
                    assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "index"
                assert [r["event"] for r in logs].count("index_reachable") == 1
                assert sample(await _metrics(http, url), "kvindex_route_index_reachable") == 1

                # Down again: the fleet is known now, so requests are routed by the fallback.
                await svc.grpc.stop(grace=0)
                for _ in range(3):
                    async with http.post(
                        url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT}
                    ) as resp:
                        assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "fallback"
                status, ready = await _get(http, url + "/ready")
                assert status == 200 and ready["routing"] == "fallback" and ready["index_reachable"] is False
                assert ready["index_last_answer_at"] is not None
        finally:
            await proxy.stop()
            await engine.close()
            if svc is not None:
                await svc.stop()
    events = [r["event"] for r in logs]
    assert events.count("index_unreachable") == 2 and events.count("index_reachable") == 1
    assert "chat_routing_hash_only" not in events


async def _metrics(
    http: aiohttp.ClientSession, url: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_chat_for_a_model_no_instance_serves_is_not_blamed_on_the_tokenizer(fleet: Fleet) -> None:
    """The index (no --tokenizer) rejects a chat request's text; for a model nobody serves that is
    beside the point: the 503 says no instance serves it, and chat_routing_hash_only (which claims
    the model's requests are being routed by hash) is not logged."""
    from structlog.testing import capture_logs

    body = {"model": "ghost", "messages": [{"role": "user", "content": "hello"}]}
    with capture_logs() as logs:
        async with await fleet.post(body, path="/v1/chat/completions") as resp:
            assert resp.status == 503
            err = (await resp.json())["error"]
    assert (
        err["code"] == "no_instance"
        and err["message"] == "no instance serves model 'ghost': the index knows none"
    )
    assert not [r for r in logs if r["event"] == "chat_routing_hash_only"]
    assert all(not e.bodies for e in fleet.engines.values())


async def test_cli_started_with_the_index_down_routes_by_its_fallback_instances() -> None:
    """``kvindex route --fallback-instance`` with no index at all: requests go by the fallback hash
    over the listed engines, and /ready says it can route (by the fallback)."""
    engines = {w: await FakeOpenAIEngine(w, MODEL).start() for w in ("w1", "w2")}
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvindex.cli", "route", "--index", f"127.0.0.1:{_free_port()}",
         "--host", "127.0.0.1", "--port", str(port), "--log-format", "json",
         *[a for w, e in engines.items() for a in ("--fallback-instance", f"{MODEL}={w}={e.endpoint}")]],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            served = set()
            for prompt in (PROMPT, [5] * (8 * BS), PROMPT):
                resp = await _post_when_up(http, port, prompt)
                assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "fallback"
                served.add(resp.headers["x-kvindex-instance"])
            assert served <= {"w1/0", "w2/0"}
            status, ready = await _get(http, f"http://127.0.0.1:{port}/ready")
            assert status == 200 and ready["routing"] == "fallback" and ready["instances_known"] == 2
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stderr = _reap(proc)
        for e in engines.values():
            await e.close()
    assert stderr.count('"index_unreachable"') == 1
