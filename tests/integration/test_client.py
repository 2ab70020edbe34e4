"""kvindex.client over a real gRPC server (the service, its servicer on a real socket, publishers on a
real nats-server): Score over the stream, commit/release, deadlines, a server restart, the index
down -> fallback decisions (counted), in both the asyncio and the blocking client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash

from kvindex.api.server import GrpcServer
from kvindex.api.servicer import KvIndexServicer
from kvindex.client import (
    DEADLINE,
    INDEX_EMPTY,
    UNAVAILABLE,
    AsyncKvIndexClient,
    BadRequest,
    IndexUnavailable,
    KvIndexClient,
    prefix_key,
)
from kvindex.keys import block_keys
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from tests.conftest import mtls_token_config, wait_until
from workers_shim.publisher import Publisher

MODEL = "client-model"
BS = 4
PROMPT = list(range(300, 300 + 8 * BS))
KEYS = block_keys(PROMPT, BS, MODEL)
ENDPOINTS = {"w1": "10.0.0.1:8000", "w2": "10.0.0.2:8000", "w3": "10.0.0.3:8000"}


MakePub = Callable[..., Awaitable[Publisher]]


class SlowServicer(KvIndexServicer):
    """The real servicer, answering Score (stream) and Commit after ``delay`` seconds, and keeping
    the metadata of the last call (to see the bearer token)."""

    delay = 0.0
    break_streams = 0  # abort this many streams at their next request (the request then in flight)
    metadata: tuple[tuple[str, str], ...] = ()

    async def ScoreStream(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.metadata = tuple(context.invocation_metadata() or ())
        async for response in super().ScoreStream(requests, context):
            if self.break_streams:
                self.break_streams -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (test)")
            if self.delay:
                await asyncio.sleep(self.delay)
            yield response

    async def Commit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.metadata = tuple(context.invocation_metadata() or ())
        if self.delay:
            await asyncio.sleep(self.delay)
        return await super().Commit(request, context)


@pytest.fixture
async def index(nats_server: EmbeddedNats) -> AsyncIterator[IndexService]:
    svc = IndexService(ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0))
    svc.servicer = svc.grpc.servicer = SlowServicer(
        svc.index, svc.registry, svc.counters, svc.metrics, svc.ranker, svc.tokenizers
    )
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


async def fleet(index: IndexService, make_publisher: MakePub) -> dict[str, Publisher]:
    """Three workers with endpoints; w1 holds the prompt's first 6 blocks, w2 the first 2."""
    pubs = {
        w: await make_publisher(worker=w, model=MODEL, block_size=BS, capacity={"gpu": 100}, endpoint=e)
        for w, e in ENDPOINTS.items()
    }
    pubs["w1"].stored(KEYS[:6])
    pubs["w2"].stored(KEYS[:2])
    for p in pubs.values():
        await p.flush()
    await wait_until(
        lambda: (
            index.index.block_counts(("w1", 0))[0] == 6
            and index.index.block_counts(("w2", 0))[0] == 2
            and all(index.registry.endpoint(f"{w}/0") for w in ENDPOINTS)
        ),
        what="fleet indexed",
    )
    return pubs


async def restart_grpc(index: IndexService, down_for: float = 0.0) -> None:
    port = index.grpc.port
    await index.grpc.stop(grace=0)
    await asyncio.sleep(down_for)
    index.grpc = GrpcServer(index.servicer, "127.0.0.1", port)
    await index.grpc.start()


def rendezvous(key: int, instance_ids: list[str]) -> str:
    """Independent rewrite of the fallback: the highest xxh3(instance id, seed = prefix key) wins."""
    return max(instance_ids, key=lambda i: xxhash.xxh3_64_intdigest(i.encode(), seed=key))


