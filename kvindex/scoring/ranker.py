"""The router core: turns a prompt into ranked instances with TTFT estimates, and records the
decisions routers commit to and release.

``Ranker.score`` builds the request's candidates (kvindex/scoring/candidates.py; a pruned pool for
large fleets, kvindex/scoring/pool.py), lets the policy rank them (with a ``PolicyContext``: clock,
generator, index and ledger views, the cost model), draws the pick (kvindex/scoring/pick.py) and
records the decision (kvindex/scoring/decisions.py). ``build_ranker`` assembles one from its parts.

Used by the gRPC API and, in-process with a virtual clock, by the routing simulation: both run the
same code.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvindex.fleet.registry import InstanceState, Registry, instance_id
from kvindex.index.base import KvBlockIndex
from kvindex.instance import InstanceKey
from kvindex.scoring.approximate import PredictedCache
from kvindex.scoring.base import (
    DECODE_ROLE,
    Candidate,
    Choice,
    Policy,
    PolicyContext,
    PrunedPolicy,
    RouteRequest,
)
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.candidates import CandidateBuilder
from kvindex.scoring.costs import CostConfig, CostModel
from kvindex.scoring.decisions import Decisions, calibrating
from kvindex.scoring.fleet_table import FleetTables
from kvindex.scoring.ledger import Ledger, SpeculativeKeys
from kvindex.scoring.outcomes import OutcomeConfig, OutcomeTracker, Report
from kvindex.scoring.pick import Picker, PickOptions, PickResult
from kvindex.scoring.policies import make_policies
from kvindex.scoring.pool import PoolBuilder


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
    """Ranks instances for requests (``score``) and records the decisions (``commit``,
    ``release_reported``) of one router. Made by ``build_ranker`` from its parts: the candidates
    and pools it ranks, the policies, the pick, and the decisions (ledger, speculative keys,
    predicted caches, outcomes) it records and reads back."""

    def __init__(
        self,
        registry: Registry,
        config: RankerConfig,
        clock: Callable[[], float],
        costs: CostModel,
        calibrator: Calibrator,
        candidates: CandidateBuilder,
        pools: PoolBuilder,
        decisions: Decisions,
        policies: dict[str, Policy],
        picker: Picker,
        context: PolicyContext,
        observer: Callable[[Ranker], RoutingObserver] | None = None,
    ) -> None:
        """``observer`` makes the router's observer (told every decision committed and released
        here), called with this router once it is built; None: a lone replica."""
        self.index = pools.index
        self.registry = registry
        self.config = config
        self.clock = clock
        self.costs = costs
        self.calibrator = calibrator
        self.pools = pools
        self.decisions = decisions
        self.context = context
        self.rng = context.rng
        self.picker = picker
        self.policies = policies
        # Capabilities, decided once here (an isinstance with a protocol would cost microseconds
        # per Score): the policies that rank a pruned pool.
        self.pruned: dict[str, PrunedPolicy] = {
            name: p for name, p in self.policies.items() if isinstance(p, PrunedPolicy)
        }
        if self.config.default_policy not in self.policies:
            raise ValueError(f"unknown default policy {self.config.default_policy!r}")
        # What the ranking reads of the decisions (and tests and the replica sync inspect).
        self.ledger = decisions.ledger
        self.speculative = decisions.speculative
        self.predicted = decisions.predicted
        self.outcomes = decisions.outcomes
        self.degraded = decisions.degraded
        self.candidates = candidates.candidates  # one request's candidates (CandidateBuilder)
        self.pool = pools.pool  # one request's pruned pool (PoolBuilder)
        self.observer: RoutingObserver | None = observer(self) if observer is not None else None

    @property
    def tables(self) -> FleetTables:
        """Per-model columns of instance state (made on first use: they watch the registry)."""
        return self.pools.tables

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
            and not self.costs.own_models(request.model)
        ):
            pool = self.pool(request, candidates, chosen.speculative_ttl)
            choices = pruned.rank_top(request, pool, self.context, top_k) if pool is not None else []
        else:
            states = self.registry.routable(request.model, candidates)
            cands = self.candidates(request, states, chosen.speculative_ttl, every=candidates is None)
            choices = chosen.rank(request, cands, self.context) if cands else []
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

    def explain(
        self,
        request: RouteRequest,
        candidates: list[str] | None = None,
        policy: str | None = None,
        top_k: int = 0,
        pick: PickOptions | None = None,
    ) -> ScoreResult:
        """``score`` without commit that leaves the router as it was (the Explain RPC): what a
        ranking changes is put back, the policy's scalar state (ttft's congestion weight, folded in
        at every ranking) and the generators (randomised policies, draws without a request id).
        A policy's containers hold what commits change (heat, rotations, trees) or caches."""
        chosen = self.policies["decode"] if request.role == DECODE_ROLE else self.policy(policy)
        scalars = {
            name: value
            for name, value in vars(chosen).items()
            if value is None or isinstance(value, (bool, int, float, str))
        }
        rng, drawn = self.rng.getstate(), self.picker.getstate()
        try:
            return self.score(request, candidates, policy, commit=False, top_k=top_k, pick=pick)
        finally:
            vars(chosen).update(scalars)
            self.rng.setstate(rng)
            self.picker.setstate(drawn)

    # -- decisions ------------------------------------------------------------------------------

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
        self.decisions.commit(request, cand, policy)
        policy.on_commit(request, cand, self.context)
        if self.observer is not None:
            self.observer.committed(request, cand, policy)

    def prefill_work_ms(self, model: str, instance: InstanceKey, miss: int, prompt: int) -> float:
        """The engine time a prefill of ``miss`` of ``prompt`` tokens takes on ``instance``, by the
        prefill model that ranks it: the ledger's work for a decision another replica made."""
        return self.costs.work_ms(model, instance_id(instance), miss, prompt)

    def release(self, request_id: str, phase: str, report: Report | None = None) -> bool:
        return self.release_reported(request_id, phase, report)[0]

    def release_reported(self, request_id: str, phase: str, report: Report | None) -> tuple[bool, str]:
        """Release, and compare a well-formed ``report`` (Report.malformed() is None) with what was
        predicted: (found, what became of the report: "" without one, see outcomes.py)."""
        found, status = self.decisions.release(request_id, phase, report)
        if self.observer is not None:  # told even when not found: another replica may hold it
            self.observer.released(request_id, phase)
        return found, status

    def state_of(self, state: InstanceState) -> tuple[str, str]:
        """(exact | degraded | approximate, why): see kvindex/scoring/outcomes.py."""
        return self.decisions.state_of(state)

    def sync_changed(self, state: InstanceState, reconciled: bool = False) -> None:
        self.decisions.sync_changed(state, reconciled)

    def forget(self, instance: InstanceKey) -> None:
        self.decisions.forget(instance)


