"""The TTFT cost model, calibration, routing state and the policies (unit and property tests)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.calibration import Calibrator, ModelCalibration
from kvindex.scoring.costs import CostConfig, EngineShape, FetchCosts, KvProfile, PrefillModel, queue_ms
from kvindex.scoring.home import home_block, rendezvous_order
from kvindex.scoring.ledger import Ledger, SpeculativeKeys
from kvindex.scoring.policies import POLICY_NAMES
from kvindex.scoring.ranker import Ranker, RankerConfig, build_ranker
from kvindex.wire.schema import GPU, Load

MODEL = "m"
BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fleet(
    n: int,
    clock: Clock | None = None,
    observer: Any = None,
    *,
    layout: Any = None,
    config: Any = None,
    policy_options: Any = None,
) -> tuple[Ranker, InvertedIndex, Registry, Clock]:
    """``n`` instances w0.. of MODEL, heard now, with room; ``layout``: a hybrid model's groups."""
    clock = clock or Clock()
    index = InvertedIndex()
    registry = Registry(clock=clock)
    for i in range(n):
        key = (f"w{i}", 0)
        index.add_instance(key, MODEL)
        state = registry.add(key, MODEL, BS)
        state.last_heartbeat_at = clock.t
        state.capacity = {GPU: 10_000}
        state.local_blocks_seen = True
    if layout is not None:
        index.set_layout(MODEL, layout)
    router = build_ranker(
        index,
        registry,
        Calibrator.of(CostConfig()),
        config,
        clock=clock,
        observer=observer,
        policy_options=policy_options,
    )
    return router, index, registry, clock


def prompt(n_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n_blocks)]


def request(keys: list[int], tokens: int | None = None, rid: str = "") -> RouteRequest:
    return RouteRequest(MODEL, keys, tokens if tokens is not None else len(keys) * BS, BS, rid)


# -- terms ----------------------------------------------------------------------------------------


def test_prefill_model_and_fetch_costs() -> None:
    m = PrefillModel(10.0, 0.1, 1e-5)
    assert m.ms(0, 4000) == 0.0
    assert m.ms(1000, 4000) == pytest.approx(10 + 100 + 40)
    # 4000/4000 saves more than 500/500: absolute work, not a ratio.
    assert m.ms(8000, 8000) - m.ms(4000, 8000) > m.ms(8000, 8000) - m.ms(7500, 8000)
    p = KvProfile(kv_bytes_per_token=1e6, pcie_gbps=10, disk_gbps=1, network_gbps=5)
    f = FetchCosts.from_profile(p)
    assert f.per_token_ms == pytest.approx((0.0, 0.1, 1.0, 0.2))
    assert f.ms((100, 10, 1, 5)) == pytest.approx(1 + 1 + 1)


def test_queue_counts_parallel_work_once() -> None:
    m = PrefillModel(500.0, 0.1, 0.0)  # the per-prefill constant is not a per-step cost
    shape = EngineShape(chunk_tokens=1000, step_ms=5.0, decode_ms_per_seq=1.0)
    # Two queued 1000-token prefills are 2000 tokens at the engine's rate, plus two steps' overhead:
    # not the sum of two serial batch times counted from each one's own start.
    assert queue_ms(m, shape, 2000, running=0) == pytest.approx(0.1 * 2000 + 2 * 5.0)
    assert queue_ms(m, shape, 2000, running=10) == pytest.approx(200 + 2 * (5.0 + 10))
    assert queue_ms(m, shape, 0, running=10) == 0.0


def test_candidate_terms() -> None:
    router, index, registry, _clock = fleet(3)
    keys = prompt(10)
    index.store(("w0", 0), 0, keys[:6])
    index.store(("w1", 0), 1, keys[:4])  # CPU tier
    registry.get(("w2", 0)).load = Load(running=2, waiting=1, waiting_prefill_tokens=1000)  # type: ignore[union-attr]
    model = router.calibrator.prefill(MODEL)
    cands = {c.state.worker: c for c in router.candidates(request(keys, 160), registry.all(), 0.0)}
    assert cands["w0"].hit_tokens == 96 and cands["w0"].miss_tokens == 64
    assert cands["w0"].prefill_ms == pytest.approx(model.ms(64, 160))
    assert cands["w1"].tokens_by_tier == (0, 64, 0, 0)
    assert cands["w1"].fetch_ms == pytest.approx(router.config.costs.fetch.ms((0, 64, 0, 0)))
    assert cands["w2"].wait_ms > 0 and cands["w0"].wait_ms == 0
    # The whole prompt cached: the last token is still computed (vLLM's rule).
    index.store(("w0", 0), 0, keys)
    (c,) = router.candidates(request(keys, 160), [registry.get(("w0", 0))], 0.0)  # type: ignore[list-item]
    assert c.hit_tokens == 159 and c.miss_tokens == 1


