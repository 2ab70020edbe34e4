"""Scoring over real parts: gRPC Score/Commit/Release, calibration persisted in NATS KV, and cold homes
agreed on by two separate index processes."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvindex.keys import block_keys
from kvindex.scoring.costs import PrefillModel
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.serve import serve_argv
from tests.conftest import wait_until
from tests.integration.test_cli import read_log_until
from workers_shim.publisher import Publisher

MODEL = "score-model"
BS = 16
MakePub = Callable[..., Awaitable[Publisher]]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


async def fleet(make_publisher: MakePub, n: int) -> list[Publisher]:
    pubs = [
        await make_publisher(worker=f"w{i}", model=MODEL, block_size=BS, capacity={"gpu": 1000})
        for i in range(n)
    ]
    for p in pubs:
        await p.heartbeat()
    return pubs


async def test_score_commit_release_over_grpc(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    pubs = await fleet(make_publisher, 4)
    await wait_until(lambda: len(service.registry) == 4)
    cold = tokens(40 * BS, seed=1)
    reply = await stub.Score(
        pb.ScoreRequest(model=MODEL, token_ids=cold, explain=True, commit=True, request_id="req-1")
    )
    assert reply.policy == "ttft" and reply.cost_unit == "ms" and len(reply.ranked) == 4
    top = reply.ranked[0]
    assert top.explain == "home" and reply.committed_instance_id == top.instance_id
    assert top.est_ttft_ms == pytest.approx(top.wait_ms + top.prefill_ms + top.fetch_ms)
    assert top.matched_blocks == 0 and top.prefill_ms > 0
    # Its prefill is done but no stored event has arrived yet: a sibling of the committed prompt
    # already sees the blocks on the chosen instance (speculative keys).
    assert (await stub.Release(pb.ReleaseRequest(request_id="req-1", phase="prefill"))).found
    sibling = cold[: 30 * BS] + tokens(10 * BS, seed=2)
    again = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=sibling, explain=True))
    assert again.ranked[0].instance_id == top.instance_id
    assert again.ranked[0].matched_blocks == 30 and again.ranked[0].matched_tokens_by_tier.gpu == 30 * BS
    assert again.ranked[0].explain == "cache"
    # Finished: the in-flight entry goes away.
    assert (await stub.Release(pb.ReleaseRequest(request_id="req-1", phase="finished"))).found
    assert not (await stub.Release(pb.ReleaseRequest(request_id="req-1", phase="finished"))).found
    # Commit without Score, then every policy answers.
    ok = await stub.Commit(
        pb.CommitRequest(
            request_id="req-2", instance_id=pubs[2].worker + "/0", model=MODEL, token_ids=sibling
        )
    )
    assert ok.committed
    unknown = await stub.Commit(
        pb.CommitRequest(request_id="req-3", instance_id="ghost/0", model=MODEL, token_ids=[1] * BS)
    )
    assert not unknown.committed
    for policy in (
        "overlap",
        "kvaware",
        "round_robin",
        "power_of_two",
        "prefix_hash",
        "cache_aware",
        "loadaware",
        "dynamo",
        "llmd",
        "flexlb",
        "preble",
    ):
        r = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=sibling, policy=policy, top_k=2))
        assert r.policy == policy and len(r.ranked) == 2
    decode = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=sibling, role="decode"))
    assert decode.policy == "decode"


async def test_scoring_argument_errors(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await fleet(make_publisher, 1)
    await wait_until(lambda: len(service.registry) == 1)
    cases = [
        (pb.ScoreRequest(model=MODEL, token_ids=[1], policy="magic"), "unknown policy 'magic'"),
        (pb.ScoreRequest(model=MODEL, token_ids=[1], role="train"), "role must be"),
        (pb.ScoreRequest(model=MODEL, token_ids=[1], commit=True), "commit needs a request_id"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Score(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (
            info.value.details() or ""
        )
    for bad in (
        pb.CommitRequest(instance_id="w0/0", model=MODEL, token_ids=[1]),
        pb.CommitRequest(request_id="x", instance_id="w0", model=MODEL, token_ids=[1]),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Commit(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Release(pb.ReleaseRequest(request_id="x", phase="later"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_calibration_from_heartbeats_is_shared_through_nats_kv(make_publisher: MakePub) -> None:
    natsd = EmbeddedNats(jetstream=True)
    await natsd.start()
    try:
        cfg = ServiceConfig(nats_url=natsd.url, grpc_host="127.0.0.1", grpc_port=0)
        first = IndexService(cfg)
        await first.start()
        from nats import connect

        nc = await connect(natsd.url)
        pub = Publisher(nc, worker="w0", model=MODEL, block_size=BS, heartbeat_interval=0.1)
        pub._owns_nc = True
        await pub.start()
        true = PrefillModel(30.0, 0.05, 1e-6)
        rng = random.Random(3)
        for _ in range(10):
            for _ in range(20):
                length = rng.randint(500, 20_000)
                cached = rng.randint(0, length - 1)
                pub.prefill_sample(length, cached, true.ms(length - cached, length))
            await pub.heartbeat()
        await wait_until(
            lambda: (
                first.calibrator.models.get(MODEL) is not None
                and first.calibrator.models[MODEL].samples == 200
            )
        )
        learned = first.calibrator.prefill(MODEL)
        for length, cached in ((1000, 0), (10_000, 3000), (20_000, 500)):
            assert learned.ms(length - cached, length) == pytest.approx(
                true.ms(length - cached, length), rel=0.05
            )
        await first.calibration.save()
        await pub.close()
        await first.stop()
        second = IndexService(cfg)  # a restarted index (or another replica) starts calibrated
        await second.start()
        try:
            assert second.calibrator.prefill(MODEL) == learned
        finally:
            await second.stop()
    finally:
        await natsd.stop()


async def test_cold_homes_agree_across_two_index_processes(
    nats_server: EmbeddedNats, make_publisher: MakePub
) -> None:
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            serve_argv(nats_server.url, p),
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for p in ports
    ]
    try:
        for proc in procs:
            read_log_until(proc, "kvindex_serving")
        await fleet(make_publisher, 6)
        prompts = [tokens(20 * BS, seed=100 + i) for i in range(20)]
        answers = []
        for port in ports:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KvIndexStub(channel)
                for _ in range(100):
                    listed = await stub.ListInstances(pb.ListInstancesRequest())
                    if len(listed.instances) == 6:
                        break
                    await asyncio.sleep(0.05)
                tops = []
                for p in prompts:
                    r = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=p, explain=True, top_k=1))
                    assert r.ranked[0].explain == "home"
                    tops.append(r.ranked[0].instance_id)
                answers.append(tops)
        assert answers[0] == answers[1]
        assert len(set(answers[0])) >= 3  # homes spread over the fleet, not one hot spot
        # The same homes follow from the key function alone.
        assert block_keys(prompts[0], BS, MODEL)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
