"""The periodic reconciliation's schedule as pure logic: each instance checked once per interval, only
what is due, and a large fleet kept to the rate. Repairs over a real nats-server:
tests/integration/test_repair.py."""

from __future__ import annotations

from typing import Any

from kvindex.observability.counters import IngestCounters
from kvindex.repair.nats_repair import RepairConfig
from kvindex.sequencer.cursor import Sequencer


def _scheduled_fleet(n: int, cfg: RepairConfig, seed: int) -> tuple[Any, Any, list[tuple[str, int]]]:
    """A repairer over ``n`` synced instances whose periodic checks are recorded, not sent:
    (repairer, consumer, checked keys in order)."""
    import random

    from kvindex.fleet.registry import Registry
    from kvindex.index.inverted import InvertedIndex
    from kvindex.ingest.consumer import Consumer
    from kvindex.ingest.limits import DEFAULT_INGEST_LIMITS
    from kvindex.repair.nats_repair import NatsRepairer
    from kvindex.wire.subjects import Subjects

    def make_repairer(machine: Any) -> NatsRepairer:
        return NatsRepairer(
            machine, Subjects(), DEFAULT_INGEST_LIMITS.limits_of, cfg, rng=random.Random(seed)
        )

    consumer = Consumer(
        InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters(), repair=make_repairer
    )
    repairer = consumer.repairs.scheduler
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