def test_reported_queue_drains_and_ledger_adds_what_came_after() -> None:
    router, _index, registry, clock = fleet(1)
    state = registry.get(("w0", 0))
    assert state is not None
    state.load = Load(waiting_prefill_tokens=10_000)
    keys = prompt(4)
    (before,) = router.candidates(request(keys), [state], 0.0)
    clock.t += 0.5  # half a second of draining at ~9 K tokens/s
    (later,) = router.candidates(request(keys), [state], 0.0)
    assert later.queued_tokens < before.queued_tokens
    router.score(request(prompt(100, seed=3), rid="r1"), commit=True)
    (after_commit,) = router.candidates(request(keys), [state], 0.0)
    assert after_commit.routed_tokens == 1600 and after_commit.wait_ms > later.wait_ms
    # A heartbeat after the commit reports it in its queue: the ledger stops counting it.
    state.last_heartbeat_at = clock.t + 0.001
    clock.t += 0.002
    (reported,) = router.candidates(request(keys), [state], 0.0)
    assert reported.routed_tokens == 0
    assert router.release("r1", "prefill") and router.release("r1", "finished")
    assert not router.release("r1", "finished")
    with pytest.raises(ValueError):
        router.release("r1", "done")


def test_ledger_work_runs_one_after_another_from_the_last_finished_prefill() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    w = ("w", 0)
    t0 = clock.t
    assert ledger.busy_until(w) == 0.0
    ledger.commit("a", w, MODEL, 1000, 1000, work_ms=500.0)
    clock.t += 0.1
    ledger.commit("b", w, MODEL, 600, 600, work_ms=300.0)  # queued behind a
    ledger.commit("c", w, MODEL, 600, 0, work_ms=0.0)  # nothing to prefill: no work
    assert ledger.busy_until(w) == pytest.approx(t0 + 0.8)
    clock.t = t0 + 1.0
    ledger.commit("d", w, MODEL, 400, 400, work_ms=200.0)  # the engine was idle again: starts now
    assert ledger.busy_until(w) == pytest.approx(t0 + 1.2)
    # a finished late (its first token at 0.9 s): b could only start then.
    clock.t = t0 + 0.9
    ledger.release("a", "prefill")
    assert ledger.busy_until(w) == pytest.approx(t0 + 1.4)  # b to 1.2, then d to 1.4
    clock.t = t0 + 1.0
    ledger.commit("e", w, MODEL, 400, 400, work_ms=100.0)
    assert ledger.busy_until(w) == pytest.approx(t0 + 1.5)
    for rid in ("b", "d", "e"):
        ledger.release(rid, "prefill")
    assert ledger.busy_until(w) == 0.0
    for rid in "abcde":
        ledger.release(rid, "finished")
    assert ledger.busy_until(w) == 0.0 and not ledger.busy


def test_a_prefill_the_heartbeat_does_not_count_is_still_waited_for() -> None:
    """vLLM reports a prompt it is prefilling as running, not waiting: the heartbeat after its
    commit shows no queue, but the ledger still holds its work until its first token."""
    router, _index, registry, clock = fleet(2)
    long = request(prompt(512, seed=5), rid="long")  # 8 K tokens, about a second of prefill
    res = router.score(long, candidates=["w0"], commit=True)
    work = res.choices[0].candidate.prefill_ms
    w0 = registry.get(("w0", 0))
    assert w0 is not None and work > 500
    clock.t += 0.2
    w0.load, w0.last_heartbeat_at = Load(running=1, waiting=0, waiting_prefill_tokens=0), clock.t
    clock.t += 0.1
    short = request(prompt(8, seed=6))
    cands = {c.state.worker: c for c in router.candidates(short, registry.all(), 0.0)}
    assert cands["w0"].routed_tokens == 0  # the heartbeat came after the commit
    assert cands["w0"].wait_ms == pytest.approx(work - 300, rel=1e-6)
    assert cands["w1"].wait_ms == 0.0
    assert router.score(short).choices[0].candidate.state.worker == "w1"
    clock.t += 0.1
    router.release("long", "prefill")  # its first token: the engine is free
    (after,) = router.candidates(short, [w0], 0.0)
    assert after.wait_ms == 0.0


