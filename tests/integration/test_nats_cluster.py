"""A 3-node NATS cluster (issue 13 §6): workers on different nodes, the node the index is connected
to is killed; the index reconnects to another node, resynchronizes, and ends equal to every worker
(no lost or extra blocks), while Score keeps answering throughout."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from kvindex.config import NatsSettings
from kvindex.ingest.nats_source import JetStreamConfig
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import FaultyPublisher
from kvtools.testing.natscluster import NatsCluster
from tests.conftest import converged, wait_until

MODEL = "llama"
BS = 4


@pytest.fixture(params=["core", "jetstream"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[NatsCluster]:
    c = NatsCluster(3, jetstream=request.param == "jetstream")
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def _churn(pub: FaultyPublisher, rng: random.Random, stop: asyncio.Event) -> None:
    """A busy worker: new prefixes stored, old ones evicted, all the time."""
    held: list[list[int]] = []
    n = 0
    while not stop.is_set():
        n += 1
        keys = block_keys([rng.randrange(1 << 20) for _ in range(BS * 4)], BS, MODEL)
        pub.stored(keys)
        held.append(keys)
        if len(held) > 20:
            pub.removed(held.pop(rng.randrange(len(held))))
        await asyncio.sleep(0.01)


async def test_index_survives_losing_its_nats_node(cluster: NatsCluster) -> None:
    js = cluster.jetstream
    svc = IndexService(
        ServiceConfig(
            nats_url=NatsSettings(servers=tuple(cluster.urls)),
            grpc_host="127.0.0.1",
            grpc_port=0,
            repair=RepairConfig(reconcile_interval=0, replay_timeout=1.0, snapshot_timeout=2.0),
            jetstream=JetStreamConfig(replicas=3) if js else None,
        )
    )
    await svc.start()
    assert svc.source is not None and svc.source.nc is not None
    if js:
        info = await svc.source.nc.jetstream().stream_info(svc.source.stream)
        assert info.config.num_replicas == 3
    pubs: list[FaultyPublisher] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        # Each worker connects to its own node (it learns the others from the cluster).
        for i, url in enumerate(cluster.urls):
            pub = await FaultyPublisher.connect(
                url, worker=f"w{i}", model=MODEL, block_size=BS, heartbeat_interval=0.1
            )
            pubs.append(pub)
        probe = block_keys(list(range(BS * 8)), BS, MODEL)
        pubs[0].stored(probe)
        await converged(svc, *pubs)
        tasks = [asyncio.create_task(_churn(p, random.Random(i), stop)) for i, p in enumerate(pubs)]

        answered = 0
        failures: list[str] = []

        async def ask() -> None:
            nonlocal answered
            async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
                stub = pb_grpc.KvIndexStub(channel)
                while not stop.is_set():
                    try:
                        reply = await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=probe), timeout=2)
                        best = reply.ranked[0]
                        assert (best.worker, best.matched_blocks) == ("w0", len(probe)), str(reply)
                        answered += 1
                    except Exception as exc:  # recorded: Score must never fail here
                        failures.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.01)

        tasks.append(asyncio.create_task(ask()))
        await asyncio.sleep(0.3)
        before = svc.source.nc.connected_url
        assert before is not None
        victim = cluster.node_of(before.geturl())
        reconnects = svc.source.reconnects
        await victim.kill()
        await wait_until(lambda: svc.source.reconnects > reconnects, 10, "the index reconnecting")  # type: ignore[union-attr]
        after = svc.source.nc.connected_url
        assert after is not None and after.port != before.port
        answered_at_reconnect = answered
        await asyncio.sleep(0.5)  # keep churning on the surviving nodes
        stop.set()
        await asyncio.gather(*tasks)
        tasks = []
        await converged(svc, *pubs, timeout=15)
        assert failures == []
        assert answered_at_reconnect > 0 and answered > answered_at_reconnect
        for p in pubs:  # every worker is still reachable for repairs, wherever it reconnected
            assert p.nc.is_connected
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for p in pubs:
            await p.close()
        await svc.stop()


async def test_a_replicated_stream_waits_for_the_cluster_to_place_it() -> None:
    """A cluster still forming (two of its three nodes up): JetStream cannot place a 3-replica
    stream and says so; the index's start waits, and completes once the third node is up."""
    cluster = await NatsCluster(jetstream=True).start(only=2)
    try:
        svc = IndexService(
            ServiceConfig(
                nats_url=NatsSettings(servers=tuple(cluster.urls[:2])),
                grpc_host="127.0.0.1",
                grpc_port=0,
                repair=RepairConfig(reconcile_interval=0),
                jetstream=JetStreamConfig(replicas=3),
            )
        )
        starting = asyncio.create_task(svc.start())
        await asyncio.sleep(1.5)
        assert not starting.done()  # still waiting for placement, not failed
        await cluster.nodes[2].start()
        await asyncio.wait_for(starting, 30)
        try:
            assert svc.source is not None and svc.source.nc is not None
            info = await svc.source.nc.jetstream().stream_info(svc.source.stream)
            assert info.config.num_replicas == 3
        finally:
            await svc.stop()
    finally:
        await cluster.stop()
