"""The routing decisions of one router, once made: commit, release, and what the engines' reports
say about them (docs/feedback.md).

A commit enters the in-flight ledger with what was predicted (``Prediction``), adds the prompt's
speculative keys and, for an instance without KV events, its predicted cache. A release (prefill
done, or finished) settles the speculative keys; the final one may carry the engine's report, which
outcomes compare with the prediction: the instance's state (exact / degraded / approximate) and the
calibration follow. The ranker records its decisions here (kvindex/scoring/ranker.py); the replica
sync applies the other replicas' through the same structures.
"""

from __future__ import annotations

from collections.abc import Callable

from kvindex.fleet.registry import InstanceState, Registry, instance_id
from kvindex.index.base import NO_MATCH, KvBlockIndex
from kvindex.index.hybrid import hit_limit
from kvindex.instance import InstanceKey
from kvindex.scoring.approximate import PredictedCache
from kvindex.scoring.base import DECODE_ROLE, Candidate, Policy, RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.ledger import FINISHED, PREFILL, Ledger, SpeculativeKeys
from kvindex.scoring.outcomes import (
    ALREADY_RELEASED,
    DEGRADED,
    DUPLICATE,
    NO_PREDICTION,
    UNKNOWN_REQUEST,
    Outcome,
    OutcomeTracker,
    Prediction,
    Report,
)


def calibrating(calibrator: Calibrator) -> Callable[[Outcome], None]:
    """An outcomes subscriber: a request's report (measured TTFT minus the predicted wait, with the
    engine's cached tokens) is a prefill sample of the instance it ran on, unless prefills were
    queued ahead of it there."""

    def calibrate(outcome: Outcome) -> None:
        p, r = outcome.prediction, outcome.report
        if r.ttft_ms is not None and r.cached_tokens is not None:
            if p.prefills_ahead > 0:
                calibrator.queued += 1
                return
            calibrator.add_reported(
                p.model, instance_id(p.instance), p.prompt_tokens, r.cached_tokens, r.ttft_ms, p.wait_ms
            )

    return calibrate


class Decisions:
    """Commits, releases and their outcomes, for one router (its ledger, speculative keys,
    predicted caches and outcome tracker); ``degraded``: the instances whose match the index is
    known to get wrong (their cache credit is discounted when candidates are built)."""

    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        ledger: Ledger,
        speculative: SpeculativeKeys,
        predicted: PredictedCache,
        outcomes: OutcomeTracker,
        clock: Callable[[], float],
        speculative_grace: float,
    ) -> None:
        self.index = index
        self.registry = registry
        self.ledger = ledger
        self.speculative = speculative
        self.predicted = predicted
        self.outcomes = outcomes
        self.clock = clock
        # Seconds a committed prompt's speculative keys outlive its release (RankerConfig).
        self.speculative_grace = speculative_grace
        self.degraded: set[InstanceKey] = set()

    # -- commit ---------------------------------------------------------------------------------

    def commit(self, request: RouteRequest, cand: Candidate, policy: Policy) -> None:
        """``request`` goes to ``cand``'s instance, ranked by ``policy``: its ledger entry (with the
        prediction, when it has a request id), speculative keys and predicted cache."""
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
            self.expect(key, request, policy.speculative_ttl, cand.reach)
            if request.request_id:
                entry.keys = request.keys
        if cand.state.approximate and request.keys:
            self.predicted.on_commit(cand.state, request.keys)

    def expect(self, instance: InstanceKey, request: RouteRequest, ttl: float, junction: int = 0) -> None:
        """A committed prompt's keys are expected on ``instance`` for ``ttl`` (speculative keys; a
        commit here or, through the replica sync, another replica's). ``junction``: a hybrid model's
        full-attention prefix held there beyond the hit (``Candidate.reach``), kept from now on."""
        boundary = self.spec_boundary(request.model, request.prompt_tokens, request.block_size)
        self.speculative.add(instance, request.keys, ttl, boundary, junction)

    def spec_boundary(self, model: str, prompt_tokens: int, block_size: int) -> int | None:
        """For SpeculativeKeys.add: a hybrid-attention model's committed prompt will serve later
        prompts up to the block before its last token only (its sliding-window and Mamba groups keep
        state there, kvindex/index/hybrid.py); None for other models (every block)."""
        layout = self.index.layout_of(model)
        if layout is None or not layout.hybrid:
            return None
        return hit_limit(prompt_tokens) // block_size

    # -- release --------------------------------------------------------------------------------

    def release(self, request_id: str, phase: str, report: Report | None) -> tuple[bool, str]:
        """Release, and compare a well-formed ``report`` (Report.malformed() is None) with what was
        predicted: (found, what became of the report: "" without one, see outcomes.py)."""
        if phase not in (PREFILL, FINISHED):
            raise ValueError(f"phase must be {PREFILL!r} or {FINISHED!r}, got {phase!r}")
        status = ""
        if report is not None and not report.empty():
            status = self._report(request_id, report)
        return self.end(request_id, phase), status

    def end(self, request_id: str, phase: str) -> bool:
        """End the ledger entry's ``phase`` (here or from another replica) and settle its
        speculative keys; whether there was an entry."""
        entry = self.ledger.release(request_id, phase)
        if entry is None:
            return False
        if entry.keys is not None:
            self.speculative.settle(entry.instance, entry.keys, self.clock() + self.speculative_grace)
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
        if not was and state.key in self.degraded and state.repair.failed:
            # Holes accepted or a repair timed out: ask for a snapshot (rate-limited).
            self.outcomes.request_reconcile(state.key)

    def forget(self, instance: InstanceKey) -> None:
        self.speculative.forget(instance)
        self.predicted.forget(instance)
        self.outcomes.forget(instance)
        self.degraded.discard(instance)
