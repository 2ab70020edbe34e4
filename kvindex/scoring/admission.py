"""Admission: serve a request now, hold it in the router, or shed it — judged by its TTFT objective.

A request may carry a TTFT objective (ms) and a priority (an integer, higher first, 0 by default,
as the Gateway API Inference Extension's InferenceObjective defines it). Scoring gives every ranked
instance an estimated TTFT (queue wait + prefill + fetch). The rule (docs/scoring.md, "Admission"):

- **admit** when some ranked instance's estimate, plus the time the request has already waited,
  is within the objective x (1 + margin), and not every candidate's estimated queue wait is past
  the queue threshold. The request goes to the best-ranked instance that meets the objective.
- **queue** otherwise, in the router: bounded, ordered by priority (higher first), then deadline
  (earliest first), then arrival. Queued requests are re-scored when they get their turn (the fleet
  has changed since); the time queued counts in their TTFT.
- **shed** only when no instance could meet the objective even with an empty queue (its own
  prefill and fetch alone are too long for what is left of the budget), or when the queue is full
  and the request ranks last; a request without an objective is shed after ``max_wait_s`` in the
  queue. A request is never shed while an instance could meet its objective. Negative priorities
  are "sheddable" (GIE): never queued, shed when they could not be served within the objective.
- **best effort**: a request no instance could meet is still served when an instance has nothing
  queued (``idle_wait_ms``): idle capacity costs no one else their objective, and what it leaves in
  the cache is what the conversation's next, shorter turns reuse (shedding a long first turn sheds
  the cheap turns after it too).

Estimates are corrected by what the router measures (:class:`Correction`): the ratio of measured
to estimated TTFT of the streams it served, per model (streams still waiting counted once late),
plus, per instance, how late its waiting streams already are — so that an index whose time model
does not match the engines (no prefill samples from their bridge, a queue bound by KV memory) does
not admit what the engines cannot serve in time, nor shed what they can.

Everything here is pure logic on plain numbers, so the routing simulation runs the same rule in
virtual time (benchmarks/routing_sim.py). Objectives come from kvindex/scoring/objectives.py; the
asyncio gate that holds requests of the proxy and the picker is kvindex/route/gate.py, its flags
kvindex/route/admission_args.py.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.scoring.objectives import Objective

ADMIT = "admit"
QUEUE = "queue"
SHED = "shed"

# Why a request was shed (the ``reason`` label of the shed counters).
UNATTAINABLE = "unattainable"  # no instance could meet the objective even with an empty queue
DEADLINE = "deadline"  # queued until no instance could meet the objective any more
QUEUE_FULL = "queue_full"  # the queue was full and the request ranked last
TIMEOUT = "timeout"  # no objective: queued longer than max_wait_s
SHEDDABLE = "sheddable"  # negative priority, and no instance within the objective / threshold
SHED_REASONS = (UNATTAINABLE, DEADLINE, QUEUE_FULL, TIMEOUT, SHEDDABLE)

BEST_EFFORT = "best_effort"  # admitted although no instance can meet its objective: one is idle

# Why a request was queued.
OVER_OBJECTIVE = "over_objective"  # no instance's estimate within the objective
SATURATED = "saturated"  # every candidate's queue past the threshold
BEHIND = "behind"  # admissible, but queued requests rank ahead of it


# -- the rule -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Estimate:
    """One ranked instance as admission sees it (ms): the TTFT estimate, the part of it that is
    the request's own work (prefill + fetch: what it would take on an idle instance), the queue."""

    est_ttft_ms: float
    service_ms: float
    wait_ms: float
    instance: str = ""  # "worker/dp_rank"

    @classmethod
    def of(cls, ranked: Any) -> Estimate:
        """From a ``RankedInstance`` (gRPC) or a scoring ``Candidate`` (in process)."""
        own = float(ranked.prefill_ms + ranked.fetch_ms)
        iid = ranked.instance_id if hasattr(ranked, "instance_id") else ranked.state.instance_id
        return cls(float(ranked.est_ttft_ms), own, float(ranked.wait_ms), iid)


