"""Self-healing over a real nats-server: replays, snapshots, restarts, drift, liveness."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from kvindex.fleet.liveness import LivenessConfig
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import Faults, FaultyPublisher
from tests.conftest import converged, index_view, wait_until
from workers_shim.publisher import Publisher

FAST = RepairConfig(
    replay_timeout=0.5,
    snapshot_timeout=1.0,
    reconcile_interval=0,
    tick=0.05,
)
LIVENESS = LivenessConfig(stale_after=0.6, forget_after=1.5, tick=0.05)
MakeService = Callable[..., Awaitable[IndexService]]


@pytest.fixture
def make_worker(
    make_publisher: Callable[..., Awaitable[Publisher]],
) -> Callable[..., Awaitable[FaultyPublisher]]:
    async def make(worker: str, faults: Faults | None = None, **kwargs: object) -> FaultyPublisher:
        kwargs.setdefault("model", "m")
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("heartbeat_interval", 0.1)
        pub = await make_publisher(cls=FaultyPublisher, worker=worker, faults=faults, **kwargs)
        assert isinstance(pub, FaultyPublisher)
        return pub

    return make


async def test_gap_is_repaired_by_replay(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1")
    w.stored([1, 2, 3])
    await w.flush()
    w.faults.only_seqs = {2}
    w.stored([4, 5])  # batch 2: lost
    await w.flush()
    w.faults.only_seqs.clear()
    w.stored([6])  # batch 3 reveals the gap
    await converged(svc, w)
    c = svc.counters
    assert c.gaps >= 1 and c.replays_ok >= 1 and sum(c.snapshots_requested.values()) == 0


async def test_lost_tail_is_found_by_heartbeat(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1")
    w.stored([1])
    await w.flush()
    w.faults.only_seqs = {2}
    w.removed([1])
    w.stored([9])
    await w.flush()  # the last batch is lost; nothing follows it but heartbeats
    w.faults.only_seqs.clear()
    await converged(svc, w)
    assert svc.counters.replays_ok >= 1


async def test_replay_too_old_falls_back_to_snapshot(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1", history=2)
    w.stored([1])
    await w.flush()
    w.faults.only_seqs = {2, 3, 4, 5}
    for k in range(10, 14):
        w.stored([k])
        await w.flush()
    w.faults.only_seqs.clear()
    w.stored([20])
    await converged(svc, w)
    c = svc.counters
    assert c.replays_failed["too_old"] >= 1 and c.snapshots_applied >= 1


async def test_restart_with_cache_kept_or_lost(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1")
    w.stored([1, 2, 3])
    await converged(svc, w)
    await w.close()
    # Same worker id, new epoch. Its cache survived (a shim restart): it announces what it holds.
    kept = await make_worker("w1")
    kept.stored([2, 3, 4])
    await converged(svc, kept)
    assert svc.counters.restarts >= 1
    await kept.close()
    # And a restart that lost everything.
    lost = await make_worker("w1")
    await converged(svc, lost)
    assert index_view(svc.index, ("w1", 0)) == {}


async def test_drift_is_detected_from_the_digest(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1")
    w.stored([1, 2, 3])
    await converged(svc, w)
    svc.index.remove(("w1", 0), 0, [2])  # the index silently diverges (a bug, a bit flip...)
    await converged(svc, w)
    assert svc.counters.drift_detected >= 1 and svc.counters.snapshot_blocks_added >= 1


async def test_index_started_after_the_workers(make_service: MakeService, make_worker) -> None:
    w1 = await make_worker("w1")
    w2 = await make_worker("w2", dp_rank=1)
    w1.stored(list(range(100, 200)))
    w2.stored(list(range(150, 250)), tier="cpu")
    await w1.flush()
    await w2.flush()
    svc = await make_service(FAST, liveness=LIVENESS)  # joins mid-stream: every worker is resynchronised
    w1.stored([7])
    await converged(svc, w1, w2)
    assert svc.counters.snapshots_requested["start"] >= 2


async def test_large_snapshot_spans_several_messages(make_service: MakeService, make_worker) -> None:
    w = await make_worker("big")
    keys = list(range(1, 300_001))  # ~2.7 MB of keys: more than one 1 MB NATS message
    w.stored(keys)
    await w.flush()
    _sealed, parts = w.snapshot_messages()
    assert len(parts) >= 3
    svc = await make_service(FAST, liveness=LIVENESS)
    await converged(svc, w, timeout=15)
    assert svc.index.block_counts(("big", 0))[0] == 300_000


async def test_stale_then_forgotten_then_back(make_service: MakeService, make_worker) -> None:
    svc = await make_service(FAST, liveness=LIVENESS)
    w = await make_worker("w1")
    other = await make_worker("w2")
    w.stored([1])
    await converged(svc, w, other)
    w.faults.partitioned = True
    await wait_until(lambda: svc.registry.get(("w1", 0)).stale, 3, "stale")  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        listed = {i.instance_id: i for i in (await stub.ListInstances(pb.ListInstancesRequest())).instances}
        assert listed["w1/0"].stale and not listed["w2/0"].stale
        assert listed["w2/0"].sync == "synced"
        ranked = await stub.Score(pb.ScoreRequest(model="m", block_keys=[1]))
        assert [r.instance_id for r in ranked.ranked] == ["w2/0"]
        assert (await stub.Stats(pb.StatsRequest())).instances_stale == 1
    await wait_until(lambda: svc.registry.get(("w1", 0)) is None, 3, "forgotten")
    assert not svc.index.has_instance(("w1", 0))
    w.faults.partitioned = False  # it comes back: resynchronised from a snapshot
    await converged(svc, w)
    assert svc.counters.stale_marked >= 1 and svc.counters.instances_forgotten >= 1


async def test_many_index_replicas_do_not_storm_a_worker(make_service: MakeService, make_worker) -> None:
    w = await make_worker("w1")
    w.stored(list(range(1, 5001)))
    await w.flush()
    replicas = [await make_service(FAST, liveness=LIVENESS) for _ in range(4)]
    for svc in replicas:
        await converged(svc, w)
    # Four replicas joined and each resynchronised from a snapshot.
    assert w.snapshots_served >= 4


async def test_simultaneous_snapshot_requests_share_one_build(make_worker) -> None:
    w = await make_worker("w1", snapshot_reuse=10.0)
    w.stored(list(range(1, 1001)))
    _sealed, first = w.snapshot_messages()
    _sealed, again = w.snapshot_messages()
    assert again is first and w.snapshots_built == 1
    w.stored([5000])  # a change invalidates it
    _sealed, fresh = w.snapshot_messages()
    assert fresh is not first and w.snapshots_built == 2


async def test_periodic_reconciliation_restores_silent_loss(make_service: MakeService, make_worker) -> None:
    cfg = RepairConfig(replay_timeout=0.5, snapshot_timeout=1.0, reconcile_interval=0.3, tick=0.05)
    svc = await make_service(cfg)
    w = await make_worker("w1", heartbeat_interval=0.1)
    w.stored([1, 2])
    await converged(svc, w)
    before = svc.counters.snapshots_requested["periodic"]
    # A divergence the digest cannot see: same count, same xor (1 ^ 2 == 4 ^ 7), other blocks.
    svc.index.remove(("w1", 0), 0, [1, 2])
    svc.index.store(("w1", 0), 0, [4, 7])
    assert svc.index.digest(("w1", 0), 0) == w.digest("gpu")
    await asyncio.sleep(0.5)
    await converged(svc, w, timeout=3)
    assert svc.counters.drift_detected == 0
    assert svc.counters.snapshots_requested["periodic"] > before


def _scheduled_fleet(n: int, cfg: RepairConfig, seed: int) -> tuple[Any, Any, list[tuple[str, int]]]:
    """A repairer over ``n`` synced instances whose periodic checks are recorded, not sent:
    (repairer, consumer, checked keys in order)."""
    import random

    from kvindex.fleet.registry import Registry
    from kvindex.index.inverted import InvertedIndex
    from kvindex.ingest.consumer import Consumer
    from kvindex.repair.nats_repair import NatsRepairer

    consumer = Consumer(InvertedIndex(), Registry())
    repairer = NatsRepairer(consumer, cfg, rng=random.Random(seed))
    checked: list[tuple[str, int]] = []
    consumer.repairs.reconcile = lambda key, cause: checked.append(key)  # type: ignore[method-assign]
    for i in range(n):
        join(consumer, (f"w{i}", 0))
    return repairer, consumer, checked


def join(consumer: Any, key: tuple[str, int]) -> None:
    """A synced instance, as a heartbeat at seq 0 leaves it."""
    consumer.registry.add(key, "m", 16)
    consumer.sequencer.open(key, 1)


def test_periodic_checks_each_instance_once_per_interval_and_only_what_is_due() -> None:
    """The reconciliation schedule: new instances spread over one interval, then every 0.8-1.2
    intervals; forgotten ones dropped; a tick looks only at what is due (kvindex/repair)."""
    cfg = RepairConfig(reconcile_interval=60.0, reconcile_rate=0)
    repairer, consumer, checked = _scheduled_fleet(500, cfg, 7)
    keys = [(f"w{i}", 0) for i in range(500)]
    t = 0.0
    repairer._periodic(t)  # schedules all 500, checks none
    assert checked == [] and len(repairer._next_reconcile) == 500
    while t < 60.0:
        t += 0.25
        repairer._periodic(t)
    # Each at least once in the first interval (first checks spread over it), at most twice (the
    # next one comes 0.8-1.2 intervals later).
    first = {k: checked.count(k) for k in keys}
    assert set(checked) == set(keys) and max(first.values()) == 2 and min(first.values()) == 1
    # A late joiner is scheduled at the next tick; a forgotten instance is never checked again.
    late = ("late", 0)
    join(consumer, late)
    gone = keys[0]
    consumer.sequencer.forget(gone)
    checked.clear()
    while t < 60.0 * 2.3:
        t += 0.25
        repairer._periodic(t)
    counts = {k: checked.count(k) for k in set(checked)}
    assert gone not in counts and counts.get(late) in (1, 2, 3)
    assert all(1 <= c <= 3 for c in counts.values()) and len(counts) == 500
    assert gone not in repairer._next_reconcile
    # A busy instance (repair in flight) is rescheduled, not checked.
    busy = keys[1]
    consumer.sequencer.cursor(busy).repairing = "snapshot"  # type: ignore[union-attr]
    checked.clear()
    while t < 60.0 * 4:
        t += 0.25
        repairer._periodic(t)
    assert busy not in checked and len(repairer._due) <= 2 * len(repairer._next_reconcile) + 64


def test_periodic_checks_of_a_large_fleet_keep_to_the_rate() -> None:
    """Beyond reconcile_rate x interval instances, each is checked less often so that the fleet as a
    whole gets at most reconcile_rate periodic snapshots a second."""
    cfg = RepairConfig(reconcile_interval=60.0, reconcile_rate=8.0)
    repairer, _, checked = _scheduled_fleet(2_000, cfg, 3)
    assert repairer.reconcile_every() == 250.0  # 2,000 / 8 per s, not 60 s
    t = 0.0
    while t < 1_000.0:
        t += 0.25
        repairer._periodic(t)
    rate = len(checked) / 1_000.0
    assert 6.0 <= rate <= 8.5, rate  # ~8 a second on average (jitter +-20 %), not 33
    assert len(set(checked)) == 2_000  # everyone within the first 250 s (+ jitter)