async def test_score_commit_release_over_the_stream(index: IndexService, make_publisher: MakePub) -> None:
    await fleet(index, make_publisher)
    async with AsyncKvIndexClient(
        index.grpc.address, token="s3cret", timeout=5, refresh_interval=0
    ) as client:
        decision = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="r1")
        assert decision.source == "index" and decision.committed
        assert decision.targets[0].instance_id == "w1/0" and decision.endpoint == ENDPOINTS["w1"]
        assert {t.instance_id: t.endpoint for t in decision.targets} == {
            f"{w}/0": e for w, e in ENDPOINTS.items()
        }
        assert decision.response is not None and decision.response.ranked[0].matched_blocks == 6
        assert ("authorization", "Bearer s3cret") in index.servicer.metadata  # type: ignore[attr-defined]
        assert len(index.ranker.ledger) == 1  # r1 is in flight on w1
        assert await client.release("r1", "prefill") and await client.release("r1", "finished")
        assert not await client.release("r1", "finished")  # already gone
        # Concurrent Score calls share the one stream, each gets its own answer.
        prompts = [PROMPT[: BS * n] for n in range(1, 9)]
        decisions = await asyncio.gather(
            *(client.score(MODEL, token_ids=p, request_id=f"q{i}") for i, p in enumerate(prompts))
        )
        assert [d.request_id for d in decisions] == [f"q{i}" for i in range(8)]
        assert [d.response.total_blocks for d in decisions if d.response] == list(range(1, 9))
        assert client.stats.streams_opened == 1 and client.stats.decisions == {"index": 9}
        # Commit after a Score without commit, Lookup, ListInstances (which fills the fallback's cache).
        assert await client.commit("r2", "w2/0", MODEL, token_ids=PROMPT)
        assert await client.release("r2")
        assert not await client.commit("r3", "w9/0", MODEL, token_ids=PROMPT)  # unknown instance
        looked = await client.lookup(MODEL, block_keys=KEYS)
        assert [m.matched_blocks for m in looked.matches][:2] == [6, 2]
        listed = await client.list_instances()
        assert sorted(i.endpoint for i in listed) == sorted(ENDPOINTS.values())
        assert sorted(k.instance_id for k in client.instances.instances(MODEL)) == ["w1/0", "w2/0", "w3/0"]


async def test_bad_arguments_are_errors_not_fallbacks(index: IndexService, make_publisher: MakePub) -> None:
    await fleet(index, make_publisher)
    async with AsyncKvIndexClient(index.grpc.address, timeout=5, refresh_interval=0) as client:
        await client.refresh_instances()
        with pytest.raises(BadRequest, match="exactly one of token_ids, block_keys, prompt and messages"):
            await client.score(MODEL, token_ids=PROMPT, block_keys=KEYS)
        with pytest.raises(BadRequest, match="commit needs a request_id"):
            await client.score(MODEL, token_ids=PROMPT, commit=True)
        with pytest.raises(BadRequest, match="instance_id"):
            await client.commit("r1", "not an id", MODEL, token_ids=PROMPT)
        with pytest.raises(TypeError, match="no_such_field"):
            await client.score(MODEL, token_ids=PROMPT, no_such_field=1)
        # The stream survives a rejected request.
        assert (await client.score(MODEL, token_ids=PROMPT)).source == "index"
        assert client.stats.streams_opened == 1 and client.stats.fallbacks == {}


async def test_deadline_falls_back_and_the_stream_stays_aligned(
    index: IndexService, make_publisher: MakePub
) -> None:
    await fleet(index, make_publisher)
    servicer: SlowServicer = index.servicer  # type: ignore[assignment]
    async with AsyncKvIndexClient(index.grpc.address, timeout=0.1, refresh_interval=0) as client:
        assert await client.refresh_instances(timeout=5)
        servicer.delay = 0.3
        late = await client.score(MODEL, token_ids=PROMPT, request_id="late")
        assert late.source == "fallback" and late.reason == DEADLINE and not late.committed
        key = prefix_key(token_ids=PROMPT, block_size=BS)
        assert late.instance_id == rendezvous(key, ["w1/0", "w2/0", "w3/0"])
        assert late.endpoint == ENDPOINTS[late.instance_id.split("/")[0]]
        with pytest.raises(IndexUnavailable) as err:
            await client.commit("c1", "w1/0", MODEL, token_ids=PROMPT)
        assert err.value.reason == DEADLINE
        servicer.delay = 0.0
        await asyncio.sleep(0.4)  # the late answer arrives and is dropped
        on_time = await client.score(MODEL, token_ids=PROMPT[: 3 * BS], request_id="on-time", timeout=2)
        assert on_time.source == "index" and on_time.request_id == "on-time"
        assert on_time.response is not None and on_time.response.total_blocks == 3
        assert client.stats.fallbacks == {DEADLINE: 1} and client.stats.errors == {"Commit:deadline": 1}
        assert client.stats.streams_opened == 1


