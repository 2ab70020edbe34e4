"""``kvaware``: vLLM production-stack's KV-aware routing — the instance with the longest cached
prefix of the prompt; ties (including no match anywhere) go to the fewest in-flight requests.

The baseline of production-stack's load-aware experiment (busiest/idlest 2.358 there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool


class KvAware:
    name = "kvaware"
    cost_unit = "-matched_tokens"
    speculative_ttl = 0.0

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        ordered = sorted(candidates, key=lambda c: (-c.hit_tokens, c.load, c.state.key))
        return [Choice(c, -c.hit_tokens) for c in ordered]

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """``rank``'s first ``top_k``: the others match nothing, so they follow by load."""
        top = pool.top([pool.load], lambda c: (-c.hit_tokens, c.load, c.state.key), top_k)
        return [Choice(c, -c.hit_tokens) for c in top]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
