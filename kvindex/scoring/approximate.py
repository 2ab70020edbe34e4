"""Predicted caches for instances that publish no KV events (the approximate mode of Dynamo and llm-d).

Some engines cannot emit KV events (older vLLM, other servers). Such an instance joins with heartbeats
only (``events: false`` in its heartbeat, e.g. ``kvshim heartbeat``) or is listed statically
(``kvindex serve --instance NAME=HOST:PORT``). The index then predicts its prefix cache from its own
routing decisions: when a request is committed to it, the prompt's blocks are assumed cached there —
stored in the index's GPU tier like reported blocks, so matching and the TTFT model need no special
case — for ``ttft`` seconds after their last use, and evicted least recently used beyond the
instance's announced GPU capacity (or ``default_capacity`` blocks when none is announced).

Failure modes, by construction: a prediction is wrong when the engine evicted earlier than the TTL
or the capacity say (a cache smaller than announced, other traffic bypassing the router), or when
several routers send it requests the index never sees. Both make the index over-promise hits on that
instance, bounded by the TTL. Instances with events are never touched here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import KvBlockIndex
from kvindex.instance import InstanceKey
from kvindex.wire.schema import GPU


class PredictedCache:
    def __init__(
        self,
        index: KvBlockIndex,
        clock: Callable[[], float],
        ttl: float = 120.0,
        default_capacity: int = 8192,
    ) -> None:
        self.index = index
        self.clock = clock
        self.ttl = ttl
        self.default_capacity = default_capacity
        # instance -> key -> expiry, least recently used first (a fixed TTL makes it expiry order too)
        self._lru: dict[InstanceKey, OrderedDict[int, float]] = {}
        self.predicted = 0  # blocks added by predictions
        self.evicted = 0  # blocks dropped for capacity
        self.expired = 0  # blocks dropped for age

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def on_commit(self, state: InstanceState, keys: Iterable[int]) -> None:
        """A request with these prompt blocks was sent to ``state``: they will be cached there."""
        key = state.key
        if not self.index.has_instance(key):
            return
        lru = self._lru.setdefault(key, OrderedDict())
        expires = self.clock() + self.ttl
        new: list[int] = []
        # Tail first, so that a prompt's first blocks are its most recently used: eviction then
        # shortens cached prefixes from their ends, as engines free a finished request's blocks.
        for k in reversed(list(keys)):
            if k in lru:
                lru.move_to_end(k)
            else:
                new.append(k)
            lru[k] = expires
        if new:
            self.predicted += self.index.store(key, GPU, new)
        capacity = state.capacity.get(GPU) or self.default_capacity
        over = len(lru) - capacity
        if over > 0:
            evict = [lru.popitem(last=False)[0] for _ in range(over)]
            self.evicted += self.index.remove(key, GPU, evict)

    def expire(self) -> None:
        """Drop predictions older than the TTL (cheap when nothing is due: one look per instance)."""
        now = self.clock()
        for key, lru in self._lru.items():
            if not lru or next(iter(lru.values())) > now:
                continue
            old: list[int] = []
            while lru:
                k, expires = next(iter(lru.items()))
                if expires > now:
                    break
                lru.popitem(last=False)
                old.append(k)
            if self.index.has_instance(key):
                self.expired += self.index.remove(key, GPU, old)

    def forget(self, instance: InstanceKey) -> None:
        """The instance left (its blocks went with it) or switched to reporting events."""
        self._lru.pop(instance, None)

    def holds(self, instance: InstanceKey) -> int:
        return len(self._lru.get(instance, ()))