class Correction:
    """Measured / estimated TTFT per model: ratio of exponentially weighted sums (so that long
    prefills, where the estimate matters, weigh more than a few ms of overhead on a cached prompt),
    clamped to [lo, hi], 1 until ``min_samples`` were seen. Only time the estimate covers counts:
    from the decision to the first token, not time queued in the router.

    Requests still waiting for their first token count too, once they are late (waited longer than
    their estimate), with the time waited so far as a lower bound of their TTFT: in an overload the
    first tokens come late, and a correction that waited for them would learn only after the fleet
    is already far past every objective (:meth:`start` and :meth:`finish` track them)."""

    def __init__(self, keep: float = 0.98, lo: float = 0.25, hi: float = 32.0, min_samples: int = 8) -> None:
        self.keep, self.lo, self.hi, self.min_samples = keep, lo, hi, min_samples
        self._sums: dict[str, list[float]] = {}  # model -> [measured, estimated, samples]
        # model -> key -> (est ms, since s, instance)
        self._waiting: dict[str, dict[Any, tuple[float, float, str]]] = {}

    def start(self, model: str, key: Any, est_ms: float, since_s: float, instance: str = "") -> None:
        """A decision whose first token is awaited (estimated ``est_ms`` at clock ``since_s``, on
        ``instance``)."""
        if est_ms > 0 and math.isfinite(est_ms):
            self._waiting.setdefault(model, {})[key] = (est_ms, since_s, instance)

    def finish(self, model: str, key: Any) -> None:
        """Its first token came (then :meth:`observe` it), or it ended without one."""
        waiting = self._waiting.get(model)
        if waiting is not None:
            waiting.pop(key, None)

    def observe(self, model: str, est_ms: float, measured_ms: float) -> None:
        if not (est_ms > 0 and measured_ms > 0 and math.isfinite(est_ms) and math.isfinite(measured_ms)):
            return
        s = self._sums.setdefault(model, [0.0, 0.0, 0])
        s[0] = s[0] * self.keep + measured_ms
        s[1] = s[1] * self.keep + est_ms
        s[2] += 1

    def factor(self, model: str, now_s: float | None = None) -> float:
        measured, estimated, n = self._sums.get(model) or (0.0, 0.0, 0)
        if now_s is not None:
            for est_ms, since, _instance in self._waiting.get(model, {}).values():
                waited = (now_s - since) * 1000.0
                if waited > est_ms:  # late: its TTFT is at least what it waited
                    measured, estimated, n = measured + waited, estimated + est_ms, n + 1
        if n < self.min_samples or estimated <= 0:
            return 1.0
        return min(self.hi, max(self.lo, measured / estimated))

    def lateness(self, model: str, now_s: float, k: float = 1.0) -> dict[str, float]:
        """Per instance, how far past its (corrected) estimate its latest-running stream still
        waiting for a first token is (ms): a request sent there now queues behind it, so its wait is
        at least that much longer than estimated (queueing adds; a ratio alone cannot follow it)."""
        out: dict[str, float] = {}
        for est_ms, since, instance in self._waiting.get(model, {}).values():
            late = (now_s - since) * 1000.0 - est_ms * k
            if instance and late > out.get(instance, 0.0):
                out[instance] = late
        return out

    def apply(self, model: str, estimates: Sequence[Estimate], now_s: float | None = None) -> list[Estimate]:
        k = self.factor(model, now_s)
        late = self.lateness(model, now_s, k) if now_s is not None else {}
        if k == 1.0 and not late:
            return list(estimates)
        out = []
        for e in estimates:
            extra = late.get(e.instance, 0.0)
            out.append(
                Estimate(e.est_ttft_ms * k + extra, e.service_ms * k, e.wait_ms * k + extra, e.instance)
            )
        return out


@dataclass
class AdmissionConfig:
    """``margin``: admitted while the estimate is within objective x (1 + margin) (estimates are
    estimates); ``queue_threshold_ms``: every candidate's estimated queue wait past it → queue
    (0: off); ``max_queue``: requests held at most; ``max_wait_s``: how long a request without an
    objective may be held; ``scan``: queued requests re-scored per turn; ``tick_s``: how often the
    queue is looked at when nothing wakes it; ``idle_wait_ms``: best effort (above)."""

    margin: float = 0.0
    queue_threshold_ms: float = 0.0
    max_queue: int = 256
    max_wait_s: float = 30.0
    scan: int = 8
    tick_s: float = 0.05
    # Serve a request no instance can meet on an instance whose estimated queue wait is at most
    # this (ms); negative: never (shed it).
    idle_wait_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class AdmissionVerdict:
    action: str  # ADMIT, QUEUE, SHED
    reason: str = ""  # the queue or shed reason
    pick: int = 0  # ADMIT (or a QUEUE that could meet): index of the ranked instance to use
    can_meet: bool = False  # some instance's estimate is within the objective right now
    retry_after_s: int = 0  # SHED: a hint for the client


def budget_ms(objective: Objective, elapsed_ms: float, config: AdmissionConfig) -> float:
    """What is left of the objective (with the margin) after ``elapsed_ms``; inf without one."""
    if objective.ttft_ms is None:
        return math.inf
    return objective.ttft_ms * (1.0 + config.margin) - elapsed_ms


