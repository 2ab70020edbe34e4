"""Per-instance calibration of the prefill model: the fit, the rule that picks the model ranking an
instance (default, shared fit, own fit), routers' TTFT reports as samples, persistence, and the
scrape of vLLM's per-request histograms (unit tests of pure logic; the path over real parts is in
tests/integration/test_calibration_e2e.py)."""

from __future__ import annotations

import gzip
import math
import random

import pytest

from kvindex.fleet.registry import Registry
from kvindex.index.inverted import InvertedIndex
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.calibration import DEFAULT, OWN, SHARED, Calibrator, ModelCalibration
from kvindex.scoring.costs import DEFAULT_PREFILL, CostConfig, PrefillModel
from kvindex.scoring.outcomes import Report
from kvindex.scoring.ranker import Ranker, RankerConfig, build_ranker
from kvtools import data
from workers_shim.bridges.engines import SGLANG, VLLM
from workers_shim.bridges.load import LoadReader, PrefillSampler, parse_samples

MODEL = "m"
CPU = PrefillModel(15.0, 0.45, 2e-5)  # what a small model on one CPU core measured like (e2e-routing)


def samples(true: PrefillModel, n: int, seed: int, noise: float = 0.05) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(200, 6000)
        cached = rng.randint(0, length - 1)
        out.append((length, cached, true.ms(length - cached, length) * math.exp(rng.gauss(0, noise))))
    return out


def test_the_default_stays_until_enough_samples_then_a_better_fit_ranks() -> None:
    cal = Calibrator()
    data = samples(CPU, 40, 1)
    cal.add(MODEL, data[:19], "w0/0")
    status = cal.status(MODEL, "w0/0")
    assert (status.source, status.model, status.samples, status.error) == (DEFAULT, DEFAULT_PREFILL, 19, None)
    assert cal.prefill(MODEL) == DEFAULT_PREFILL
    # 20 samples make a candidate; it is judged on the next ones (predicted before learned from).
    cal.add(MODEL, data[19:24], "w0/0")
    assert cal.status(MODEL, "w0/0").source == DEFAULT
    cal.add(MODEL, data[24:], "w0/0")
    status = cal.status(MODEL, "w0/0")
    assert status.source == SHARED and status.samples == 40
    assert status.error is not None and status.error < 0.15  # ~5 % noise, and the fit converged
    assert cal.prefill(MODEL) == status.model
    for length, cached in ((1000, 0), (4000, 3000), (6000, 100)):
        assert status.model.ms(length - cached, length) == pytest.approx(
            CPU.ms(length - cached, length), rel=0.1
        )
    # Every sample was predicted by the default too: it is off by a factor of several on this engine.
    shared = cal.models[MODEL]
    assert shared.error_base > 1.0 > 0.2 > shared.error_fit


def test_a_fit_no_better_than_the_default_is_not_used() -> None:
    cal = Calibrator()
    # The engine behaves like the default model (with noise): its fit is no 10 % better.
    cal.add(MODEL, samples(DEFAULT_PREFILL, 200, 2, noise=0.3), "w0/0")
    status = cal.status(MODEL, "w0/0")
    assert cal.models[MODEL].samples == 200 and cal.models[MODEL].scored > 100
    assert status.source == DEFAULT and status.model == DEFAULT_PREFILL
    assert status.error == pytest.approx(cal.models[MODEL].error_base)


def test_a_fit_that_stops_predicting_well_falls_back() -> None:
    cal = Calibrator()
    cal.add(MODEL, samples(CPU, 60, 3), "w0/0")
    assert cal.status(MODEL, "w0/0").source == SHARED
    # The engine changed (now it is as fast as the default says): the fit, with ~500 samples of
    # memory, still predicts the old engine; once its error over what it learned from exceeds the
    # default's, it goes (not at the first samples: the choice does not follow every change of load).
    cal.add(MODEL, samples(DEFAULT_PREFILL, 30, 4, noise=0.02), "w0/0")
    assert cal.status(MODEL, "w0/0").source == SHARED
    cal.add(MODEL, samples(DEFAULT_PREFILL, 250, 5, noise=0.02), "w0/0")
    assert cal.status(MODEL, "w0/0").source == DEFAULT
    assert cal.prefill(MODEL) == DEFAULT_PREFILL


