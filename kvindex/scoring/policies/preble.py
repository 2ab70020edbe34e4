"""``preble``: Preble's scheduling (as in AIBrix's prefix-cache-preble).

Definition, as its authors published it (docs/scoring.md, Peer policies):
if the longest match covers more than half the prompt, go to the least
loaded among the instances holding that longest match; otherwise take the argmin over instances of
load cost (recent window: miss-weighted prefill time + decode time of the requests routed there)
plus eviction cost.

Here: the window is the last ``window_s`` seconds of commits, each costing its estimated prefill time
of its missed tokens plus ``decode_ms`` per request; the eviction cost is the prefill time of the
blocks this request would push out of a full GPU cache (missed blocks beyond the free capacity).
"""

from __future__ import annotations

from collections import deque

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest
from kvindex.wire.schema import GPU


class Preble:
    name = "preble"
    cost_unit = "ms"
    speculative_ttl = 0.0

    def __init__(self, window_s: float = 30.0, decode_ms: float = 200.0, threshold: float = 0.5) -> None:
        self.window_s = window_s
        self.decode_ms = decode_ms
        self.threshold = threshold
        self._recent: dict[tuple[str, int], deque[tuple[float, float]]] = {}

    def _window_cost(self, instance: tuple[str, int], now: float) -> float:
        recent = self._recent.get(instance)
        if not recent:
            return 0.0
        while recent and recent[0][0] < now - self.window_s:
            recent.popleft()
        return sum(cost for _t, cost in recent)

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        now = ctx.clock()
        longest = max(c.hit_tokens for c in candidates)
        if request.prompt_tokens and longest / request.prompt_tokens > self.threshold:
            holders = sorted(
                (c for c in candidates if c.hit_tokens == longest), key=lambda c: (c.load, c.state.key)
            )
            top = holders[0]
            rest = sorted(
                (c for c in candidates if c is not top), key=lambda c: (-c.hit_tokens, c.load, c.state.key)
            )
            return [Choice(top, float(top.load), "longest_match")] + [Choice(c, float(c.load)) for c in rest]
        model = ctx.costs.prefill(request.model)
        b = request.block_size
        out = []
        for c in candidates:
            state = c.state
            capacity = state.capacity.get(GPU, 0)
            free = (1 - state.load.kv_usage) * capacity
            evicted = max(0.0, c.miss_tokens / b - free) if capacity else 0.0
            eviction = model.b_ms_per_token * evicted * b
            out.append(Choice(c, self._window_cost(state.key, now) + c.prefill_ms + eviction))
        return sorted(out, key=lambda ch: (ch.cost, ch.candidate.state.key))

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        self._recent.setdefault(instance.state.key, deque()).append(
            (ctx.clock(), instance.prefill_ms + self.decode_ms)
        )