def judge(
    objective: Objective, elapsed_ms: float, estimates: Sequence[Estimate], config: AdmissionConfig
) -> AdmissionVerdict:
    """The rule, for ranked ``estimates`` (best-ranked first). Without estimates (the index did not
    rank: fallback, unknown model) there is nothing to judge by: admit."""
    if not estimates:
        return AdmissionVerdict(ADMIT, can_meet=True)
    budget = budget_ms(objective, elapsed_ms, config)
    meets = next((i for i, e in enumerate(estimates) if e.est_ttft_ms <= budget), None)
    threshold = config.queue_threshold_ms
    saturated = threshold > 0 and all(e.wait_ms > threshold for e in estimates)
    if meets is not None:
        if saturated and objective.priority >= 0:
            return AdmissionVerdict(QUEUE, SATURATED, meets, can_meet=True)
        return AdmissionVerdict(ADMIT, pick=meets, can_meet=True)
    retry = max(1, math.ceil(min(e.wait_ms for e in estimates) / 1000.0))
    if not any(e.service_ms <= budget for e in estimates):
        idle = next((i for i, e in enumerate(estimates) if e.wait_ms <= config.idle_wait_ms), None)
        if idle is not None:
            return AdmissionVerdict(ADMIT, BEST_EFFORT, pick=idle)
        return AdmissionVerdict(SHED, UNATTAINABLE, retry_after_s=retry)
    if objective.priority < 0:
        return AdmissionVerdict(SHED, SHEDDABLE, retry_after_s=retry)
    return AdmissionVerdict(QUEUE, OVER_OBJECTIVE)


# -- the queue ------------------------------------------------------------------------------------


@dataclass(eq=False)
class QueueEntry:
    """One held request. ``deadline`` (clock seconds): when its objective (with the margin) runs
    out, or ``max_wait_s`` after arrival for a request without one."""

    objective: Objective
    model: str
    arrived: float
    deadline: float
    seq: int
    service_ms: float = 0.0  # the least own work among the last ranked instances (ms)
    can_meet: bool = False  # at its last look some instance was within the objective
    evicted: bool = False  # displaced by a better request: served if it can meet, else shed
    expired: str = ""  # the tick found it can no longer be served in time: the shed reason

    @property
    def key(self) -> tuple[int, float, int]:
        return (-self.objective.priority, self.deadline, self.seq)


class AdmissionQueue:
    """Bounded, ordered by priority (higher first), deadline, arrival. Pure: no clock, no I/O."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max(1, max_size)
        self._keys: list[tuple[int, float, int]] = []
        self._entries: list[QueueEntry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Any:
        return iter(list(self._entries))

    def next_seq(self) -> int:
        return next(self._seq)

    def ahead_of(self, key: tuple[int, float, int]) -> bool:
        """Some held request ranks before ``key`` (a newcomer then waits its turn)."""
        return bool(self._keys) and self._keys[0] < key

    def push(self, entry: QueueEntry) -> QueueEntry | None:
        """Hold ``entry``; when full, the last-ranked of the queue and ``entry`` is returned (and
        not held): the caller sheds it, or serves it if it can meet its objective."""
        key = entry.key
        if len(self._entries) >= self.max_size:
            if key >= self._keys[-1]:
                return entry
            worst = self._entries.pop()
            self._keys.pop()
        else:
            worst = None
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._entries.insert(i, entry)
        return worst

    def remove(self, entry: QueueEntry) -> bool:
        key = entry.key
        i = bisect.bisect_left(self._keys, key)
        if i < len(self._entries) and self._entries[i] is entry:
            del self._keys[i]
            del self._entries[i]
            return True
        return False

    def expired(self, now: float, config: AdmissionConfig) -> list[tuple[QueueEntry, str]]:
        """Entries that can no longer be served in time, with the reason (not removed here):
        with an objective, when what is left of it is below the least own work seen at the last
        look (no instance could meet it even if idle); without one, past ``max_wait_s``."""
        out = []
        for e in self._entries:
            if e.objective.ttft_ms is None:
                if now >= e.deadline:
                    out.append((e, TIMEOUT))
            elif (e.deadline - now) * 1000.0 < e.service_ms:
                out.append((e, DEADLINE))
        return out


def deadline_of(objective: Objective, arrived: float, config: AdmissionConfig) -> float:
    if objective.ttft_ms is None:
        return arrived + config.max_wait_s
    return arrived + objective.ttft_ms * (1.0 + config.margin) / 1000.0