def test_an_instance_gets_its_own_fit_only_when_it_differs() -> None:
    cal = Calibrator()
    slow = PrefillModel(CPU.a_ms * 3, CPU.b_ms_per_token * 3, CPU.c_ms_per_token2 * 3)
    for round_ in range(8):  # interleaved, as heartbeats arrive
        for i in range(4):
            cal.add(MODEL, samples(CPU, 10, 10 * round_ + i), f"fast{i}/0")
        cal.add(MODEL, samples(slow, 10, 100 + round_), "slow/0")
    assert cal.status(MODEL, "slow/0").source == OWN
    assert cal.prefill_of(MODEL, "slow/0").ms(2000, 2000) == pytest.approx(slow.ms(2000, 2000), rel=0.15)
    assert set(cal.own_models(MODEL)) >= {"slow/0"}

    # A homogeneous fleet stays on the one shared fit: its instances' fits differ by noise only.
    even = Calibrator()
    for round_ in range(8):
        for i in range(4):
            even.add(MODEL, samples(CPU, 10, 1000 + 10 * round_ + i), f"w{i}/0")
    assert [even.status(MODEL, f"w{i}/0").source for i in range(4)] == [SHARED] * 4
    assert even.own_models(MODEL) == {}


def test_router_reports_become_samples_of_the_instance() -> None:
    router = fleet_router(("a", "b"))
    keys = list(range(100))
    request = RouteRequest(MODEL, keys, 1600, 16, "r1")
    top = router.score(request, commit=True).choices[0].candidate
    inst = top.state.instance_id
    assert router.release("r1", "finished", Report(cached_tokens=320, ttft_ms=top.wait_ms + 380.0))
    # One sample: the measured TTFT minus the predicted wait, with the engine's cached tokens.
    own = router.calibrator.instances[MODEL][inst]
    assert own.samples == 1 and router.calibrator.models[MODEL].samples == 1
    assert own.atb[0] == pytest.approx(380.0) and own.atb[1] == pytest.approx(380.0 * 1280 * 1e-3)
    # A TTFT no longer than the predicted wait says nothing about prefill: counted, not learned.
    router.score(RouteRequest(MODEL, keys, 1600, 16, "r2"), commit=True)
    assert router.release("r2", "finished", Report(cached_tokens=0, ttft_ms=0.0))
    assert router.calibrator.rejected == 1 and router.calibrator.models[MODEL].samples == 1
    # Committed while another prefill was in flight on the instance: batched with it, no sample.
    lone = fleet_router(("a",))
    lone.score(RouteRequest(MODEL, keys, 1600, 16, "r3"), commit=True)
    lone.score(RouteRequest(MODEL, keys, 1600, 16, "r4"), commit=True)
    assert lone.release("r4", "finished", Report(cached_tokens=320, ttft_ms=900.0))
    assert lone.calibrator.queued == 1 and MODEL not in lone.calibrator.models
    assert lone.release("r3", "finished", Report(cached_tokens=0, ttft_ms=400.0))
    assert lone.calibrator.models[MODEL].samples == 1  # r3 had nothing ahead of it


def test_reports_of_requests_the_index_saw_waiting_are_not_learned_from() -> None:
    cal = Calibrator()
    assert cal.add_reported(MODEL, "w0/0", 1000, 200, ttft_ms=500.0, predicted_wait_ms=50.0)  # 10 %
    assert cal.models[MODEL].atb[0] == pytest.approx(450.0)
    # A predicted wait of 120 ms in a 500 ms TTFT: the sample would carry the wait estimate's error.
    assert not cal.add_reported(MODEL, "w0/0", 1000, 200, ttft_ms=500.0, predicted_wait_ms=120.0)
    assert cal.queued == 1
    for ttft, wait in ((math.nan, 0.0), (100.0, -1.0), (math.inf, 0.0)):
        assert not cal.add_reported(MODEL, "w0/0", 1000, 200, ttft_ms=ttft, predicted_wait_ms=wait)
    assert cal.rejected == 3 and cal.models[MODEL].samples == 1