def build_ranker(
    index: KvBlockIndex,
    registry: Registry,
    calibrator: Calibrator,
    config: RankerConfig | None = None,
    clock: Callable[[], float] | None = None,
    policy_options: dict[str, dict[str, Any]] | None = None,
    on_degraded: Callable[[InstanceKey], None] | None = None,
    observer: Callable[[Ranker], RoutingObserver] | None = None,
) -> Ranker:
    """A router over ``index`` and ``registry``, priced with ``calibrator``'s prefill models: its
    parts made and connected here (kvindex/core.py's ``build_core`` makes the service's).
    ``clock``: the registry's by default; ``on_degraded``: told when outcomes find an instance
    degraded; ``observer``: see ``Ranker``."""
    config = config or RankerConfig()
    clock = clock or registry.clock
    costs = CostModel(config.costs, calibrator)
    ledger = Ledger(clock, ttl=config.ledger_ttl, released_memory=config.outcomes.released_memory)
    speculative = SpeculativeKeys(clock)
    predicted = PredictedCache(index, clock, config.predicted_ttl, config.predicted_capacity)
    outcomes = OutcomeTracker(
        clock, config.outcomes, on_degraded=on_degraded, subscribers=[calibrating(calibrator)]
    )
    decisions = Decisions(
        index, registry, ledger, speculative, predicted, outcomes, clock, config.speculative_grace
    )
    candidates = CandidateBuilder(
        index, ledger, speculative, costs, clock, decisions.degraded, config.outcomes.degraded_credit
    )
    pools = PoolBuilder(registry, candidates, config.group_min_instances, clock)
    # Randomised policies (power_of_two, flexlb) draw from the router's seeded generator.
    context = PolicyContext(clock, random.Random(config.seed), index, ledger, costs)
    picker = Picker(registry, config.seed, config.pick, config.temperature, config.warmup)
    policies = make_policies(policy_options or {})
    return Ranker(
        registry,
        config,
        clock,
        costs,
        calibrator,
        candidates,
        pools,
        decisions,
        policies,
        picker,
        context,
        observer,
    )