def test_ledger_expiry_and_speculative_ttl() -> None:
    clock = Clock()
    ledger = Ledger(clock, ttl=10)
    ledger.commit("a", ("w", 0), MODEL, 100, 100)
    clock.t += 11
    ledger.expire()
    assert len(ledger) == 0 and ledger.expired == 1
    spec = SpeculativeKeys(clock, ttl=2)
    spec.add(("w", 0), [1, 2, 3])
    assert spec.extend(("w", 0), [1, 2, 3, 4], 0) == 3
    assert spec.extend(("w", 0), [1, 2, 3, 4], 1) == 3
    clock.t += 2.5
    assert spec.extend(("w", 0), [1, 2, 3], 0) == 0  # expired
    spec.expire()
    assert len(spec) == 0


def test_rendezvous_is_stable_and_moves_little() -> None:
    ids = [f"w{i}" for i in range(10)]
    keys = prompt(500)
    first = {k: rendezvous_order(ids, ids, k)[0] for k in keys}
    assert first == {k: rendezvous_order(ids[::-1], ids[::-1], k)[0] for k in keys}  # order-independent
    fewer = [i for i in ids if i != "w3"]
    moved = sum(1 for k in keys if rendezvous_order(fewer, fewer, k)[0] != first[k])
    assert moved == sum(1 for k in keys if first[k] == "w3")  # only w3's prefixes move
    assert (
        home_block(10, 16, 2048) == 9 and home_block(200, 16, 2048) == 127 and home_block(3, 512, 2048) == 2
    )


def test_calibration_converges_and_persists() -> None:
    true = PrefillModel(20.0, 0.08, 2e-6)
    rng = random.Random(5)
    cal = Calibrator()
    assert cal.prefill("x") == cal.prior
    samples = []
    for _ in range(600):
        length = rng.randint(200, 32_000)
        cached = rng.randint(0, length)
        samples.append((length, cached, true.ms(length - cached, length) * rng.uniform(0.97, 1.03)))
    assert cal.add("x", samples) == 600
    fit = cal.prefill("x")
    for length, cached in ((1000, 0), (8000, 2000), (30_000, 1000)):
        assert fit.ms(length - cached, length) == pytest.approx(true.ms(length - cached, length), rel=0.05)
    other = Calibrator()
    other.restore("x", cal.export("x"))
    assert other.prefill("x") == fit
    assert not ModelCalibration().add(100, 200, 5.0)  # more cached than the prompt: rejected


# -- policies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_ranks_every_instance(policy: str) -> None:
    router, index, registry, _clock = fleet(5)
    keys = prompt(20)
    index.store(("w2", 0), 0, keys[:15])
    registry.get(("w4", 0)).load = Load(running=30, waiting=10, waiting_prefill_tokens=50_000, kv_usage=0.9)  # type: ignore[union-attr]
    for i in range(3):
        result = router.score(request(keys, rid=f"{policy}{i}"), policy=policy, commit=True)
        assert sorted(c.candidate.state.worker for c in result.choices) == [f"w{i}" for i in range(5)]
        assert result.committed is not None and result.policy == policy


def test_ttft_prefers_the_cache_until_its_queue_costs_more() -> None:
    router, index, registry, _clock = fleet(4)
    keys = prompt(400)  # 6400 tokens
    index.store(("w1", 0), 0, keys)
    assert router.score(request(keys)).choices[0].candidate.state.worker == "w1"
    registry.get(("w1", 0)).load = Load(waiting_prefill_tokens=200_000, running=20)  # type: ignore[union-attr]
    top = router.score(request(keys)).choices[0]
    assert top.candidate.state.worker != "w1"


