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
from kvindex.index.base import NO_MATCH, GroupedIndex, InstanceMatch, KvBlockIndex, MatchGroup
from kvindex.index.hybrid import hit_limit
from kvindex.instance import InstanceKey
from kvindex.scoring.approximate import PredictedCache
from kvindex.scoring.base import DECODE_ROLE, Candidate, Choice, Policy, PrunedPolicy, RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig, drain_rate, prefill_terms, queue_ms
from kvindex.scoring.fleet_table import FleetTables, ModelTable, smallest

try:
    from kvindex.scoring._kernels import mark_group_rows as _native_mark_group_rows
    from kvindex.scoring._kernels import rank_grouped as _native_rank_grouped
    from kvindex.scoring._kernels import rank_others as _native_rank_others
except ImportError:  # no compiler at install time: numpy columns (CandidatePool.smallest)
    _native_rank_others = None
    _native_rank_grouped = None
    _native_mark_group_rows = None
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
class RankerConfig:
    costs: CostConfig = field(default_factory=CostConfig)
    default_policy: str = "ttft"
    ledger_ttl: float = 300.0  # seconds before an unreleased request is forgotten
    seed: int = 0  # randomised policies (power_of_two, flexlb) draw from a seeded generator
    # Instances without KV events: how long a routed prompt's blocks are assumed cached there, and
    # their capacity in blocks when they announce none (kvindex/scoring/approximate.py).
    predicted_ttl: float = 120.0
    predicted_capacity: int = 8192
    # Score with top_k ranks only the holders and the best few others (Ranker.pool) from this many
    # instances of the model on; below it the full ranking is as cheap (0: always prune).
    prune_min_instances: int = 128
    # The pick after the ranking (kvindex/scoring/pick.py): "best" (the policy's first choice) or
    # "softmax" over estimated TTFT at ``temperature``; ``warmup`` s > 0 ramps new instances' share.
    pick: str = "best"
    temperature: float = 0.0
    warmup: float = 0.0
    # Pruned rankings: an answer of the index (matched blocks per tier) shared by more than this
    # many instances is ranked like the non-holders, by the instances' own columns, instead of one
    # candidate per instance (a prompt that starts with the fleet's system prompt).
    group_min_instances: int = 16
    # Seconds a committed prompt's speculative keys outlive its release (prefill done or finished):
    # time for its KV events to arrive; from then on the events alone say what the engine holds.
    speculative_grace: float = 1.0
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


