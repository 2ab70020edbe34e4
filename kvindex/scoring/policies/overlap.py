"""``overlap``: the first ranking (kvindex v0): estimated blocks of prefill work, lowest first.

    cost_i = queued_i / B + miss_i / B + sum_t w_t * matched_t,i / B      (w: cpu 0.1, disk 0.4, shared 0.3)

with queued_i the prefill tokens of the last heartbeat plus those routed here since.

Absolute work rather than ratios, but blocks instead of milliseconds and no model of the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool

TIER_WEIGHTS = (0.0, 0.1, 0.4, 0.3)


class Overlap:
    name = "overlap"
    cost_unit = "prefill_blocks"
    speculative_ttl = 0.0

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        b = request.block_size
        out = [
            Choice(c, _cost(c.state.load.waiting_prefill_tokens + c.routed_tokens, c, b)) for c in candidates
        ]
        return sorted(out, key=lambda ch: (ch.cost, ch.candidate.state.load.kv_usage, ch.candidate.state.key))

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """``rank``'s first ``top_k``: the others' cost is their queue plus their group's miss and
        fetch (the whole prompt and none when they hold nothing)."""
        b = request.block_size
        table = pool.table
        queued = table.queued_now[: table.n]  # (reported + routed since, per row)

        def columns(t: Candidate) -> list[np.ndarray]:
            return [_cost(queued, t, b), pool.kv]

        top = pool.top(columns, lambda c: (self._cost(c, b), c.state.load.kv_usage, c.state.key), top_k)
        return [Choice(c, self._cost(c, b)) for c in top]

    @staticmethod
    def _cost(c: Candidate, b: int) -> float:
        cost: float = _cost(c.state.load.waiting_prefill_tokens + c.routed_tokens, c, b)
        return cost

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None


def _cost(queued: Any, c: Candidate, b: int) -> Any:
    """The cost in blocks: ``queued`` tokens (one instance's, or a column of them), then ``c``'s
    miss and the weighted tokens it fetches from slower tiers."""
    w = TIER_WEIGHTS
    t = c.tokens_by_tier
    fetch = (w[1] * t[1] + w[2] * t[2] + w[3] * t[3]) / b
    return queued / b + c.miss_tokens / b + fetch
