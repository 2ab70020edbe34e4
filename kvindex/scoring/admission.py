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

Everything here but :class:`AdmissionGate` is pure logic on plain numbers, so the routing
simulation runs the same rule in virtual time (benchmarks/routing_sim.py).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

HEADER_TTFT = "x-kvindex-ttft-slo-ms"
HEADER_PRIORITY = "x-kvindex-priority"
# The Gateway API Inference Extension names an InferenceObjective (a Kubernetes object holding the
# request's priority) in this header; the picker maps names to objectives from its flags.
HEADER_GIE_OBJECTIVE = "x-gateway-inference-objective"

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

MAX_PRIORITY = 100  # |priority| bound: it is a metrics label, and a stack rank needs few values
MAX_TTFT_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class Objective:
    """A request's TTFT objective in ms (None: none) and its priority (higher first)."""

    ttft_ms: float | None = None
    priority: int = 0

    @property
    def label(self) -> str:
        return str(self.priority)


class ObjectiveError(ValueError):
    """A malformed objective or priority: rejected (400 naming ``header``), never queued."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(f"{header}: {message}")
        self.header = header


def parse_ttft_ms(value: str, where: str = HEADER_TTFT) -> float:
    try:
        ms = float(value.strip())
    except ValueError:
        raise ObjectiveError(where, f"not a number of milliseconds: {value!r}") from None
    if not (0 < ms <= MAX_TTFT_MS):  # also rejects nan and inf
        raise ObjectiveError(where, f"must be > 0 and <= {MAX_TTFT_MS:.0f} ms, got {value!r}")
    return ms


def parse_priority(value: str, where: str = HEADER_PRIORITY) -> int:
    try:
        p = int(value.strip())
    except ValueError:
        raise ObjectiveError(where, f"not an integer: {value!r}") from None
    if abs(p) > MAX_PRIORITY:
        raise ObjectiveError(where, f"must be between -{MAX_PRIORITY} and {MAX_PRIORITY}, got {p}")
    return p


@dataclass
class ObjectiveDefaults:
    """Objectives from flags: per model (``""``: every model), and the named InferenceObjectives a
    gateway may refer to (``x-gateway-inference-objective``; an unknown name means priority 0, as in
    the Inference Extension when no such object exists)."""

    ttft_ms: dict[str, float] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    named: dict[str, Objective] = field(default_factory=dict)

    @classmethod
    def from_flags(
        cls, ttft: Iterable[str] = (), priority: Iterable[str] = (), objectives: Iterable[str] = ()
    ) -> ObjectiveDefaults:
        """``ttft``: ``MS`` or ``MODEL=MS``; ``priority``: ``N`` or ``MODEL=N``; ``objectives``:
        ``NAME=PRIORITY`` or ``NAME=PRIORITY:TTFT_MS``. ValueError naming the bad flag value."""
        out = cls()
        for item in ttft:
            model, _, value = item.rpartition("=")
            out.ttft_ms[model] = parse_ttft_ms(value, f"--ttft-slo-ms {item}")
        for item in priority:
            model, _, value = item.rpartition("=")
            out.priority[model] = parse_priority(value, f"--priority {item}")
        for item in objectives:
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise ObjectiveError(f"--objective {item}", "expected NAME=PRIORITY[:TTFT_MS]")
            prio, _, ms = value.partition(":")
            out.named[name] = Objective(
                parse_ttft_ms(ms, f"--objective {item}") if ms else None,
                parse_priority(prio, f"--objective {item}"),
            )
        return out

    @property
    def any(self) -> bool:
        return bool(self.ttft_ms or self.priority or self.named)

    def of(self, model: str, headers: Mapping[str, str]) -> Objective:
        """The request's objective: its own headers first, then a named objective, then the model's
        defaults. ``headers`` with lower-case names. ObjectiveError for a malformed value."""
        ttft: float | None = self.ttft_ms.get(model, self.ttft_ms.get(""))
        prio = self.priority.get(model, self.priority.get("", 0))
        name = headers.get(HEADER_GIE_OBJECTIVE)
        if name:
            named = self.named.get(name.strip())
            if named is not None:
                prio = named.priority
                ttft = named.ttft_ms if named.ttft_ms is not None else ttft
        raw = headers.get(HEADER_TTFT)
        if raw is not None:
            ttft = parse_ttft_ms(raw)
        raw = headers.get(HEADER_PRIORITY)
        if raw is not None:
            prio = parse_priority(raw)
        return Objective(ttft, prio)


def check_headers(headers: Mapping[str, str]) -> None:
    """Validate the objective headers alone (before anything else is done with the request)."""
    raw = headers.get(HEADER_TTFT)
    if raw is not None:
        parse_ttft_ms(raw)
    raw = headers.get(HEADER_PRIORITY)
    if raw is not None:
        parse_priority(raw)


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


@dataclass
class Shed:
    reason: str
    retry_after_s: int
    message: str


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
        return Shed(reason, max(1, retry), f"overloaded: {what} ({reason})")

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
                return Admitted(trial, verdict.pick, 0.0, est_ms=est_ms)
            reason = BEHIND
        elif verdict.action == SHED:
            await undo(trial)
            return self._shed(model, objective, verdict.reason, verdict.retry_after_s, None)
        else:
            reason = verdict.reason
        displaced = self.queue.push(entry)
        if displaced is entry:  # full, and this one ranks last
            if verdict.can_meet:  # never shed while an instance could meet
                return Admitted(trial, verdict.pick, 0.0, est_ms=est_ms)
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
            return await self._held(entry, turn, attempt, estimates, undo)
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
                return Admitted(trial, verdict.pick, waited, committed=False, est_ms=est_ms)
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


# -- command line ----------------------------------------------------------------------------------


def add_admission_options(group: Any, named: bool = False) -> None:
    """The admission flags of ``kvindex route`` and of ``kvindex serve``'s picker; ``named``: also
    ``--objective`` (the Inference Extension's objective names)."""
    group.add_argument(
        "--ttft-slo-ms", action="append", default=[], metavar="[MODEL=]MS",
        help="default TTFT objective, for every model or one (repeatable); a request's "
        f"{HEADER_TTFT} header overrides it",
    )  # fmt: skip
    group.add_argument(
        "--priority", action="append", default=[], metavar="[MODEL=]N",
        help=f"default priority (higher first, negative: sheddable; {HEADER_PRIORITY} overrides)",
    )  # fmt: skip
    if named:
        group.add_argument(
            "--objective", action="append", default=[], metavar="NAME=PRIORITY[:TTFT_MS]",
            help=f"a named objective a gateway's {HEADER_GIE_OBJECTIVE} header may refer to (repeatable)",
        )  # fmt: skip
    group.add_argument(
        "--slo-margin", type=float, default=0.0,
        help="admit while the estimated TTFT is within objective x (1 + margin)",
    )  # fmt: skip
    group.add_argument(
        "--queue-threshold-ms", type=float, default=0.0,
        help="hold requests when every instance's estimated queue wait is past this (0: off)",
    )  # fmt: skip
    group.add_argument("--max-queue", type=int, default=256, help="requests held in the router at most")
    group.add_argument(
        "--max-queue-wait",
        type=float,
        default=30.0,
        help="seconds a request without an objective may be held",
    )


def admission_from_args(args: Any) -> tuple[AdmissionConfig, ObjectiveDefaults]:
    """ValueError (naming the flag) for a malformed value."""
    if args.slo_margin < 0 or args.queue_threshold_ms < 0 or args.max_queue < 1 or args.max_queue_wait <= 0:
        raise ValueError(
            "--slo-margin and --queue-threshold-ms must be >= 0, --max-queue >= 1, --max-queue-wait > 0"
        )
    config = AdmissionConfig(
        margin=args.slo_margin,
        queue_threshold_ms=args.queue_threshold_ms,
        max_queue=args.max_queue,
        max_wait_s=args.max_queue_wait,
    )
    defaults = ObjectiveDefaults.from_flags(args.ttft_slo_ms, args.priority, getattr(args, "objective", ()))
    return config, defaults