def test_persisted_and_replayed_state_picks_the_same_models() -> None:
    cal = Calibrator()
    slow = PrefillModel(60.0, 1.5, 1e-4)
    cal.add(MODEL, samples(CPU, 60, 5), "a/0")
    cal.add(MODEL, samples(slow, 60, 6), "b/0")
    assert cal.dirty == {(MODEL, ""), (MODEL, "a/0"), (MODEL, "b/0")}
    restored = Calibrator()
    for model, instance in cal.dirty:
        restored.restore(model, cal.export(model, instance), instance)
    replayed = Calibrator()
    replayed.load_snapshot(cal.snapshot())
    for other in (restored, replayed):
        for inst in ("a/0", "b/0"):
            assert other.status(MODEL, inst) == cal.status(MODEL, inst)
        assert other.own_models(MODEL) == cal.own_models(MODEL)
    # A calibration stored before errors were kept is judged again before it ranks.
    old = ModelCalibration()
    old.load(
        {k: v for k, v in cal.models[MODEL].to_dict().items() if k in ("ata", "atb", "samples", "updated")}
    )
    assert old.samples == 120 and not old.accepted and old.model() == DEFAULT_PREFILL


def fleet_router(workers: tuple[str, ...], prune_min_instances: int = 128) -> Ranker:
    registry = Registry()
    index = InvertedIndex()
    for w in workers:
        index.add_instance((w, 0), MODEL)
        state = registry.add((w, 0), MODEL, 16)
        state.last_heartbeat_at = registry.clock()
        state.capacity = {0: 10_000}
        state.local_blocks_seen = True
    return build_ranker(
        index,
        registry,
        Calibrator.of(CostConfig()),
        config=RankerConfig(prune_min_instances=prune_min_instances),
    )


def test_the_ranking_prices_an_instance_with_its_own_model() -> None:
    router = fleet_router(("a", "b", "c"), prune_min_instances=2)
    slow = PrefillModel(60.0, 1.5, 1e-4)
    for round_ in range(6):
        router.calibrator.add(MODEL, samples(CPU, 10, 200 + round_), "a/0")
        router.calibrator.add(MODEL, samples(CPU, 10, 300 + round_), "b/0")
        router.calibrator.add(MODEL, samples(slow, 10, 400 + round_), "c/0")
    own = router.calibrator.own_models(MODEL)
    assert "c/0" in own
    request = RouteRequest(MODEL, list(range(100)), 1600, 16)
    result = router.score(request, top_k=3)  # pruning would be on (3 >= 2 instances): not with own fits
    by = {c.candidate.state.instance_id: c.candidate for c in result.choices}
    assert by["c/0"].prefill_ms == pytest.approx(own["c/0"].ms(1600, 1600))
    for inst in ("a/0", "b/0"):
        assert by[inst].prefill_ms == pytest.approx(router.calibrator.prefill_of(MODEL, inst).ms(1600, 1600))
    assert result.choices[-1].candidate.state.instance_id == "c/0"  # the slow one is last


def _page(n: int, seconds: float, prompt: float, computed: float | None, cached: float | None = None) -> str:
    lines = [
        "# TYPE vllm:request_prefill_time_seconds histogram",
        f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {n}',
        f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {n}',
        f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {seconds}',
        "# TYPE vllm:request_prompt_tokens histogram",
        f'vllm:request_prompt_tokens_count{{engine="0",model_name="m"}} {n}',
        f'vllm:request_prompt_tokens_sum{{engine="0",model_name="m"}} {prompt}',
    ]
    if computed is not None:
        lines += [
            "# TYPE vllm:request_prefill_kv_computed_tokens histogram",
            f'vllm:request_prefill_kv_computed_tokens_count{{engine="0",model_name="m"}} {n}',
            f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0",model_name="m"}} {computed}',
        ]
    if cached is not None:
        lines += [
            "# TYPE vllm:prompt_tokens_cached counter",
            f'vllm:prompt_tokens_cached_total{{engine="0",model_name="m"}} {cached}',
        ]
    return "\n".join(lines) + "\n"


