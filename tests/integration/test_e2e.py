"""End to end over real parts: publishers -> nats-server -> kvindex -> gRPC client over a socket."""

from __future__ import annotations

import urllib.request
from collections.abc import Awaitable, Callable

import grpc
import msgpack
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvindex.keys import block_keys
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire import encode_batch
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MODEL = "llama-test"
BS = 4
PROMPT = list(range(1000, 1000 + 10 * BS + 3))  # 10 full blocks and a partial one
KEYS = block_keys(PROMPT, BS, MODEL)

MakePub = Callable[..., Awaitable[Publisher]]


def tiers(m: pb.TierBlocks) -> tuple[int, int, int, int]:
    return (m.gpu, m.cpu, m.disk, m.shared)


async def settle(service: IndexService, *pubs: Publisher) -> None:
    """Flush publishers and wait until the service has applied every batch they sent."""
    for p in pubs:
        await p.flush()

    def done() -> bool:
        for p in pubs:
            state = service.registry.get((p.worker, p.dp_rank))
            if state is None or state.last_seq < p.seq or state.epoch != p.epoch:
                return False
        return True

    await wait_until(done, what="batches applied")


async def lookup(stub: pb_grpc.KvIndexStub, **kw: object) -> dict[str, tuple[int, tuple[int, int, int, int]]]:
    reply = await stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=PROMPT, **kw))
    assert list(reply.block_keys) == KEYS
    return {m.instance_id: (m.matched_blocks, tiers(m.matched)) for m in reply.matches}


async def test_multi_worker_multi_tier_overlaps(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    w1 = await make_publisher(worker="w1", model=MODEL, block_size=BS, capacity={"gpu": 100})
    w2 = await make_publisher(worker="w2", model=MODEL, block_size=BS, capacity={"gpu": 100, "cpu": 100})
    w3r0 = await make_publisher(worker="w3", dp_rank=0, model=MODEL, block_size=BS, capacity={"gpu": 100})
    w3r1 = await make_publisher(worker="w3", dp_rank=1, model=MODEL, block_size=BS, capacity={"gpu": 100})
    w1.stored(KEYS[:8])
    w2.stored(KEYS[:3])
    w2.stored(KEYS[3:6], tier="cpu", parent=KEYS[2])
    w2.stored(KEYS[7:9])  # not contiguous with its prefix: must not count
    w3r0.stored(KEYS[:2])
    w3r0.stored(KEYS[2:4], tier="disk", parent=KEYS[1])
    w3r1.stored(KEYS[:1], tier="cpu")
    await settle(service, w1, w2, w3r0, w3r1)

    assert await lookup(stub) == {
        "w1/0": (8, (8, 0, 0, 0)),
        "w2/0": (6, (3, 3, 0, 0)),
        "w3/0": (4, (2, 0, 2, 0)),
        "w3/1": (1, (0, 1, 0, 0)),
    }

    # A shared pool publisher (capacity only on 'shared') extends every instance's run.
    pool = await make_publisher(worker="mooncake", model=MODEL, block_size=BS, capacity={"shared": 10_000})
    pool.stored(KEYS[:10], tier="shared")
    await settle(service, pool)
    assert await lookup(stub) == {
        "w1/0": (10, (8, 0, 0, 2)),
        # gpu 0-2, cpu 3-5, pool 6, its own gpu copies of 7-8 (now reachable), pool 9
        "w2/0": (10, (5, 3, 0, 2)),
        "w3/0": (10, (2, 0, 2, 6)),
        "w3/1": (10, (0, 1, 0, 9)),
        "mooncake/0": (10, (0, 0, 0, 10)),
    }

    reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT, policy="overlap"))
    ids = [r.instance_id for r in reply.ranked]
    assert "mooncake/0" not in ids  # a pool is never a routing target
    assert reply.total_blocks == 10 and reply.block_size == BS and reply.cost_unit == "prefill_blocks"
    by_id = {r.instance_id: r for r in reply.ranked}
    assert by_id["w1/0"].matched_blocks == 10 and by_id["w1/0"].matched_tokens == 40
    assert ids[0] == "w1/0"  # most on GPU, nothing queued