class Ranker:
    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        calibrator: Calibrator | None = None,
        config: RankerConfig | None = None,
        clock: Callable[[], float] | None = None,
        policy_options: dict[str, dict] | None = None,
        on_degraded: Callable[[InstanceKey], None] | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.config = config or RankerConfig()
        self.clock = clock or registry.clock
        costs = self.config.costs
        self.calibrator = calibrator or Calibrator(costs.default_prefill, learn=costs.calibrate)
        self.ledger = Ledger(
            self.clock, ttl=self.config.ledger_ttl, released_memory=self.config.outcomes.released_memory
        )
        self.outcomes = OutcomeTracker(self.clock, self.config.outcomes, on_degraded=on_degraded)
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
        # Capabilities, decided once here (an isinstance with a protocol would cost microseconds
        # per Score): the policies that rank a pruned pool, and the index's grouped answers.
        self.pruned: dict[str, PrunedPolicy] = {
            name: p for name, p in self.policies.items() if isinstance(p, PrunedPolicy)
        }
        self.grouped_index: GroupedIndex | None = index if isinstance(index, GroupedIndex) else None
        self.observer: RoutingObserver | None = None  # None: a lone replica, nothing to share
        self._tables: FleetTables | None = None
        # model -> (slot layout, table, table version, row of each index slot), for match groups
        self._slot_rows: dict[str, tuple[int, ModelTable, int, np.ndarray]] = {}
        if self.config.default_policy not in self.policies:
            raise ValueError(f"unknown default policy {self.config.default_policy!r}")

    def _calibrate(self, outcome: Outcome) -> None:
        p, r = outcome.prediction, outcome.report
        if r.ttft_ms is not None and r.cached_tokens is not None:
            if p.prefills_ahead > 0:
                self.calibrator.queued += 1
                return
            self.calibrator.add_reported(
                p.model, instance_id(p.instance), p.prompt_tokens, r.cached_tokens, r.ttft_ms, p.wait_ms
            )

    def spec_boundary(self, model: str, prompt_tokens: int, block_size: int) -> int | None:
        """For SpeculativeKeys.add: a hybrid-attention model's committed prompt will serve later
        prompts up to the block before its last token only (its sliding-window and Mamba groups keep
        state there, kvindex/index/hybrid.py); None for other models (every block)."""
        layout = self.index.layout_of(model)
        if layout is None or not layout.hybrid:
            return None
        return hit_limit(prompt_tokens) // block_size

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
        mask from the list. ``matches``: the index's answer, when the caller already has it.

        The estimate's terms are kvindex/scoring/costs.py's (``queued_now``, ``queue_ms``,
        ``prefill_ms``, ``FetchCosts.ms``), inlined where a call per instance would cost: the same
        operations in the same order (tests/unit/test_cost_forms.py holds them equal)."""
        keys = request.keys
        if matches is not None:
            pass
        elif keys:
            matches = self.index.match(
                request.model,
                keys,
                None if every else [s.key for s in states],
                hit_limit(request.prompt_tokens),
            )
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
        chunk, dps = shape.chunk_tokens, shape.decode_ms_per_seq
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
                    rate = drain_rate(fit, drains)
                elif model is not shared:
                    model, prefill_of, rate = shared, shared_prefill_of, shared_rate
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
                n_new, tokens_new, inflight = pending(key, state.last_heartbeat_at)
                left = (busy_until(key) - now) * 1000.0  # costs.ledger_ms, compared below
            else:  # nothing routed there in flight (the common case: skip the ledger walk)
                n_new = tokens_new = inflight = 0
                left = 0.0
            # costs.queued_now, inline: the reported queue has been draining since the heartbeat,
            # at the engine's rate.
            queued = load.waiting_prefill_tokens
            if queued and rate and state.last_heartbeat_at is not None:
                queued = max(0.0, queued - (now - state.last_heartbeat_at) * rate)
            queued += tokens_new
            running = load.running + n_new
            wait = queue_ms(model, shape, queued, running) if queued > 0 else 0.0
            if left > wait:  # costs.wait_ms: the longer of the reported queue and the ledger's work
                wait = left
            if miss > 0:  # costs.prefill_ms, inline, with the model's term cached per miss size
                base = prefill_of.get(miss)
                if base is None:
                    base = prefill_of[miss] = model.ms(miss, prompt)
                prefill = base + -(-miss // chunk) * dps * running
            else:
                prefill = 0.0
            # costs.FetchCosts.ms, inline (0 when every matched block is on the GPU)
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
        pruned = self.pruned.get(chosen.name)
        if (
            top_k > 0
            and pruned is not None
            and len(self.registry.members(request.model)) >= self.config.prune_min_instances
            # The columns price every instance with one prefill model (see docs/scoring.md).
            and not self.calibrator.own_models(request.model)
        ):
            pool = self.pool(request, candidates, chosen.speculative_ttl)
            choices = pruned.rank_top(request, pool, self, top_k) if pool is not None else []
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
        groups: list[MatchGroup] = []
        if keys:
            restrict = None if candidates is None else [states[i].key for i in np.flatnonzero(mask)]
            grouped = self.grouped_index
            if grouped is not None:
                matches, groups = grouped.match_groups(
                    request.model,
                    keys,
                    restrict,
                    self.config.group_min_instances,
                    hit_limit(request.prompt_tokens),
                )
            else:
                matches = self.index.match(request.model, keys, restrict, hit_limit(request.prompt_tokens))
        else:
            matches = {}
        if everyone:  # a set lookup per holder rather than a numpy scalar read
            out = table.unroutable_set()
            rows = [i for k in matches if (i := row.get(k)) is not None and i not in out]
        else:
            rows = [i for k in matches if (i := row.get(k)) is not None and mask[i]]
        if groups:
            group_of, marked = self._group_rows(request.model, table, groups, mask)
        else:
            group_of, marked = None, []
        if spec_ttl > 0 and keys:
            # An instance whose speculative keys continue its match extends it: a full candidate
            # (past 0 blocks for a non-holder, past its group's answer for a group's member).
            now = self.clock()
            n_keys = len(keys)
            for inst, held in self.speculative.by_instance():
                if inst in matches:
                    continue
                i = row.get(inst)
                if i is None or not mask[i]:
                    continue
                g = int(group_of[i]) if group_of is not None else 0
                depth = groups[g - 1].match.length if g else 0
                expiry = held.get(keys[depth]) if depth < n_keys else None
                if expiry is not None and expiry > now:
                    rows.append(i)
                    if g:
                        matches[inst] = groups[g - 1].match
            for inst in self.speculative.marked():  # hybrid models' committed prompts (answers all listed)
                if inst in matches or (i := row.get(inst)) is None or not mask[i] or i in rows:
                    continue
                if self.speculative.extend(inst, keys, 0):
                    rows.append(i)
        if group_of is not None and self.degraded:
            # A degraded instance is credited only part of its match: not its group's terms.
            for inst in self.degraded:
                i = row.get(inst)
                if i is None or not mask[i] or inst in matches:
                    continue
                g = int(group_of[i])
                if g:
                    rows.append(i)
                    matches[inst] = groups[g - 1].match
        explicit = self.candidates(request, [states[i] for i in rows], spec_ttl, matches=matches)
        pool = CandidatePool(
            self, request, table, mask, count, everyone, explicit, rows, spec_ttl, groups, group_of
        )
        if group_of is not None:
            # Per group, its candidates that are not explicit (explicit ones: pulled out above).
            counts = [0, *marked]
            for i in rows:
                g = group_of[i]
                if g:
                    counts[g] -= 1
            counts[0] = count - len(rows) - sum(counts)
            pool.group_counts = counts
        return pool

    def _group_rows(
        self, model: str, table: ModelTable, groups: list[MatchGroup], mask: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """Per table row, the match group (1-based) of its instance, 0 for none; and per group, how
        many of its rows are in ``mask``."""
        cached = self._slot_rows.get(model)
        known = -1 if cached is None or cached[1] is not table or cached[2] != table.version else cached[0]
        assert self.grouped_index is not None  # groups come from its match_groups only
        layout, owners = self.grouped_index.slot_layout(model, known)
        if layout != known or cached is None:
            get = table.row.get
            slot_rows = np.array([-1 if o is None else get(o, -1) for o in owners], dtype=np.int64)
            cached = self._slot_rows[model] = (layout, table, table.version, slot_rows)
        slot_rows = cached[3]
        group_of = np.zeros(table.n, dtype=np.int32)
        marked = []
        if _native_mark_group_rows is not None:
            candidate = mask.view(np.uint8)
            for g, group in enumerate(groups, 1):
                marked.append(_native_mark_group_rows(group.masks, slot_rows, candidate, group_of, g))
            return group_of, marked
        for g, group in enumerate(groups, 1):
            held = np.unpackbits(np.frombuffer(group.masks, dtype=np.uint8), bitorder="little")
            rows = slot_rows[: len(held)][held.view(bool)]
            rows = rows[rows >= 0]
            group_of[rows] = g
            marked.append(int(np.count_nonzero(mask[rows])))
        return group_of, marked

    def commit(self, request: RouteRequest, instance: InstanceKey, policy: str | None = None) -> bool:
        """Record that ``request`` was sent to ``instance`` (outside a Score with commit)."""
        state = self.registry.get(instance)
        if state is None or state.model != request.model:
            return False
        chosen = self.policy(policy)
        (cand,) = self.candidates(request, [state], chosen.speculative_ttl)
        self._commit(request, cand, chosen)
        return True

    def prefill_work_ms(self, model: str, instance: InstanceKey, miss: int, prompt: int) -> float:
        """The engine time a prefill of ``miss`` of ``prompt`` tokens takes on ``instance``, by the
        prefill model that ranks it: the ledger's work for a decision another replica made."""
        return self.calibrator.prefill_of(model, instance_id(instance)).ms(miss, prompt)

    def _commit(self, request: RouteRequest, cand: Candidate, policy: Policy) -> None:
        key = cand.state.key
        if request.request_id:
            # A disaggregated decode receives the prompt's KV from a prefill instance: it queues no
            # prefill work there (a decode instance prefilling itself is committed as a prefill).
            miss = 0 if request.role == DECODE_ROLE else cand.miss_tokens
            ahead = sum(1 for e in self.ledger.of(key) if not e.prefill_done) + cand.state.load.waiting
            work = cand.prefill_ms + cand.fetch_ms if miss else cand.fetch_ms
            entry = self.ledger.commit(
                request.request_id, key, request.model, request.prompt_tokens, miss, work
            )
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
                ahead,
            )
        if policy.speculative_ttl > 0 and request.keys:
            self.speculative.add(
                key,
                request.keys,
                policy.speculative_ttl,
                self.spec_boundary(request.model, request.prompt_tokens, request.block_size),
            )
            if request.request_id:
                entry.keys = request.keys
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
        found = self.released(request_id, phase)
        if self.observer is not None:  # told even when not found: another replica may hold it
            self.observer.released(request_id, phase)
        return found, status

    def released(self, request_id: str, phase: str) -> bool:
        """Release the ledger entry (here or from another replica) and settle its speculative keys."""
        entry = self.ledger.release(request_id, phase)
        if entry is None:
            return False
        if entry.keys is not None:
            self.speculative.settle(entry.instance, entry.keys, self.clock() + self.config.speculative_grace)
        return True

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
            held = self.index.match(p.model, p.keys, [p.instance], hit_limit(p.prompt_tokens))
            return held.get(p.instance, NO_MATCH)[0]

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

    ``explicit`` are full candidates: the routable instances that hold some of the prompt, except
    the members of large match groups. The others are ranked through per-row columns: those that
    hold nothing of it (group 0: ``Ranker.candidates`` with no match) and the members of each match
    group g >= 1 (``groups[g - 1]``: many instances with one answer of the index, such as a
    fleet-wide system prompt), whose terms differ from group 0's only by constants of the answer
    (``templates``: one candidate per group, of which only the match's terms are read). ``wait``,
    ``prefill``, ``fetch`` and the costs per table row are kvindex/scoring/costs.py's terms as
    columns: the same float64 operations in the same order, hence bit-identical to
    ``Ranker.candidates`` (tests/unit/test_cost_forms.py). ``materialize`` turns rows into full
    candidates through ``Ranker.candidates`` itself.
    """

    def __init__(
        self,
        router: Ranker,
        request: RouteRequest,
        table: ModelTable,
        mask: np.ndarray,
        count: int,
        everyone: bool,
        explicit: list[Candidate],
        explicit_rows: list[int],
        spec_ttl: float,
        groups: list[MatchGroup] | None = None,
        group_of: np.ndarray | None = None,
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
        # Match groups ranked by columns; group_of: per row, its group (0: none). None: no groups.
        self.groups = groups or []
        self.group_of = group_of if self.groups else None

    @cached_property
    def templates(self) -> list[Candidate]:
        """Per group (0: no match), a candidate with the group's answer, for its constant terms
        (blocks, tokens by tier, hit, miss, fetch); its instance's own terms are not meant."""
        # (an instance whose match is credited in full: a degraded one's is cut; when every one is
        # degraded, every group member is explicit and only the no-match template is read)
        degraded = self.router.degraded
        state = next((s for s in self.table.states if s.key not in degraded), self.table.states[0])
        matches = [NO_MATCH] + [g.match for g in self.groups]
        # (no speculative keys: the members whose keys extend their answer are explicit)
        return [
            self.router.candidates(self.request, [state], 0.0, matches={state.key: m})[0] for m in matches
        ]

    @cached_property
    def group_counts(self) -> list[int]:
        """Per group (0: no match), how many of the request's candidates are in it (not explicit;
        Ranker.pool sets it from the rows it marked)."""
        if self.group_of is None:
            return [self.count - len(self.explicit)]
        return np.bincount(self.group_of[self.rest_rows], minlength=len(self.groups) + 1).tolist()

    def group_rows(self, g: int) -> np.ndarray:
        """The rows of group g among the request's candidates that are not explicit, ascending."""
        rows = self.rest_rows
        if self.group_of is None:
            return rows if g == 0 else rows[:0]
        return rows[self.group_of[rows] == g]

    @cached_property
    def blocks(self) -> np.ndarray:
        """Blocks matched per row for the others (0, or their group's answer)."""
        if self.group_of is None:
            return np.zeros(self.table.n, dtype=np.int64)
        depth = np.array([t.blocks for t in self.templates], dtype=np.int64)
        return depth[self.group_of]

    # The cost terms of the others, per row (only the ttft policy reads them: made on first use).

    @cached_property
    def wait(self) -> np.ndarray:
        """Ranker.candidates' wait per row (the table's cache: do not modify)."""
        router = self.router
        model = router.calibrator.prefill(self.request.model)
        costs = router.config.costs
        shape = costs.engine
        return self.table.waits(
            router.clock(),
            model.b_ms_per_token,
            shape.step_ms,
            shape.chunk_tokens,
            shape.decode_ms_per_seq,
            drain_rate(model, costs.drain_reported_queue),
        )[: self.table.n]

    def _prefill_terms(self, miss: int) -> tuple[float, float]:
        """(a, b) with Ranker.candidates' prefill = a * running + b for a miss of ``miss`` tokens
        (costs.prefill_terms)."""
        model = self.router.calibrator.prefill(self.request.model)
        return prefill_terms(model, self.router.config.costs.engine, miss, self.request.prompt_tokens)

    @cached_property
    def prefill(self) -> np.ndarray:
        """Ranker.candidates' prefill per row: of the whole prompt, or of its group's miss."""
        table = self.table
        n = table.n
        prompt = self.request.prompt_tokens
        if prompt <= 0:
            return np.zeros(n)
        a, b = self._prefill_terms(prompt)
        prefill = a * table.running_now[:n]
        prefill += b
        if self.group_of is not None:
            running = table.running_now[:n]
            for g, t in enumerate(self.templates[1:], 1):
                rows = self.group_of == g
                a, b = self._prefill_terms(t.miss_tokens)
                part = a * running[rows]
                part += b
                prefill[rows] = part
        return prefill

    @cached_property
    def fetch(self) -> np.ndarray | None:
        """Ranker.candidates' fetch per row (its group's); None: 0 everywhere (no groups)."""
        if self.group_of is None:
            return None
        per_group = np.array([t.fetch_ms for t in self.templates])
        return per_group[self.group_of]

    @cached_property
    def est(self) -> np.ndarray:
        """Candidate.est_ttft_ms per row (costs.est_ttft_ms: wait + prefill + fetch)."""
        est = self.wait + self.prefill
        if self.fetch is not None:
            est += self.fetch
        return est

    def cost(self, k: float) -> np.ndarray:
        """The ttft policy's cost per row with congestion weight ``k`` (costs.weighted_cost)."""
        if not k:
            return self.est
        return self.est + k * (self.prefill + (0.0 if self.fetch is None else self.fetch))

    def rank_others(self, k: float, top_k: int) -> tuple[np.ndarray, float, int] | None:
        """The ttft policy's selection of the others in one native pass (``_kernels.rank_others``):
        the ``top_k`` rows first in (``cost(k)``, kv, load, key) order, of each group when there are
        match groups, the lowest prefill of any row and how many rows wait at most that long; None
        without the extension (or for a large ``top_k``, where its insertion into a sorted buffer
        would not pay): then the columns."""
        if _native_rank_others is None or not 0 < top_k <= 64:
            return None
        table = self.table
        prompt = self.request.prompt_tokens
        n = table.n
        if self.group_of is not None:
            if _native_rank_grouped is None:
                return None
            terms = [self._prefill_terms(prompt)] + [
                self._prefill_terms(t.miss_tokens) for t in self.templates[1:]
            ]
            n_groups = len(terms)
            out = np.empty(top_k * n_groups, dtype=np.int64)
            filled = np.empty(n_groups, dtype=np.int64)
            low, waiting = _native_rank_grouped(
                self.wait,
                table.running_now[:n],
                self.mask.view(np.uint8),
                np.sort(self.explicit_rows),
                self.group_of,
                np.array([a for a, _ in terms]),
                np.array([b for _, b in terms]),
                np.array([t.fetch_ms for t in self.templates]),
                k,
                self.kv,
                self.load,
                self.key_rank,
                out,
                filled,
            )
            chosen = np.concatenate([out[g * top_k : g * top_k + filled[g]] for g in range(n_groups)])
            return chosen, low, waiting
        out = np.empty(top_k, dtype=np.int64)
        a, b = self._prefill_terms(prompt)
        found, low, waiting = _native_rank_others(
            self.wait,
            table.running_now[:n],
            self.mask.view(np.uint8),
            np.sort(self.explicit_rows),
            prompt > 0,
            a,
            b,
            k,
            self.kv,
            self.load,
            self.key_rank,
            out,
        )
        return out[:found], low, waiting

    def materialize(self, rows: list[int] | np.ndarray) -> list[Candidate]:
        states = self.table.states
        group_of = self.group_of
        if group_of is None:
            matches: dict[InstanceKey, InstanceMatch] = {}
        else:
            groups = self.groups
            matches = {states[i].key: groups[g - 1].match for i in rows if (g := group_of[i])}
        return self.router.candidates(self.request, [states[i] for i in rows], self.spec_ttl, matches=matches)

    def top(
        self,
        columns: list[np.ndarray] | Callable[[Candidate], list[np.ndarray]],
        key: Callable[[Candidate], Any],
        top_k: int,
    ) -> list[Candidate]:
        """The first ``top_k`` candidates in ``key`` order: the explicit ones and the best ``top_k``
        others of each group, chosen on ``columns`` (per row, the others' values of ``key``'s
        leading terms, in order; the instance key, ``key``'s last term, is added here). A callable
        gives them for a group from its template candidate (``templates``); a list serves every
        group (right when the leading terms do not depend on the match within a group)."""
        if self.group_of is None:
            cols = columns(self.templates[0]) if callable(columns) else columns
            rows = smallest([*cols, self.key_rank], self.rest_rows, top_k)
        else:
            parts = []
            for g, template in enumerate(self.templates):
                cols = columns(template) if callable(columns) else columns
                parts.append(smallest([*cols, self.key_rank], self.group_rows(g), top_k))
            rows = np.concatenate(parts)
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
        """The ``top_k`` others first in (``cost``, kv, load, instance key) order, unordered (of
        each group, with match groups)."""
        table = self.table
        if self.group_of is not None:
            tie = table.tie_order()
            columns = [cost, self.kv, self.load, self.key_rank] if tie is None else [cost, tie]
            parts = [smallest(columns, self.group_rows(g), top_k) for g in range(len(self.groups) + 1)]
            return np.concatenate(parts)
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
