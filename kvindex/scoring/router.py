"""The router core: turns a prompt into ranked instances with TTFT estimates, and keeps the routing
state (in-flight ledger, speculative keys) that routers commit to and release.

Used by the gRPC API and, in-process with a virtual clock, by the routing simulation: both run the
same code.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from kvindex.fleet.registry import InstanceState, Registry, instance_id
from kvindex.index.base import NO_MATCH, InstanceKey, InstanceMatch, KvBlockIndex
from kvindex.scoring.approximate import PredictedCache
from kvindex.scoring.base import DECODE_ROLE, Candidate, Choice, Policy, RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig, queue_ms
from kvindex.scoring.fleet_table import FleetTables, ModelTable, smallest

try:
    from kvindex.index._native import rank_others as _native_rank_others
except ImportError:  # no compiler at install time: numpy columns (CandidatePool.smallest)
    _native_rank_others = None
from kvindex.scoring.ledger import FINISHED, PREFILL, Ledger, SpeculativeKeys
from kvindex.scoring.outcomes import (
    ALREADY_RELEASED,
    DEGRADED,
    DUPLICATE,
    NO_PREDICTION,
    UNKNOWN_REQUEST,
    Outcome,
    OutcomeConfig,
    OutcomeTracker,
    Prediction,
    Report,
)
from kvindex.scoring.pick import Picker, PickOptions, PickResult
from kvindex.scoring.policies import make_policies


@dataclass
class RouterConfig:
    costs: CostConfig = field(default_factory=CostConfig)
    default_policy: str = "ttft"
    ledger_ttl: float = 300.0  # seconds before an unreleased request is forgotten
    seed: int = 0  # randomised policies (power_of_two, flexlb) draw from a seeded generator
    # Instances without KV events: how long a routed prompt's blocks are assumed cached there, and
    # their capacity in blocks when they announce none (kvindex/scoring/approximate.py).
    predicted_ttl: float = 120.0
    predicted_capacity: int = 8192
    # Score with top_k ranks only the holders and the best few others (Router.pool) from this many
    # instances of the model on; below it the full ranking is as cheap (0: always prune).
    prune_min_instances: int = 128
    # The pick after the ranking (kvindex/scoring/pick.py): "best" (the policy's first choice) or
    # "softmax" over estimated TTFT at ``temperature``; ``warmup`` s > 0 ramps new instances' share.
    pick: str = "best"
    temperature: float = 0.0
    warmup: float = 0.0
    # Predicted against actual: outcome reports, per-instance state, degraded credit.
    outcomes: OutcomeConfig = field(default_factory=OutcomeConfig)


class RoutingObserver(Protocol):
    """Told of every routing decision committed and released here (kvindex/routing_sync shares
    them with the other index replicas)."""

    def committed(self, request: RouteRequest, candidate: Candidate, policy: Policy) -> None: ...

    def released(self, request_id: str, phase: str) -> None: ...


@dataclass(slots=True)
class ScoreResult:
    request: RouteRequest
    policy: str
    choices: list[Choice]
    committed: InstanceState | None = None
    pick: PickResult | None = None  # how choices[0] was drawn; None: the policy's first, no draw


class Router:
    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        calibrator: Calibrator | None = None,
        config: RouterConfig | None = None,
        clock: Callable[[], float] | None = None,
        policy_options: dict[str, dict] | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.config = config or RouterConfig()
        self.clock = clock or registry.clock
        costs = self.config.costs
        self.calibrator = calibrator or Calibrator(costs.default_prefill, learn=costs.calibrate)
        self.ledger = Ledger(
            self.clock, ttl=self.config.ledger_ttl, released_memory=self.config.outcomes.released_memory
        )
        self.outcomes = OutcomeTracker(self.clock, self.config.outcomes)
        # A request's report (measured TTFT minus the predicted wait, with the engine's cached
        # tokens) is a prefill sample of the instance it ran on.
        self.outcomes.subscribe(self._calibrate)
        # Instances whose state is degraded: their cache credit is discounted (docs/scoring.md).
        self.degraded: set[InstanceKey] = set()
        self.speculative = SpeculativeKeys(self.clock)
        self.predicted = PredictedCache(
            index, self.clock, self.config.predicted_ttl, self.config.predicted_capacity
        )
        self.rng = random.Random(self.config.seed)
        cfg = self.config
        self.picker = Picker(registry, cfg.seed, cfg.pick, cfg.temperature, cfg.warmup)
        self.policies: dict[str, Policy] = make_policies(policy_options or {})
        self.observer: RoutingObserver | None = None  # None: a lone replica, nothing to share
        self._tables: FleetTables | None = None
        if self.config.default_policy not in self.policies:
            raise ValueError(f"unknown default policy {self.config.default_policy!r}")

    def _calibrate(self, outcome: Outcome) -> None:
        p, r = outcome.prediction, outcome.report
        if r.ttft_ms is not None and r.cached_tokens is not None:
            self.calibrator.add_reported(
                p.model, instance_id(p.instance), p.prompt_tokens, r.cached_tokens, r.ttft_ms, p.wait_ms
            )

    # -- candidates -----------------------------------------------------------------------------

    def candidates(
        self,
        request: RouteRequest,
        states: list[InstanceState],
        spec_ttl: float,
        every: bool = False,
        matches: dict[InstanceKey, InstanceMatch] | None = None,
    ) -> list[Candidate]:
        """``every``: ``states`` are all the model's routable instances, so the index may match all
        of its instances (the extra ones, stale or pools, are not looked at) instead of building a
        mask from the list. ``matches``: the index's answer, when the caller already has it."""
        keys = request.keys
        if matches is not None:
            pass
        elif keys:
            matches = self.index.match(request.model, keys, None if every else [s.key for s in states])
        else:
            matches = {}
        shared = self.calibrator.prefill(request.model)
        # Instances ranked with their own calibrated model (usually none; kvindex/scoring/calibration.py).
        own = self.calibrator.own_models(request.model)
        costs = self.config.costs
        shape = costs.engine
        drains = costs.drain_reported_queue
        # Hoisted: this loop runs once per instance on every Score.
        model = shared
        b_ms = model.b_ms_per_token
        chunk, dps = shape.chunk_tokens, shape.decode_ms_per_seq
        f_cpu, f_disk, f_pool = costs.fetch.per_token_ms[1:]
        drain_rate = shared_rate = 1000 / b_ms if drains and b_ms > 0 else 0.0
        b = request.block_size
        prompt = request.prompt_tokens
        cap = max(prompt - 1, 0)  # vLLM always recomputes at least the prompt's last token
        now = self.clock()
        spec = self.speculative._keys if spec_ttl > 0 and keys else {}
        pending = self.ledger.pending
        busy = self.ledger.busy
        get_match = matches.get
        degraded = self.degraded
        credit = self.config.outcomes.degraded_credit
        prefill_of: dict[int, float] = {}  # many instances share a miss size
        shared_prefill_of = prefill_of
        out = []
        append = out.append
        for state in states:
            key = state.key
            if own:
                fit = own.get(state.instance_id)
                if fit is not None:
                    model, prefill_of = fit, {}
                    b_ms = fit.b_ms_per_token
                    drain_rate = 1000 / b_ms if drains and b_ms > 0 else 0.0
                elif model is not shared:
                    model, prefill_of, drain_rate = shared, shared_prefill_of, shared_rate
                    b_ms = shared.b_ms_per_token
            match = get_match(key, NO_MATCH)
            blocks, t = match
            gpu = t[0]
            if spec and key in spec:
                extended = self.speculative.extend(key, keys, blocks)
                gpu += extended - blocks
                blocks = extended
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
                n_new, tokens_new, inflight = pending(key, state.last_status_at)
            else:  # nothing routed there in flight (the common case: skip the ledger walk)
                n_new = tokens_new = inflight = 0
            queued = load.waiting_prefill_tokens
            if queued and drain_rate and state.last_status_at is not None:
                # The reported queue has been draining since the heartbeat, at the engine's rate.
                queued = max(0.0, queued - (now - state.last_status_at) * drain_rate)
            queued += tokens_new
            running = load.running + n_new
            wait = queue_ms(model, shape, queued, running) if queued > 0 else 0.0
            if miss > 0:
                base = prefill_of.get(miss)
                if base is None:
                    base = prefill_of[miss] = model.ms(miss, prompt)
                prefill = base + -(-miss // chunk) * dps * running
            else:
                prefill = 0.0
            fetch = f_cpu * by_tier[1] + f_disk * by_tier[2] + f_pool * by_tier[3] if blocks > gpu else 0.0
            append(
                Candidate(
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
            )
        return out

    # -- API ------------------------------------------------------------------------------------

    def policy(self, name: str | None) -> Policy:
        name = name or self.config.default_policy
        policy = self.policies.get(name)
        if policy is None:
            raise KeyError(name)
        return policy

    def score(
        self,
        request: RouteRequest,
        candidates: list[str] | None = None,
        policy: str | None = None,
        commit: bool = False,
        top_k: int = 0,
        pick: PickOptions | None = None,
    ) -> ScoreResult:
        """Rank the routable instances (all of them, or ``candidates``) for ``request``.

        ``top_k`` > 0 asks for the best ``top_k`` only: a policy that can (``rank_top``) then looks
        at the instances holding some of the prompt and the few best others, not the whole fleet
        (the answer is the same as the first ``top_k`` of the full ranking).

        ``pick`` (default: the router's): how the request's instance is drawn from those choices
        (kvindex/scoring/pick.py); the picked one comes first and is the one committed."""
        # Disaggregated decode instances are chosen for KV headroom, not for prefix overlap.
        chosen = self.policies["decode"] if request.role == DECODE_ROLE else self.policy(policy)
        self.predicted.expire()
        wanted = top_k
        if top_k > 0 and self.picker.warmup > 0:  # room for the share new instances give up
            top_k += self.picker.extra(request.model, self.clock())
        rank_top = getattr(chosen, "rank_top", None)
        if (
            top_k > 0
            and rank_top is not None
            and len(self.registry.members(request.model)) >= self.config.prune_min_instances
            # The columns price every instance with one prefill model (see docs/scoring.md).
            and not self.calibrator.own_models(request.model)
        ):
            pool = self.pool(request, candidates, chosen.speculative_ttl)
            choices = rank_top(request, pool, self, top_k) if pool is not None else []
        else:
            states = self.registry.routable(request.model, candidates)
            cands = self.candidates(request, states, chosen.speculative_ttl, every=candidates is None)
            choices = chosen.rank(request, cands, self) if cands else []
            if top_k > 0:
                choices = choices[:top_k]
        result = ScoreResult(request, chosen.name, choices)
        options = pick or self.picker.default
        if len(choices) > 1 and self.picker.needed(options):
            result.choices, result.pick = self.picker.pick(
                request.model, request.request_id, choices, options, self.clock()
            )
            choices = result.choices
        if len(choices) > wanted > 0:
            choices = result.choices = choices[:wanted]
        if commit and choices:
            top = choices[0].candidate
            self._commit(request, top, chosen)
            result.committed = top.state
        return result

    # -- pruned rankings ------------------------------------------------------------------------

    @property
    def tables(self) -> FleetTables:
        """Per-model columns of instance state (made on first use: they watch the registry)."""
        tables = self._tables
        if tables is None:
            tables = self._tables = FleetTables(self.registry, self.ledger)
        return tables

    def pool(
        self, request: RouteRequest, candidates: list[str] | None, spec_ttl: float
    ) -> CandidatePool | None:
        """The request's candidates for a pruned ranking: full ``Candidate`` objects for the
        instances that hold some of the prompt (in the index, or speculatively), columns for the
        others; None when no instance is routable."""
        table = self.tables.get(request.model)
        if table is None:
            return None
        n = table.n
        if candidates is None:
            count = len(table.routable_rows())
            if not count:
                return None
            mask = table.routable[:n]  # a view (nothing modifies a pool's mask)
            everyone = True
        else:
            mask = table.routable[:n].copy()
            wanted = np.zeros(n, dtype=bool)
            wanted[table.rows_of(set(candidates))] = True
            mask &= wanted
            count = int(np.count_nonzero(mask))
            if not count:
                return None
            everyone = count == len(table.routable_rows())
        keys = request.keys
        states = table.states
        row = table.row
        if keys:
            restrict = None if candidates is None else [states[i].key for i in np.flatnonzero(mask)]
            matches = self.index.match(request.model, keys, restrict)
        else:
            matches = {}
        if everyone:  # a set lookup per holder rather than a numpy scalar read
            out = table.unroutable_set()
            rows = [i for k in matches if (i := row.get(k)) is not None and i not in out]
        else:
            rows = [i for k in matches if (i := row.get(k)) is not None and mask[i]]
        if spec_ttl > 0 and keys:
            # An instance whose speculative keys start the prompt extends its match past 0 blocks.
            now = self.clock()
            first = keys[0]
            for inst, held in self.speculative._keys.items():
                expiry = held.get(first)
                if expiry is not None and expiry > now and inst not in matches:
                    i = row.get(inst)
                    if i is not None and mask[i]:
                        rows.append(i)
        explicit = self.candidates(request, [states[i] for i in rows], spec_ttl, matches=matches)
        return CandidatePool(self, request, table, mask, count, everyone, explicit, rows, spec_ttl)

    def commit(self, request: RouteRequest, instance: InstanceKey, policy: str | None = None) -> bool:
        """Record that ``request`` was sent to ``instance`` (outside a Score with commit)."""
        state = self.registry.get(instance)
        if state is None or state.model != request.model:
            return False
        chosen = self.policy(policy)
        (cand,) = self.candidates(request, [state], chosen.speculative_ttl)
        self._commit(request, cand, chosen)
        return True

    def _commit(self, request: RouteRequest, cand: Candidate, policy: Policy) -> None:
        key = cand.state.key
        if request.request_id:
            # A disaggregated decode receives the prompt's KV from a prefill instance: it queues no
            # prefill work there (a decode instance prefilling itself is committed as a prefill).
            miss = 0 if request.role == DECODE_ROLE else cand.miss_tokens
            entry = self.ledger.commit(request.request_id, key, request.model, request.prompt_tokens, miss)
            entry.prediction = Prediction(
                key,
                request.model,
                policy.name,
                request.block_size,
                request.prompt_tokens,
                cand.blocks,
                cand.match[0],
                cand.tokens_by_tier,
                cand.wait_ms,
                cand.prefill_ms,
                cand.fetch_ms,
                cand.wait_ms + cand.prefill_ms + cand.fetch_ms,
                entry.committed_at,
                request.keys,
                cand.state.removals,
            )
        if policy.speculative_ttl > 0 and request.keys:
            self.speculative.add(key, request.keys, policy.speculative_ttl)
        if cand.state.approximate and request.keys:
            self.predicted.on_commit(cand.state, request.keys)
        policy.on_commit(request, cand, self)
        if self.observer is not None:
            self.observer.committed(request, cand, policy)

    def release(self, request_id: str, phase: str, report: Report | None = None) -> bool:
        return self.release_reported(request_id, phase, report)[0]

    def release_reported(self, request_id: str, phase: str, report: Report | None) -> tuple[bool, str]:
        """Release, and compare a well-formed ``report`` (Report.malformed() is None) with what was
        predicted: (found, what became of the report: "" without one, see outcomes.py)."""
        if phase not in (PREFILL, FINISHED):
            raise ValueError(f"phase must be {PREFILL!r} or {FINISHED!r}, got {phase!r}")
        status = ""
        if report is not None and not report.empty():
            status = self._report(request_id, report)
        found = self.ledger.release(request_id, phase) is not None
        if self.observer is not None:  # told even when not found: another replica may hold it
            self.observer.released(request_id, phase)
        return found, status

    def _report(self, request_id: str, report: Report) -> str:
        outcomes = self.outcomes
        entry = self.ledger.get(request_id)
        if entry is None:
            gone = self.ledger.was_released(request_id)
            return outcomes.ignore(ALREADY_RELEASED if gone else UNKNOWN_REQUEST)
        if entry.reported:
            return outcomes.ignore(DUPLICATE)
        if entry.prediction is None:
            return outcomes.ignore(NO_PREDICTION)
        p = entry.prediction
        state = self.registry.get(p.instance)

        def held_now() -> int:
            if state is None or not p.keys:
                return 0
            return self.index.match(p.model, p.keys, [p.instance]).get(p.instance, NO_MATCH)[0]

        removals = None if state is None else state.removals
        status, outcome = outcomes.compare(p, report, removals, held_now)
        if outcome is not None:
            entry.reported = True
            self.refresh_state(entry.instance)
        return status

    # -- instance state -------------------------------------------------------------------------

    def state_of(self, state: InstanceState) -> tuple[str, str]:
        """(exact | degraded | approximate, why): see kvindex/scoring/outcomes.py."""
        return self.outcomes.state(state)

    def refresh_state(self, instance: InstanceKey) -> None:
        """Re-decide whether ``instance`` is degraded (after a report or a repair change)."""
        state = self.registry.get(instance)
        if state is not None and self.outcomes.state(state)[0] == DEGRADED:
            self.degraded.add(instance)
        else:
            self.degraded.discard(instance)

    def sync_changed(self, state: InstanceState, reconciled: bool = False) -> None:
        """The consumer's repair state of ``state`` changed; ``reconciled``: its blocks were just
        made equal to the worker's (snapshot, restart), so earlier outcome evidence is void."""
        if reconciled:
            self.outcomes.repaired(state.key)
        was = state.key in self.degraded
        self.refresh_state(state.key)
        if not was and state.key in self.degraded and state.repair_failed:
            # Holes accepted or a repair timed out: ask for a snapshot (rate-limited).
            self.outcomes.request_reconcile(state.key)

    def forget(self, instance: InstanceKey) -> None:
        self.speculative.forget(instance)
        self.predicted.forget(instance)
        self.outcomes.forget(instance)
        self.degraded.discard(instance)


class CandidatePool:
    """One request's candidates, for a pruned ranking (Policy ``rank_top``).

    ``explicit`` are full candidates: every routable instance that holds some of the prompt. The
    others hold nothing of it, so their terms are those of ``Router.candidates`` with no match:
    ``wait`` and ``prefill`` (of the whole prompt) per table row, computed here with the same
    float64 operations in the same order, hence bit-identical. ``materialize`` turns rows into
    full candidates through ``Router.candidates`` itself.
    """

    def __init__(
        self,
        router: Router,
        request: RouteRequest,
        table: ModelTable,
        mask: np.ndarray,
        count: int,
        everyone: bool,
        explicit: list[Candidate],
        explicit_rows: list[int],
        spec_ttl: float,
    ) -> None:
        self.router = router
        self.request = request
        self.table = table
        self.mask = mask  # the request's candidates, by row (read only: may be the table's own)
        self.count = count  # how many
        # Every routable row is a candidate (no candidate list, the common case): shortcuts apply.
        self.everyone = everyone
        self.explicit = explicit
        self.explicit_rows = np.array(explicit_rows, dtype=np.int64)
        self.spec_ttl = spec_ttl
        # Tie-breaks of the rankings: emptier cache, fewer requests (reported + in flight), key.
        n = table.n
        self.kv = table.kv[:n]
        self.load = table.load[:n]
        self.key_rank = table.ranks()

    # The cost terms of the others, per row (only the ttft policy reads them: made on first use).

    @cached_property
    def wait(self) -> np.ndarray:
        """Router.candidates' wait per row (the table's cache: do not modify)."""
        router = self.router
        model = router.calibrator.prefill(self.request.model)
        costs = router.config.costs
        shape = costs.engine
        b_ms = model.b_ms_per_token
        drain_rate = 1000 / b_ms if costs.drain_reported_queue and b_ms > 0 else 0.0
        return self.table.waits(
            router.clock(), b_ms, shape.step_ms, shape.chunk_tokens, shape.decode_ms_per_seq, drain_rate
        )[: self.table.n]

    @cached_property
    def prefill(self) -> np.ndarray:
        """Router.candidates' prefill of the whole prompt per row."""
        table = self.table
        n = table.n
        prompt = self.request.prompt_tokens
        if prompt <= 0:
            return np.zeros(n)
        model = self.router.calibrator.prefill(self.request.model)
        shape = self.router.config.costs.engine
        prefill = (-(-prompt // shape.chunk_tokens) * shape.decode_ms_per_seq) * table.running_now[:n]
        prefill += model.ms(prompt, prompt)
        return prefill

    @cached_property
    def est(self) -> np.ndarray:
        """Candidate.est_ttft_ms per row (no fetch: nothing held)."""
        return self.wait + self.prefill

    def cost(self, k: float) -> np.ndarray:
        """The ttft policy's cost per row with congestion weight ``k``."""
        return self.est + k * (self.prefill + 0.0) if k else self.est

    def rank_others(self, k: float, top_k: int) -> tuple[np.ndarray, float, int] | None:
        """The ttft policy's selection of the others in one native pass (``_native.rank_others``):
        the ``top_k`` rows first in (``cost(k)``, kv, load, key) order, the lowest prefill of any
        row and how many rows wait at most that long; None without the extension (or for a large
        ``top_k``, where its insertion into a sorted buffer would not pay): then the columns."""
        if _native_rank_others is None or not 0 < top_k <= 64:
            return None
        table = self.table
        prompt = self.request.prompt_tokens
        model = self.router.calibrator.prefill(self.request.model)
        shape = self.router.config.costs.engine
        n = table.n
        out = np.empty(top_k, dtype=np.int64)
        found, low, waiting = _native_rank_others(
            self.wait,
            table.running_now[:n],
            self.mask.view(np.uint8),
            np.sort(self.explicit_rows),
            prompt > 0,
            (-(-prompt // shape.chunk_tokens) * shape.decode_ms_per_seq) if prompt > 0 else 0.0,
            model.ms(prompt, prompt) if prompt > 0 else 0.0,
            k,
            self.kv,
            self.load,
            self.key_rank,
            out,
        )
        return out[:found], low, waiting

    def materialize(self, rows: list[int] | np.ndarray) -> list[Candidate]:
        states = self.table.states
        return self.router.candidates(self.request, [states[i] for i in rows], self.spec_ttl, matches={})

    def top(self, columns: list[np.ndarray], key: Callable[[Candidate], Any], top_k: int) -> list[Candidate]:
        """The first ``top_k`` candidates in ``key`` order: the explicit ones and the best ``top_k``
        others, chosen on ``columns`` (per row, the others' values of ``key``'s leading terms, in
        order; the instance key, ``key``'s last term, is added here)."""
        rows = smallest([*columns, self.key_rank], self.rest_rows, top_k)
        cands = self.explicit + self.materialize(rows)
        cands.sort(key=key)
        return cands[:top_k]

    def column(self, rest: np.ndarray, explicit: list[float]) -> np.ndarray:
        """A per-row column: ``rest`` for the others, ``explicit`` at the explicit candidates' rows."""
        out = rest.copy()
        out[self.explicit_rows] = explicit
        return out

    def of_everyone(self, rest: np.ndarray, explicit: list[float]) -> np.ndarray:
        """``column`` at the request's candidates only (in row order)."""
        out = self.column(rest, explicit)
        return out if self.everyone and len(out) == self.count else out[self.mask]

    def smallest(self, cost: np.ndarray, top_k: int) -> np.ndarray:
        """The ``top_k`` others first in (``cost``, kv, load, instance key) order, unordered."""
        table = self.table
        tie = table.tie_order()
        n = table.n
        others = self.count - len(self.explicit)
        if tie is None or not self.everyone or others <= top_k or top_k <= 0:
            columns = [cost, self.kv, self.load, self.key_rank] if tie is None else [cost, tie]
            return smallest(columns, self.rest_rows, top_k)
        # Every routable row is a candidate: the explicit ones and the unroutable rows are set aside
        # at +inf instead of listing the others' rows, and the common case (an idle fleet: at least
        # top_k others tied on the lowest cost) is a minimum and one comparison, not a partition of
        # the whole fleet.
        c = cost.copy()
        c[self.explicit_rows] = np.inf
        if self.count != n:
            c[table.unroutable_rows()] = np.inf
        low = c.min()
        at_low = c == low
        if np.count_nonzero(at_low) >= top_k:
            below = _NO_ROWS
            ties = np.flatnonzero(at_low)
        else:
            pivot = np.partition(c, top_k - 1)[top_k - 1]
            below = np.flatnonzero(c < pivot)
            ties = np.flatnonzero(c == pivot)
        need = top_k - len(below)
        if len(ties) > need:
            ties = ties[np.argpartition(tie[ties], need - 1)[:need]]
        return np.concatenate((below, ties)) if len(below) else ties

    @cached_property
    def rest(self) -> np.ndarray:
        """Per row, whether it is a candidate that holds nothing of the prompt."""
        rest = self.mask.copy()
        rest[self.explicit_rows] = False
        return rest

    @cached_property
    def rest_rows(self) -> np.ndarray:
        """The others' rows, ascending."""
        if self.everyone:
            rows = self.table.routable_rows()
            if not len(self.explicit_rows):
                return rows
            keep = self.rest[rows]
            return rows[keep]
        return np.flatnonzero(self.rest)


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _trim(by_tier: tuple[int, int, int, int], over: int) -> tuple[int, int, int, int]:
    t = list(by_tier)
    for i in (3, 2, 1, 0):
        take = min(t[i], over)
        t[i] -= take
        over -= take
        if not over:
            break
    return (t[0], t[1], t[2], t[3])