async def test_index_down_falls_back_consistently_then_reconnects(
    index: IndexService, make_publisher: MakePub
) -> None:
    await fleet(index, make_publisher)
    async with AsyncKvIndexClient(index.grpc.address, timeout=2, refresh_interval=0.2) as client:
        await wait_until(lambda: client.stats.refreshes >= 1, what="instances listed")
        assert (await client.score(MODEL, token_ids=PROMPT)).source == "index"
        port = index.grpc.port
        await index.grpc.stop(grace=0)
        sibling = PROMPT[: 4 * BS] + [7] * (3 * BS)  # shares the first 4 blocks
        other = list(range(9000, 9000 + 8 * BS))
        decisions = [
            await client.score(MODEL, token_ids=p, commit=True, request_id=f"d{i}")
            for i, p in enumerate([PROMPT, sibling, other, PROMPT])
        ]
        assert all(d.source == "fallback" and d.reason == UNAVAILABLE and not d.committed for d in decisions)
        assert decisions[0].instance_id == decisions[1].instance_id == decisions[3].instance_id
        ids = ["w1/0", "w2/0", "w3/0"]
        assert decisions[2].instance_id == rendezvous(prefix_key(token_ids=other, block_size=BS), ids)
        assert decisions[0].targets[0].instance_id == rendezvous(
            prefix_key(token_ids=PROMPT, block_size=BS), ids
        )
        assert sorted(t.instance_id for t in decisions[0].targets) == ids  # the rest, to retry in order
        assert client.stats.fallbacks == {UNAVAILABLE: 4} and client.stats.decisions["fallback"] == 4
        with pytest.raises(IndexUnavailable) as err:  # no fallback for an unknown model
            await client.score("no-such-model", token_ids=PROMPT)
        assert err.value.reason == UNAVAILABLE
        await asyncio.sleep(0.5)  # refreshes fail meanwhile, the last known fleet is kept
        assert client.stats.refresh_errors >= 1 and len(client.instances.instances(MODEL)) == 3
        # The index comes back on the same port: the channel reconnects, a new stream opens.
        index.grpc = GrpcServer(index.servicer, "127.0.0.1", port)
        await index.grpc.start()

        async def back() -> bool:
            return (await client.score(MODEL, token_ids=PROMPT)).source == "index"

        for _ in range(100):
            if await back():
                break
            await asyncio.sleep(0.05)
        decision = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="after")
        assert decision.source == "index" and decision.committed and decision.instance_id == "w1/0"
        assert client.stats.streams_opened >= 2


async def test_stream_broken_under_a_call_is_retried_once(
    index: IndexService, make_publisher: MakePub
) -> None:
    await fleet(index, make_publisher)
    servicer: SlowServicer = index.servicer  # type: ignore[assignment]
    async with AsyncKvIndexClient(index.grpc.address, timeout=5, refresh_interval=0) as client:
        await client.refresh_instances()
        assert (await client.score(MODEL, token_ids=PROMPT)).source == "index"
        servicer.break_streams = 1  # the stream dies with this request in flight
        decision = await client.score(MODEL, token_ids=PROMPT, request_id="in-flight")
        assert decision.source == "index" and decision.request_id == "in-flight"
        assert client.stats.retries == 1 and client.stats.streams_broken == 1
        assert client.stats.streams_opened == 2
        servicer.break_streams = 2  # broken again on the retry: the fallback answers
        decision = await client.score(MODEL, token_ids=PROMPT, request_id="twice")
        assert decision.source == "fallback" and decision.reason == UNAVAILABLE
        assert client.stats.retries == 2 and client.stats.fallbacks == {UNAVAILABLE: 1}
        # Server restarts break the stream as well: the next call reopens it.
        await restart_grpc(index)
        for _ in range(100):
            decision = await client.score(MODEL, token_ids=PROMPT, request_id="after-restart")
            if decision.source == "index":
                break
            await asyncio.sleep(0.05)
        assert decision.source == "index" and decision.request_id == "after-restart"


async def test_without_fallback_the_caller_gets_a_clear_error(index: IndexService) -> None:
    port = index.grpc.port
    await index.grpc.stop(grace=0)
    async with AsyncKvIndexClient(f"127.0.0.1:{port}", use_fallback=False, refresh_interval=0) as client:
        with pytest.raises(IndexUnavailable, match="no fallback configured") as err:
            await client.score(MODEL, token_ids=PROMPT)
        assert err.value.reason == UNAVAILABLE and client.stats.errors == {"Score:unavailable": 1}
    index.grpc = GrpcServer(index.servicer, "127.0.0.1", port)
    await index.grpc.start()


