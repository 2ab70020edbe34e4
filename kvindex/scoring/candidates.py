"""Candidates for one request: each routable instance as the router sees it, with the TTFT
estimate's parts (kvindex/scoring/base.py ``Candidate``).

The index's match (and the speculative keys that extend it), the last heartbeat's load and what the
ledger routed since are priced by the cost model (kvindex/scoring/costs.py) into a wait, a prefill
and a fetch per instance. The rankings of every fleet size build their candidates here: the full
ranking for every routable instance, a pruned one (kvindex/scoring/pool.py) for the holders and the
few best others.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import NO_MATCH, InstanceMatch, KvBlockIndex
from kvindex.index.hybrid import hit_limit
from kvindex.instance import InstanceKey
from kvindex.scoring.base import Candidate, RouteRequest
from kvindex.scoring.costs import (
    CostModel,
    drain_rate,
    fetch_ms,
    ledger_ms,
    prefill_at,
    prefill_terms,
    queue_wait,
    queued_now,
    wait_ms,
)
from kvindex.scoring.ledger import Ledger, SpeculativeKeys


class CandidateBuilder:
    """Builds ``Candidate``s (one router's: its ledger, speculative keys and degraded instances)."""

    def __init__(
        self,
        index: KvBlockIndex,
        ledger: Ledger,
        speculative: SpeculativeKeys,
        costs: CostModel,
        clock: Callable[[], float],
        degraded: AbstractSet[InstanceKey],
        degraded_credit: float,
    ) -> None:
        """``degraded``: the instances whose match the index is known to get wrong (the router's
        outcomes keep the set); their match is credited ``degraded_credit`` of its tokens."""
        self.index = index
        self.ledger = ledger
        self.speculative = speculative
        self.costs = costs
        self.clock = clock
        self.degraded = degraded
        self.degraded_credit = degraded_credit

    def candidates(
        self,
        request: RouteRequest,
        states: list[InstanceState],
        spec_ttl: float,
        every: bool = False,
        matches: dict[InstanceKey, InstanceMatch] | None = None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> list[Candidate]:
        """The request's candidates among ``states``. A hot loop (every Score, once per instance):
        kept in one function, its reads hoisted.

        ``every``: ``states`` are all the model's routable instances, so the index may match all
        of its instances (the extra ones, stale or pools, are not looked at) instead of building a
        mask from the list. ``matches``: the index's answer, when the caller already has it, with
        ``reach`` (KvBlockIndex.match: a hybrid model's full-attention prefixes beyond the answer).

        The estimate's terms are the cost model's (kvindex/scoring/costs.py: ``queued_now``,
        ``queue_wait``, ``ledger_ms``, ``wait_ms``, ``prefill_terms`` and ``prefill_at``,
        ``fetch_ms``), called per instance, compiled where the extension is built."""
        keys = request.keys
        if matches is not None:
            pass
        elif keys:
            reach = {}
            matches = self.index.match(
                request.model,
                keys,
                None if every else [s.key for s in states],
                hit_limit(request.prompt_tokens),
                reach,
            )
        else:
            matches = {}
        shared = self.costs.prefill(request.model)
        # Instances ranked with their own calibrated model (usually none; kvindex/scoring/calibration.py).
        own = self.costs.own_models(request.model)
        costs = self.costs
        shape = costs.engine
        drains = costs.config.drain_reported_queue
        # Hoisted: this loop runs once per instance on every Score.
        model = shared
        b_ms, step_ms, chunk, dps = (
            model.b_ms_per_token,
            shape.step_ms,
            shape.chunk_tokens,
            shape.decode_ms_per_seq,
        )
        f_cpu, f_disk, f_pool = costs.fetch.per_token_ms[1:]
        rate = shared_rate = drain_rate(model, drains)
        b = request.block_size
        prompt = request.prompt_tokens
        cap = max(prompt - 1, 0)  # vLLM always recomputes at least the prompt's last token
        now = self.clock()
        spec = self.speculative.instances() if spec_ttl > 0 and keys else ()
        pending = self.ledger.pending
        busy_until = self.ledger.busy_until
        busy = self.ledger.busy
        get_match = matches.get
        get_reach = reach.get if reach else None  # (hybrid models only)
        marked = self.speculative.marked() if spec else ()
        degraded = self.degraded
        credit = self.degraded_credit
        terms_of: dict[int, tuple[float, float]] = {}  # prefill_terms per miss size (shared by many)
        shared_terms_of = terms_of
        out: list[Candidate] = []
        append = out.append
        for state in states:
            key = state.key
            if own:
                fit = own.get(state.instance_id)
                if fit is not None:
                    model, terms_of = fit, {}
                    rate = drain_rate(fit, drains)
                elif model is not shared:
                    model, terms_of, rate = shared, shared_terms_of, shared_rate
                b_ms = model.b_ms_per_token
            match = get_match(key, NO_MATCH)
            blocks, t = match
            gpu = t[0]
            far = get_reach(key, 0) if get_reach is not None else 0
            if spec and key in spec:
                extended = self.speculative.extend(key, keys, blocks)
                gpu += extended - blocks
                blocks = extended
                if key in marked:  # a hybrid model's committed prompts: their full-attention blocks
                    far = self.speculative.reach(key, keys, max(far, blocks))
            hit = blocks * b
            by_tier = (gpu * b, t[1] * b, t[2] * b, t[3] * b)
            if hit > cap:  # the capped tokens come off the last (slowest) tier that has any
                by_tier = _trim(by_tier, hit - cap)
                hit = cap
            if degraded and key in degraded and hit:
                # The index is known to be wrong about it: credit only part of the match.
                cut = hit - int(hit * credit)
                if cut:
                    by_tier = _trim(by_tier, cut)
                    hit -= cut
            miss = prompt - hit
            load = state.load
            if key in busy:
                n_new, tokens_new, inflight = pending(key, state.last_heartbeat_at)
                ledger = ledger_ms(busy_until(key), now)
            else:  # nothing routed there in flight (the common case: skip the ledger walk)
                n_new = tokens_new = inflight = 0
                ledger = 0.0
            # The reported queue has been draining since the heartbeat, at the engine's rate.
            queued = queued_now(load.waiting_prefill_tokens, state.last_heartbeat_at, now, rate, tokens_new)
            running = load.running + n_new
            wait = wait_ms(queue_wait(b_ms, step_ms, chunk, dps, queued, running), ledger)
            if miss > 0:
                terms = terms_of.get(miss)
                if terms is None:
                    terms = terms_of[miss] = prefill_terms(model, shape, miss, prompt)
                prefill = prefill_at(terms[0], terms[1], running)
            else:
                prefill = 0.0
            # (0 when every matched block is on the GPU)
            fetch = (
                fetch_ms(f_cpu, f_disk, f_pool, by_tier[1], by_tier[2], by_tier[3]) if blocks > gpu else 0.0
            )
            cand = Candidate(
                state,
                match,
                blocks,
                by_tier,
                hit,
                miss,
                wait,
                prefill,
                fetch,
                inflight,
                queued,
                tokens_new,
            )
            if far > blocks:
                far = min(far, cap // b)
                if far > blocks:
                    # The prefill as if the held full-attention prefix were the hit (capped as the
                    # hit is): what a later request sharing it would pay here.
                    far_miss = prompt - min(far * b, cap)
                    cand.reach = far
                    cand.reach_prefill_ms = (
                        prefill_at(*prefill_terms(model, shape, far_miss, prompt), running)
                        if far_miss > 0
                        else 0.0
                    )
            append(cand)
        return out


def _trim(by_tier: tuple[int, int, int, int], over: int) -> tuple[int, int, int, int]:
    t = list(by_tier)
    for i in (3, 2, 1, 0):
        take = min(t[i], over)
        t[i] -= take
        over -= take
        if not over:
            break
    return (t[0], t[1], t[2], t[3])
