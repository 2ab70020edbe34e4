"""``llmd``: llm-d's precise prefix-cache scoring (inference scheduler defaults).

Definition, as its authors published it (docs/scoring.md, Peer policies):
score = 2 * (weighted consecutive matched blocks / total; gpu 1.0,
cpu 0.8) + 1 * (1 - kv_usage) + 1 * (maxQ - q) / (maxQ - minQ), argmax; the chosen pod gets
speculative entries for 2 s. Disk and external-pool blocks are weighted like CPU (0.8). When all
queues are equal the queue term is 1 for everyone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool

TIER_WEIGHT = (1.0, 0.8, 0.8, 0.8)


class LlmdPrecise:
    name = "llmd"
    cost_unit = "-score"

    def __init__(
        self,
        prefix_weight: float = 2.0,
        kv_weight: float = 1.0,
        queue_weight: float = 1.0,
        speculative_ttl: float = 2.0,
    ) -> None:
        self.prefix_weight = prefix_weight
        self.kv_weight = kv_weight
        self.queue_weight = queue_weight
        self.speculative_ttl = speculative_ttl

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        b = request.block_size
        total = max(1, len(request.keys))
        queues = [c.state.load.waiting + c.inflight for c in candidates]
        qmax, qmin = max(queues), min(queues)
        out = []
        for c, q in zip(candidates, queues, strict=True):
            weighted = sum(w * t for w, t in zip(TIER_WEIGHT, c.tokens_by_tier, strict=True)) / b
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            score = (
                self.prefix_weight * weighted / total
                + self.kv_weight * (1 - c.state.load.kv_usage)
                + self.queue_weight * queue
            )
            out.append(Choice(c, -score))
        return sorted(out, key=lambda ch: (ch.cost, ch.candidate.state.key))

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """``rank``'s first ``top_k``; the queue range is taken over the columns."""
        b = request.block_size
        total = max(1, len(request.keys))
        table = pool.table
        queues = table.queue[: table.n]
        everyone = queues[pool.mask]
        qmax, qmin = float(everyone.max()), float(everyone.min())

        def queue(q: float) -> float:
            return 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)

        rest_queue = np.ones(table.n) if qmax == qmin else (qmax - queues) / (qmax - qmin)
        kv_term = self.kv_weight * (1 - pool.kv)
        queue_term = self.queue_weight * rest_queue

        def columns(t: Candidate) -> list[np.ndarray]:  # per group: its weighted hit (0 for none)
            weighted = sum(w * x for w, x in zip(TIER_WEIGHT, t.tokens_by_tier, strict=True)) / b
            return [-(self.prefix_weight * weighted / total + kv_term + queue_term)]

        def cost(c: Candidate) -> float:
            weighted = sum(w * t for w, t in zip(TIER_WEIGHT, c.tokens_by_tier, strict=True)) / b
            score = (
                self.prefix_weight * weighted / total
                + self.kv_weight * (1 - c.state.load.kv_usage)
                + self.queue_weight * queue(c.state.load.waiting + c.inflight)
            )
            return -score

        top = pool.top(columns, lambda c: (cost(c), c.state.key), top_k)
        return [Choice(c, cost(c)) for c in top]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
