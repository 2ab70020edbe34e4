"""The asyncio admission gate of the routing proxy and the ext_proc picker: each request is scored,
judged by the rule (kvindex/scoring/admission.py) and served, held in the router until an instance can
meet its objective, or shed; with its Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvindex.scoring.admission import (
    ADMIT,
    BEHIND,
    BEST_EFFORT,
    DEADLINE,
    QUEUE_FULL,
    SHED,
    SHEDDABLE,
    TIMEOUT,
    UNATTAINABLE,
    AdmissionConfig,
    AdmissionQueue,
    Correction,
    Estimate,
    QueueEntry,
    deadline_of,
    judge,
)
from kvindex.scoring.objectives import Objective

# -- metrics ---------------------------------------------------------------------------------------

# Queue waits: from a few ms (a turn after the next release) to the longest objective.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class AdmissionMetrics:
    """``{prefix}_admission_*`` and ``{prefix}_slo_requests_total`` in ``registry``."""

    def __init__(self, prefix: str, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw = {"registry": registry} if registry is not None else {}
        self.queued = Counter(
            f"{prefix}_admission_queued", "requests held in the router's queue, by model, priority and "
            "why (over_objective, saturated, behind)", ["model", "priority", "reason"], **kw,
        )  # fmt: skip
        self.shed = Counter(
            f"{prefix}_admission_shed", "requests shed (429), by model, priority and reason "
            "(unattainable, deadline, queue_full, timeout, sheddable)", ["model", "priority", "reason"], **kw,
        )  # fmt: skip
        self.queue_wait = Histogram(
            f"{prefix}_admission_queue_wait_seconds", "time held in the queue, by outcome (admitted, shed)",
            ["outcome"], buckets=WAIT_BUCKETS, **kw,
        )  # fmt: skip
        self.depth = Gauge(f"{prefix}_admission_queue_depth", "requests held in the queue now", **kw)
        self.best_effort = Counter(
            f"{prefix}_admission_best_effort", "requests no instance could serve within their objective, "
            "served on an idle instance instead of shed", ["model", "priority"], **kw,
        )  # fmt: skip
        self.slo = Counter(
            f"{prefix}_slo_requests",
            "requests with a TTFT objective by model, priority and result: met (goodput), missed "
            "(served late), shed; queue time counts in the TTFT", ["model", "priority", "result"], **kw,
        )  # fmt: skip

    def observe_ttft(self, model: str, objective: Objective, ttft_s: float) -> None:
        if objective.ttft_ms is not None:
            met = ttft_s * 1000.0 <= objective.ttft_ms
            self.slo.labels(model, objective.label, "met" if met else "missed").inc()


# -- the asynchronous gate (proxy, picker) --------------------------------------------------------

T = TypeVar("T")


@dataclass
class Admitted(Generic[T]):
    """Serve ``trial`` on its ranked instance ``pick``. ``committed``: the trial was made with
    commit (the first look); a request admitted from the queue was re-scored without one, so the
    caller commits it where it sends it. ``est_ms``: the (uncorrected) estimate of the pick, for
    :meth:`AdmissionGate.observe` (0: none)."""

    trial: T
    pick: int
    waited_s: float
    committed: bool = True
    est_ms: float = 0.0
    # Why: the rule's reason to admit ("" within the objective, best_effort), and why it was held
    # first ("" if it was not: over_objective, saturated, behind) — the proxy's debug explanation.
    reason: str = ""
    held: str = ""


@dataclass
class Shed:
    reason: str
    retry_after_s: int
    message: str
    waited_s: float = 0.0  # held this long first


Attempt = Callable[[bool], Awaitable[T]]  # score, with commit or not


class AdmissionGate(Generic[T]):
    """Admission for concurrent requests of an asyncio server.

    :meth:`admit` runs ``attempt(True)`` (a Score with commit), judges its estimates, and either
    returns the trial to serve, or undoes it (releases the commit) and holds the request until its
    turn comes — a release anywhere (:meth:`wake`) or every ``tick_s`` — when it is scored again
    without commit (a held request never counts against an instance), or until it must be shed.
    ``metrics`` may be None."""

    def __init__(
        self,
        config: AdmissionConfig,
        metrics: AdmissionMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.queue = AdmissionQueue(config.max_queue)
        self.correction = Correction()
        self._wake = asyncio.Event()
        self._turns: dict[int, asyncio.Event] = {}
        self._trying: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (the turn-giving task runs only while something is queued)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def awaiting(self, model: str, key: Any, est_ms: float, since_s: float, instance: str = "") -> None:
        """A stream was sent to ``instance`` (the decision estimated ``est_ms`` at clock
        ``since_s``): its first token is awaited (:class:`Correction` counts it once it is late)."""
        self.correction.start(model, key, est_ms, since_s, instance)

    def observe(self, model: str, key: Any, est_ms: float, measured_s: float | None) -> None:
        """The stream's first token came ``measured_s`` after the decision (None: it ended without
        one, or it does not count)."""
        self.correction.finish(model, key)
        if measured_s is not None:
            self.correction.observe(model, est_ms, measured_s * 1000.0)

    def wake(self) -> None:
        """Something was released: queued requests may fit now."""
        if self.queue:
            self._wake.set()

    # -- one request

    def _shed(self, model: str, objective: Objective, reason: str, retry: int, waited: float | None) -> Shed:
        if self.metrics is not None:
            self.metrics.shed.labels(model, objective.label, reason).inc()
            if objective.ttft_ms is not None:
                self.metrics.slo.labels(model, objective.label, "shed").inc()
            if waited is not None:
                self.metrics.queue_wait.labels("shed").observe(waited)
        what = {
            UNATTAINABLE: "no instance can meet the TTFT objective",
            DEADLINE: "no instance could meet the TTFT objective while it was queued",
            QUEUE_FULL: "the router's queue is full",
            TIMEOUT: "queued too long",
            SHEDDABLE: "the fleet is past its objectives and the request is sheddable (negative priority)",
        }[reason]
        return Shed(reason, max(1, retry), f"overloaded: {what} ({reason})", waited or 0.0)

    async def admit(
        self,
        model: str,
        objective: Objective,
        arrived: float,
        attempt: Attempt[T],
        estimates: Callable[[T], Sequence[Estimate]],
        undo: Callable[[T], Awaitable[None]],
    ) -> Admitted[T] | Shed:
        cfg = self.config
        trial = await attempt(True)
        raw = estimates(trial)
        # Nothing to hold for: no objective, no threshold, nobody queued (the common case, unchanged).
        if objective.ttft_ms is None and cfg.queue_threshold_ms <= 0 and not self.queue:
            return Admitted(trial, 0, 0.0, est_ms=raw[0].est_ttft_ms if raw else 0.0)
        now = self.clock()
        ests = self.correction.apply(model, raw, now)
        verdict = judge(objective, (now - arrived) * 1000.0, ests, cfg)
        est_ms = raw[verdict.pick].est_ttft_ms if raw else 0.0
        entry = QueueEntry(
            objective,
            model,
            arrived,
            deadline_of(objective, arrived, cfg),
            self.queue.next_seq(),
            service_ms=min((e.service_ms for e in ests), default=0.0),
            can_meet=verdict.can_meet,
        )
        if verdict.action == ADMIT:
            if objective.priority < 0 or not self.queue.ahead_of(entry.key):
                if verdict.reason == BEST_EFFORT and self.metrics is not None:
                    self.metrics.best_effort.labels(model, objective.label).inc()
                return Admitted(trial, verdict.pick, 0.0, est_ms=est_ms, reason=verdict.reason)
            reason = BEHIND
        elif verdict.action == SHED:
            await undo(trial)
            return self._shed(model, objective, verdict.reason, verdict.retry_after_s, None)
        else:
            reason = verdict.reason
        displaced = self.queue.push(entry)
        if displaced is entry:  # full, and this one ranks last
            if verdict.can_meet:  # never shed while an instance could meet
                return Admitted(trial, verdict.pick, 0.0, est_ms=est_ms, reason=verdict.reason)
            await undo(trial)
            return self._shed(model, objective, QUEUE_FULL, verdict.retry_after_s or 1, None)
        if displaced is not None:
            displaced.evicted = True
            self._turn(displaced)
        # Its turn exists before the first await: an arrival that displaces it from the queue while
        # it undoes its trial must find the turn to wake it (else it waits forever, out of the queue).
        turn = self._turns[entry.seq] = asyncio.Event()
        try:
            await undo(trial)
            if self.metrics is not None:
                self.metrics.queued.labels(model, objective.label, reason).inc()
                self.metrics.depth.set(len(self.queue))
            self._start()
            held = await self._held(entry, turn, attempt, estimates, undo)
            if isinstance(held, Admitted):
                held.held = reason
            return held
        finally:
            self._turns.pop(entry.seq, None)
            self._trying.discard(entry.seq)
            self.queue.remove(entry)
            if self.metrics is not None:
                self.metrics.depth.set(len(self.queue))

    async def _held(
        self,
        entry: QueueEntry,
        turn: asyncio.Event,
        attempt: Attempt[T],
        estimates: Callable[[T], Sequence[Estimate]],
        undo: Callable[[T], Awaitable[None]],
    ) -> Admitted[T] | Shed:
        cfg = self.config
        model, objective = entry.model, entry.objective
        while True:
            await turn.wait()
            turn.clear()
            self._trying.add(entry.seq)
            trial = await attempt(False)
            raw = estimates(trial)
            now = self.clock()
            ests = self.correction.apply(model, raw, now)
            waited = now - entry.arrived
            verdict = judge(objective, waited * 1000.0, ests, cfg)
            entry.service_ms = min((e.service_ms for e in ests), default=0.0)
            entry.can_meet = verdict.can_meet
            if entry.expired and verdict.action != ADMIT:  # a last look found no way in (best effort)
                return self._shed(model, objective, entry.expired, 1, waited)
            if verdict.action == ADMIT or (entry.evicted and verdict.can_meet):
                if self.metrics is not None:
                    self.metrics.queue_wait.labels("admitted").observe(waited)
                    if verdict.reason == BEST_EFFORT:
                        self.metrics.best_effort.labels(model, objective.label).inc()
                est_ms = raw[verdict.pick].est_ttft_ms if raw else 0.0
                return Admitted(
                    trial, verdict.pick, waited, committed=False, est_ms=est_ms, reason=verdict.reason
                )
            if entry.evicted:
                return self._shed(model, objective, QUEUE_FULL, verdict.retry_after_s or 1, waited)
            if verdict.action == SHED:
                reason = DEADLINE if verdict.reason == UNATTAINABLE else verdict.reason
                return self._shed(model, objective, reason, verdict.retry_after_s, waited)
            if objective.ttft_ms is None and now >= entry.deadline:
                return self._shed(model, objective, TIMEOUT, 1, waited)
            self._trying.discard(entry.seq)

    def _turn(self, entry: QueueEntry) -> None:
        turn = self._turns.get(entry.seq)
        if turn is not None:
            turn.set()

    async def _run(self) -> None:
        """Gives queued requests their turn: on a wake, and every ``tick_s``; sheds the expired."""
        cfg = self.config
        while self.queue:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=cfg.tick_s)
            self._wake.clear()
            now = self.clock()
            for entry, reason in self.queue.expired(now, cfg):
                if entry.seq not in self._trying:
                    entry.expired = reason
                    self.queue.remove(entry)
                    self._turn(entry)
            given = 0
            for entry in self.queue:
                if given >= cfg.scan:
                    break
                if entry.seq in self._trying or entry.expired:
                    continue
                self._turn(entry)
                given += 1
