"""Admission: the rule and the queue, as pure logic. ``kvindex route`` admitting, queueing and shedding
against a real index: tests/integration/test_admission.py; the picker's side:
tests/integration/test_ext_proc.py."""

from __future__ import annotations

import pytest

from kvindex.scoring.admission import (
    ADMIT,
    BEST_EFFORT,
    DEADLINE,
    OVER_OBJECTIVE,
    QUEUE,
    SATURATED,
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
from kvindex.scoring.objectives import Objective, ObjectiveDefaults, ObjectiveError

MODEL = "route-model"

CFG = AdmissionConfig()


def est(total: float, own: float) -> Estimate:
    return Estimate(est_ttft_ms=total, service_ms=own, wait_ms=total - own)


# -- the rule -------------------------------------------------------------------------------------


def test_admits_the_first_ranked_instance_within_the_objective() -> None:
    v = judge(Objective(1000), 0, [est(1500, 100), est(900, 300), est(500, 200)], CFG)
    assert (v.action, v.pick, v.can_meet) == (ADMIT, 1, True)
    # Time already spent (queued) counts against the objective.
    v = judge(Objective(1000), 200, [est(1500, 100), est(900, 300)], CFG)
    assert (v.action, v.reason) == (QUEUE, OVER_OBJECTIVE)
    # The margin widens it.
    v = judge(Objective(1000), 200, [est(1500, 100), est(900, 300)], AdmissionConfig(margin=0.2))
    assert (v.action, v.pick) == (ADMIT, 1)


def test_without_an_objective_or_estimates_everything_is_admitted() -> None:
    assert judge(Objective(), 0, [est(60_000, 100)], CFG).action == ADMIT
    assert judge(Objective(10), 0, [], CFG).action == ADMIT  # the index did not rank: cannot judge


def test_never_shed_while_an_idle_instance_could_meet_it() -> None:
    v = judge(Objective(1000), 0, [est(5000, 400), est(7000, 900)], CFG)
    assert (v.action, v.reason) == (QUEUE, OVER_OBJECTIVE)
    v = judge(Objective(1000), 0, [est(5000, 1200), est(7000, 1100)], CFG)
    assert (v.action, v.reason) == (SHED, UNATTAINABLE)
    assert v.retry_after_s == 4  # the shortest queue, rounded up to whole seconds
    # Sheddable requests (negative priority) are not held: shed when none meets, served when one does.
    assert judge(Objective(1000, -1), 0, [est(5000, 400)], CFG).reason == SHEDDABLE
    saturated = AdmissionConfig(queue_threshold_ms=1)
    assert judge(Objective(1000, -1), 0, [est(900, 400)], saturated).action == ADMIT


def test_best_effort_on_an_idle_instance_for_what_no_instance_can_meet() -> None:
    # Its own prefill (6 s) is past the 5 s objective everywhere; the second instance is idle.
    v = judge(Objective(5000), 0, [est(9000, 6000), est(6500, 6500)], CFG)
    assert (v.action, v.reason, v.pick, v.can_meet) == (ADMIT, BEST_EFFORT, 1, False)
    assert (
        judge(Objective(5000), 0, [est(9000, 6000), est(6500, 6500)], AdmissionConfig(idle_wait_ms=-1)).action
        == SHED
    )
    assert judge(Objective(5000), 0, [est(9000, 6000), est(6600, 6500)], CFG).action == SHED


def test_queue_threshold_holds_requests_when_every_queue_is_past_it() -> None:
    cfg = AdmissionConfig(queue_threshold_ms=2000)
    v = judge(Objective(), 0, [est(3000, 500), est(2600, 100)], cfg)
    assert (v.action, v.reason) == (QUEUE, SATURATED)
    assert judge(Objective(), 0, [est(3000, 500), est(1000, 100)], cfg).action == ADMIT
    v = judge(Objective(5000), 0, [est(3000, 500), est(2600, 100)], cfg)
    assert (v.action, v.reason, v.can_meet) == (QUEUE, SATURATED, True)


def test_correction_by_measured_ttft() -> None:
    c = Correction(min_samples=3)
    for _ in range(2):
        c.observe("m", est_ms=100, measured_ms=300)
    assert c.factor("m") == 1.0  # too few samples yet
    c.observe("m", est_ms=100, measured_ms=300)
    assert c.factor("m") == pytest.approx(3.0)
    (scaled,) = c.apply("m", [est(1000, 400)])
    assert (scaled.est_ttft_ms, scaled.service_ms, scaled.wait_ms) == pytest.approx((3000, 1200, 1800))
    # Long prefills weigh more than a few ms of overhead on cached prompts (a ratio of sums).
    c.observe("m", est_ms=1, measured_ms=50)
    assert c.factor("m") < 3.2
    c.observe("m", est_ms=0, measured_ms=50)  # nothing to compare: ignored
    assert c.factor("other") == 1.0
    for _ in range(50):
        c.observe("m", est_ms=10, measured_ms=1000)
    assert c.factor("m") == 32.0  # clamped


def test_correction_counts_late_first_tokens_before_they_come() -> None:
    c = Correction(min_samples=4)
    for key in range(4):
        c.start("m", key, est_ms=100, since_s=10.0)
    assert c.factor("m", now_s=10.05) == 1.0  # within their estimates: nothing learnt yet
    assert c.factor("m", now_s=11.0) == pytest.approx(10.0)  # 1 s waited so far, 0.1 s estimated
    for key in range(4):
        c.finish("m", key)
    assert c.factor("m", now_s=11.0) == 1.0


def test_objective_defaults_and_headers() -> None:
    d = ObjectiveDefaults.from_flags(["2000", "big=8000"], ["big=-1"], ["premium=5:500", "batch=-2"])
    assert d.of("small", {}) == Objective(2000, 0)
    assert d.of("big", {}) == Objective(8000, -1)
    assert d.of("big", {"x-gateway-inference-objective": "premium"}) == Objective(500, 5)
    assert d.of("big", {"x-gateway-inference-objective": "batch"}) == Objective(8000, -2)
    assert d.of("big", {"x-gateway-inference-objective": "unknown"}) == Objective(8000, -1)
    own = {"x-kvindex-ttft-slo-ms": " 750.5", "x-kvindex-priority": "3"}
    assert d.of("big", own) == Objective(750.5, 3)
    for header, value in (
        ("x-kvindex-ttft-slo-ms", "fast"),
        ("x-kvindex-ttft-slo-ms", "0"),
        ("x-kvindex-ttft-slo-ms", "nan"),
        ("x-kvindex-ttft-slo-ms", "-5"),
        ("x-kvindex-priority", "1.5"),
        ("x-kvindex-priority", "high"),
        ("x-kvindex-priority", "1000"),
    ):
        with pytest.raises(ObjectiveError) as err:
            d.of("big", {header: value})
        assert err.value.header == header and header in str(err.value)
    with pytest.raises(ObjectiveError, match="--objective"):
        ObjectiveDefaults.from_flags(objectives=["nameonly"])
    with pytest.raises(ObjectiveError, match="--ttft-slo-ms"):
        ObjectiveDefaults.from_flags(ttft=["m=soon"])


def _entry(q: AdmissionQueue, prio: int, ttft: float | None, arrived: float = 0.0) -> QueueEntry:
    o = Objective(ttft, prio)
    return QueueEntry(o, MODEL, arrived, deadline_of(o, arrived, CFG), q.next_seq())


def test_queue_orders_by_priority_then_deadline_and_displaces_the_last() -> None:
    q = AdmissionQueue(3)
    a = _entry(q, 0, 5000)
    b = _entry(q, 0, 1000)
    c = _entry(q, 1, 9000)
    for e in (a, b, c):
        assert q.push(e) is None
    assert list(q) == [c, b, a]
    assert q.ahead_of(_entry(q, 0, 2000).key) and not q.ahead_of(_entry(q, 2, 9000).key)
    d = _entry(q, 0, 3000)
    assert q.push(d) is a  # full: the last-ranked leaves
    assert list(q) == [c, b, d]
    e = _entry(q, -1, 100)
    assert q.push(e) is e  # ranks last: not held
    assert q.remove(b) and not q.remove(b)
    assert list(q) == [c, d]


def test_queue_expiry() -> None:
    q = AdmissionQueue(8)
    late = _entry(q, 0, 1000)
    late.service_ms = 300
    patient = _entry(q, 0, None)
    for e in (late, patient):
        q.push(e)
    assert q.expired(0.5, CFG) == []
    assert q.expired(0.75, CFG) == [(late, DEADLINE)]  # 250 ms left, 300 ms of own work
    assert q.expired(CFG.max_wait_s, CFG) == [(late, DEADLINE), (patient, TIMEOUT)]


def test_a_request_displaced_while_it_undoes_its_trial_is_not_forgotten() -> None:
    """At overload the queue is full: a request being queued undoes its trial (a release, an await)
    and a later, higher-ranked arrival displaces it meanwhile. It must still be woken (and shed or
    admitted), never left waiting out of the queue with its client connection open."""
    import asyncio

    from kvindex.route.gate import AdmissionGate, Admitted

    async def scenario() -> tuple[object, object]:
        gate: AdmissionGate[str] = AdmissionGate(AdmissionConfig(max_queue=1, tick_s=0.01), clock=lambda: 0.0)
        late = {"ms": 1500.0}  # over the 1 s objective, with 100 ms of own work: held, not shed
        undoing = asyncio.Event()
        release_a = asyncio.Event()

        async def attempt(commit: bool) -> str:
            return "trial"

        def estimates(trial: str) -> list[Estimate]:
            return [est(late["ms"], 100)]

        async def undo_a(trial: str) -> None:
            undoing.set()
            await release_a.wait()

        async def undo_b(trial: str) -> None:
            return None

        a = asyncio.ensure_future(gate.admit(MODEL, Objective(1000), 0.0, attempt, estimates, undo_a))
        await undoing.wait()  # A is queued and awaiting its undo
        b = asyncio.ensure_future(gate.admit(MODEL, Objective(1000, 1), 0.0, attempt, estimates, undo_b))
        await asyncio.sleep(0.02)  # B displaces A (higher priority) and is held
        release_a.set()
        late["ms"] = 500.0  # the fleet drained: B fits now
        return await asyncio.wait_for(asyncio.gather(a, b), timeout=5.0)

    got_a, got_b = asyncio.run(scenario())
    # Displaced, A was woken: the fleet had drained, so it was served (it could meet); so was B.
    assert isinstance(got_a, Admitted) and got_a.committed is False
    assert isinstance(got_b, Admitted)
