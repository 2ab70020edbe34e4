"""``loadaware``: vLLM production-stack's load-aware KV routing.

Definition, as its authors published it (docs/scoring.md, Peer policies):
    score_i = min(matched_i, P) / max(P, 1) - beta * (L_i - mean L) / max(1, mean L),   argmax
with P the prompt length, matched_i the cached prefix tokens, L_i the in-prefill + in-decode requests
of instance i; beta defaults to 1.0 (0.5 in the published experiment).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool


class LoadAware:
    name = "loadaware"
    cost_unit = "-score"
    speculative_ttl = 0.0

    def __init__(self, beta: float = 1.0) -> None:
        self.beta = beta

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        p = request.prompt_tokens
        mean = sum(c.load for c in candidates) / len(candidates)
        scored = []
        for c in candidates:
            score = min(c.hit_tokens, p) / max(p, 1) - self.beta * (c.load - mean) / max(1.0, mean)
            scored.append(Choice(c, -score))
        return sorted(scored, key=lambda ch: (ch.cost, ch.candidate.state.key))

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """``rank``'s first ``top_k``; the fleet's mean load is a sum over the columns."""
        p = request.prompt_tokens
        mean = float(pool.load[pool.mask].sum()) / pool.count
        spread = self.beta * (pool.load - mean) / max(1.0, mean)

        def columns(t: Candidate) -> list[np.ndarray]:  # per group: its hit (0 for none)
            return [-(min(t.hit_tokens, p) / max(p, 1) - spread)]

        def cost(c: Candidate) -> float:
            return -(min(c.hit_tokens, p) / max(p, 1) - self.beta * (c.load - mean) / max(1.0, mean))

        top = pool.top(columns, lambda c: (cost(c), c.state.key), top_k)
        return [Choice(c, cost(c)) for c in top]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
