"""Engines without KV events (approximate mode): the predicted cache the index keeps from its own
routing decisions (TTL, LRU at capacity). Over real parts: tests/integration/test_approximate.py."""

from __future__ import annotations

import random

from kvindex.fleet.registry import Registry
from kvindex.index.inverted import InvertedIndex
from kvindex.keys import block_keys
from kvindex.scoring.approximate import PredictedCache
from kvindex.wire.schema import GPU

MODEL = "approx-model"
BS = 16


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_predicted_cache_holds_routed_blocks_for_a_ttl_and_evicts_lru_at_capacity() -> None:
    clock = Clock()
    index, registry = InvertedIndex(), Registry(clock)
    key = ("old-engine", 0)
    index.add_instance(key, MODEL)
    state = registry.add(key, MODEL, BS)
    state.approximate = True
    state.capacity = {GPU: 10}
    cache = PredictedCache(index, clock, ttl=60.0)

    a = block_keys(tokens(6 * BS, 1), BS, MODEL)
    cache.on_commit(state, a)
    assert set(index.keys_of(key, GPU)) == set(a) and cache.predicted == 6
    clock.now += 30
    b = block_keys(tokens(6 * BS, 2), BS, MODEL)
    cache.on_commit(state, b)  # 12 blocks predicted, capacity 10: a's last two blocks go
    assert set(index.keys_of(key, GPU)) == set(a[:4]) | set(b) and cache.evicted == 2
    assert index.match(MODEL, a)[key].length == 4  # the prefix shortens from its end
    clock.now += 20
    cache.on_commit(state, a[:2])  # used again: moves to the back of the LRU, TTL renewed
    clock.now += 15  # a[2:4] (committed at +0) is 65 s old; b is 35 s old; a[:2] 15 s
    cache.expire()
    assert set(index.keys_of(key, GPU)) == set(b) | set(a[:2]) and cache.expired == 2
    clock.now += 60
    cache.expire()
    assert not set(index.keys_of(key, GPU)) and len(cache) == 0
    cache.on_commit(state, a)
    cache.forget(key)
    assert cache.holds(key) == 0