async def test_removes_and_clears(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    w1 = await make_publisher(worker="w1", model=MODEL, block_size=BS)
    w2 = await make_publisher(worker="w2", model=MODEL, block_size=BS)
    w1.stored(KEYS[:6])
    w1.stored(KEYS[:6], tier="cpu")
    w2.stored(KEYS[:5])
    await settle(service, w1, w2)
    assert await lookup(stub) == {"w1/0": (6, (6, 0, 0, 0)), "w2/0": (5, (5, 0, 0, 0))}

    w1.removed(KEYS[2:6])  # evicted from GPU, still on CPU
    w2.removed([KEYS[1]])  # a hole in the chain cuts the run
    await settle(service, w1, w2)
    assert await lookup(stub) == {"w1/0": (6, (2, 4, 0, 0)), "w2/0": (1, (1, 0, 0, 0))}

    w1.cleared("cpu")
    await settle(service, w1)
    assert await lookup(stub) == {"w1/0": (2, (2, 0, 0, 0)), "w2/0": (1, (1, 0, 0, 0))}

    w2.cleared()
    await settle(service, w2)
    assert await lookup(stub) == {"w1/0": (2, (2, 0, 0, 0)), "w2/0": (0, (0, 0, 0, 0))}
    stats = await stub.Stats(pb.StatsRequest())
    assert tiers(stats.entries) == (2, 0, 0, 0)
    assert stats.events_cleared == 2 and stats.gaps == 0 and stats.rejects_total == 0


async def test_load_moves_the_ranking(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    hot = await make_publisher(worker="hot", model=MODEL, block_size=BS)
    cold = await make_publisher(worker="cold", model=MODEL, block_size=BS)
    hot.stored(KEYS[:10])
    hot.set_load(running=8, waiting=4, waiting_prefill_tokens=200, kv_usage=0.9)
    cold.set_load(running=0, waiting=0, waiting_prefill_tokens=0, kv_usage=0.1)
    await hot.heartbeat()
    await cold.heartbeat()
    await settle(service, hot, cold)
    await wait_until(lambda: service.registry.get(("hot", 0)).load.waiting_prefill_tokens == 200)  # type: ignore[union-attr]

    reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT, policy="overlap"))
    by_id = {r.instance_id: r for r in reply.ranked}
    # hot: 200/4 = 50 queued blocks + 0 missed; cold: 0 queued + 10 missed + 3/4 partial block.
    assert by_id["hot/0"].cost == pytest.approx(50.0 + 3 / 4)  # L-1 cap: the last token is recomputed
    assert by_id["cold/0"].cost == pytest.approx(43 / 4)
    assert [r.instance_id for r in reply.ranked] == ["cold/0", "hot/0"]
    assert by_id["hot/0"].load.running == 8 and by_id["hot/0"].load.kv_usage == pytest.approx(0.9)
    assert by_id["hot/0"].load.status_age_s >= 0

    # Once the queue drains, the cache wins.
    hot.set_load(running=1, waiting=0, waiting_prefill_tokens=0, kv_usage=0.9)
    await hot.heartbeat()
    await wait_until(lambda: service.registry.get(("hot", 0)).load.waiting_prefill_tokens == 0)  # type: ignore[union-attr]
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=KEYS, top_k=1, policy="overlap"))
    assert [r.instance_id for r in reply.ranked] == ["hot/0"]
    # The load shown is the latest heartbeat's (the response reuses per-instance parts between them).
    assert reply.ranked[0].load.running == 1 and reply.ranked[0].load.waiting_prefill_tokens == 0

    # Candidates restrict the ranking.
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=KEYS, candidates=["cold"]))
    assert [r.instance_id for r in reply.ranked] == ["cold/0"]
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=KEYS, candidates=["hot/0", "nobody/3"]))
    assert [r.instance_id for r in reply.ranked] == ["hot/0"]