def test_vllm_histograms_give_the_mean_prefill_between_scrapes() -> None:
    sampler = PrefillSampler(LoadReader(VLLM))
    assert sampler.sample(parse_samples(_page(3, 0.6, 3100, 1628)), 0) is None  # the first scrape: a baseline
    assert sampler.sample(parse_samples(_page(3, 0.6, 3100, 1628)), 0) is None  # nothing finished since
    # Two requests finished: 1000 + 3000 prompt tokens, 972 + 24 computed, 0.3 s + 0.1 s.
    assert sampler.sample(parse_samples(_page(5, 1.0, 7100, 2624)), 0) == (2000, 1502, pytest.approx(200.0))
    assert (
        sampler.sample(parse_samples(_page(5, 1.0, 7100, 2624)), 1) is None
    )  # another rank: its own baseline
    # The engine restarted: counters went back; no sample, and the next one counts from there.
    assert sampler.sample(parse_samples(_page(1, 0.2, 800, 800)), 0) is None
    assert sampler.sample(parse_samples(_page(2, 0.25, 1600, 832)), 0) == (800, 768, pytest.approx(50.0))
    # Without the computed-tokens histogram (older vLLM), the cached-token counter stands in.
    older = PrefillSampler(LoadReader(VLLM))
    assert older.sample(parse_samples(_page(1, 0.1, 500, None, cached=0)), 0) is None
    assert older.sample(parse_samples(_page(2, 0.15, 1000, None, cached=480)), 0) == (
        500,
        480,
        pytest.approx(50.0),
    )
    # Requests waiting at a scrape: the prefills around it ran batched with others'; no sample for
    # the interval before it or the one after.
    busy = PrefillSampler(LoadReader(VLLM))
    waiting = 'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
    assert busy.sample(parse_samples(_page(1, 0.1, 500, 500)), 0) is None
    assert busy.sample(parse_samples(_page(2, 0.2, 1000, 1000) + waiting), 0) is None
    assert busy.sample(parse_samples(_page(3, 0.3, 1500, 1500)), 0) is None
    assert busy.sample(parse_samples(_page(4, 0.4, 2000, 2000)), 0) == (500, 0, pytest.approx(100.0))
    assert busy.skipped_queued == 2
    # Histograms that disagree on the request count, or an engine without them: nothing.
    broken = _page(4, 1.0, 7100, 2624).replace('prompt_tokens_count{engine="0",model_name="m"} 4', "x 1")
    assert PrefillSampler(LoadReader(VLLM))._totals(parse_samples(broken), 0) is None
    assert PrefillSampler(LoadReader(SGLANG)).sample(parse_samples(_page(2, 1.0, 10, 5)), 0) is None


def test_calibration_off_keeps_the_default_and_counts_the_samples() -> None:
    cal = Calibrator(learn=False)
    assert cal.add(MODEL, samples(CPU, 60, 9), "w0/0") == 0
    assert cal.ignored == 60 and cal.models == {} and cal.dirty == set()
    assert cal.status(MODEL, "w0/0").source == DEFAULT and cal.prefill(MODEL) == DEFAULT_PREFILL


def test_a_scrape_parses_only_the_samples_it_reads_and_reads_the_same() -> None:
    """A real vLLM page (kvtools/data): parsing only the profile's sample names gives the load, the
    cache info and the prefill totals the full parse gives, and drops the rest of the page."""
    page = gzip.decompress((data.vllm_captures() / "metrics_page.txt.gz").read_bytes()).decode()
    full = parse_samples(page)
    names = VLLM.sample_names()
    some = parse_samples(page, names)
    assert set(some) <= names and len(some) < len(full) / 5
    assert {name: full[name] for name in some} == some  # same series, same labels, same values
    reader = LoadReader(VLLM)
    assert reader.load(some, 0) == reader.load(full, 0)
    assert reader.cache_info(some, 0) == reader.cache_info(full, 0)
    assert reader.cache_info(some, 0).block_size == 32
    totals = PrefillSampler(reader)._totals(some, 0)
    assert totals is not None and totals == PrefillSampler(reader)._totals(full, 0)
    assert totals[0] > 0  # the page holds finished requests: the samples are really read
    # Comment lines, label values holding a wanted name, and a name's longer sibling are not taken.
    tricky = "\n".join(
        [
            "# HELP vllm:num_requests_running running",
            'vllm:other{name="vllm:num_requests_running"} 5',
            'vllm:num_requests_running_max{engine="0"} 9',
            'vllm:num_requests_running{engine="0"} 2',
            "vllm:num_requests_waiting 1",
        ]
    )
    with pytest.raises(ValueError, match="none of the"):  # not this engine's page: an error, not idle
        parse_samples("garbage{\n<html>Bad Gateway</html>", names)
    assert parse_samples("", names) == {}
    assert parse_samples(tricky, names) == {
        "vllm:num_requests_running": [({"engine": "0"}, 2.0)],
        "vllm:num_requests_waiting": [({}, 1.0)],
    }
