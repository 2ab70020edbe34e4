"""``dynamo``: NVIDIA Dynamo's KV router cost.

Definition, as its authors published it (docs/scoring.md, Peer policies):
cost_i = w * prefill_blocks_i + decode_blocks_i, w = 1, argmin (temperature
0; ties to the smaller tree), prefill_blocks_i = active_prefill_blocks_i + (ISL - overlap_i * B) / B.
Newer versions credit lower tiers: a matched block counts 1 on GPU, 0.75 in host memory, 0.25 on disk
or an external pool.

Here: active prefill blocks = queued prefill tokens / B (last heartbeat plus routed since); decode blocks =
KV usage x GPU capacity in blocks (blocks held by running requests).
"""

from __future__ import annotations

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest
from kvindex.wire.schema import GPU

TIER_CREDIT = (1.0, 0.75, 0.25, 0.25)


class Dynamo:
    name = "dynamo"
    cost_unit = "blocks"
    speculative_ttl = 0.0

    def __init__(self, prefill_weight: float = 1.0) -> None:
        self.w = prefill_weight

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        b = request.block_size
        out = []
        for c in candidates:
            t = c.tokens_by_tier
            overlap = sum(credit * tokens for credit, tokens in zip(TIER_CREDIT, t, strict=True)) / b
            active = c.state.load.waiting_prefill_tokens + c.routed_tokens
            prefill = active / b + (request.prompt_tokens - overlap * b) / b
            state = c.state
            decode = state.load.kv_usage * state.capacity.get(GPU, 0)
            tree = sum(ctx.index.block_counts(state.key))
            out.append((self.w * prefill + decode, tree, state.key, c))
        out.sort(key=lambda x: (x[0], x[1], x[2]))
        return [Choice(c, cost) for cost, _tree, _key, c in out]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
