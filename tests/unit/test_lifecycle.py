"""kvindex.lifecycle pieces on their own: the bounded helpers and the readiness decision (pure). The
runner's last resorts, in child processes: tests/integration/test_lifecycle.py."""

from __future__ import annotations

import asyncio
import time

from kvindex.fleet.registry import Registry
from kvindex.lifecycle import bounded, finish
from kvindex.sequencer.cursor import Sequencer
from kvindex.service.readiness import Readiness, ReadinessConfig


async def stubborn(seconds: float, swallow: int) -> None:
    """Work that catches its first ``swallow`` cancellations (as nats-py's drain() does)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(deadline - time.monotonic())
        except asyncio.CancelledError:
            if swallow <= 0:
                raise
            swallow -= 1


async def test_finish_repeats_the_cancellation_until_the_task_ends() -> None:
    task = asyncio.ensure_future(stubborn(30.0, swallow=3))
    started = time.monotonic()
    assert await finish([task], 2.0)
    assert task.cancelled() and time.monotonic() - started < 1.0


async def test_bounded_returns_in_time_and_says_what_happened() -> None:
    assert await bounded(asyncio.sleep(0.01), 1.0, "quick")
    started = time.monotonic()
    assert not await bounded(stubborn(30.0, swallow=2), 0.2, "stubborn")
    assert time.monotonic() - started < 1.0

    async def boom() -> None:
        raise RuntimeError("nope")

    assert not await bounded(boom(), 1.0, "failing")  # logged, not raised: the next step still runs


def test_readiness_waits_for_the_first_window_then_the_initial_sync() -> None:
    registry, sequencer = Registry(clock=lambda: 0.0), Sequencer()
    r = Readiness(registry, sequencer, ReadinessConfig(window=1.0, grace=10.0))
    assert r.evaluate(0.0, connected=True) == (False, "starting")
    r.start(100.0)
    a = registry.add(("a", 0), "m", 4)
    b = registry.add(("b", 0), "m", 4)
    sequencer.open(a.key, 1, applied=5)
    cursor_b = sequencer.open(b.key, 1)
    a.heartbeat.seq = 5
    b.repair.sync, cursor_b.repairing = "snapshot", "snapshot"
    assert r.evaluate(100.5, connected=True) == (False, "first_heartbeat_window")
    assert r.evaluate(101.5, connected=True) == (False, "initial_sync")
    assert r.pending() == [("b", 0)]
    registry.add(("late", 0), "m", 4)  # heard after the window: not waited for
    b.stale = True  # went silent: not ranked, not waited for
    assert r.evaluate(101.6, connected=True) == (True, "ready")
    # Latched: a later repair does not take readiness away, a lost NATS connection does.
    b.stale = False
    assert r.evaluate(102.0, connected=True) == (True, "ready")
    assert r.evaluate(102.0, connected=False) == (False, "nats_disconnected")
    r.stopping = True
    assert r.evaluate(103.0, connected=True) == (False, "stopping")


def test_readiness_needs_every_announced_batch_and_a_read_stream() -> None:
    registry, sequencer = Registry(clock=lambda: 0.0), Sequencer()
    r = Readiness(registry, sequencer, ReadinessConfig(window=0.5, grace=3.0))
    r.start(0.0)
    a = registry.add(("a", 0), "m", 4)
    sequencer.open(a.key, 1, applied=3)
    a.heartbeat.seq = 7  # its heartbeat announced batches not applied yet
    assert r.evaluate(1.0, connected=True) == (False, "initial_sync")
    a.heartbeat.seq = 3
    assert r.evaluate(1.1, connected=True, caught_up=False) == (False, "initial_sync")
    assert r.evaluate(1.2, connected=True, caught_up=True) == (True, "ready")


def test_readiness_after_the_grace_whatever_is_pending() -> None:
    registry, sequencer = Registry(clock=lambda: 0.0), Sequencer()
    r = Readiness(registry, sequencer, ReadinessConfig(window=0.5, grace=3.0))
    r.start(0.0)
    a = registry.add(("a", 0), "m", 4)
    cursor = sequencer.open(a.key, 1)
    a.repair.sync, cursor.repairing = "snapshot", "snapshot"
    assert r.evaluate(2.9, connected=True) == (False, "initial_sync")
    assert r.evaluate(3.0, connected=True) == (True, "ready")
