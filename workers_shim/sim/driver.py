"""A minimal discrete-event driver for several engines, and a sink that mirrors events.

The routing simulation (benchmarks/routing_sim.py) has its own loop; this one serves tests, examples
and ``kvshim sim --trace``. The contract any loop must keep: call ``submit``/``advance`` on an engine
with non-decreasing times, and pick the next event as the earliest of the next arrival and every
engine's ``next_time()``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvindex.keys import group_mask
from workers_shim.sim.engine import TIERS, Completion, SimEngine, SimRequest

__all__ = ["MirrorSink", "run_until_idle"]

Route = Callable[[SimRequest, float], SimEngine]


def run_until_idle(
    engines: Sequence[SimEngine] | Mapping[str, SimEngine],
    arrivals: Iterable[tuple[SimRequest, SimEngine | str]] | Iterable[SimRequest],
    route: Route | None = None,
    on_completion: Callable[[Completion], None] | None = None,
) -> list[Completion]:
    """Run every arrival (in ``arrival`` order) until all engines are idle; return the completions.

    ``arrivals`` are (request, engine or engine name) pairs, or plain requests with ``route`` called
    at each arrival (after the engines were advanced to that instant) to pick the engine.
    """
    by_name = dict(engines) if isinstance(engines, Mapping) else {e.name: e for e in engines}
    pool = list(by_name.values())
    items: list[tuple[SimRequest, SimEngine | None]] = []
    for item in arrivals:
        if isinstance(item, SimRequest):
            if route is None:
                raise ValueError("plain requests need a route function")
            items.append((item, None))
        else:
            req, target = item
            items.append((req, by_name[target] if isinstance(target, str) else target))
    items.sort(key=lambda it: it[0].arrival)
    out: list[Completion] = []

    def collect(batch: list[Completion]) -> None:
        if on_completion is not None:
            for c in batch:
                on_completion(c)
        out.extend(batch)

    # Heap of (next event time, index, version); stale entries are skipped.
    version = [0] * len(pool)
    heap: list[tuple[float, int, int]] = []

    def reschedule(i: int) -> None:
        version[i] += 1
        t = pool[i].next_time()
        if t is not None:
            heapq.heappush(heap, (t, i, version[i]))

    index = {id(e): i for i, e in enumerate(pool)}
    for i in range(len(pool)):
        reschedule(i)
    pos = 0
    while pos < len(items) or heap:
        t_arr = items[pos][0].arrival if pos < len(items) else float("inf")
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        t_eng = heap[0][0] if heap else float("inf")
        if t_arr == float("inf") and t_eng == float("inf"):
            break
        if t_eng < t_arr:
            _, i, _ = heapq.heappop(heap)
            collect(pool[i].advance(t_eng))
            reschedule(i)
            continue
        req, target = items[pos]
        pos += 1
        if target is None:
            assert route is not None
            for i, e in enumerate(pool):  # the router sees every engine as of now
                collect(e.advance(t_arr))
                reschedule(i)
            target = route(req, t_arr)
        target.submit(req, t_arr)
        reschedule(index[id(target)])
    for e in pool:
        collect(e.advance(e.now))
    return out


class MirrorSink:
    """Applies stored/removed/cleared calls to one set per tier, as an index would. A hybrid engine's
    blocks of KV-cache group g are kept as group keys (``kvindex.keys.group_key``, as the publisher
    and the index keep them; group 0's are the block keys)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {t: set() for t in TIERS}
        self.calls = 0

    def stored(self, keys: list[int], tier: str = "gpu", parent: int | None = None, group: int = 0) -> int:
        self.calls += 1
        held = self.tiers[tier]
        before = len(held)
        held.update(_group_keys(keys, group))
        return len(held) - before

    def removed(self, keys: list[int], tier: str = "gpu", group: int = 0) -> int:
        self.calls += 1
        held = self.tiers[tier]
        before = len(held)
        held.difference_update(_group_keys(keys, group))
        return before - len(held)

    def cleared(self, tier: str | None = None) -> int:
        self.calls += 1
        tiers = TIERS if tier is None else (tier,)
        n = 0
        for t in tiers:
            n += len(self.tiers[t])
            self.tiers[t] = set()
        return n


def _group_keys(keys: list[int], group: int) -> list[int]:
    mask = group_mask(group) if group else 0
    return [k ^ mask for k in keys] if mask else keys