def test_cold_prefix_goes_home_and_siblings_follow() -> None:
    router, _index, registry, _clock = fleet(8)
    keys = prompt(200, seed=9)
    ids = [s.instance_id for s in registry.all()]
    home = rendezvous_order(ids, ids, keys[home_block(200, BS, 2048)])[0]
    first = router.score(request(keys, rid="a"), commit=True)
    assert first.choices[0].candidate.state.instance_id == home and first.choices[0].reason == "home"
    # A sibling sharing the prefix, before any stored event: the speculative keys show it on home.
    sibling = keys[:150] + prompt(50, seed=10)
    ranked = router.score(request(sibling)).choices
    assert {c.candidate.state.instance_id: c.candidate.blocks for c in ranked}[home] == 150
    # Home is busy with the first's prefill and every other instance is idle: a recompute there
    # delays nobody and serves sooner (replica_by_wait)...
    assert ranked[0].candidate.state.instance_id != home and ranked[0].reason.startswith("spill")
    assert ranked[0].candidate.wait_ms == 0.0
    # ...while a duplicate that counts in full (a busy fleet) keeps the sibling with the first.
    router.policies["ttft"].replica_by_wait = False  # type: ignore[attr-defined]
    second = router.score(request(sibling, rid="b"), commit=True)
    assert second.choices[0].candidate.state.instance_id == home
    assert second.choices[0].candidate.blocks == 150 and second.choices[0].reason == "replica"


def test_released_prompt_keeps_no_speculative_credit_for_blocks_evicted_since() -> None:
    """A committed prompt's speculative keys end a grace after its release: from then the KV
    events alone say what the engine holds, so a prefix stored and then evicted is not promised
    to a sibling for the rest of the TTL (an ``over`` outcome on a real engine)."""
    router, index, _registry, clock = fleet(8)
    keys = prompt(200, seed=9)
    first = router.score(request(keys, rid="a"), commit=True).choices[0].candidate.state.key
    index.store(first, 0, keys)  # the engine prefilled it: stored events
    assert router.release("a", "prefill")
    index.remove(first, 0, keys[100:])  # ... and evicted its second half soon after
    sibling = keys[:150] + prompt(50, seed=10)
    within_grace = router.score(request(sibling))
    assert within_grace.choices[0].candidate.blocks == 150  # events may still be in flight
    clock.t += router.config.speculative_grace + 0.01
    after = router.score(request(sibling)).choices
    assert [c.candidate.blocks for c in after if c.candidate.state.key == first] == [100]
    # A request never released keeps its keys for the policy's TTL.
    other = prompt(200, seed=11)
    home = router.score(request(other, rid="b"), commit=True).choices[0].candidate.state.key
    clock.t += 5.0
    held = [c.candidate.blocks for c in router.score(request(other)).choices if c.candidate.state.key == home]
    assert held == [200]


def test_hot_prefix_spills_to_the_next_home_and_is_capped() -> None:
    router, index, registry, _clock = fleet(8)
    ttft = router.policies["ttft"]
    ttft.max_replicas = 2  # type: ignore[attr-defined]
    keys = prompt(200, seed=4)
    ids = sorted(s.instance_id for s in registry.all())
    homes = rendezvous_order(ids, ids, keys[home_block(200, BS, 2048)])
    index.store((homes[0].split("/")[0], 0), 0, keys)
    registry.get((homes[0].split("/")[0], 0)).load = Load(waiting_prefill_tokens=500_000, running=50)  # type: ignore[union-attr]
    spill = router.score(request(keys)).choices[0]
    assert spill.candidate.state.instance_id == homes[1] and spill.reason.startswith("spill")
    # A second replica exists and is overloaded too: with the cap at 2, no third replica...
    index.store((homes[1].split("/")[0], 0), 0, keys)
    registry.get((homes[1].split("/")[0], 0)).load = Load(waiting_prefill_tokens=6_000, running=10)  # type: ignore[union-attr]
    capped = router.score(request(keys)).choices[0]
    assert capped.candidate.state.instance_id == homes[1] and capped.reason == "capped"
    # ...unless every holder is far slower than a fresh instance.
    registry.get((homes[1].split("/")[0], 0)).load = Load(waiting_prefill_tokens=500_000, running=50)  # type: ignore[union-attr]
    assert router.score(request(keys)).choices[0].reason == "overflow"


