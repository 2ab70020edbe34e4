"""``prefix_hash``: SGLang model gateway's prefix-hash policy.

Definition, as its authors published it (docs/scoring.md, Peer policies):
key = xxh3_64 of the first min(len, 256) tokens on a consistent-hash
ring with 150 virtual nodes per worker; if the home's load > 1.25 x (total load + 1) / n, go to the
least-loaded worker instead; load = the router's in-flight request count.

Here the prompt arrives as chained block keys, and the key of the block holding token 256 already
names exactly the first 256 tokens (for block sizes dividing 256; with larger blocks, the first
block: documented deviation).
"""

from __future__ import annotations

from bisect import bisect_left

import xxhash

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

_xxh3 = xxhash.xxh3_64_intdigest


class PrefixHash:
    name = "prefix_hash"
    cost_unit = "rank"
    speculative_ttl = 0.0

    def __init__(self, prefix_tokens: int = 256, virtual_nodes: int = 150, balance: float = 1.25) -> None:
        self.prefix_tokens = prefix_tokens
        self.virtual_nodes = virtual_nodes
        self.balance = balance
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(ids)
        if ring is None:
            points = sorted((_xxh3(f"{i}#{v}".encode()), i) for i in ids for v in range(self.virtual_nodes))
            ring = self._rings[ids] = ([p for p, _ in points], [i for _, i in points])
            if len(self._rings) > 64:
                self._rings.pop(next(iter(self._rings)))
        return ring

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        by_id = {c.state.instance_id: c for c in candidates}
        ids = tuple(sorted(by_id))
        least = sorted(candidates, key=lambda c: (c.inflight, c.state.key))
        if request.keys:
            block = min(len(request.keys), max(1, self.prefix_tokens // request.block_size)) - 1
            points, owners = self._ring(ids)
            j = bisect_left(points, request.keys[block]) % len(points)
            home = by_id[owners[j]]
            total = sum(c.inflight for c in candidates)
            if home.inflight <= self.balance * (total + 1) / len(candidates):
                return [Choice(home, 0.0, "home")] + [
                    Choice(c, 1.0 + i) for i, c in enumerate(least) if c is not home
                ]
        return [Choice(c, float(i), "least_loaded" if i == 0 else "") for i, c in enumerate(least)]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
