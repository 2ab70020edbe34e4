"""``decode``: ranking of decode instances under prefill/decode disaggregation.

A decode instance receives a request whose KV cache was computed elsewhere, so prefix overlap does
not matter; what matters is room for its KV cache and how many sequences it is already decoding.
Lowest KV usage first, then fewest running requests; an instance above ``full`` usage goes last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool


class DecodeHeadroom:
    name = "decode"
    cost_unit = "kv_usage"
    speculative_ttl = 0.0

    def __init__(self, full: float = 0.95) -> None:
        self.full = full

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        def cost(c: Candidate) -> float:
            usage = c.state.load.kv_usage
            return (1.0 if usage >= self.full else 0.0) + usage + 0.001 * c.load

        return sorted(
            (Choice(c, cost(c), "headroom") for c in candidates),
            key=lambda ch: (ch.cost, ch.candidate.state.key),
        )

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """``rank``'s first ``top_k``: headroom is the instance's own state."""
        kv = pool.kv
        rest = np.where(kv >= self.full, 1.0, 0.0) + kv + 0.001 * pool.load
        top = pool.top([rest], lambda c: (self._cost(c), c.state.key), top_k)
        return [Choice(c, self._cost(c), "headroom") for c in top]

    def _cost(self, c: Candidate) -> float:
        usage = c.state.load.kv_usage
        return (1.0 if usage >= self.full else 0.0) + usage + 0.001 * c.load

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
