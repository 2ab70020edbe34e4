"""Publisher library against a real nats-server: numbering, batching, chunking, digests, heartbeats."""

from __future__ import annotations

import asyncio
from functools import reduce
from operator import xor

import nats
import pytest

from kvindex.service.natsd import EmbeddedNats
from kvindex.wire import CLEARED, GPU, REMOVED, STORED, decode_batch, decode_heartbeat
from workers_shim.publisher import Publisher


async def collect(nats_server: EmbeddedNats) -> tuple[nats.NATS, list[tuple[str, bytes]]]:
    nc = await nats.connect(nats_server.url)
    got: list[tuple[str, bytes]] = []

    async def cb(msg: nats.aio.msg.Msg) -> None:
        got.append((msg.subject, msg.data))

    await nc.subscribe("kvindex.>", cb=cb)
    await nc.flush()
    return nc, got


async def test_batches_numbered_deduplicated_and_digest_consistent(nats_server: EmbeddedNats) -> None:
    nc, got = await collect(nats_server)
    pub_nc = await nats.connect(nats_server.url)
    pub = Publisher(
        pub_nc, worker="w1", model="m", block_size=16, heartbeat_interval=60, capacity={"gpu": 10}
    )
    await pub.start()  # sends a first heartbeat (seq 0)
    assert pub.stored([1, 2, 3]) == 3
    assert pub.stored([2, 3, 4]) == 1  # re-announced blocks are not republished
    assert pub.removed([1, 99]) == 1  # unknown blocks are not republished
    await pub.heartbeat()
    pub.cleared()
    await pub.close()
    await pub_nc.close()
    await nc.flush()
    await asyncio.sleep(0.1)
    await nc.close()

    batches = [decode_batch(d, "w1") for s, d in got if s == "kvindex.events.w1"]
    heartbeats = [decode_heartbeat(d, "w1") for s, d in got if s == "kvindex.status.w1"]
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert {b.epoch for b in batches} == {pub.epoch}
    events = [(e.op, e.tier, list(e.keys)) for b in batches for e in b.events]
    assert events == [
        (STORED, "gpu", [1, 2, 3]),
        (STORED, "gpu", [4]),
        (REMOVED, "gpu", [1]),
        (CLEARED, None, []),
    ]
    first, mid, last = heartbeats[0], heartbeats[1], heartbeats[-1]
    assert first.seq == 0
    assert mid.seq == 1 and mid.digest[GPU] == (3, reduce(xor, [2, 3, 4]))
    assert last.seq == batches[-1].seq and last.digest.get(GPU, (0, 0)) == (0, 0)
    assert mid.capacity == {GPU: 10}


async def test_large_events_are_chunked_with_chained_parents(nats_server: EmbeddedNats) -> None:
    nc, got = await collect(nats_server)
    pub_nc = await nats.connect(nats_server.url)
    pub = Publisher(pub_nc, worker="big", model="m", block_size=16, max_batch_keys=100, heartbeat_interval=60)
    await pub.start()
    keys = list(range(1000, 1350))
    pub.stored(keys, parent=7)
    await pub.close()
    await pub_nc.close()
    await asyncio.sleep(0.1)
    await nc.close()
    batches = [decode_batch(d, "big") for s, d in got if s == "kvindex.events.big"]
    assert [len(e.keys) for b in batches for e in b.events] == [100, 100, 100, 50]
    assert all(sum(len(e.keys) for e in b.events) <= 100 for b in batches)
    parents = [e.parent for b in batches for e in b.events]
    assert parents == [7, 1099, 1199, 1299]
    assert [k for b in batches for e in b.events for k in e.keys] == keys


async def test_flush_loop_lingers_then_sends(nats_server: EmbeddedNats) -> None:
    nc, got = await collect(nats_server)
    pub = await Publisher.connect(
        nats_server.url, worker="w2", model="m", block_size=4, flush_interval=0.01, heartbeat_interval=60
    )
    for i in range(10):
        pub.stored([i])  # one engine step's worth of events ...
    await asyncio.sleep(0.2)
    batches = [decode_batch(d, "w2") for s, d in got if s == "kvindex.events.w2"]
    assert len(batches) == 1 and len(batches[0].events) == 10  # ... share one batch
    await pub.close()
    await nc.close()
    with pytest.raises(RuntimeError):
        pub.stored([99])


def test_argument_checks() -> None:
    with pytest.raises(ValueError):
        Publisher(None, worker="bad id", model="m", block_size=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Publisher(None, worker="w", model="m", block_size=0)  # type: ignore[arg-type]
