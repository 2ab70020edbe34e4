"""``round_robin``: each request to the next instance in turn (per model); cache-blind."""

from __future__ import annotations

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest


class RoundRobin:
    name = "round_robin"
    cost_unit = "turn"
    speculative_ttl = 0.0

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        ordered = sorted(candidates, key=lambda c: c.state.key)
        start = self._next.get(request.model, 0) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return [Choice(c, float(i)) for i, c in enumerate(rotated)]

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        self._next[request.model] = self._next.get(request.model, 0) + 1