def test_decode_role_ranks_by_headroom() -> None:
    router, index, registry, _clock = fleet(3)
    keys = prompt(50)
    index.store(("w0", 0), 0, keys)
    for i, usage in enumerate((0.9, 0.2, 0.5)):
        registry.get((f"w{i}", 0)).load = Load(kv_usage=usage)  # type: ignore[union-attr]
    req = request(keys)
    req.role = "decode"
    assert [c.candidate.state.worker for c in router.score(req).choices] == ["w1", "w2", "w0"]


def test_loadaware_formula() -> None:
    router, index, registry, _clock = fleet(2)
    keys = prompt(100)
    index.store(("w0", 0), 0, keys[:50])
    registry.get(("w0", 0)).load = Load(running=6)  # type: ignore[union-attr]
    registry.get(("w1", 0)).load = Load(running=2)  # type: ignore[union-attr]
    choices = router.score(request(keys), policy="loadaware").choices
    by = {c.candidate.state.worker: -c.cost for c in choices}
    # w0: 800/1600 - 1.0 * (6 - 4) / 4 = 0.0; w1: 0 - (2 - 4) / 4 = 0.5
    assert by["w0"] == pytest.approx(0.0) and by["w1"] == pytest.approx(0.5)


def test_unknown_default_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        build_ranker(
            InvertedIndex(),
            Registry(),
            Calibrator.of(CostConfig()),
            config=RankerConfig(default_policy="nope"),
        )


# -- properties ------------------------------------------------------------------------------------

loads = st.lists(st.integers(0, 200_000), min_size=4, max_size=4)
overlaps = st.lists(st.integers(0, 64), min_size=4, max_size=4)


def _rank_of(router: Ranker, keys: list[int], worker: str) -> int:
    return [c.candidate.state.worker for c in router.score(request(keys)).choices].index(worker)


def _setup(queue: list[int], overlap: list[int], keys: list[int]) -> tuple[Ranker, InvertedIndex, Registry]:
    router, index, registry, _clock = fleet(4)
    for i in range(4):
        index.store((f"w{i}", 0), 0, keys[: overlap[i]])
        registry.get((f"w{i}", 0)).load = Load(waiting_prefill_tokens=queue[i], running=queue[i] // 5000)  # type: ignore[union-attr]
    return router, index, registry


@settings(max_examples=150, deadline=None)
@given(queue=loads, overlap=overlaps, who=st.integers(0, 3), extra=st.integers(1, 100_000))
def test_more_load_never_improves_a_rank(queue: list[int], overlap: list[int], who: int, extra: int) -> None:
    keys = prompt(64, seed=1)
    router, _index, _registry = _setup(queue, overlap, keys)
    before = _rank_of(router, keys, f"w{who}")
    queue = list(queue)
    queue[who] += extra
    router, _index, _registry = _setup(queue, overlap, keys)
    assert _rank_of(router, keys, f"w{who}") >= before


@settings(max_examples=150, deadline=None)
@given(queue=loads, overlap=overlaps, who=st.integers(0, 3), extra=st.integers(1, 64))
def test_more_overlap_never_worsens_a_rank(
    queue: list[int], overlap: list[int], who: int, extra: int
) -> None:
    keys = prompt(64, seed=2)
    router, _index, _registry = _setup(queue, overlap, keys)
    before = _rank_of(router, keys, f"w{who}")
    overlap = list(overlap)
    overlap[who] = min(64, overlap[who] + extra)
    router, _index, _registry = _setup(queue, overlap, keys)
    assert _rank_of(router, keys, f"w{who}") <= before


def test_congestion_weight_follows_the_fleet_and_is_capped_when_asked() -> None:
    """The weight tends to congestion x (median wait / median prefill - 1), smoothed over
    congestion_tau; ``congestion_max`` bounds it (docs/scoring.md)."""
    from kvindex.scoring.policies.ttft import Ttft

    free, capped = Ttft(), Ttft(congestion_max=30.0)
    for t in range(200):  # 200 s of a fleet whose queues are 60x the work: far past congestion_tau
        free._fold_congestion(60_000.0, 1_000.0, float(t))
        capped._fold_congestion(60_000.0, 1_000.0, float(t))
    assert free._k == pytest.approx(10.0 * 59.0)
    assert capped._k == pytest.approx(30.0)
    calm = Ttft(congestion_max=30.0)
    for t in range(200):  # queues shorter than the work: no weight at all
        calm._fold_congestion(500.0, 1_000.0, float(t))
    assert calm._k == 0.0
