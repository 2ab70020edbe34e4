"""Replicas that agree, over real parts: two index services on one real nats-server, a fleet of real
publishers, routers calling Score over gRPC. A burst of requests sharing a few long prefixes, asked
alternately of the two replicas, is placed like one replica places it when they share routing state,
and not when they do not."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import msgpack
import nats
import pytest
from prometheus_client import generate_latest

from kvindex.fleet.liveness import LivenessConfig
from kvindex.repair.nats_repair import RepairConfig
from kvindex.routing_sync.sync import DELAY_BUCKETS, SyncConfig
from kvindex.scoring.base import RouteRequest
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.serve import serve_argv
from tests.conftest import wait_until
from tests.integration.test_cli import read_log_until
from tests.integration.test_nats_authorization import PASSWORDS, as_user, secured  # noqa: F401 (the fixture, shared)
from workers_shim.publisher import Publisher

MODEL = "replica-model"
BS = 16
INSTANCES = 8


MakeService = Callable[..., Awaitable[IndexService]]


MakePub = Callable[..., Awaitable[Publisher]]


def burst(
    prefixes: int, per_prefix: int, prefix_blocks: int, suffix_blocks: int
) -> list[tuple[int, list[int]]]:
    """(prefix number, block keys) per request, the prefixes interleaved as concurrent users send them."""
    rng = random.Random(7)
    heads = [[rng.getrandbits(64) for _ in range(prefix_blocks)] for _ in range(prefixes)]
    return [
        (p, heads[p] + [rng.getrandbits(64) for _ in range(suffix_blocks)])
        for _ in range(per_prefix)
        for p in range(prefixes)
    ]


async def place(
    replicas: list[IndexService], requests: list[tuple[int, list[int]]], slot: float = 0.01
) -> tuple[dict[int, set[str]], list[float]]:
    """Ask the replicas in turn (request i goes to replica i mod n) to Score and commit, one request
    every ``slot`` seconds in every mode (the ttft policy smooths some of its inputs over time, so the
    pace must be the same for the comparison). With routing sync on, each slot also waits until the
    other replicas applied the decision; how long that took is returned."""
    channels = [grpc.aio.insecure_channel(r.grpc.address) for r in replicas]
    stubs = [pb_grpc.KvIndexStub(c) for c in channels]
    placed: dict[int, set[str]] = {}
    seen: list[float] = []
    loop = asyncio.get_running_loop()
    try:
        for i, (p, keys) in enumerate(requests):
            start = loop.time()
            replica = i % len(replicas)
            reply = await stubs[replica].Score(
                pb.ScoreRequest(model=MODEL, block_keys=keys, commit=True, request_id=f"req-{i}")
            )
            placed.setdefault(p, set()).add(reply.committed_instance_id)
            others = [r for j, r in enumerate(replicas) if j != replica and r.routing_sync is not None]
            if others:
                while not all(len(r.ranker.ledger) == i + 1 for r in others):
                    assert loop.time() - start < 5.0, f"request {i} not applied by the other replica in 5 s"
                    await asyncio.sleep(0.0002)
                seen.append(loop.time() - start)
            await asyncio.sleep(max(0.0, start + slot - loop.time()))
    finally:
        for c in channels:
            await c.close()
    return placed, seen


@pytest.fixture
async def fleet(make_publisher: MakePub) -> AsyncIterator[list[Publisher]]:
    # Heartbeats rarely: a burst is shorter than one, so what the replicas know of the queues is only
    # what they routed (the ledger), as during a real burst between two heartbeats.
    pubs = [
        await make_publisher(
            worker=f"w{i}", model=MODEL, block_size=BS, capacity={"gpu": 100_000}, heartbeat_interval=30.0
        )
        for i in range(INSTANCES)
    ]
    for p in pubs:
        await p.heartbeat()
    yield pubs


async def replicas(
    make_service: MakeService, fleet: list[Publisher], n: int, sync: bool
) -> list[IndexService]:
    made = [
        await make_service(
            repair=RepairConfig(reconcile_interval=0),
            liveness=LivenessConfig(stale_after=120.0, forget_after=300.0),
            routing_sync=SyncConfig(enabled=sync, replica_id=f"replica-{i}"),
        )
        for i in range(n)
    ]
    for p in fleet:
        await p.heartbeat()
    for svc in made:
        await wait_until(lambda svc=svc: len(svc.registry.routable(MODEL, None)) == INSTANCES)
    return made


def copies(placed: dict[int, set[str]]) -> list[int]:
    return [len(placed[p]) for p in sorted(placed)]


def delay_quantile(svc: IndexService, q: float) -> float:
    """Upper edge of the delay-histogram bucket holding quantile ``q`` (decision -> applied)."""
    assert svc.routing_sync is not None
    h = svc.routing_sync.delay
    seen = 0
    for edge, n in zip((*DELAY_BUCKETS, float("inf")), h.counts, strict=True):
        seen += n
        if seen >= q * h.count:
            return edge
    return float("inf")


async def test_two_replicas_place_a_burst_like_one_replica(
    make_service: MakeService, fleet: list[Publisher]
) -> None:
    # 3 prefixes of 4096 tokens, 48 requests each with its own 2048-token suffix, interleaved.
    requests = burst(3, 48, 256, 128)
    (alone,) = await replicas(make_service, fleet, 1, sync=False)
    one, _ = await place([alone], requests)
    apart = await replicas(make_service, fleet, 2, sync=False)
    assert all(r.routing_sync is None for r in apart)
    two, _ = await place(apart, requests)
    together = await replicas(make_service, fleet, 2, sync=True)
    synced, seen = await place(together, requests)
    c_one, c_two, c_synced = copies(one), copies(two), copies(synced)
    print(
        f"\nprefix copies: one replica {c_one} (total {sum(c_one)}), two without sync {c_two} "
        f"(total {sum(c_two)}), two with sync {c_synced} (total {sum(c_synced)}); "
        f"decision -> applied on the other replica: p50 <= {delay_quantile(together[1], 0.5) * 1e3:g} ms, "
        f"p99 <= {delay_quantile(together[1], 0.99) * 1e3:g} ms; Score + propagation, as the driver saw it: "
        f"median {sorted(seen)[len(seen) // 2] * 1e3:.2f} ms"
    )
    # Like one replica: the same number of copies of every prefix, within one, and in all.
    assert all(abs(a - b) <= 1 for a, b in zip(c_synced, c_one, strict=True))
    assert abs(sum(c_synced) - sum(c_one)) <= 1
    # Without sharing, the two replicas place the same burst differently.
    assert abs(sum(c_two) - sum(c_one)) >= 2
    a, b = together
    for svc in together:
        sync = svc.routing_sync
        assert sync is not None and sync.peers() == 1 and not sync.rejects and not sync.dropped
        assert sync.published["commit"] == len(requests) // 2 == sync.applied["commit"]
    assert a.routing_sync.delay.count == b.routing_sync.messages_applied > 0  # type: ignore[union-attr]
    assert sorted(a.ranker.ledger._entries) == sorted(b.ranker.ledger._entries)


async def test_commit_and_release_through_different_replicas(
    make_service: MakeService, fleet: list[Publisher]
) -> None:
    a, b = await replicas(make_service, fleet, 2, sync=True)
    keys = burst(1, 1, 64, 8)[0][1]
    async with (
        grpc.aio.insecure_channel(a.grpc.address) as ca,
        grpc.aio.insecure_channel(b.grpc.address) as cb,
    ):
        sa, sb = pb_grpc.KvIndexStub(ca), pb_grpc.KvIndexStub(cb)
        scored = await sa.Score(pb.ScoreRequest(model=MODEL, block_keys=keys, commit=True, request_id="s1"))
        await sb.Commit(pb.CommitRequest(model=MODEL, block_keys=keys, instance_id="w3/0", request_id="c1"))
        await wait_until(lambda: len(a.ranker.ledger) == len(b.ranker.ledger) == 2)
        assert {e.request_id: e.instance for e in b.ranker.ledger.of(("w3", 0))} == {"c1": ("w3", 0)}
        # A sibling asked of b sees a's decision as held blocks (speculative keys), b's own instance
        # choice aside.
        sibling = await sb.Score(pb.ScoreRequest(model=MODEL, block_keys=[*keys, 1, 2, 3]))
        matched = {r.instance_id: r.matched_blocks for r in sibling.ranked}
        assert matched[scored.committed_instance_id] == len(keys)
        assert sum(matched.values()) == 2 * len(keys)  # and w3 through b's own commit
        # Released through the replica that did not decide it.
        assert (await sb.Release(pb.ReleaseRequest(request_id="s1", phase="finished"))).found
        assert (await sa.Release(pb.ReleaseRequest(request_id="c1", phase="prefill"))).found
        await wait_until(lambda: len(a.ranker.ledger) == 1 and b.ranker.ledger._entries["c1"].prefill_done)
        assert set(b.ranker.ledger._entries) == {"c1"}
    text = generate_latest(a.metrics.registry).decode()
    assert 'kvindex_routing_sync_published_total{op="commit"} 1.0' in text
    assert 'kvindex_routing_sync_applied_total{op="commit"} 1.0' in text
    assert 'kvindex_routing_sync_applied_total{op="release"} 1.0' in text
    assert "kvindex_routing_sync_peers 1.0" in text
    assert "kvindex_routing_sync_delay_seconds_count 2.0" in text


async def test_bad_routing_messages_are_rejected_counted_and_harmless(
    make_service: MakeService, fleet: list[Publisher], nats_server: EmbeddedNats
) -> None:
    (svc,) = await replicas(make_service, fleet, 1, sync=True)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.publish("kvindex.routing.evil", b"\xc1 not msgpack")
        await nc.publish("kvindex.routing.evil", msgpack.packb({"v": 1, "replica": "other", "epoch": 1}))
        bad_op = {"op": "release", "id": "x", "phase": "sometime"}
        await nc.publish(
            "kvindex.routing.evil",
            msgpack.packb({"v": 1, "replica": "evil", "epoch": 1, "seq": 1, "ts": 0.0, "ops": [bad_op]}),
        )
        # Anyone speaking the documented format is applied: a peer in another language would be.
        commit = {
            "op": "commit",
            "id": "peer-1",
            "model": MODEL,
            "worker": "w5",
            "dp_rank": 0,
            "block_size": BS,
            "prompt_tokens": 4096,
            "miss_tokens": 4096,
            "policy": "ttft",
            "spec_ttl": 10.0,
            "keys": burst(1, 1, 256, 0)[0][1],
        }
        await nc.publish(
            "kvindex.routing.peer",
            msgpack.packb(
                {"v": 1, "replica": "peer", "epoch": 9, "seq": 1, "ts": time.time(), "ops": [commit]}
            ),
        )
        await nc.flush()
    finally:
        await nc.close()
    sync = svc.routing_sync
    assert sync is not None
    await wait_until(lambda: sync.messages_applied == 1 and sum(sync.rejects.values()) == 3)
    assert sync.rejects == {"malformed_msgpack": 1, "missing_field": 1, "bad_value": 1}
    assert [e.request_id for e in svc.ranker.ledger.of(("w5", 0))] == ["peer-1"]
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        reply = await pb_grpc.KvIndexStub(channel).Score(
            pb.ScoreRequest(model=MODEL, block_keys=commit["keys"])  # type: ignore[arg-type]
        )
    # The peer's decision counts here: its prompt is expected on w5 (speculative keys), and w5 is
    # busy with its prefill (the ledger's work).
    by_id = {r.instance_id: r for r in reply.ranked}
    assert by_id["w5/0"].matched_blocks == 256
    assert all(r.matched_blocks == 0 for i, r in by_id.items() if i != "w5/0")
    assert by_id["w5/0"].wait_ms > 0 and all(r.wait_ms == 0 for i, r in by_id.items() if i != "w5/0")


def _metric(port: int, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_two_serve_processes_share_routing_state(
    nats_server: EmbeddedNats, fleet: list[Publisher]
) -> None:
    """``kvindex serve --nats URL --replica-id ...`` twice, as two pods of a Deployment run it."""
    procs = []
    ports = []
    try:
        for name in ("pod-a", "pod-b"):
            grpc_port, metrics_port = free_port(), free_port()
            proc = subprocess.Popen(
                serve_argv(nats_server.url, grpc_port, metrics_port, "--replica-id", name),
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            procs.append(proc)
            ports.append((grpc_port, metrics_port))
        for proc, name in zip(procs, ("pod-a", "pod-b"), strict=True):
            started = await asyncio.to_thread(read_log_until, proc, "kvindex_serving")
            assert started["routing_sync"] == name
        for p in fleet:
            await p.heartbeat()
        keys = burst(1, 1, 64, 8)[0][1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0][0]}") as channel:
            stub = pb_grpc.KvIndexStub(channel)
            for _ in range(100):
                reply = await stub.Score(
                    pb.ScoreRequest(model=MODEL, block_keys=keys, commit=True, request_id="r1")
                )
                if reply.committed_instance_id:
                    break
                await asyncio.sleep(0.05)
            assert reply.committed_instance_id
        applied = 'kvindex_routing_sync_applied_total{op="commit"}'
        for _ in range(100):
            if await asyncio.to_thread(_metric, ports[1][1], applied) >= 1:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(_metric, ports[1][1], applied) == 1
        assert (
            await asyncio.to_thread(_metric, ports[0][1], 'kvindex_routing_sync_published_total{op="commit"}')
            == 1
        )
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_replicas_share_under_the_shipped_nats_permissions(secured: EmbeddedNats) -> None:  # noqa: F811
    """deploy/nats/nats-server.conf lets the index user publish its routing decisions, and refuses a
    worker that tries to publish some."""
    made = []
    pub = rogue = None
    try:
        for name in ("pod-a", "pod-b"):
            svc = IndexService(
                ServiceConfig(
                    nats_url=as_user(secured, "index"),
                    grpc_host="127.0.0.1",
                    grpc_port=0,
                    routing_sync=SyncConfig(replica_id=name),
                )
            )
            await svc.start()
            made.append(svc)
        a, b = made
        pub = await Publisher.connect(
            as_user(secured, "node-1"), worker="node-1", model=MODEL, block_size=BS, heartbeat_interval=0.1
        )
        await wait_until(lambda: all(len(s.registry.routable(MODEL, None)) == 1 for s in made))
        keys = burst(1, 1, 32, 0)[0][1]
        a.ranker.score(RouteRequest(MODEL, keys, len(keys) * BS, BS, "auth-1"), commit=True)
        await wait_until(lambda: [e.request_id for e in b.ranker.ledger.of(("node-1", 0))] == ["auth-1"])
        violations: list[str] = []

        async def on_error(exc: Exception) -> None:
            violations.append(str(exc))

        rogue = await nats.connect(
            secured.url, user="node-1", password=PASSWORDS["node-1"], error_cb=on_error
        )
        forged = {"v": 1, "replica": "evil", "epoch": 1, "seq": 1, "ts": 0.0, "ops": []}
        await rogue.publish("kvindex.routing.evil", msgpack.packb(forged))
        await rogue.flush()
        await wait_until(lambda: any('publish to "kvindex.routing.evil"' in v.lower() for v in violations))
        await asyncio.sleep(0.1)
        syncs = [svc.routing_sync for svc in made]
        assert [s.peers() for s in syncs if s is not None] == [0, 1]  # b heard a, and nobody else
        assert all(s is not None and not s.rejects and not s.dropped for s in syncs)
    finally:
        if rogue is not None:
            await rogue.close()
        if pub is not None:
            await pub.close()
        for svc in made:
            await svc.stop()
