"""The pick step (kvindex/scoring/pick.py): the softmax's distribution, seeded draws, the warm-up
ramp, and the pick applied by the router after its ranking."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvindex.scoring import pick as P
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.ranker import Ranker, RankerConfig, build_ranker
from kvindex.wire.schema import Load
from tests.unit.test_scoring import MODEL, Clock, fleet, prompt, request

# -- the distribution -----------------------------------------------------------------------------


def test_temperature_zero_is_the_first_choice() -> None:
    assert P.softmax([100.0, 100.0, 120.0], 0.0) == [1.0, 0.0, 0.0]
    assert P.softmax([100.0], 0.5) == [1.0]
    assert P.softmax([], 0.5) == []
    # A vanishing temperature converges to the same (argmin of the eligible estimates).
    p = P.softmax([100.0, 101.0, 150.0], 1e-4)
    assert p[0] == pytest.approx(1.0) and p[1] < 1e-30


def test_softmax_weights_are_relative_to_the_first_choice() -> None:
    t = 0.2
    p = P.softmax([100.0, 120.0, 140.0, 100.0], t)
    # 20 % slower at T = 0.2: 1/e of the first choice's weight; 40 %: 1/e^2; a tie: equal.
    assert p[1] / p[0] == pytest.approx(math.exp(-1))
    assert p[2] / p[0] == pytest.approx(math.exp(-2))
    assert p[3] == pytest.approx(p[0])
    assert sum(p) == pytest.approx(1.0)
    # Scale-free: the same ratios in seconds or milliseconds, for a slow or a fast model.
    assert P.softmax([1000.0, 1200.0, 1400.0, 1000.0], t) == pytest.approx(p)
    # One very slow candidate does not flatten the others (range normalisation would).
    with_outlier = P.softmax([100.0, 120.0, 140.0, 100.0, 50_000.0], t)
    assert with_outlier[1] / with_outlier[0] == pytest.approx(math.exp(-1))
    assert with_outlier[4] == 0.0


def test_scale_is_the_first_choices_own_work() -> None:
    """A queue-dominated estimate (10 s, 0.5 s of it prefill): 0.5 s more is a whole prefill more
    work, which at T = 0.2 costs a factor e^5, not the e^0.25 a 5 % excess over the estimate would."""
    p = P.softmax([10_000.0, 10_500.0], 0.2, work=500.0)
    assert p[1] / p[0] == pytest.approx(math.exp(-5.0))
    q = P.softmax([10_000.0, 10_500.0], 0.2)  # relative to the whole estimate instead
    assert q[1] / q[0] == pytest.approx(math.exp(-0.25))


def test_lower_estimates_ranked_below_the_first_choice_are_not_eligible() -> None:
    # The policy preferred a cache holder (100 ms) over a faster instance without the prefix (80 ms).
    p = P.softmax([100.0, 80.0, 110.0], 1.0)
    assert p[1] == 0.0 and p[0] > p[2] > 0


def test_scale_floor_for_estimates_near_zero() -> None:
    p = P.softmax([0.0, 0.5, 2.0], 1.0)  # scale = 1 ms, not 0
    assert p[1] / p[0] == pytest.approx(math.exp(-0.5)) and p[2] / p[0] == pytest.approx(math.exp(-2))


def test_sampled_frequencies_match_the_probabilities() -> None:
    probabilities = P.softmax([100.0, 110.0, 130.0, 200.0], 0.25)
    n = 40_000
    counts = Counter(P.choose(probabilities, P.uniform(seed)) for seed in range(n))
    for i, p in enumerate(probabilities):
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[i] / n - p) < 5 * sigma + 1e-9, (i, counts[i] / n, p)


def test_draws_are_seeded_and_reproducible() -> None:
    assert P.uniform(12345) == P.uniform(12345)
    assert 0.0 <= P.uniform(0) < 1.0 and 0.0 <= P.uniform((1 << 64) - 1) < 1.0
    assert P.seed_for(0, "req-1") == P.seed_for(0, "req-1")
    assert P.seed_for(0, "req-1") != P.seed_for(0, "req-2") != P.seed_for(1, "req-2")
    # The uniform is splitmix64's first output: documented, so other tools can recompute it.
    assert P.uniform(0) == (0xE220A8397B1DCDAF >> 11) / (1 << 53)


def test_choose_skips_impossible_candidates() -> None:
    assert P.choose([0.0, 0.5, 0.0, 0.5], 0.0) == 1
    assert P.choose([0.0, 0.5, 0.0, 0.5], 0.7) == 3
    assert P.choose([0.5, 0.5, 0.0], 0.999999999999) == 1  # rounding never lands on a 0


def test_option_errors() -> None:
    with pytest.raises(ValueError, match="pick must be"):
        P.check_options("random", 0.0)
    with pytest.raises(ValueError, match="temperature"):
        P.check_options("softmax", -1.0)
    with pytest.raises(ValueError, match="temperature"):
        P.check_options("softmax", math.nan)
    router, *_ = fleet(2)
    with pytest.raises(ValueError, match="applies to pick 'softmax'"):
        router.picker.options("best", 0.5, None)
    assert router.picker.options("softmax", None, None) == P.PickOptions("softmax", 0.0)


# -- the ramp -------------------------------------------------------------------------------------


def test_ramp_weight_grows_linearly_over_the_warmup() -> None:
    w = 60.0
    assert [P.ramp_weight(age, 3600.0, w) for age in (0, 15, 30, 60, 600)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    # A fleet that started together (an index restart, a new deployment) is not ramped.
    assert P.ramp_weight(5.0, 5.0, w) == 1.0
    assert P.ramp_weight(0.0, 0.0, w) == 1.0
    assert P.ramp_weight(10.0, 3600.0, 0.0) == 1.0


def test_ramped_probabilities_move_the_lost_share_to_warm_candidates() -> None:
    # best: the warming first choice keeps r, the first warm one in rank order gets the rest.
    assert P.ramped([1.0, 0.0, 0.0], [0.25, 1.0, 1.0]) == pytest.approx([0.25, 0.75, 0.0])
    assert P.ramped([1.0, 0.0, 0.0], [0.25, 0.5, 1.0]) == pytest.approx([0.25, 0.0, 0.75])
    # softmax: in proportion to the warm candidates' probabilities.
    assert P.ramped([0.5, 0.3, 0.2], [0.0, 1.0, 1.0]) == pytest.approx([0.0, 0.6, 0.4])
    # Every candidate warming: their shares relative to each other.
    assert P.ramped([0.5, 0.5], [0.5, 0.25]) == pytest.approx([2 / 3, 1 / 3])


def test_new_instance_share_over_time_through_the_router() -> None:
    """An instance joining an established fleet: its share of requests it would win grows with its
    age, ~ age / warmup, then is its full share."""
    clock = Clock()
    router, index, registry, _ = fleet(4, clock)
    router = build_ranker(
        index, registry, Calibrator.of(CostConfig()), config=RankerConfig(warmup=60.0), clock=clock
    )
    clock.t += 3600.0  # the fleet is an hour old
    for state in registry.all():
        state.last_heartbeat_at = clock.t
        state.load = Load(running=4, waiting=2, waiting_prefill_tokens=4000)
    new = registry.add(("new", 0), MODEL, 16)
    index.add_instance(("new", 0), MODEL)
    new.last_heartbeat_at = clock.t
    new.capacity = {0: 10_000}
    new.local_blocks_seen = True
    base = clock.t
    shares = []
    for age in (0.0, 15.0, 30.0, 45.0, 60.0, 120.0):
        clock.t = base + age
        for state in registry.all():
            state.last_heartbeat_at = clock.t
        won = 0
        n = 400
        for i in range(n):
            result = router.score(request(prompt(8, seed=i), rid=f"r{age}-{i}"), top_k=3)
            won += result.choices[0].candidate.state.worker == "new"
        shares.append(won / n)
    # Idle and new, it is every request's best; the ramp gives it age/60 of them.
    expected = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    for got, want in zip(shares, expected, strict=True):
        assert abs(got - want) < 0.08, (shares, expected)


# -- the router's pick ----------------------------------------------------------------------------


def _busy_fleet(n: int, **config: object) -> tuple[Ranker, Clock]:
    clock = Clock()
    _router, index, registry, _ = fleet(n, clock)
    router = build_ranker(
        index, registry, Calibrator.of(CostConfig()), config=RankerConfig(**config), clock=clock
    )  # type: ignore[arg-type]
    for i, state in enumerate(registry.all()):
        # Different queues: estimates 10-40 % apart.
        state.load = Load(running=2, waiting=1, waiting_prefill_tokens=400 * (i + 1))
    return router, clock


def test_router_softmax_spreads_and_reproduces_by_request_id() -> None:
    router, _clock = _busy_fleet(4, pick="softmax", temperature=0.5)
    keys = prompt(16)
    picks = [router.score(request(keys, rid=f"q{i}"), top_k=4) for i in range(300)]
    counts = Counter(r.choices[0].candidate.state.worker for r in picks)
    assert len(counts) >= 3, counts  # spread, not one instance
    assert counts.most_common(1)[0][0] == "w0"  # the fastest (shortest queue) most often
    # The same request id draws the same instance, here and in a fresh router (a replica, a replay).
    again, _ = _busy_fleet(4, pick="softmax", temperature=0.5)
    for r in picks[:50]:
        rid = r.request.request_id
        assert again.score(request(keys, rid=rid), top_k=4).choices[0].candidate.state.key == (
            r.choices[0].candidate.state.key
        )
        assert r.pick is not None and r.pick.seed == P.seed_for(0, rid) and r.pick.drawn
    # The reported probabilities are those of the softmax over the ranking, picked one first.
    r = picks[0]
    assert r.pick is not None and sum(r.pick.probabilities) == pytest.approx(1.0)
    # An explicit seed overrides the id; temperature 0 is the policy's first choice.
    best, _ = _busy_fleet(4)
    first = best.score(request(keys, rid="x"), top_k=4).choices[0].candidate.state.key
    zero = router.score(request(keys, rid="x"), top_k=4, pick=P.PickOptions("softmax", 0.0))
    assert zero.choices[0].candidate.state.key == first and zero.pick is None


def test_router_commits_the_picked_instance() -> None:
    router, _clock = _busy_fleet(4, pick="softmax", temperature=2.0)
    keys = prompt(16)
    for i in range(40):
        result = router.score(request(keys, rid=f"c{i}"), commit=True, top_k=4)
        assert result.committed is result.choices[0].candidate.state
        assert router.ledger._entries[f"c{i}"].instance == result.committed.key  # type: ignore[union-attr]


def test_ramp_holds_when_the_top_k_are_all_new_instances() -> None:
    """Three idle new instances are the whole top 3: the ranking is widened by one candidate per
    warming instance, so the share they give up still reaches a warm one."""
    clock = Clock()
    router, index, registry, _ = fleet(4, clock)
    router = build_ranker(
        index, registry, Calibrator.of(CostConfig()), config=RankerConfig(warmup=60.0), clock=clock
    )
    clock.t += 3600.0
    for state in registry.all():
        state.load = Load(running=4, waiting=2, waiting_prefill_tokens=4000)
    for i in range(3):
        new = registry.add((f"new{i}", 0), MODEL, 16)
        index.add_instance((f"new{i}", 0), MODEL)
        new.capacity = {0: 10_000}
        new.local_blocks_seen = True
    clock.t += 15.0
    for state in registry.all():
        state.last_heartbeat_at = clock.t
    assert router.picker.extra(MODEL, clock.t) == 3
    n = 400
    results = [router.score(request(prompt(8, seed=i), rid=f"a{i}"), top_k=3) for i in range(n)]
    assert all(len(r.choices) == 3 for r in results)
    new_share = sum(r.choices[0].candidate.state.worker.startswith("new") for r in results) / n
    assert abs(new_share - 0.25) < 0.08, new_share
