"""Engines without KV events (approximate mode): heartbeat-only workers and static --instance entries,
whose caches the index predicts from its own routing decisions (TTL, LRU at capacity)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable

import grpc

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.schema import GPU
from tests.conftest import wait_until
from tests.unit.test_approximate import BS, MODEL, tokens
from workers_shim.publisher import Publisher

MakePub = Callable[..., Awaitable[Publisher]]


async def test_mixed_fleet_routes_siblings_to_the_instance_that_served_their_prefix(
    make_service: Callable[..., Awaitable[IndexService]], make_publisher: MakePub
) -> None:
    svc = await make_service(
        static_instances=[("static-0", "10.1.0.9:8000")],
        static_model=MODEL,
        static_block_size=BS,
        static_capacity=64,
    )
    events = [
        await make_publisher(
            worker=f"ev{i}", model=MODEL, block_size=BS, capacity={"gpu": 1000}, endpoint=f"10.1.0.{i}:8000"
        )
        for i in range(2)
    ]
    silent = await make_publisher(
        worker="hb-0",
        model=MODEL,
        block_size=BS,
        capacity={"gpu": 1000},
        endpoint="10.1.0.5:8000",
        events=False,
    )
    for p in (*events, silent):
        await p.heartbeat()
    await wait_until(lambda: len(svc.registry) == 4, what="4 instances")
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        listed = {i.instance_id: i for i in (await stub.ListInstances(pb.ListInstancesRequest())).instances}
        assert {i: x.approximate for i, x in listed.items()} == {
            "ev0/0": False,
            "ev1/0": False,
            "hb-0/0": True,
            "static-0/0": True,
        }
        assert (
            listed["static-0/0"].endpoint == "10.1.0.9:8000" and listed["hb-0/0"].endpoint == "10.1.0.5:8000"
        )

        for n, target in enumerate(("hb-0/0", "static-0/0")):
            prefix = tokens(24 * BS, seed=10 + n)
            first = await stub.Score(
                pb.ScoreRequest(
                    model=MODEL, token_ids=prefix, candidates=[target], commit=True, request_id=f"first-{n}"
                )
            )
            assert first.committed_instance_id == target
            await stub.Release(pb.ReleaseRequest(request_id=f"first-{n}", phase="finished"))
            # A sibling: same 24-block prefix, new tail; the predicted cache brings it to the same place.
            sibling = prefix + tokens(4 * BS, seed=20 + n)
            again = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=sibling, explain=True))
            top = again.ranked[0]
            assert top.instance_id == target and top.matched_blocks == 24, (top.instance_id, top.explain)

        # Real events still rule the others, and a cache reported by events ranks as before.
        held = tokens(30 * BS, seed=30)
        events[1].stored(block_keys(held, BS, MODEL))
        await events[1].flush()
        await wait_until(lambda: svc.index.block_counts(("ev1", 0))[0] == 30, what="ev1's blocks")
        reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=held))
        assert reply.ranked[0].instance_id == "ev1/0" and reply.ranked[0].matched_blocks == 30

        # Capacity: the static instance holds at most 64 predicted blocks, least recently used out.
        for n in range(3):
            await stub.Commit(
                pb.CommitRequest(
                    request_id=f"fill-{n}",
                    instance_id="static-0/0",
                    model=MODEL,
                    token_ids=tokens(30 * BS, 40 + n),
                )
            )
        assert svc.index.block_counts(("static-0", 0))[0] == 64
    # Heartbeat-only and static instances never get repair traffic (nothing to replay or compare).
    await asyncio.sleep(0.5)  # a few more heartbeats
    assert svc.registry.get(("hb-0", 0)).repair.sync == "synced"
    assert svc.consumer.sequencer.cursor(("hb-0", 0)) is None
    assert svc.counters.snapshots_requested.get("drift", 0) == 0


async def test_kvshim_heartbeat_registers_an_engine_without_events(
    nats_server: EmbeddedNats, service: IndexService
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "workers_shim.cli", "heartbeat",
            "--worker-id", "plain-vllm", "--model", MODEL, "--block-size", str(BS),
            "--endpoint", "10.2.0.1:8000", "--capacity", "gpu=500", "--nats", nats_server.url,
            "--heartbeat-interval", "0.1", "--log-format", "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        await wait_until(
            lambda: service.registry.get(("plain-vllm", 0)) is not None, timeout=20, what="joined"
        )
        state = service.registry.get(("plain-vllm", 0))
        await wait_until(lambda: state.approximate, what="approximate")
        assert state.endpoint == "10.2.0.1:8000" and state.capacity == {GPU: 500}
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
