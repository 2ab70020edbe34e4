"""``ttft`` (ours): lowest estimated time to first token, with stable homes and bounded spread.

est_ttft_i = wait_i + prefill_i(miss_i, L) + fetch_i  (kvindex/scoring/costs.py defines the parts and
the weighted cost below, kvindex/scoring/ranker.py computes them; docs/scoring.md explains them; the
sums here are costs.est_ttft_ms and costs.weighted_cost, inline). Placement rules on top of the estimate:

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
- Hybrid-attention models: an instance whose full-attention group holds a prefix no window ends at
  (``Candidate.reach``) is a holder of it, and is credited the prefill the prefix will save later
  requests, by its heat (``_reach_costs``); its estimate stays the exact, cold one.
"""

from __future__ import annotations

import heapq
import math
import operator
import statistics
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvindex.scoring.base import Candidate, Choice, PolicyContext, RouteRequest
from kvindex.scoring.costs import weighted_cost
from kvindex.scoring.fleet_table import median_of
from kvindex.scoring.home import home_block, rendezvous_order

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool


class Ttft:
    name = "ttft"
    cost_unit = "ms"

    def __init__(
        self,
        home_tokens: int = 2048,
        useful_tokens: int = 1024,
        margin: float = 0.0,
        margin_ms: float = 0.0,
        max_replicas: int = 4,
        overflow: float = 3.0,
        speculative_ttl: float = 10.0,
        congestion: float = 10.0,
        congestion_tau: float = 5.0,
        congestion_max: float = math.inf,
        replica_cost: float = 4.0,
        hot_requests: float = 3.0,
        hot_half_life: float = 30.0,
        max_tracked: int = 100_000,
        replica_by_wait: bool = True,
        reach_credit: float = 1.0,
        reach_holders: bool = True,
    ) -> None:
        self.home_tokens = home_tokens
        self.useful_tokens = useful_tokens
        self.margin = margin
        self.margin_ms = margin_ms
        self.max_replicas = max_replicas
        self.overflow = overflow
        self.speculative_ttl = speculative_ttl
        self.congestion = congestion
        self.congestion_tau = congestion_tau
        self.congestion_max = congestion_max
        self._k = 0.0
        self._k_at: float | None = None
        self.replica_cost = replica_cost
        self.hot_requests = hot_requests
        self.hot_half_life = hot_half_life
        self.replica_by_wait = replica_by_wait
        self.reach_credit = reach_credit
        self.reach_holders = reach_holders
        self.max_tracked = max_tracked
        # Recent requests per home prefix (exponentially decayed): how hot a prefix is.
        self._hot: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        # An overloaded fleet (queues longer than the work itself) is limited by throughput: every
        # token computed delays everyone queued after it, so prefill work is weighed by how far
        # waits exceed it (costs.weighted_cost); hits then win over small differences in wait.
        # Loading matched blocks from a slower tier or the shared pool occupies the engine too, so
        # it is weighed alike (a hit in the pool is not free for the instance that has to fetch it).
        # The weight is a fleet regime tracked over time (medians, smoothed over ``congestion_tau``
        # s), never the current candidates' own loads: one instance's load must not reorder the others.
        k = self._congestion_weight(candidates, ctx.clock()) if self.congestion else 0.0
        est, costs = _costs(candidates, k)
        keys = request.keys
        reach = self._has_reach(request, candidates)
        depth = self._depth if reach and self.reach_holders else _blocks
        if reach and self.reach_credit:
            costs = self._reach_costs(request, candidates, costs, k, ctx)
        cost = {id(c): x for c, x in zip(candidates, costs, strict=True)}
        # Ties (an idle fleet, equal hits) go to the emptier cache, then the less busy instance
        # (Candidate.load); instance keys are unique, so the position is never compared.
        decorated = sorted(
            [
                (x, (ld := c.state.load).kv_usage, ld.running + ld.waiting + c.inflight, c.state.key, i)
                for i, (c, x) in enumerate(zip(candidates, costs, strict=True))
            ]
        )
        ordered = [candidates[d[4]] for d in decorated]
        best = ordered[0]
        limit = cost[id(best)] * (1 + self.margin) + self.margin_ms

        def ok(c: Candidate) -> bool:
            return cost[id(c)] <= limit

        pick, reason = best, "fastest"
        if keys:
            h = home_block(len(keys), request.block_size, self.home_tokens)
            longest = max(depth(c) for c in ordered)
            held = min(h + 1, longest)
            holders = [c for c in ordered if depth(c) >= held]

            def homes() -> list[Candidate]:  # only cold prompts and spills need the hashing
                return rendezvous_order(ordered, [c.state.instance_id for c in ordered], keys[h])

            # Short prompts: half of them is useful.
            useful = max(1, min(self.useful_tokens // request.block_size, (len(keys) + 1) // 2))
            if longest < useful:
                pick, reason = _first(homes(), ok, "home")
            elif depth(best) < held:  # the fastest does not hold the prefix: a new replica
                # A new copy of the prefix costs more than its own recompute: cache space, and the
                # work every later copy-holder does again. Holders win unless they are worse than
                # the best by more than ``replica_cost`` x the duplicated prefill.
                slack = self._replica_slack(best, cost[id(best)], holders[0], keys[heat_block(held, h)], ctx)
                within = [c for c in holders if cost[id(c)] <= slack]
                if within:
                    pick, reason = within[0], "replica"
                elif len(holders) < self.max_replicas:
                    pick, reason = _first([c for c in homes() if depth(c) < held], ok, "spill")
                elif cost[id(holders[0])] <= cost[id(best)] * self.overflow:
                    pick, reason = holders[0], "capped"
                else:
                    pick, reason = best, "overflow"
            else:
                reason = "cache"
        out = [Choice(pick, pick.est_ttft_ms, reason)]
        out += [Choice(candidates[d[4]], est[d[4]], "") for d in decorated if candidates[d[4]] is not pick]
        return out

    def _congestion_weight(self, candidates: list[Candidate], now: float) -> float:
        """The weight in force (from earlier requests), then fold in what these candidates show."""
        wait = statistics.median([c.wait_ms for c in candidates])
        work = statistics.median([c.prefill_ms for c in candidates]) or 1.0
        return self._fold_congestion(wait, work, now)

    def _fold_congestion(self, wait: float, work: float, now: float) -> float:
        return self._fold_target(min(self.congestion_max, self.congestion * max(0.0, wait / work - 1.0)), now)

    def _fold_target(self, target: float, now: float) -> float:
        k = self._k
        dt = max(0.0, now - self._k_at) if self._k_at is not None else self.congestion_tau
        blend = 1.0 - math.exp(-dt / self.congestion_tau)
        self._k = k + (target - k) * blend
        self._k_at = now
        return k

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """The first ``top_k`` of ``rank`` without a candidate per instance (Ranker.score).

        Only the prompt's holders are full candidates; the others hold nothing, so they are ranked by
        their own columns (pool) and only the best ``top_k`` of them, and a rendezvous home when the
        placement rules pick one, become candidates. The fleet-wide medians of the congestion weight
        are skipped when counts show the weight's target is 0 (``_uncongested``), else taken over the
        columns (a partition, not a sort)."""
        explicit = pool.explicit
        # The weight in force is the one from earlier requests (the fold returns it unchanged), so
        # the others can be selected before these candidates are folded in.
        k = self._k if self.congestion else 0.0
        native = pool.rank_others(k, top_k)
        if self.congestion:
            self._fold_pool(pool, None if native is None else native[1:], ctx.clock())
        cost_e = _costs(explicit, k)[1]
        keys = request.keys
        reach = self._has_reach(request, explicit)  # (only explicit candidates can have any)
        depth = self._depth if reach and self.reach_holders else _blocks
        if reach and self.reach_credit:
            cost_e = self._reach_costs(request, explicit, cost_e, k, ctx)
        chosen_rows = native[0] if native is not None else pool.smallest(pool.cost(k), top_k)
        others = pool.materialize(chosen_rows)
        candidates = explicit + others
        costs = cost_e + _costs(others, k)[1]
        # Only the first top_k are reported (after the pick): unless the holders' own order is
        # needed (a new replica), only the candidates costing at most the (top_k + 1)-th lowest
        # cost can be among them, and only those are ordered.
        first = min(top_k + 1, len(candidates))
        bound = heapq.nsmallest(first, costs)[-1]
        order = _order(candidates, costs, bound)
        ordered = [candidates[i] for i in order]
        best = ordered[0]
        best_cost = costs[order[0]]
        limit = best_cost * (1 + self.margin) + self.margin_ms
        pick, reason = best, "fastest"
        if keys:
            h = home_block(len(keys), request.block_size, self.home_tokens)
            # (match groups: the others of a group hold its answer; a group of none is empty)
            counts = pool.group_counts if pool.groups else None
            depths = [t.blocks for g, t in enumerate(pool.templates) if counts[g]] if counts else []
            longest = max(max((depth(c) for c in explicit), default=0), max(depths, default=0))
            held = min(h + 1, longest)
            useful = max(1, min(self.useful_tokens // request.block_size, (len(keys) + 1) // 2))
            if longest < useful:
                pick, reason = self._first_home(
                    pool, explicit, cost_e, pool.cost(k), limit, keys[h], 0, "home"
                )
            elif depth(best) < held:
                ordered = [candidates[i] for i in _order(candidates, costs, math.inf)]
                cost = {c.state.key: x for c, x in zip(candidates, costs, strict=True)}
                # Explicit ones and the best of each match group (held >= 1): the first in order of
                # them all is among them; their number counts every member of a group.
                holders = [c for c in ordered if depth(c) >= held]
                n_holders = len([c for c in explicit if depth(c) >= held])
                if counts:
                    n_holders += sum(
                        n for n, t in zip(counts, pool.templates, strict=True) if t.blocks >= held
                    )
                slack = self._replica_slack(best, best_cost, holders[0], keys[heat_block(held, h)], ctx)
                within = [c for c in holders if cost[c.state.key] <= slack]
                if within:
                    pick, reason = within[0], "replica"
                elif n_holders < self.max_replicas:
                    pick, reason = self._first_home(
                        pool, explicit, cost_e, pool.cost(k), limit, keys[h], held, "spill"
                    )
                elif cost[holders[0].state.key] <= best_cost * self.overflow:
                    pick, reason = holders[0], "capped"
                else:
                    pick, reason = best, "overflow"
            else:
                reason = "cache"
        return _top(pick, reason, ordered, top_k)

    def _fold_pool(self, pool: CandidatePool, counted: tuple[float, int] | None, now: float) -> None:
        """Fold in what the pool's candidates show (``_fold_congestion``): the target is 0 when counts
        show it (``_uncongested``), else from the medians taken over the columns."""
        if _uncongested(pool, counted):
            self._fold_target(0.0, now)
            return
        explicit = pool.explicit
        wait = median_of(pool.of_everyone(pool.wait, [c.wait_ms for c in explicit]))
        work = median_of(pool.of_everyone(pool.prefill, [c.prefill_ms for c in explicit])) or 1.0
        self._fold_congestion(wait, work, now)

    def _first_home(
        self,
        pool: CandidatePool,
        explicit: list[Candidate],
        cost_e: list[float],
        cost_rest: np.ndarray,
        limit: float,
        key: int,
        held: int,
        what: str,
    ) -> tuple[Candidate, str]:
        """``_first`` over rendezvous order (``held`` > 0: of the instances holding fewer than ``held``
        blocks), on columns: the first candidate within ``limit`` is the one with the highest weight
        among those within it; its rank counts the candidates with higher weights."""
        table = pool.table
        weights = table.weights(key & 0xFFFFFFFFFFFFFFFF)
        eligible = pool.mask.copy()
        if held:
            if pool.groups:  # a match group's members hold its answer
                eligible &= pool.blocks < held
            eligible[pool.explicit_rows] = [self._depth(c) < held for c in explicit]
        within = pool.column(cost_rest <= limit, [x <= limit for x in cost_e]) & eligible
        target = within if within.any() else eligible
        rows = np.flatnonzero(target)
        w = weights[rows]
        top = w.max()
        ids = table.ids
        # Highest weight first, then the smaller id (rendezvous_order's key); equal weights are rare.
        row = min((int(i) for i in rows[w == top]), key=lambda i: ids[i].decode())
        rank = 0
        if target is within:
            mine = weights[row]
            ahead = eligible & (weights > mine)
            rank = int(np.count_nonzero(ahead))
            ties = np.flatnonzero(eligible & (weights == mine))
            rank += sum(1 for i in ties if ids[i].decode() < ids[row].decode())
        at = np.flatnonzero(pool.explicit_rows == row)
        pick = explicit[int(at[0])] if len(at) else pool.materialize([row])[0]
        return pick, what if rank == 0 else f"{what}+{rank}"

    def _replica_slack(
        self, best: Candidate, best_cost: float, holder: Candidate, heat_key: int, ctx: PolicyContext
    ) -> float:
        """How far above the best cost a holder may be and still win over a new replica on ``best``:
        the margins plus ``replica_cost`` x the duplicated prefill, weighed by how hot the prefix is
        and by ``_replica_weight``."""
        # (a holder by its full-attention prefix alone: what a replica duplicates is that prefix)
        dup = max(0.0, best.prefill_ms - (holder.reach_prefill_ms if holder.reach else holder.prefill_ms))
        hot = min(1.0, self._heat(heat_key, ctx.clock()) / self.hot_requests)
        dup *= self._replica_weight(best)
        return best_cost * (1 + self.margin) + self.margin_ms + self.replica_cost * hot * dup

    def _has_reach(self, request: RouteRequest, candidates: list[Candidate]) -> bool:
        """Whether the reach applies to this ranking: some candidate has one (only a hybrid model's
        can) and the policy uses it. When not, the placement rules read plain ``blocks``."""
        return (
            bool(request.keys)
            and (self.reach_credit != 0 or self.reach_holders)
            and any(c.reach for c in candidates)
        )

    def _depth(self, c: Candidate) -> int:
        """How much of the prompt ``c`` holds for the placement rules (holders, spread, spills): its
        match, or a hybrid model's held full-attention prefix (``Candidate.reach``) with
        ``reach_holders``: the engine will keep a window there, so it is where the prefix lives."""
        return c.reach if self.reach_holders and c.reach > c.blocks else c.blocks

    def _reach_costs(
        self,
        request: RouteRequest,
        candidates: list[Candidate],
        costs: list[float],
        k: float,
        ctx: PolicyContext,
    ) -> list[float]:
        """``costs`` with the reach credit: a hybrid model's instance whose full-attention group holds
        a prefix the engine cannot reuse yet (``Candidate.reach``; only such models have any) is
        cold for this request, but this request makes vLLM keep a window at that junction, and
        every later request sharing the prefix then hits there. Its cost is lowered by
        ``reach_credit`` x the prefix's heat (as the replica rule's) x the prefill (weighted as the
        cost weighs it) that prefix saves: at full heat it ranks as if the prefix were the hit,
        while its estimate, admission and the ledger stay with the exact (cold) figure."""
        h = home_block(len(request.keys), request.block_size, self.home_tokens)
        now = ctx.clock()
        out = list(costs)
        for i, c in enumerate(candidates):
            if c.reach:
                hot = min(1.0, self._heat(request.keys[heat_block(c.reach, h)], now) / self.hot_requests)
                out[i] -= self.reach_credit * hot * (1.0 + k) * max(0.0, c.prefill_ms - c.reach_prefill_ms)
        return out

    def _replica_weight(self, best: Candidate) -> float:
        """How much of a new replica's duplicated prefill counts against it: the best instance's own
        wait over its prefill, capped at 1 (``replica_by_wait``; else always 1). On an idle
        instance the duplicate delays nobody, so a hot prefix's holder that is busy does not keep
        the request waiting; once the best instance has a queue as long as the work itself, the
        duplicate is paid in full by whoever queues behind it."""
        if not self.replica_by_wait:
            return 1.0
        prefill = best.prefill_ms + best.fetch_ms
        return min(1.0, best.wait_ms / prefill) if prefill > 0 else 1.0

    def _heat(self, key: int, now: float) -> float:
        entry = self._hot.get(key)
        if entry is None:
            return 0.0
        count, at = entry
        decay: float = 0.5 ** ((now - at) / self.hot_half_life)
        return count * decay

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        keys = request.keys
        if not keys:
            return
        h = home_block(len(keys), request.block_size, self.home_tokens)
        now = ctx.clock()
        hot = self._hot
        for i in heat_blocks(len(keys), h):
            key = keys[i]
            hot[key] = (self._heat(key, now) + 1.0, now)
            hot.move_to_end(key)
        while len(hot) > self.max_tracked:
            hot.popitem(last=False)


def heat_blocks(n_blocks: int, home: int) -> list[int]:
    """The block positions at which a committed prompt of ``n_blocks`` counts toward heat: 0, 1, 3,
    7, ... (2**i - 1) below the home block ``home``, and the home block when the prompt reaches it.

    A prompt shorter than the home prefix has no shared home block (its last block holds its own
    question), so heat counts at a few depths instead: a prefix held by the holders is as hot as
    the requests that shared at least ``heat_block(held)`` + 1 of its blocks."""
    out = []
    i = 1
    while i - 1 < n_blocks and i - 1 < home:
        out.append(i - 1)
        i *= 2
    if n_blocks > home:
        out.append(home)
    return out


def heat_block(held: int, home: int) -> int:
    """The position whose heat tells how hot a prefix of ``held`` blocks (>= 1) is: the home block
    if it is held, else the deepest 2**i - 1 within the held blocks (``heat_blocks``)."""
    if held > home:
        return home
    i = 1
    while 2 * i - 1 <= held - 1:
        i *= 2
    return i - 1


_blocks: Callable[[Candidate], int] = operator.attrgetter("blocks")


def _costs(candidates: list[Candidate], k: float) -> tuple[list[float], list[float]]:
    """Per candidate, its estimate (``Candidate.est_ttft_ms``) and the policy's cost at congestion
    weight ``k`` (costs.weighted_cost: the estimate itself when ``k`` is 0)."""
    est = [c.est_ttft_ms for c in candidates]
    if not k:
        return est, est
    return est, [weighted_cost(e, c.prefill_ms, c.fetch_ms, k) for e, c in zip(est, candidates, strict=True)]


def _order(candidates: list[Candidate], costs: list[float], bound: float) -> list[int]:
    """Positions of the candidates costing at most ``bound``, in ``rank``'s order: cost, then the
    emptier cache, then the less busy instance (Candidate.load), then the instance key (unique)."""
    decorated = sorted(
        [
            (x, (ld := c.state.load).kv_usage, ld.running + ld.waiting + c.inflight, c.state.key, i)
            for i, (c, x) in enumerate(zip(candidates, costs, strict=True))
            if x <= bound
        ]
    )
    return [d[4] for d in decorated]


def _uncongested(pool: CandidatePool, counted: tuple[float, int] | None = None) -> bool:
    """Whether the median wait over the candidates is at most their median prefill (then the
    congestion target is exactly 0: ``max(0.0, wait / work - 1.0)`` with ``wait <= work``), shown
    by counts instead of the two medians, which cost a partition of the whole fleet each.

    With a threshold T at most every other's prefill (the column's minimum): the median prefill is
    >= T when at most (N - 1) // 2 candidates have a prefill below T (only explicit ones can), and
    the median wait is <= T when at least N // 2 + 1 candidates wait at most T (counted low: every
    row that is not one of the others is assumed to wait longer). Both medians of two middle values
    keep the bound (their mean lies between them). False when this cannot be shown."""
    rows = pool.table.n
    if not rows or pool.count < 2:
        return False
    # ``counted``: the threshold and the rows waiting at most that long, from rank_others.
    threshold = float(pool.prefill.min()) if counted is None else counted[0]
    if threshold <= 0.0:
        return False
    explicit = pool.explicit
    n = pool.count
    # (The explicit candidates are counted only when their number could change the answer.)
    if len(explicit) > (n - 1) // 2 and len([c for c in explicit if c.prefill_ms < threshold]) > (n - 1) // 2:
        return False
    others = n - len(explicit)
    waiting = int(np.count_nonzero(pool.wait <= threshold)) if counted is None else counted[1]
    waiting_less = waiting - (rows - others)
    if waiting_less < n // 2 + 1:
        waiting_less += len([c for c in explicit if c.wait_ms <= threshold])
    return waiting_less >= n // 2 + 1


def _first(order: list[Candidate], ok: Callable[[Candidate], bool], what: str) -> tuple[Candidate, str]:
    for rank, c in enumerate(order):
        if ok(c):
            return c, what if rank == 0 else f"{what}+{rank}"
    return order[0], what


def _top(pick: Candidate, reason: str, ordered: list[Candidate], top_k: int) -> list[Choice]:
    """The pick first (with why it was picked), then the others in order, ``top_k`` in all."""
    out = [Choice(pick, pick.est_ttft_ms, reason)]
    picked = pick.state.key
    for c in ordered:
        if len(out) >= top_k:
            break
        if c.state.key != picked:
            out.append(Choice(c, c.est_ttft_ms, ""))
    return out
