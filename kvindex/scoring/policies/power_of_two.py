"""``power_of_two``: two healthy instances at random, the less loaded wins (load: running + waiting
requests as reported, plus those routed since). Cache-blind."""

from __future__ import annotations

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest


class PowerOfTwo:
    name = "power_of_two"
    cost_unit = "requests"
    speculative_ttl = 0.0

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        ordered = sorted(candidates, key=lambda c: c.state.key)
        pair = ctx.rng.sample(ordered, min(2, len(ordered)))
        pair.sort(key=lambda c: (c.load, c.state.key))
        rest = sorted((c for c in ordered if c not in pair), key=lambda c: (c.load, c.state.key))
        return [Choice(c, float(c.load)) for c in pair + rest]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        return None
