"""JetStream mode: a restarted index rebuilds from the stream without asking workers for snapshots."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest

from kvindex.ingest.nats_source import JetStreamConfig
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvtools.testing.faults import FaultyPublisher
from tests.conftest import wait_until

REPAIR = RepairConfig(replay_timeout=0.5, snapshot_timeout=1.0, reconcile_interval=0, tick=0.05)


@pytest.fixture
async def js_server() -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(jetstream=True)
    await server.start()
    yield server
    await server.stop()


async def start_index(url: str) -> IndexService:
    svc = IndexService(
        ServiceConfig(
            nats_url=url, grpc_host="127.0.0.1", grpc_port=0, repair=REPAIR, jetstream=JetStreamConfig()
        )
    )
    await svc.start()
    return svc


def in_sync(svc: IndexService, pub: FaultyPublisher) -> bool:
    key = (pub.worker, pub.dp_rank)
    cursor = svc.consumer.sequencer.cursor(key)
    view = {t: k for t in range(4) if (k := set(svc.index.keys_of(key, t)))}
    return (
        cursor is not None and cursor.repairing is None and cursor.applied == pub.seq and view == pub.truth()
    )


async def test_restarted_index_rebuilds_from_the_stream(js_server: EmbeddedNats) -> None:
    pubs = []
    for name in ("a", "b"):
        nc = await nats.connect(js_server.url)
        pub = FaultyPublisher(nc, worker=name, model="m", block_size=4, heartbeat_interval=0.1)
        pub._owns_nc = True
        await pub.start()
        pubs.append(pub)
    first = await start_index(js_server.url)
    try:
        pubs[0].stored([1, 2, 3])
        pubs[1].stored([7], tier="cpu")
        for p in pubs:
            await p.flush()
        await wait_until(lambda: all(in_sync(first, p) for p in pubs), what="first index in sync")
    finally:
        await first.stop()
    # While no index runs, the workers keep changing; the stream keeps the batches.
    pubs[0].removed([2])
    pubs[1].stored([8, 9])
    for p in pubs:
        await p.flush()
    second = await start_index(js_server.url)
    try:
        await wait_until(lambda: all(in_sync(second, p) for p in pubs), what="restarted index in sync")
        assert second.source is not None and second.source.caught_up
        assert sum(second.counters.snapshots_requested.values()) == 0
        assert second.counters.replays_requested == 0
        assert second.counters.gaps == 0
    finally:
        await second.stop()
        for p in pubs:
            await p.close()


async def test_jetstream_mode_still_repairs_lost_batches(js_server: EmbeddedNats) -> None:
    svc = await start_index(js_server.url)
    nc = await nats.connect(js_server.url)
    pub = FaultyPublisher(nc, worker="w", model="m", block_size=4, heartbeat_interval=0.1)
    pub._owns_nc = True
    await pub.start()
    try:
        pub.stored([1])
        await pub.flush()
        pub.faults.only_seqs = {2}  # never reaches the stream
        pub.stored([2])
        await pub.flush()
        pub.faults.only_seqs.clear()
        pub.stored([3])
        await pub.flush()
        await wait_until(lambda: in_sync(svc, pub), what="in sync after a lost batch")
        assert svc.counters.replays_ok >= 1
    finally:
        await pub.close()
        await svc.stop()
