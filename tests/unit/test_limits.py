"""Ingest limits (kvindex/ingest/limits.py): beyond a bound the input is refused, counted by reason,
logged once per instance and reason per minute, and nothing else changes."""

from __future__ import annotations

from typing import Any

from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.ingest.limits import BLOCK_LIMIT, INSTANCE_LIMIT, MODEL_LIMIT, IngestLimits
from kvindex.observability.counters import IngestCounters
from kvindex.repair.machine import EVICT_STRIKES, HELD_LIMIT, QUEUED, REPAIR_LIMIT
from kvindex.sequencer.cursor import Sequencer
from kvindex.service.readiness import Readiness, ReadinessConfig
from kvindex.wire import encode_batch, encode_heartbeat
from kvindex.wire.reconcile import Snapshot
from tests.unit.test_consumer import snapshot as index_state
from tests.unit.test_consumer import stored


class Pending:
    """A repair transport whose answers never come (the test answers by hand)."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, str]] = []

    def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
        self.asked.append((instance, "replay"))

    def request_snapshot(self, instance: Any, cause: str) -> None:
        self.asked.append((instance, "snapshot"))


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    info = error = warning


def make(repair: Any = None, **limits: Any) -> tuple[Consumer, Log]:
    log = Log()
    c = build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=None if repair is None else lambda _machine: repair,
        ingest_limits=IngestLimits(**limits),
        log=log,
    )
    return c, log


def batch(
    seq: int, events: list[dict], worker: str = "w1", model: str = "m", epoch: int = 1, **kw: Any
) -> bytes:
    return encode_batch(
        worker=worker, model=model, epoch=epoch, seq=seq, ts=0.0, block_size=4, events=events, **kw
    )


def heartbeat(
    seq: int, capacity: dict, digest: dict | None = None, worker: str = "w1", epoch: int = 1
) -> bytes:
    return encode_heartbeat(
        worker=worker,
        model="m",
        epoch=epoch,
        seq=seq,
        ts=0.0,
        block_size=4,
        load={},
        capacity=capacity,
        digest=digest or {},
    )


def refusals(log: Log) -> list[str]:
    return [kw["reason"] for event, kw in log.lines if event == "limit_refused"]


def xor(keys: range | list[int]) -> int:
    out = 0
    for k in keys:
        out ^= k
    return out


def test_limits_follow_announced_capacity_with_slack_and_default() -> None:
    lim = IngestLimits(capacity_slack=1.25, default_tier_blocks=500, max_tier_blocks=10_000)
    assert lim.block_limits({0: 100, 1: 0}) == (125, 500, 500, 500)  # 0 means "not announced"
    assert lim.block_limits({3: 1 << 40}) == (500, 500, 500, 10_000)  # never above the ceiling


def test_stores_beyond_capacity_are_dropped_removals_still_apply_and_others_unaffected() -> None:
    c, log = make()
    w1, w2 = ("w1", 0), ("w2", 0)
    assert c.on_heartbeat("kvindex.status.w1", heartbeat(0, {"gpu": 8}))  # limit 10
    c.on_heartbeat("kvindex.status.w2", heartbeat(0, {"gpu": 8}, worker="w2"))
    assert c.on_events("kvindex.events.w1", batch(1, [stored(*range(1, 9))]))
    assert c.index.block_counts(w1) == (8, 0, 0, 0)
    # 20 more: only 2 fit; the removal in the same batch still applies, and frees room first.
    c.on_events(
        "kvindex.events.w1",
        batch(2, [{"type": "removed", "tier": "gpu", "keys": [1]}, stored(*range(100, 120))]),
    )
    assert c.index.block_counts(w1) == (10, 0, 0, 0)
    assert set(c.index.keys_of(w1, 0)) == set(range(2, 9)) | {100, 101, 102}
    assert c.counters.rejects[BLOCK_LIMIT] == 1 and c.counters.blocks_refused == 17
    state = c.registry.get(w1)
    assert state is not None and state.capped == 1 and state.last_seq == 2  # the seq is consumed
    # Already-held keys cost no room; every further new store is refused, logged once a minute.
    c.on_events("kvindex.events.w1", batch(3, [stored(2, 3, 200)]))
    assert c.index.block_counts(w1) == (10, 0, 0, 0) and 200 not in set(c.index.keys_of(w1, 0))
    assert c.counters.rejects[BLOCK_LIMIT] == 2 and refusals(log) == [BLOCK_LIMIT]
    # Another instance of the same model is unaffected.
    assert c.on_events("kvindex.events.w2", batch(1, [stored(*range(1, 11))], worker="w2"))
    assert c.index.block_counts(w2) == (10, 0, 0, 0)
    assert c.counters.rejects_by_worker == {"w1": 2}


def test_capped_tier_skips_the_digest_until_the_worker_fits_then_a_snapshot_makes_it_exact() -> None:
    pending = Pending()
    c, _ = make(repair=pending)
    w1 = ("w1", 0)
    c.on_heartbeat("kvindex.status.w1", heartbeat(0, {"gpu": 4}))  # limit 5
    c.on_events("kvindex.events.w1", batch(1, [stored(*range(1, 11))]))  # the worker holds 10
    assert c.index.block_counts(w1) == (5, 0, 0, 0)
    # Its heartbeat's digest disagrees, as it must: no drift snapshot (it would be capped again).
    c.on_heartbeat("kvindex.status.w1", heartbeat(1, {"gpu": 4}, {"gpu": (10, xor(range(1, 11)))}))
    assert pending.asked == [] and c.counters.drift_detected == 0
    # It evicts down to 4 blocks; the index, holding a subset, drifts; now the digest counts again.
    c.on_events(
        "kvindex.events.w1", batch(2, [{"type": "removed", "tier": "gpu", "keys": list(range(1, 7))}])
    )
    c.on_heartbeat("kvindex.status.w1", heartbeat(2, {"gpu": 4}, {"gpu": (4, xor(range(7, 11)))}))
    assert pending.asked == [(w1, "snapshot")] and c.counters.drift_detected == 1
    c.repairs.on_snapshot(w1, Snapshot(1, 2, {0: list(range(7, 11))}))
    assert sorted(c.index.keys_of(w1, 0)) == [7, 8, 9, 10]
    state = c.registry.get(w1)
    assert state is not None and state.capped == 0 and state.repair.sync == "synced"


def test_snapshot_beyond_the_limit_is_applied_up_to_it() -> None:
    pending = Pending()
    c, _ = make(repair=pending)
    w1 = ("w1", 0)
    c.on_heartbeat("kvindex.status.w1", heartbeat(5, {"gpu": 8}))  # discovered mid-stream: snapshot
    assert pending.asked == [(w1, "snapshot")]
    c.repairs.on_snapshot(w1, Snapshot(1, 5, {0: list(range(1, 101))}))
    assert c.index.block_counts(w1) == (10, 0, 0, 0)
    assert c.counters.rejects[BLOCK_LIMIT] == 1 and c.counters.blocks_refused == 90
    state = c.registry.get(w1)
    assert state is not None and state.capped == 1 and state.repair.sync == "synced"


def test_default_limits_admit_the_largest_measured_fleet() -> None:
    """Dynamo's largest Mooncake run has 224,000 workers of one model, which the index was measured
    at (benchmarks/README.md): no default refuses such a fleet (16,384 did)."""
    assert IngestLimits().max_instances_per_model >= 224_000


def test_new_instances_and_models_beyond_the_limits_are_refused_whole() -> None:
    c, log = make(max_instances_per_model=2, max_models=2)
    assert c.on_events("kvindex.events.a", batch(1, [stored(1)], worker="a"))
    assert c.on_events("kvindex.events.b", batch(1, [stored(1)], worker="b"))
    before = index_state(c)
    assert not c.on_events("kvindex.events.c", batch(1, [stored(1)], worker="c"))
    assert not c.on_heartbeat("kvindex.status.c", heartbeat(0, {"gpu": 8}, worker="c"))
    assert c.on_events("kvindex.events.d", batch(1, [stored(1)], worker="d", model="m2"))
    assert not c.on_events("kvindex.events.e", batch(1, [stored(1)], worker="e", model="m3"))
    assert c.counters.rejects == {INSTANCE_LIMIT: 2, MODEL_LIMIT: 1}
    assert c.registry.get(("c", 0)) is None and c.registry.get(("e", 0)) is None
    assert index_state(c)[1] == {**before[1], ("d", 0): (1, 0, 0, 0)}
    assert refusals(log) == [INSTANCE_LIMIT, MODEL_LIMIT]  # c's second refusal is not logged again
    # Existing instances keep working.
    assert c.on_events("kvindex.events.a", batch(2, [stored(2)], worker="a"))
    # When one goes, a new one fits.
    c.forget(("b", 0))
    assert c.on_events("kvindex.events.c", batch(1, [stored(1)], worker="c"))


def test_held_batches_beyond_the_limit_are_dropped_for_a_snapshot() -> None:
    pending = Pending()
    c, _ = make(repair=pending, max_held_batches=3, max_held_keys=10)
    w1 = ("w1", 0)
    c.on_events("kvindex.events.w1", batch(1, [stored(1)]))
    c.on_events("kvindex.events.w1", batch(3, [stored(3)]))  # gap: replay asked, batch 3 held
    assert pending.asked == [(w1, "replay")]
    c.on_events("kvindex.events.w1", batch(4, [stored(*range(10, 19))]))  # 10 keys held: at the limit
    cursor = c.sequencer.cursor(w1)
    assert cursor is not None and cursor.held_keys == 10 and len(cursor.buffer) == 2
    c.on_events("kvindex.events.w1", batch(5, [stored(5)]))  # 11 keys: over, dropped
    assert cursor.held_keys == 0 and not cursor.buffer
    assert pending.asked[-1] == (w1, "snapshot") and c.counters.rejects[HELD_LIMIT] == 1
    assert c.index.block_counts(w1) == (1, 0, 0, 0)  # nothing held was applied out of order
    # The snapshot makes it exact; batches after it apply in order.
    c.repairs.on_snapshot(w1, Snapshot(1, 5, {0: [1, 3, 5, *range(10, 19)]}))
    assert c.on_events("kvindex.events.w1", batch(6, [stored(6)]))
    assert c.index.block_counts(w1) == (13, 0, 0, 0) and cursor.repairing is None


def test_repairs_beyond_the_limit_wait_in_a_queue_and_start_as_repairs_end() -> None:
    pending = Pending()
    c, _ = make(repair=pending, max_pending_repairs=1)
    for w in ("a", "b"):
        c.on_events(f"kvindex.events.{w}", batch(1, [stored(1)], worker=w))
    c.on_events("kvindex.events.a", batch(3, [stored(3)], worker="a"))  # a: repair 1 of 1
    c.on_events("kvindex.events.b", batch(3, [stored(3)], worker="b"))  # b: queued, hole accepted
    assert pending.asked == [(("a", 0), "replay")]
    assert c.counters.rejects[REPAIR_LIMIT] == 1
    assert sorted(c.index.keys_of(("b", 0), 0)) == [1, 3]  # applied across the hole, as NoRepair does
    b = c.sequencer.cursor(("b", 0))
    assert b is not None and b.repairing is None and b.applied == 3
    assert c.repairs.queued == {("b", 0): "gap"} and c.registry.get(("b", 0)).repair.sync == QUEUED  # type: ignore[union-attr]
    # Once a's repair ends, b's snapshot starts (a hole is repaired by a snapshot once queued).
    c.repairs.give_up(("a", 0))
    assert pending.asked[-1] == (("b", 0), "snapshot") and not c.repairs.queued
    # A repair that ends without a word (its instance forgotten): the next queued instance's heartbeat
    # starts its snapshot, a snapshot even when what it met was a hole.
    c.on_events("kvindex.events.a", batch(5, [stored(5)], worker="a"))  # a: queued behind b
    assert c.repairs.queued == {("a", 0): "gap"}
    c.forget(("b", 0))
    assert c.sequencer.repairs() == 0 and c.repairs.queued
    c.on_heartbeat("kvindex.status.a", heartbeat(5, {"gpu": 8}, {"gpu": (3, 1 ^ 3 ^ 5)}, worker="a"))
    assert pending.asked[-1] == (("a", 0), "snapshot") and not c.repairs.queued


def test_an_index_started_into_a_fleet_beyond_the_limit_queues_once_and_is_ready_only_when_exact() -> None:
    """Issue 34: workers heard mid-stream beyond --max-pending-repairs were refused at every heartbeat
    (and their drift logged), and the refused ones looked in sync to the readiness."""
    pending = Pending()
    c, _ = make(repair=pending, max_pending_repairs=1)
    readiness = Readiness(c.registry, c.sequencer, ReadinessConfig(window=0.0, grace=100.0))
    readiness.start(0.0)
    workers = [("a", 0), ("b", 0), ("c", 0)]

    def heartbeats() -> None:
        for w, _ in workers:
            c.on_heartbeat(f"kvindex.status.{w}", heartbeat(3, {"gpu": 8}, {"gpu": (2, 1 ^ 2)}, worker=w))

    heartbeats()
    assert pending.asked == [(("a", 0), "snapshot")]
    assert c.repairs.queued == {("b", 0): "start", ("c", 0): "start"}
    for _ in range(3):  # their next heartbeats neither refuse them again nor find drift
        heartbeats()
    assert c.counters.rejects[REPAIR_LIMIT] == 2 and c.counters.drift_detected == 0
    assert pending.asked == [(("a", 0), "snapshot")]
    assert readiness.evaluate(1.0, connected=True) == (False, "initial_sync")
    # Each snapshot that applies starts the next queued one, oldest first.
    c.repairs.on_snapshot(("a", 0), Snapshot(1, 3, {0: [1, 2]}))
    assert pending.asked[-1] == (("b", 0), "snapshot") and list(c.repairs.queued) == [("c", 0)]
    assert readiness.evaluate(1.1, connected=True) == (False, "initial_sync")
    assert readiness.pending() == [("b", 0), ("c", 0)]
    c.repairs.on_snapshot(("b", 0), Snapshot(1, 3, {0: [1, 2]}))
    assert pending.asked[-1] == (("c", 0), "snapshot") and not c.repairs.queued
    assert readiness.evaluate(1.2, connected=True) == (False, "initial_sync")
    c.repairs.on_snapshot(("c", 0), Snapshot(1, 3, {0: [1, 2]}))
    assert readiness.evaluate(1.3, connected=True) == (True, "ready")
    assert all(sorted(c.index.keys_of(w, 0)) == [1, 2] for w in workers)
    assert c.counters.rejects[REPAIR_LIMIT] == 2


def test_at_the_repair_limit_a_worker_that_never_answers_gives_way() -> None:
    """Hostile workers whose snapshot requests keep failing must not hold every repair slot: a
    repair of an instance that answers takes the place of the one that failed most (issue 32)."""
    pending = Pending()
    c, log = make(repair=pending, max_pending_repairs=2)
    m = c.repairs
    for w in ("h1", "h2", "a", "b", "c"):
        c.on_events(f"kvindex.events.{w}", batch(1, [stored(1)], worker=w))
    for w in ("h1", "h2"):  # holes, replays that fail, snapshots that fail
        c.on_events(f"kvindex.events.{w}", batch(3, [stored(3)], worker=w))
        m.on_replay_failed((w, 0), 1, "timeout")
    for _ in range(3):
        m.snapshot_failed(("h1", 0), "timeout")
    m.snapshot_failed(("h2", 0), "timeout")
    assert m.strikes == {("h1", 0): 3, ("h2", 0): 1} and c.sequencer.repairs() == 2
    # a has a hole: h1, with the most strikes, gives way.
    c.on_events("kvindex.events.a", batch(3, [stored(3)], worker="a"))
    assert pending.asked[-1] == (("a", 0), "replay")
    h1 = c.sequencer.cursor(("h1", 0))
    assert h1 is not None and h1.repairing is None and h1.applied == 3  # its hole accepted
    assert c.counters.rejects[REPAIR_LIMIT] == 1 and refusals(log) == [REPAIR_LIMIT]
    # ... then h2 (EVICT_STRIKES: one failure is enough) for b.
    assert EVICT_STRIKES == 1
    c.on_events("kvindex.events.b", batch(3, [stored(3)], worker="b"))
    assert pending.asked[-1] == (("b", 0), "replay") and c.sequencer.repairing() == {("a", 0), ("b", 0)}
    # Among instances that answer, the limit is first come, first served, as before.
    c.on_events("kvindex.events.c", batch(3, [stored(3)], worker="c"))
    assert pending.asked[-1] == (("b", 0), "replay") and c.counters.rejects[REPAIR_LIMIT] == 3
    # A worker with strikes of its own takes nobody's place.
    c.repairs.give_up(("b", 0))
    m.snapshot_failed(("a", 0), "timeout")
    c.on_events("kvindex.events.c", batch(5, [stored(5)], worker="c"))  # c takes b's place
    c.on_events("kvindex.events.h1", batch(5, [stored(5)], worker="h1"))
    assert c.sequencer.repairing() == {("a", 0), ("c", 0)} and c.counters.rejects[REPAIR_LIMIT] == 4
    # A usable answer clears the strikes; a forgotten instance comes back clean.
    m.on_snapshot(("h2", 0), Snapshot(1, 3, {0: [1, 3]}))
    assert ("h2", 0) not in m.strikes
    c.forget(("h1", 0))
    assert m.strikes == {("a", 0): 1}


def test_a_batch_may_pass_the_limit_on_the_way_if_it_ends_within_it() -> None:
    # Engines store before they evict (an offload tier takes its victims, then trims to capacity):
    # the limit holds for what a batch leaves.
    c, log = make()
    w1 = ("w1", 0)
    c.on_heartbeat("kvindex.status.w1", heartbeat(0, {"gpu": 8, "cpu": 8}))  # limits 10
    c.on_events(
        "kvindex.events.w1",
        batch(
            1,
            [
                stored(*range(1, 21), tier="cpu"),
                {"type": "removed", "tier": "cpu", "keys": list(range(1, 13))},
            ],
        ),
    )
    assert sorted(c.index.keys_of(w1, 1)) == list(range(13, 21))
    assert not c.counters.rejects and not refusals(log)
    # Ending beyond it: the newest stores go, and only as many as needed.
    c.on_events("kvindex.events.w1", batch(2, [stored(30, 31, 32, 33, tier="cpu")]))
    assert sorted(c.index.keys_of(w1, 1)) == [*range(13, 21), 30, 31]
    assert c.counters.blocks_refused == 2 and c.counters.rejects == {BLOCK_LIMIT: 1}


def test_an_instance_at_the_limit_may_restart_with_another_block_size() -> None:
    c, _ = make(max_instances_per_model=1)
    assert c.on_events("kvindex.events.w1", batch(1, [stored(1)]))
    b = encode_batch(worker="w1", model="m", epoch=2, seq=1, ts=0.0, block_size=8, events=[stored(2)])
    assert c.on_events("kvindex.events.w1", b)
    state = c.registry.get(("w1", 0))
    assert state is not None and state.block_size == 8 and not c.counters.rejects


def test_serve_limit_flags_from_the_command_line_and_the_environment() -> None:
    import argparse

    from kvindex import cli
    from kvindex.config import parse_layered

    parser = argparse.ArgumentParser()
    cli._add_serve(parser.add_subparsers(dest="command"))
    args = parse_layered(parser, ["serve", "--max-models", "7"], env={"KVINDEX_CAPACITY_SLACK": "2.0"})
    assert cli._limits(args) == IngestLimits(capacity_slack=2.0, max_models=7)


def test_a_waiting_instance_s_repeated_heartbeats_take_the_short_path_until_its_repair_ends() -> None:
    """Issue 34: during a cold start every heartbeat of an instance whose snapshot was pending or
    queued was decoded and checked in full, though it could change nothing but liveness and load:
    at 28,000 workers that was half the index's core. A heartbeat equal to the previous one but for
    its ts and load now takes the short path while the instance waits, and the full path (digest
    checked) once its repair ends."""
    pending = Pending()
    c, _ = make(repair=pending, max_pending_repairs=1)
    a, b, d = ("a", 0), ("b", 0), ("d", 0)

    def hb(worker: str, ts: float, running: int = 1, epoch: int = 1) -> bytes:
        return encode_heartbeat(
            worker=worker, model="m", epoch=epoch, seq=3, ts=ts, block_size=4,
            load={"running": running}, capacity={"gpu": 8}, digest={"gpu": (2, 1 ^ 2)},
        )  # fmt: skip

    for ts in (1.0, 2.0):  # joined mid-stream (a: its snapshot pending; b and d: queued), then again
        for w in ("a", "b", "d"):
            assert c.on_heartbeat(f"kvindex.status.{w}", hb(w, ts))
    assert pending.asked == [(a, "snapshot")] and list(c.repairs.queued) == [b, d]
    repeats = c.heartbeats._repeats
    assert {"kvindex.status.a", "kvindex.status.b", "kvindex.status.d"} <= set(repeats)
    # The short path refreshes liveness and load, and nothing else moves.
    state = c.registry.get(a)
    assert state is not None
    before = state.last_heartbeat_at
    assert c.on_heartbeat("kvindex.status.a", hb("a", 3.0, running=7))
    assert state.load.running == 7 and state.heartbeat.ts == 3.0 and state.last_heartbeat_at >= before
    assert c.counters.rejects[REPAIR_LIMIT] == 2 and c.counters.drift_detected == 0
    assert pending.asked == [(a, "snapshot")]
    # a's snapshot applies (b's starts): a's next heartbeat is checked in full (its digest agrees).
    c.repairs.on_snapshot(a, Snapshot(1, 3, {0: [1, 2]}))
    assert pending.asked[-1] == (b, "snapshot")
    assert c.on_heartbeat("kvindex.status.a", hb("a", 4.0, running=7))
    assert c.counters.drift_detected == 0
    # b's snapshot (d's starts) says otherwise than b's heartbeats: the short path does not hide
    # the drift, and b waits again, behind d.
    c.repairs.on_snapshot(b, Snapshot(1, 3, {0: [1]}))
    assert pending.asked[-1] == (d, "snapshot")
    assert c.on_heartbeat("kvindex.status.b", hb("b", 5.0))
    assert c.counters.drift_detected == 1 and list(c.repairs.queued) == [b]
    assert c.on_heartbeat("kvindex.status.b", hb("b", 6.0))
    assert "kvindex.status.b" in repeats
    # A repair that ends without a word (d forgotten): b's short path still starts its snapshot.
    c.forget(d)
    assert c.on_heartbeat("kvindex.status.b", hb("b", 7.0))
    assert pending.asked[-1] == (b, "snapshot") and not c.repairs.queued
    # A restart (another epoch) is never a repeat.
    assert c.on_heartbeat("kvindex.status.b", hb("b", 8.0, epoch=2))
    assert c.sequencer.cursor(b).epoch == 2  # type: ignore[union-attr]
