"""The periodic reconciliation's schedule as pure logic: each instance checked once per interval, only
what is due, and a large fleet kept to the rate; and the fair gate's turns (kvindex/repair/fair.py):
who goes next, a turn that is not answered given back, back-off. Repairs over a real nats-server:
tests/integration/test_repair.py and test_repair_fairness.py."""

from __future__ import annotations

from typing import Any

from kvindex.observability.counters import IngestCounters
from kvindex.repair.nats_repair import RepairConfig
from kvindex.sequencer.cursor import Sequencer


def _scheduled_fleet(n: int, cfg: RepairConfig, seed: int) -> tuple[Any, Any, list[tuple[str, int]]]:
    """A repairer over ``n`` synced instances whose periodic checks are recorded, not sent:
    (repairer, consumer, checked keys in order)."""
    import random

    from kvindex.core import build_consumer
    from kvindex.fleet.registry import Registry
    from kvindex.index.inverted import InvertedIndex
    from kvindex.ingest.limits import DEFAULT_INGEST_LIMITS
    from kvindex.repair.nats_repair import NatsRepairer
    from kvindex.wire.subjects import Subjects

    def make_repairer(machine: Any) -> NatsRepairer:
        return NatsRepairer(
            machine, Subjects(), DEFAULT_INGEST_LIMITS.limits_of, cfg, rng=random.Random(seed)
        )

    consumer = build_consumer(
        InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters(), repair=make_repairer
    )
    repairer = consumer.repairs.scheduler
    checked: list[tuple[str, int]] = []
    repairer._check = lambda key, cause: checked.append(key)  # type: ignore[method-assign]
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


# -- the fair gate (kvindex/repair/fair.py): whose snapshot request goes next ----------------------


async def test_the_gate_serves_by_strikes_then_answered_then_the_longest_unserved() -> None:
    import asyncio

    from kvindex.repair.fair import FairGate

    gate = FairGate(slots=1, hold=60.0)
    for name in ("old", "recent"):  # served (and answered) in this order
        (await gate.acquire((name, 0), 0)).release()
        gate.answered((name, 0))
    first = await gate.acquire(("first", 0), 0)  # holds the only slot meanwhile
    order: list[str] = []
    waiting = {
        name: gate.wait((name, 0), strikes)
        for name, strikes in [("failing", 3), ("recent", 0), ("new", 0), ("old", 0), ("failed-once", 1)]
    }
    for name, future in waiting.items():
        future.add_done_callback(lambda f, n=name: order.append(n))
    assert gate.waiting == 5 and gate.in_use == 1
    slot = first
    for _ in range(5):
        slot.release()
        await asyncio.sleep(0)
        slot = waiting[order[-1]].result()
    slot.release()
    # A new instance (a worker opening instances) goes after those known to answer.
    assert order == ["old", "recent", "new", "failed-once", "failing"]
    assert gate.in_use == 0 and gate.expired == 0


async def test_a_request_that_is_not_answered_gives_its_turn_back() -> None:
    """A silent worker's request keeps waiting for its answer, but not with the others' turn."""
    import asyncio

    from kvindex.repair.fair import FairGate

    gate = FairGate(slots=2, hold=0.05)
    silent = [await gate.acquire((f"silent{i}", 0), 0) for i in range(2)]
    honest = await asyncio.wait_for(gate.acquire(("honest", 0), 0), 10)  # never released by them
    assert gate.expired >= 1 and not all(s.held for s in silent) and honest.held
    honest.release()
    for s in silent:
        s.release()  # late releases of expired turns give nothing back twice
    assert gate.in_use == 0


async def test_a_failing_instance_backs_off_exponentially_to_the_cap() -> None:
    import asyncio
    import random

    from kvindex.repair.fair import FairGate

    gate = FairGate(slots=4, hold=60.0, base_backoff=0.25, max_backoff=5.0, rng=random.Random(1))
    for strikes in range(1, 12):
        nominal = min(5.0, 0.25 * 2 ** (strikes - 1))
        assert 0.5 * nominal <= gate.backoff(("bad", 0), strikes) <= 1.5 * nominal
    # In its backoff the instance is not served, even with every slot free; others are at once.
    gate.backoff(("bad", 0), 10)
    bad = gate.wait(("bad", 0), 10)
    good = gate.wait(("good", 0), 0)
    await asyncio.sleep(0)
    assert good.done() and not bad.done()
    good.result().release()
    bad.cancel()  # a cancelled wait is dropped, and takes no turn
    gate.forget(("bad", 0))
    again = await asyncio.wait_for(gate.acquire(("bad", 0), 10), 10)  # forgotten: no backoff
    again.release()
    assert gate.in_use == 0


async def test_one_turn_is_kept_for_instances_in_good_standing() -> None:
    import asyncio

    from kvindex.repair.fair import FairGate

    gate = FairGate(slots=3, hold=60.0)
    struck = [await gate.acquire((f"struck{i}", 0), 1) for i in range(2)]
    third = gate.wait(("struck2", 0), 5)
    await asyncio.sleep(0)
    assert not third.done() and gate.in_use == 2  # a slot is free, but not for it
    good = await asyncio.wait_for(gate.acquire(("good", 0), 0), 10)
    assert gate.in_use == 3
    good.release()
    assert not third.done()
    struck[0].release()  # a struck turn ends: the next struck one may have it
    await asyncio.sleep(0)
    assert third.done()
    third.result().release()
    struck[1].release()
    assert gate.in_use == 0
