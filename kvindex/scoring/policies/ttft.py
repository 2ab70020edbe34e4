"""``ttft`` (ours): lowest estimated time to first token, with stable homes and bounded spread.

est_ttft_i = wait_i + prefill_i(miss_i, L) + fetch_i  (kvindex/scoring/router.py computes the parts;
docs/scoring.md explains them). Placement rules on top of the estimate:

- Cold prompt (no instance holds ``useful_tokens`` of it, or half of a shorter one): go to the
  rendezvous home of its home prefix (its first ``home_tokens``) unless that instance's estimate is
  worse than the best by more than the margin; then to the next rendezvous home, and so on.
  Concurrent cold requests for one prefix meet on one instance (with speculative keys, the later
  ones see the first's blocks) instead of each starting a copy.
- Holders are the instances with the longest match (up to the home prefix). If the best estimate is
  not a holder (the holders are overloaded): spill to a holder within the margin, else to the next
  rendezvous home (not to an arbitrary idle instance), and never beyond ``max_replicas`` holders
  unless every holder is ``overflow`` times slower than the best.
- Otherwise: the best estimate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvindex.scoring.base import Candidate, Choice, RouteRequest
from kvindex.scoring.home import home_block, rendezvous_order

if TYPE_CHECKING:
    from kvindex.scoring.router import Router


class Ttft:
    name = "ttft"
    cost_unit = "ms"

    def __init__(
        self,
        home_tokens: int = 2048,
        useful_tokens: int = 1024,
        margin: float = 0.15,
        margin_ms: float = 25.0,
        max_replicas: int = 4,
        overflow: float = 3.0,
        speculative_ttl: float = 10.0,
    ) -> None:
        self.home_tokens = home_tokens
        self.useful_tokens = useful_tokens
        self.margin = margin
        self.margin_ms = margin_ms
        self.max_replicas = max_replicas
        self.overflow = overflow
        self.speculative_ttl = speculative_ttl

    def _ok(self, c: Candidate, best: float) -> bool:
        return c.est_ttft_ms <= best * (1 + self.margin) + self.margin_ms

    def rank(self, request: RouteRequest, candidates: list[Candidate], router: Router) -> list[Choice]:
        ordered = sorted(candidates, key=lambda c: (c.est_ttft_ms, c.state.key))
        best = ordered[0]
        pick, reason = best, "fastest"
        keys = request.keys
        if keys:
            h = home_block(len(keys), request.block_size, self.home_tokens)
            longest = max(c.blocks for c in ordered)
            held = min(h + 1, longest)
            holders = [c for c in ordered if c.blocks >= held]
            homes = rendezvous_order(ordered, [c.state.instance_id for c in ordered], keys[h])
            # Short prompts: half of them is useful.
            useful = max(1, min(self.useful_tokens // request.block_size, (len(keys) + 1) // 2))
            if longest < useful:
                pick, reason = self._first_ok(homes, best.est_ttft_ms, "home")
            elif best.blocks < held:  # the fastest does not hold the prefix: a new replica
                within = [c for c in holders if self._ok(c, best.est_ttft_ms)]
                if within:
                    pick, reason = within[0], "replica"
                elif len(holders) < self.max_replicas:
                    spill = [c for c in homes if c.blocks < held]
                    pick, reason = self._first_ok(spill, best.est_ttft_ms, "spill")
                elif holders[0].est_ttft_ms <= best.est_ttft_ms * self.overflow:
                    pick, reason = holders[0], "capped"
                else:
                    pick, reason = best, "overflow"
            else:
                reason = "cache"
        out = [Choice(pick, pick.est_ttft_ms, reason)]
        out += [Choice(c, c.est_ttft_ms, "") for c in ordered if c is not pick]
        return out

    def _first_ok(self, order: list[Candidate], best: float, what: str) -> tuple[Candidate, str]:
        for rank, c in enumerate(order):
            if self._ok(c, best):
                return c, what if rank == 0 else f"{what}+{rank}"
        return order[0], what

    def on_commit(self, request: RouteRequest, instance: Candidate, router: Router) -> None:
        return None
