"""Fair turns for snapshot requests: which instance's request goes next, and how long one request
may keep the others waiting (kvindex/repair/README.md "Fairness").

At most ``slots`` snapshot requests are out at once (``max_concurrent_snapshots``), so that a fleet
resynchronising at once does not flood the index with answers. A request holds its slot until its
answer is complete or it fails, but never longer than ``hold``: a worker that does not answer costs
the index nothing while it is silent, so it must not keep the slot (and every other instance's
repair) for its whole timeout. It goes on waiting for its answer outside the slots.

Waiting requests are served by standing, not arrival: fewest strikes first (snapshot requests of the
instance that failed in a row, kept by the repair machine), then instances that have answered before
instances never answered yet (a worker that opens new instances cannot put them before the fleet),
then the instance served longest ago, then arrival; and instances with strikes hold at most
``slots - 1`` turns together, so that one is free, or frees within ``hold``, for an instance in good
standing. A failed request is retried no sooner than an exponential, jittered, capped backoff of its
instance's strikes, and that holds for the instance's next repair too: a worker that keeps failing
waits longer and longer, and behind every worker that answers.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from dataclasses import dataclass
from typing import Any

from kvindex.instance import InstanceKey


@dataclass(slots=True)
class _Standing:
    answered: bool = False  # a request of the instance has had a usable answer
    last_served: float = -math.inf
    retry_at: float = 0.0


class Slot:
    """One of the gate's slots, held by one request until ``release`` or until its hold runs out."""

    __slots__ = ("_gate", "_struck", "_timer")

    def __init__(self, gate: FairGate, struck: bool) -> None:
        self._gate: FairGate | None = gate
        self._timer: asyncio.TimerHandle | None = None
        self._struck = struck

    @property
    def held(self) -> bool:
        return self._gate is not None

    def release(self) -> None:
        """Give the slot back (again: nothing)."""
        gate, self._gate = self._gate, None
        if gate is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        gate._free += 1
        if self._struck:
            gate._struck_in_use -= 1
        gate._grant()

    def _expire(self) -> None:
        if self._gate is not None:
            self._gate.expired += 1
        self._timer = None
        self.release()


class FairGate:
    def __init__(
        self,
        slots: int,
        hold: float,
        base_backoff: float = 0.25,
        max_backoff: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.slots = max(1, slots)
        self.hold = hold
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.rng = rng or random.Random()
        self._free = self.slots
        # Turns held by instances with strikes: at most slots - 1, so that one is always free soon
        # for an instance in good standing.
        self._struck_in_use = 0
        # (strikes, never answered, last served, arrival, instance, future): the first is served next.
        self._heap: list[tuple[int, bool, float, int, InstanceKey, asyncio.Future[Slot]]] = []
        self._arrivals = 0
        self._standing: dict[InstanceKey, _Standing] = {}
        self.expired = 0  # slots given back because their request outlasted ``hold``

    # -- asking for a turn --------------------------------------------------------------------

    def wait(self, instance: InstanceKey, strikes: int) -> asyncio.Future[Slot]:
        """A future that becomes ``instance``'s slot when its turn comes (not before its backoff
        ends). Cancel it to stop waiting; whoever gets its result must release the slot."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Slot] = loop.create_future()
        standing = self._standing.get(instance)
        if standing is None:
            standing = self._standing[instance] = _Standing()
        if standing.retry_at > loop.time():
            loop.call_at(standing.retry_at, self._enqueue, instance, strikes, future)
        else:
            self._enqueue(instance, strikes, future)
        return future

    async def acquire(self, instance: InstanceKey, strikes: int) -> Slot:
        """``wait`` for a task: a slot granted just as the task is cancelled is given back."""
        future = self.wait(instance, strikes)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release()
            raise

    def backoff(self, instance: InstanceKey, strikes: int) -> float:
        """After a failed request: the instance's next turn comes no sooner than this (s)."""
        delay = min(self.max_backoff, self.base_backoff * 2.0 ** min(max(strikes - 1, 0), 30))
        delay *= 0.5 + self.rng.random()
        standing = self._standing.get(instance)
        if standing is None:
            standing = self._standing[instance] = _Standing()
        standing.retry_at = asyncio.get_running_loop().time() + delay
        return delay

    def answered(self, instance: InstanceKey) -> None:
        """A request of the instance had a usable answer: it goes before instances never answered."""
        standing = self._standing.get(instance)
        if standing is None:
            standing = self._standing[instance] = _Standing()
        standing.answered = True

    def forget(self, instance: InstanceKey) -> None:
        self._standing.pop(instance, None)

    # -- what the repairer shows (tests, logs) --------------------------------------------------

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    @property
    def waiting(self) -> int:
        return sum(1 for entry in self._heap if not entry[-1].done())

    def stats(self) -> dict[str, Any]:
        return {"in_use": self.in_use, "waiting": self.waiting, "expired": self.expired}

    # -- internals ------------------------------------------------------------------------------

    def _enqueue(self, instance: InstanceKey, strikes: int, future: asyncio.Future[Slot]) -> None:
        if future.done():
            return  # cancelled while it sat out its backoff
        standing = self._standing.get(instance)
        if standing is None:
            standing = self._standing[instance] = _Standing()
        self._arrivals += 1
        entry = (strikes, not standing.answered, standing.last_served, self._arrivals, instance, future)
        heapq.heappush(self._heap, entry)
        self._grant()

    def _grant(self) -> None:
        heap = self._heap
        while self._free > 0 and heap:
            strikes, _, _, _, instance, future = heap[0]
            if future.done():
                heapq.heappop(heap)
                continue  # cancelled while waiting
            if strikes and self.slots > 1 and self._struck_in_use >= self.slots - 1:
                return  # the first in line has strikes, so has everyone waiting: keep the last turn
            heapq.heappop(heap)
            loop = future.get_loop()
            slot = Slot(self, strikes > 0)
            slot._timer = loop.call_later(self.hold, slot._expire)
            self._free -= 1
            self._struck_in_use += strikes > 0
            standing = self._standing.get(instance)
            if standing is not None:
                standing.last_served = loop.time()
            future.set_result(slot)
