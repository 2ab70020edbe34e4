"""Hostile workers must not starve an honest worker's repairs (issue 32 item 5), over a real
nats-server and gRPC: 30 workers that keep the index repairing them and answer every replay and
snapshot request with silence, garbage or an answer that never ends, beside one honest worker that
loses batches and needs snapshots of its own (kvindex/repair/README.md "Fairness")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvindex.ingest.limits import IngestLimits
from kvindex.repair.machine import SNAPSHOT
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire import reconcile
from kvtools.testing.faults import FaultyPublisher
from kvtools.testing.hostile import ANSWERS, HostilePublisher, run_hostile
from tests.conftest import converged, wait_until
from workers_shim.publisher import Publisher

HOSTILE = 30
BATCHES = 60  # the honest worker's, one every 50 ms
LOSE_EVERY = 15  # ... of which every 15th is lost on the way


async def test_an_honest_worker_stays_in_sync_beside_hostile_ones(
    make_service: Callable[..., Awaitable[IndexService]],
    make_publisher: Callable[..., Awaitable[Publisher]],
) -> None:
    # The default snapshot timeout and turns (5 s, 16 at once): a silent worker's request waits 5 s.
    # Fewer pending repairs than hostile workers, so that the repair limit is contested too.
    cfg = RepairConfig(replay_timeout=0.5, reconcile_interval=1.0, tick=0.05)
    svc = await make_service(cfg, limits=IngestLimits(max_pending_repairs=HOSTILE // 2))
    hostile = []
    for i in range(HOSTILE):
        pub = await make_publisher(
            cls=HostilePublisher, worker=f"hostile-{i}", model="h", block_size=4, answer=ANSWERS[i % 3]
        )
        assert isinstance(pub, HostilePublisher)
        hostile.append(pub)
    stop = asyncio.Event()
    noise = asyncio.create_task(run_hostile(hostile, stop, interval=0.1))
    sequencer = svc.consumer.sequencer

    def contested() -> bool:
        snapshots = [k for k, c in sequencer.cursors().items() if c.repairing == SNAPSHOT]
        return len(snapshots) >= 8 and svc.counters.snapshots_failed >= 8

    try:
        await wait_until(contested, 20, "hostile workers repaired by snapshots that fail")
        # The honest worker keeps only its last batch for replays: each loss takes a snapshot.
        honest = await make_publisher(
            cls=FaultyPublisher, worker="honest", model="m", block_size=4, history=1, heartbeat_interval=0.1
        )
        assert isinstance(honest, FaultyPublisher)
        behind = []
        for n in range(1, BATCHES + 1):
            honest.stored([n])
            if n > 16:
                honest.removed([n - 16])
            if n % LOSE_EVERY == 0:
                honest.faults.only_seqs = {honest.seq + 1}
            await honest.flush()
            honest.faults.only_seqs.clear()
            cursor = sequencer.cursor(("honest", 0))
            behind.append(honest.seq - (cursor.applied if cursor is not None else 0))
            await asyncio.sleep(0.05)
        # Every loss repaired and the index exact, while the hostile workers carry on.
        await converged(svc, honest, timeout=10)
        assert svc.counters.snapshots_requested["gap"] >= BATCHES // LOSE_EVERY - 1
        # Never far behind (the loss itself shows until the next batch reveals it; a snapshot's turn
        # comes within snapshot_slot_hold): half of what it published in the phase is a loose bound.
        assert max(behind) < BATCHES // 2, behind
        async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            reply = await stub.ListInstances(pb.ListInstancesRequest(model="m"))
            assert [(i.instance_id, i.sync, i.last_seq) for i in reply.instances] == [
                ("honest/0", "synced", honest.seq)
            ]
    finally:
        stop.set()
        await noise


class StaleSnapshots(FaultyPublisher):
    """Answers snapshot requests with a snapshot of an epoch it has left (``stale_epoch``)."""

    stale_epoch: int | None = None

    async def _on_snapshot(self, msg: Any) -> None:
        if self.stale_epoch is None:
            await super()._on_snapshot(msg)
            return
        tiers = {t: list(keys) for t, keys in self.blocks.items() if keys}
        epoch, seq, size = self.stale_epoch, self.seq, self.nc.max_payload
        for part in reconcile.snapshot_parts(self.worker, self.dp_rank, epoch, seq, tiers, size):
            await self.nc.publish(msg.reply, part)


async def test_a_snapshot_of_an_epoch_left_behind_is_a_failed_request(
    make_service: Callable[..., Awaitable[IndexService]],
    make_publisher: Callable[..., Awaitable[Publisher]],
) -> None:
    """It used to be asked again at once, forever: a worker answering so kept a request loop busy
    (and, with fair turns, would keep its standing). Now it is a strike, and backed off."""
    svc = await make_service(RepairConfig(reconcile_interval=0, tick=0.05))
    key = ("w", 0)
    old = await make_publisher(worker="w", model="m", block_size=4, epoch=1)
    old.stored([1])
    await old.flush()
    await wait_until(lambda: svc.registry.get(key) is not None and svc.registry.get(key).last_seq == 1)  # type: ignore[union-attr]
    await old.close()
    new = await make_publisher(cls=StaleSnapshots, worker="w", model="m", block_size=4, epoch=2)
    assert isinstance(new, StaleSnapshots)
    new.stale_epoch = 1
    new.stored([2])
    await new.flush()
    await wait_until(lambda: svc.registry.get(key).epoch == 2, 5, "the restart seen")  # type: ignore[union-attr]
    svc.repairer.reconcile_now(key, "degraded")
    await wait_until(lambda: svc.counters.snapshots_failed >= 1, 5, "the stale answer counted as failed")
    assert svc.consumer.repairs.strikes.get(key, 0) >= 1
    new.stale_epoch = None  # it answers properly again: the strike is cleared
    await converged(svc, new)
    assert key not in svc.consumer.repairs.strikes
