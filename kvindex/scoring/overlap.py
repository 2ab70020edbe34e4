"""First ranking: blocks of prefill work each instance would face, lowest first.

    cost_i = queued_i + miss_i + sum_t w_t * matched_t,i        (unit: blocks of prefill)

- queued_i: prefill work already waiting on the instance, ``waiting_prefill_tokens / block_size``
  from its last heartbeat.
- miss_i: prompt blocks the instance must compute (total full blocks - consecutive matched blocks).
- matched_t,i: matched blocks whose fastest copy is on tier t; w_t is the cost of loading one block
  from that tier relative to recomputing it (GPU 0; CPU, disk and the shared pool cost a transfer).

Absolute blocks, not ratios: a 4000-block hit saves more than a 500-block hit. Ties (common when the
fleet is idle and nothing matches) go to the lower KV usage, then fewer running requests, then the
instance id, so the order is deterministic. The full time-to-first-token model replaces this later
(docs/scoring.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import NO_MATCH, InstanceKey, InstanceMatch

COST_UNIT = "prefill_blocks"


class Ranked(NamedTuple):
    cost: float
    state: InstanceState
    match: InstanceMatch


@dataclass(frozen=True, slots=True)
class OverlapCost:
    # Relative cost of loading a matched block from (gpu, cpu, disk, shared) instead of recomputing:
    # PCIe host->device is ~10x faster than recompute for typical 8B-70B models, local NVMe and a
    # remote pool (RDMA/TCP) are slower. Replaced by calibrated ms/token in the TTFT model.
    tier_weights: tuple[float, float, float, float] = (0.0, 0.1, 0.4, 0.3)

    def cost(self, state: InstanceState, match: InstanceMatch, total_blocks: int) -> float:
        queued = state.load.waiting_prefill_tokens / state.block_size
        w = self.tier_weights
        t = match.tiers
        fetch = w[1] * t[1] + w[2] * t[2] + w[3] * t[3]
        return queued + (total_blocks - match.length) + fetch

    def rank(
        self,
        states: Iterable[InstanceState],
        matches: Mapping[InstanceKey, InstanceMatch],
        total_blocks: int,
    ) -> list[Ranked]:
        ranked = []
        for state in states:
            match = matches.get(state.key, NO_MATCH)
            ranked.append(Ranked(self.cost(state, match, total_blocks), state, match))
        ranked.sort(key=lambda r: (r.cost, r.state.load.kv_usage, r.state.load.running, r.state.key))
        return ranked
