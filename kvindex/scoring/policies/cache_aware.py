"""``cache_aware``: SGLang model gateway's cache-aware policy.

Definition, as its authors published it (docs/scoring.md, Peer policies;
defaults cache_threshold 0.3, balance_abs 64, balance_rel 1.5): if the
load imbalance is large ((max - min) > balance_abs and max > balance_rel x min), go to the least
loaded worker. Otherwise find the longest match in an approximate radix tree built from the router's
own past decisions (not from real cache state); if its match rate > cache_threshold go there, else
to the least loaded. Insert the prompt under the chosen worker; each worker's tree is LRU-capped.
Load = the router's in-flight request count.

The "tree" here is the index's own commit history: per instance, an LRU of the block keys of the
prompts committed to it (chained keys make a set of them equivalent to a radix tree of prefixes).
"""

from __future__ import annotations

from collections import OrderedDict

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest


class CacheAware:
    name = "cache_aware"
    cost_unit = "rank"
    speculative_ttl = 0.0

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_tree_blocks: int = 200_000,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self._trees: dict[tuple[str, int], OrderedDict[int, None]] = {}

    def _match(self, instance: tuple[str, int], keys: list[int]) -> int:
        tree = self._trees.get(instance)
        if not tree:
            return 0
        n = 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        least = sorted(candidates, key=lambda c: (c.inflight, c.state.key))
        loads = [c.inflight for c in candidates]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return [Choice(c, float(i), "imbalance" if i == 0 else "") for i, c in enumerate(least)]
        keys = request.keys
        if keys:
            scored = sorted(
                candidates, key=lambda c: (-self._match(c.state.key, keys), c.inflight, c.state.key)
            )
            top = scored[0]
            rate = self._match(top.state.key, keys) / len(keys)
            if rate > self.cache_threshold:
                return [Choice(top, -rate, "tree_match")] + [
                    Choice(c, float(i)) for i, c in enumerate(least) if c is not top
                ]
        return [Choice(c, float(i), "least_loaded" if i == 0 else "") for i, c in enumerate(least)]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        tree = self._trees.setdefault(instance.state.key, OrderedDict())
        for key in request.keys:
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)
