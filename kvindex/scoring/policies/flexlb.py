"""``flexlb``: FlexLB's cost-based prefill scheduling.

Definition, as its authors published it (docs/scoring.md, Peer policies):
S_i = T_prefill + T_inflight,i + T_batcher,i in ms; the FormulaPredictor
gives T_prefill = sum(miss tokens) + 0.3 * sum(hit tokens) (1 ms per missed token, 0.3 ms per hit
token); T_inflight = max(0, sum of the predicted times of the instance's in-flight requests - time
since the earliest started) — the serial assumption, which overestimates busy instances whose
batches run in parallel; filters drop instances whose pending count or waiting time exceeds 3x the
mean; pick uniformly among S <= min + max(0.1 * min, 20 ms). No router-side batcher here, so
T_batcher = 0.
"""

from __future__ import annotations

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest


def _predict(miss: float, hit: float) -> float:
    return miss + 0.3 * hit


class FlexLB:
    name = "flexlb"
    cost_unit = "ms"
    speculative_ttl = 0.0

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        now = ctx.clock()
        rows = []
        for c in candidates:
            pending = [e for e in ctx.ledger.of(c.state.key) if not e.prefill_done]
            inflight = 0.0
            if pending:
                predicted = sum(_predict(e.miss_tokens, e.prompt_tokens - e.miss_tokens) for e in pending)
                elapsed = (now - min(e.committed_at for e in pending)) * 1000
                inflight = max(0.0, predicted - elapsed)
            s = _predict(c.miss_tokens, c.hit_tokens) + inflight
            rows.append((c, s, len(pending), inflight))
        mean_pending = sum(r[2] for r in rows) / len(rows)
        mean_wait = sum(r[3] for r in rows) / len(rows)
        kept = [
            r
            for r in rows
            if not (mean_pending and r[2] > 3 * mean_pending) and not (mean_wait and r[3] > 3 * mean_wait)
        ]
        kept = kept or rows
        smin = min(r[1] for r in kept)
        near = sorted((r for r in kept if r[1] <= smin + max(0.1 * smin, 20.0)), key=lambda r: r[0].state.key)
        pick = ctx.rng.choice(near)
        rest = sorted((r for r in rows if r is not pick), key=lambda r: (r[1], r[0].state.key))
        return [Choice(pick[0], pick[1], "near_min")] + [Choice(r[0], r[1]) for r in rest]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