async def test_bad_input_over_nats(
    service: IndexService, stub: pb_grpc.KvIndexStub, nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    good = await make_publisher(worker="w1", model=MODEL, block_size=BS)
    good.stored(KEYS[:4])
    await settle(service, good)
    before = await lookup(stub)

    nc = await nats.connect(nats_server.url)
    ok_batch = dict(worker="w1", model=MODEL, epoch=good.epoch, block_size=BS, ts=0.0)
    junk = [
        ("kvindex.events.w1", b"\xff\xfe garbage"),
        ("kvindex.events.w1", msgpack.packb(["not", "a", "map"])),
        ("kvindex.events.w1", msgpack.packb({"v": 1, "worker": "w1"})),  # missing fields
        (
            "kvindex.events.w1",
            encode_batch(
                seq=good.seq + 1, events=[{"type": "stored", "tier": "gpu", "keys": ["x"]}], **ok_batch
            ),
        ),  # type: ignore[arg-type]
        (
            "kvindex.events.intruder",
            encode_batch(seq=good.seq + 1, events=[{"type": "cleared", "tier": None}], **ok_batch),
        ),  # type: ignore[arg-type]
        (
            "kvindex.events.w1",
            encode_batch(
                seq=good.seq + 1,
                events=[{"type": "stored", "tier": "gpu", "keys": list(range(200_000))}],
                **ok_batch,
            ),
        ),  # type: ignore[arg-type]
        ("kvindex.status.w1", b"\xc1"),  # 0xc1 is never valid msgpack
    ]
    for subject, payload in junk:
        await nc.publish(subject, payload)
    await nc.flush()
    await wait_until(lambda: service.counters.rejects_total == len(junk), what="all junk rejected")
    await nc.close()

    stats = await stub.Stats(pb.StatsRequest())
    assert stats.rejects_total == len(junk)
    assert dict(stats.rejects_by_reason) == {
        "malformed_msgpack": 2,
        "not_a_map": 1,
        "missing_field": 1,
        "bad_type": 1,
        "subject_mismatch": 1,
        "oversize": 1,
    }
    assert await lookup(stub) == before  # nothing changed

    # The consumer is alive: the next real batch applies.
    good.stored(KEYS[4:7], parent=KEYS[3])
    await settle(service, good)
    assert (await lookup(stub))["w1/0"] == (7, (7, 0, 0, 0))


async def test_invalid_arguments(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    pub = await make_publisher(worker="w1", model=MODEL, block_size=BS)
    await settle(service, pub)
    cases = [
        (pb.ScoreRequest(), "model is required"),
        (pb.ScoreRequest(model=MODEL), "one of token_ids, block_keys, prompt or messages is required"),
        (
            pb.ScoreRequest(model=MODEL, token_ids=[1], block_keys=[2]),
            "exactly one of token_ids, block_keys, prompt and messages; got token_ids and block_keys",
        ),
        (pb.ScoreRequest(model=MODEL, block_keys=[2], lora="x"), "lora and salt apply to token_ids only"),
        (pb.ScoreRequest(model=MODEL, token_ids=[1], candidates=["bad id!"]), "candidate 'bad id!'"),
        (pb.ScoreRequest(model=MODEL, token_ids=[1], candidates=["w1/x"]), "candidate 'w1/x'"),
        (pb.ScoreRequest(model="m" * 600, token_ids=[1]), "longer than 512"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Score(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Lookup(pb.LookupRequest(model=MODEL))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    unknown = await stub.Score(pb.ScoreRequest(model="no-such-model", token_ids=PROMPT))
    assert list(unknown.ranked) == [] and unknown.block_size == 0
    # Shorter than a block: every instance is ranked, with zero overlap.
    short = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=[1, 2]))
    assert [(r.instance_id, r.matched_blocks) for r in short.ranked] == [("w1/0", 0)]


async def test_score_stream_answers_in_order_and_survives_bad_requests(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    a = await make_publisher(worker="a", model=MODEL, block_size=BS)
    b = await make_publisher(worker="b", model=MODEL, block_size=BS)
    a.stored(KEYS[:7])
    b.stored(KEYS[:3])
    await settle(service, a, b)
    requests = [
        pb.ScoreRequest(model=MODEL, token_ids=PROMPT, request_id="r1"),
        pb.ScoreRequest(model=MODEL, block_keys=KEYS[:2], top_k=1, request_id="r2"),
        pb.ScoreRequest(model=MODEL, token_ids=[1], block_keys=[2], request_id="bad"),  # both set
        pb.ScoreRequest(model=MODEL, block_keys=KEYS, candidates=["b"], request_id="r3"),
        pb.ScoreRequest(model="no-such-model", token_ids=PROMPT, request_id="r4"),
        pb.ScoreRequest(model=MODEL, token_ids=PROMPT, commit=True, request_id="r5"),
    ]

    def ranking(reply: pb.ScoreResponse) -> list[tuple[str, int, float, float]]:
        return [(r.instance_id, r.matched_blocks, r.cost, r.est_ttft_ms) for r in reply.ranked]

    # Unary answers first (the streamed r5 commits, which changes later rankings).
    unary = [await stub.Score(request) for request in requests[:2]]
    replies = [reply async for reply in stub.ScoreStream(iter(requests))]
    assert [r.request_id for r in replies] == ["r1", "r2", "bad", "r3", "r4", "r5"]
    # Streamed answers are the unary ones.
    for streamed, reply in zip(replies[:2], unary, strict=True):
        assert ranking(streamed) == ranking(reply) and streamed.request_id == reply.request_id
    assert [(r.instance_id, r.matched_blocks) for r in replies[0].ranked] == [("a/0", 7), ("b/0", 3)]
    assert len(replies[1].ranked) == 1 and replies[1].ranked[0].matched_blocks == 2
    assert (
        "exactly one of token_ids, block_keys, prompt and messages; got token_ids and block_keys"
        in replies[2].error
        and not replies[2].ranked
    )
    assert [r.instance_id for r in replies[3].ranked] == ["b/0"] and not replies[3].error
    assert replies[4].block_size == 0 and not replies[4].ranked and not replies[4].error
    assert replies[5].committed_instance_id == "a/0"
    assert service.ranker.ledger.busy.keys() == {("a", 0)}


async def test_list_instances_health_reflection_and_metrics(
    nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    svc = IndexService(
        ServiceConfig(
            nats_url=nats_server.url,
            grpc_host="127.0.0.1",
            grpc_port=0,
            metrics_port=0,
            metrics_host="127.0.0.1",
        )
    )
    await svc.start()
    try:
        pub = await make_publisher(
            worker="w7", dp_rank=2, model=MODEL, block_size=BS, capacity={"gpu": 64, "cpu": 128}
        )
        pub.stored(KEYS[:5])
        pub.stored(KEYS[:2], tier="cpu")
        pub.set_load(running=3, waiting=1, waiting_prefill_tokens=64, kv_usage=0.25)
        await pub.heartbeat()
        await settle(svc, pub)
        async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            listed = await stub.ListInstances(pb.ListInstancesRequest())
            (info,) = listed.instances
            assert (info.instance_id, info.worker, info.dp_rank, info.model, info.block_size) == (
                "w7/2",
                "w7",
                2,
                MODEL,
                BS,
            )
            assert info.epoch == pub.epoch and info.last_seq == pub.seq and not info.pool
            assert tiers(info.blocks) == (5, 2, 0, 0) and tiers(info.capacity) == (64, 128, 0, 0)
            assert info.load.running == 3 and info.load.waiting_prefill_tokens == 64
            assert list((await stub.ListInstances(pb.ListInstancesRequest(model="other"))).instances) == []

            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            reply = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert reply.status == serving
            # Ready after the first heartbeat window, w7 being in sync (tests/integration/test_readiness.py).
            await wait_until(lambda: svc.grpc.ready, 5.0, "readiness")
            for name in ("", "readiness", "kvindex.v1.KvIndex"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == serving

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = refl.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await call.done_writing()
            names = set()
            async for response in call:
                names |= {s.name for s in response.list_services_response.service}
            assert {"kvindex.v1.KvIndex", "grpc.health.v1.Health"} <= names

            await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT))
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=5).read().decode()
        )
        assert "kvindex_batches_applied_total" in body
        assert 'kvindex_index_entries{tier="cpu"} 2.0' in body
        assert 'kvindex_rpc_latency_seconds_count{method="Score"} 1.0' in body
        assert "kvindex_instances 1.0" in body
    finally:
        await svc.stop()
