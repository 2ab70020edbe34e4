"""Predicted against actual: what the index promised for a committed request, what the engine did,
and per instance whether the index's view of it can be trusted.

At commit the router keeps a :class:`Prediction` with the ledger entry (matched tokens per tier,
the estimate's parts, the policy). The caller reports the engine's answer with the release
(:class:`Report`: ``usage.prompt_tokens_details.cached_tokens``, the TTFT it measured); the
:class:`OutcomeTracker` compares the two, counts them for the metrics, tells subscribers
(``subscribe``: the calibration takes TTFT samples from here) and keeps per instance the recent
evidence that decides its :data:`EXACT` / :data:`DEGRADED` / :data:`APPROXIMATE` state.

Rules (docs/feedback.md):

- predicted cached tokens = ``B · min(blocks, ⌊(L - 1) / B⌋)``: vLLM recomputes the last prompt token,
  so a prompt that is all cached hits one block less (docs/e2e-vllm.md);
- ``error = actual - predicted``; ``exact`` when ``|error| < B``, ``over`` when the index promised
  at least a block more than the engine had (a stale index), ``under`` when the engine had at least
  a block more (events late or lost);
- a disagreement the index can explain is counted in the metrics but is no evidence against the
  instance (``Outcome.excuse``): an ``over`` that only the speculative blocks explain (the events'
  part was right: a sibling's prefill had not cached the prefix yet), an ``over`` when the index
  applied evictions of the instance since the decision (the engine may have evicted the blocks
  while the request waited), an ``under`` when the index holds the engine's hit by the time of the
  report (its events were late, not lost), and any outcome of a request committed before the
  instance's last repair;
- an instance is degraded by outcomes when at least ``threshold`` of its last ``window`` counted
  outcomes disagree; outcomes of requests committed before its last repair do not count.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvindex.fleet.registry import InstanceState
from kvindex.instance import InstanceKey

EXACT = "exact"
OVER = "over"
UNDER = "under"
OUTCOMES = (EXACT, OVER, UNDER)

# Instance states.
DEGRADED = "degraded"
APPROXIMATE = "approximate"
STATES = (EXACT, DEGRADED, APPROXIMATE)

# Why a report was not compared (ReleaseResponse.report; kvindex_prediction_reports_ignored_total).
APPLIED = "applied"
UNKNOWN_REQUEST = "unknown_request"
ALREADY_RELEASED = "already_released"
DUPLICATE = "duplicate"
NO_PREDICTION = "no_prediction"
PROMPT_MISMATCH = "prompt_mismatch"
ABSURD = "absurd"
INVALID = "invalid"  # a malformed call (negative or non-finite TTFT): INVALID_ARGUMENT too

# Repairs that are checks of an instance believed in sync, not the repair of a known loss.
ROUTINE_CHECKS = frozenset({"periodic"})

MAX_TTFT_MS = 86_400_000.0  # a day: anything longer is not a measurement


@dataclass(slots=True)
class Prediction:
    """What the index predicted for a request on the instance it was committed to."""

    instance: InstanceKey
    model: str
    policy: str
    block_size: int
    prompt_tokens: int
    blocks: int  # leading prompt blocks the index credited (speculative ones included)
    event_blocks: int  # of which the KV events vouch for (the rest: speculative)
    tokens_by_tier: tuple[int, int, int, int]  # matched tokens by fastest tier
    wait_ms: float
    prefill_ms: float
    fetch_ms: float
    est_ttft_ms: float
    committed_at: float
    keys: list[int] = field(default_factory=list)  # the prompt's block keys (to look again at report)
    removals: int = 0  # the instance's InstanceState.removals at the decision
    # Requests ahead of it on the instance at the decision whose prefill was not done (the ledger's,
    # and the waiting ones its last heartbeat reported): its TTFT then includes batching with
    # them, so its report is no prefill sample (Ranker._calibrate).
    prefills_ahead: int = 0

    @property
    def cached_tokens(self) -> int:
        """The prompt-cache hit the engine should report (vLLM's last-token rule applied)."""
        return _usable(self.blocks, self.prompt_tokens, self.block_size)

    @property
    def event_cached_tokens(self) -> int:
        return _usable(self.event_blocks, self.prompt_tokens, self.block_size)


def _usable(blocks: int, prompt_tokens: int, block_size: int) -> int:
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return block_size * min(blocks, (prompt_tokens - 1) // block_size)


@dataclass(slots=True)
class Report:
    """What the caller saw: any of the figures may be missing (None)."""

    cached_tokens: int | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None

    def malformed(self) -> str | None:
        """Why the report is not a well-formed call (INVALID_ARGUMENT), or None."""
        t = self.ttft_ms
        if t is not None and (not math.isfinite(t) or t < 0):
            return f"ttft_ms must be a finite number >= 0, got {t!r}"
        if self.cached_tokens is not None and self.cached_tokens < 0:
            return f"cached_tokens must be >= 0, got {self.cached_tokens}"
        return None

    def empty(self) -> bool:
        return self.cached_tokens is None and self.ttft_ms is None


@dataclass(slots=True)
class Outcome:
    """One compared request: the prediction, the report and the verdict (what subscribers get)."""

    prediction: Prediction
    report: Report
    outcome: str | None  # exact / over / under; None without cached tokens in the report
    error_tokens: int | None  # actual - predicted cached tokens
    ttft_ratio: float | None  # measured / estimated TTFT
    evidence: bool  # counts towards the instance's state
    excuse: str = ""  # why a disagreement is no evidence: speculative, evicted, late, before_repair

    @property
    def instance(self) -> InstanceKey:
        return self.prediction.instance

    def prefill_sample(self) -> tuple[int, int, float] | None:
        """(prompt tokens, cached tokens, prefill ms) for calibration: the measured TTFT minus the
        wait the index predicted, with the tokens the engine found cached (None without both)."""
        r = self.report
        if r.ttft_ms is None or r.cached_tokens is None:
            return None
        p = self.prediction
        return p.prompt_tokens, r.cached_tokens, max(0.0, r.ttft_ms - p.wait_ms)


@dataclass
class OutcomeConfig:
    window: int = 8  # an instance's last counted outcomes kept as evidence
    threshold: int = 2  # ... of which this many disagreeing make it degraded
    # Seconds between two snapshot reconciliations an instance's degradation asks for.
    reconcile_interval: float = 5.0
    # Fraction of a degraded instance's matched tokens the TTFT estimate credits (docs/scoring.md).
    degraded_credit: float = 0.5
    released_memory: int = 65_536  # finished request ids remembered (to tell already_released)


# Buckets of kvindex_prediction_cached_tokens_error, in blocks (multiplied by the block size).
ERROR_BLOCKS = (-64, -16, -8, -4, -2, -1, 0, 1, 2, 4, 8, 16, 64)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0, 8.0)


@dataclass(slots=True)
class InstanceOutcomes:
    """Per instance: counts for the metrics, and the recent evidence."""

    block_size: int
    error_counts: list[int]  # per ERROR_BLOCKS edge, + the overflow bucket
    error_sum: int = 0
    ratio_counts: list[int] = field(default_factory=lambda: [0] * (len(RATIO_BUCKETS) + 1))
    ratio_sum: float = 0.0
    ratio_n: int = 0
    by_outcome: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    recent: deque[bool] = field(default_factory=deque)  # True: disagreed
    repaired_at: float = float("-inf")  # evidence from predictions before this does not count
    last_reconcile: float = float("-inf")

    @property
    def disagreeing(self) -> int:
        return sum(self.recent)


def _bucket(edges: tuple[float, ...], value: float) -> int:
    for i, edge in enumerate(edges):
        if value <= edge:
            return i
    return len(edges)


class OutcomeTracker:
    """Compares reports with predictions; holds the per-instance evidence and the counters."""

    def __init__(
        self,
        clock: Callable[[], float],
        config: OutcomeConfig | None = None,
        on_degraded: Callable[[InstanceKey], None] | None = None,
        subscribers: Sequence[Callable[[Outcome], None]] = (),
    ) -> None:
        """``subscribers`` are told every compared report (``subscribe`` adds more)."""
        self.clock = clock
        self.config = config or OutcomeConfig()
        self.instances: dict[InstanceKey, InstanceOutcomes] = {}
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.ignored: dict[str, int] = {}  # reports not compared, by reason
        self._subscribers: tuple[Callable[[Outcome], None], ...] = tuple(subscribers)
        # Told when an instance's evidence turns it degraded (the service asks for a snapshot).
        self.on_degraded = on_degraded
        self.reconciles = 0  # snapshots asked for degraded instances

    def subscribe(self, fn: Callable[[Outcome], None]) -> None:
        """Call ``fn(outcome)`` for every compared report (in the index's event loop: keep it short)."""
        self._subscribers = (*self._subscribers, fn)

    def ignore(self, reason: str) -> str:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1
        return reason

    def of(self, instance: InstanceKey, block_size: int) -> InstanceOutcomes:
        inst = self.instances.get(instance)
        if inst is None:
            inst = self.instances[instance] = InstanceOutcomes(block_size, [0] * (len(ERROR_BLOCKS) + 1))
        elif inst.block_size != block_size:
            if inst.block_size:  # the instance now serves another block size: buckets start over
                inst.error_counts = [0] * (len(ERROR_BLOCKS) + 1)
                inst.error_sum = 0
            inst.block_size = block_size
        return inst

    def compare(
        self,
        prediction: Prediction,
        report: Report,
        removals: int | None = None,
        held_now: Callable[[], int] | None = None,
    ) -> tuple[str, Outcome | None]:
        """Compare one well-formed report with its prediction: (report status, the outcome).

        ``removals``: the instance's removal count now (evictions applied since the decision excuse
        an ``over``); ``held_now()``: the prompt blocks the index's events say the instance holds
        now (an ``under`` whose hit the index holds by now was late, not lost)."""
        p = prediction
        if report.prompt_tokens is not None and report.prompt_tokens != p.prompt_tokens:
            return self.ignore(PROMPT_MISMATCH), None
        actual = report.cached_tokens
        if actual is not None and actual > p.prompt_tokens:
            return self.ignore(ABSURD), None
        if report.ttft_ms is not None and report.ttft_ms > MAX_TTFT_MS:
            return self.ignore(ABSURD), None
        inst = self.of(p.instance, p.block_size)
        b = max(p.block_size, 1)
        verdict = error = None
        evidence = False
        excuse = ""
        if actual is not None:
            error = actual - p.cached_tokens
            verdict = EXACT if abs(error) < b else (OVER if error < 0 else UNDER)
            self.outcomes[verdict] += 1
            inst.by_outcome[verdict] += 1
            inst.error_counts[_bucket(tuple(e * b for e in ERROR_BLOCKS), error)] += 1
            inst.error_sum += error
            if verdict == OVER and actual > p.event_cached_tokens - b:
                excuse = "speculative"  # only the speculative blocks were missing
            elif verdict == OVER and removals is not None and removals != p.removals:
                excuse = "evicted"  # the index learnt of evictions there since the decision
            elif (
                verdict == UNDER
                and held_now is not None
                and _usable(held_now(), p.prompt_tokens, p.block_size) > actual - b
            ):
                excuse = "late"  # the events came after the decision, but they came
            if verdict != EXACT and not excuse and p.committed_at < inst.repaired_at:
                excuse = "before_repair"
            evidence = not excuse and p.committed_at >= inst.repaired_at
            if evidence:
                inst.recent.append(verdict != EXACT)
                while len(inst.recent) > self.config.window:
                    inst.recent.popleft()
                if verdict != EXACT and inst.disagreeing >= self.config.threshold:
                    self._degraded(p.instance, inst)  # again while still wrong (rate-limited)
        ratio = None
        if report.ttft_ms is not None and p.est_ttft_ms > 0:
            ratio = report.ttft_ms / p.est_ttft_ms
            inst.ratio_counts[_bucket(RATIO_BUCKETS, ratio)] += 1
            inst.ratio_sum += ratio
            inst.ratio_n += 1
        outcome = Outcome(p, report, verdict, error, ratio, evidence, excuse)
        for fn in self._subscribers:
            fn(outcome)
        return APPLIED, outcome

    def _degraded(self, instance: InstanceKey, inst: InstanceOutcomes) -> None:
        self.request_reconcile(instance)

    def state(self, state: InstanceState) -> tuple[str, str]:
        """(state, why) of an instance: approximate without events; degraded by its recent
        outcomes, a repair under way for anything but a routine check, or a repair that failed."""
        if state.approximate:
            return APPROXIMATE, ""
        if state.groups_inexact:  # a hybrid model's answers not by the engine's rule (ingest/layouts.py)
            return APPROXIMATE, state.groups_inexact
        if state.repair.failed:
            return DEGRADED, "repair failed"
        if state.repair.sync != "synced" and state.repair.cause not in ROUTINE_CHECKS:
            return DEGRADED, f"{state.repair.sync} ({state.repair.cause})"
        inst = self.instances.get(state.key)
        if inst is not None and inst.disagreeing >= self.config.threshold:
            return DEGRADED, f"outcomes {inst.disagreeing}/{len(inst.recent)}"
        return EXACT, ""

    def degraded_by_outcomes(self, instance: InstanceKey) -> bool:
        inst = self.instances.get(instance)
        return inst is not None and inst.disagreeing >= self.config.threshold

    def repaired(self, instance: InstanceKey) -> None:
        """The instance's blocks were just reconciled: earlier evidence no longer applies."""
        inst = self.instances.get(instance)
        if inst is not None:
            inst.recent.clear()
            inst.repaired_at = self.clock()

    def request_reconcile(self, instance: InstanceKey) -> bool:
        """Ask ``on_degraded`` for a snapshot of ``instance``, at most once per
        ``reconcile_interval``; True when asked."""
        inst = self.instances.get(instance)
        if inst is None:
            inst = self.instances[instance] = InstanceOutcomes(0, [0] * (len(ERROR_BLOCKS) + 1))
        now = self.clock()
        if self.on_degraded is None or now - inst.last_reconcile < self.config.reconcile_interval:
            return False
        inst.last_reconcile = now
        self.reconciles += 1
        self.on_degraded(instance)
        return True

    def forget(self, instance: InstanceKey) -> None:
        self.instances.pop(instance, None)