async def test_blocking_client(index: IndexService, make_publisher: MakePub) -> None:
    await fleet(index, make_publisher)
    address = index.grpc.address

    # The blocking client runs its own loop thread; this test's loop serves the index meanwhile.
    client = await asyncio.to_thread(KvIndexClient, address, timeout=2, refresh_interval=0)
    try:
        decision = await asyncio.to_thread(
            client.score, MODEL, token_ids=PROMPT, commit=True, request_id="s1"
        )
        assert decision.source == "index" and decision.endpoint == ENDPOINTS["w1"] and decision.committed
        assert await asyncio.to_thread(client.release, "s1")
        assert len(await asyncio.to_thread(client.list_instances)) == 3
        # Any unary method by its proto name (kvindex/api/methods.py), over gRPC.
        assert (await asyncio.to_thread(client.call, "Stats")).instances == 3
        # Several threads at once share the stream.
        results = await asyncio.gather(
            *(
                asyncio.to_thread(client.score, MODEL, token_ids=PROMPT[: BS * n], request_id=f"t{n}")
                for n in range(1, 6)
            )
        )
        assert [r.request_id for r in results] == [f"t{n}" for n in range(1, 6)]
        await index.grpc.stop(grace=0)
        down = await asyncio.to_thread(client.score, MODEL, token_ids=PROMPT)
        assert down.source == "fallback" and down.reason == UNAVAILABLE
        assert down.instance_id == rendezvous(
            prefix_key(token_ids=PROMPT, block_size=BS), ["w1/0", "w2/0", "w3/0"]
        )
        assert client.stats.fallbacks == {UNAVAILABLE: 1}
        with pytest.raises(IndexUnavailable):
            await asyncio.to_thread(client.release, "s2")
    finally:
        await asyncio.to_thread(client.close)


async def test_index_that_lost_a_known_model_is_treated_as_down(index: IndexService) -> None:
    from kvindex.client import INDEX_EMPTY
    from kvindex.v1 import kvindex_pb2 as pb

    async with AsyncKvIndexClient(index.grpc.address, timeout=5, refresh_interval=0) as client:
        never_seen = await client.score("ghost", token_ids=PROMPT)  # unknown to both: no targets
        assert never_seen.source == "index" and never_seen.targets == []
        # The client saw "ghost" served before; the index (restarted, say) does not know it yet.
        client.instances.replace([pb.InstanceInfo(instance_id="g1/0", model="ghost", endpoint="10.0.0.9:80")])
        await client.refresh_instances()  # a listing without the model keeps what was known
        decision = await client.score("ghost", token_ids=PROMPT)
        assert decision.source == "fallback" and decision.reason == INDEX_EMPTY
        assert decision.targets[0].endpoint == "10.0.0.9:80"
        assert client.stats.fallbacks == {INDEX_EMPTY: 1}


async def test_mutual_tls_and_token(
    nats_server: EmbeddedNats, tmp_path: Path, make_publisher: MakePub
) -> None:
    from kvindex.security import ClientTLS

    config = mtls_token_config(nats_server.url, tmp_path)
    svc = IndexService(config)
    await svc.start()
    try:
        await fleet(svc, make_publisher)
        tls = ClientTLS(ca=tmp_path / "ca.pem", cert=tmp_path / "client.pem", key=tmp_path / "client.key")
        async with AsyncKvIndexClient(svc.grpc.address, tls=tls, token="s3cret", timeout=5) as client:
            decision = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="tls-1")
            assert decision.source == "index" and decision.endpoint == ENDPOINTS["w1"]
            assert await client.release("tls-1")
        # The wrong token: refused, and Score says so through the fallback's counters, never silently.
        async with AsyncKvIndexClient(svc.grpc.address, tls=tls, token="wrong", timeout=5) as client:
            with pytest.raises(IndexUnavailable) as err:
                await client.list_instances()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(IndexUnavailable):  # nothing known to fall back on
                await client.score(MODEL, token_ids=PROMPT)
        blocking = await asyncio.to_thread(
            KvIndexClient, svc.grpc.address, tls=tls, token="s3cret", timeout=5
        )
        try:
            decision = await asyncio.to_thread(blocking.score, MODEL, token_ids=PROMPT)
            assert decision.source == "index" and decision.instance_id == "w1/0"
        finally:
            await asyncio.to_thread(blocking.close)
    finally:
        await svc.stop()


async def test_cold_start_with_the_index_down_routes_by_the_static_list(
    index: IndexService, make_publisher: MakePub
) -> None:
    """A client that has never reached the index: with ``fallback_instances`` it still decides by
    the fallback hash over the listed instances (both clients alike); without, IndexUnavailable,
    whose message carries no gRPC debug string. Once the index answers, its report wins."""
    port = index.grpc.port
    await index.grpc.stop(grace=0)
    static = {
        MODEL: ["w1=10.0.0.1:8000", "w2/0=10.0.0.2:8000", "w3=10.0.0.3:8000"],
        "unpublished": ["10.0.0.5:8000"],  # engines that publish nothing the index would know
    }
    ids = ["w1/0", "w2/0", "w3/0"]  # named as the index names them: a cold pick is a warm one
    address = f"127.0.0.1:{port}"
    async with AsyncKvIndexClient(
        address, timeout=2, refresh_interval=0, fallback_instances=static
    ) as client:
        decision = await client.score(MODEL, token_ids=PROMPT)
        assert decision.source == "fallback" and decision.reason == UNAVAILABLE
        assert decision.instance_id == rendezvous(prefix_key(token_ids=PROMPT, block_size=16), ids)
        assert decision.endpoint == ENDPOINTS[decision.instance_id.split("/")[0]]
        with pytest.raises(IndexUnavailable, match="no known instance of 'other'") as err:
            await client.score("other", token_ids=PROMPT)
        assert "debug_error_string" not in str(err.value) and "AioRpcError" not in str(err.value)
        assert err.value.reason == UNAVAILABLE
    blocking = await asyncio.to_thread(
        KvIndexClient, address, timeout=2, refresh_interval=0, fallback_instances=static
    )
    try:
        same = await asyncio.to_thread(blocking.score, MODEL, token_ids=PROMPT)
        assert same.source == "fallback" and same.instance_id == decision.instance_id
        assert blocking.health.reachable is False
    finally:
        await asyncio.to_thread(blocking.close)
    # The index comes back and reports the model: the instances it reports replace the static ones.
    index.grpc = GrpcServer(index.servicer, "127.0.0.1", port)
    await index.grpc.start()
    await make_publisher(
        worker="w9", model=MODEL, block_size=BS, capacity={"gpu": 100}, endpoint="10.0.0.9:80"
    )
    await wait_until(lambda: index.registry.endpoint("w9/0") is not None, what="w9 announced")
    async with AsyncKvIndexClient(
        address, timeout=2, refresh_interval=0, fallback_instances=static
    ) as client:
        for _ in range(100):  # (gRPC shares the connection's reconnect backoff between channels)
            if await client.refresh_instances():
                break
            await asyncio.sleep(0.05)
        assert [k.instance_id for k in client.instances.instances(MODEL)] == ["w9/0"]
        # A listed model the index does not know: routed by the list, as one it lost would be.
        unpublished = await client.score("unpublished", token_ids=PROMPT)
        assert unpublished.source == "fallback" and unpublished.reason == INDEX_EMPTY
        assert unpublished.endpoint == "10.0.0.5:8000"


async def test_index_health_is_tracked_and_each_change_logged_once(index: IndexService) -> None:
    from structlog.testing import capture_logs

    port = index.grpc.port
    with capture_logs() as logs:
        async with AsyncKvIndexClient(
            index.grpc.address, timeout=2, refresh_interval=0, fallback_instances={MODEL: ["10.0.0.1:80"]}
        ) as client:
            assert client.health.reachable is None  # nothing asked yet
            assert await client.refresh_instances()
            assert client.health.reachable is True and client.health.last_answer_at is not None
            answered = client.health.last_answer_at
            await index.grpc.stop(grace=0)
            for _ in range(3):
                assert (await client.score(MODEL, token_ids=PROMPT)).source == "fallback"
                assert not await client.refresh_instances()
            health = client.health
            assert health.reachable is False and health.reason == UNAVAILABLE
            assert health.last_answer_at == answered and health.changed_at is not None
            said = health.describe()
            assert said.startswith(f"the index at 127.0.0.1:{port} has been unreachable since 20")
            assert "last answer at 20" in said and "UNAVAILABLE" not in said
            index.grpc = GrpcServer(index.servicer, "127.0.0.1", port)
            await index.grpc.start()
            for _ in range(100):
                if await client.refresh_instances():
                    break
                await asyncio.sleep(0.05)
            assert client.health.reachable is True
    events = [r["event"] for r in logs]
    assert events.count("index_unreachable") == 1 and events.count("index_reachable") == 1
    down = next(r for r in logs if r["event"] == "index_unreachable")
    assert down["reason"] == UNAVAILABLE and down["index"] == f"127.0.0.1:{port}" and down["last_answer_at"]
