"""One cost model, one definition (kvindex/scoring/costs.py), bit-identical wherever it prices: its
compiled build against its Python source (interpreted, as an install without a C compiler runs it),
the candidates (``CandidateBuilder.candidates``, one instance at a time) against the definition, and
the pruned rankings' columns and selection (``CandidatePool``: the row loops ``wait_rows``,
``cost_rows``, ``rank_others``, ``rank_grouped``) against both, on random fleets, engine shapes and
prefill models."""

from __future__ import annotations

import random
from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index import InvertedIndex
from kvindex.scoring import _kernels, costs
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import (
    CostConfig,
    EngineShape,
    FetchCosts,
    PrefillModel,
    drain_rate,
    est_ttft_ms,
    ledger_ms,
    prefill_ms,
    queue_ms,
    queued_now,
    wait_ms,
    weighted_cost,
)
from kvindex.scoring.pool import CandidatePool
from kvindex.scoring.ranker import Ranker, RankerConfig, build_ranker
from kvindex.wire.schema import CPU, DISK, GPU, SHARED, Load
from tests.unit.interpreted_costs import compiled, interpreted, interpreted_cost_model

MODEL = "m"
BS = 16


def test_the_rankings_use_the_compiled_cost_model() -> None:
    """Built (the cost model compiled from its source, the kernels imported above) and picked up by
    the modules that rank with them."""
    from kvindex.scoring import candidates, fleet_table, pool

    assert compiled(), costs.__file__
    assert fleet_table.wait_rows is costs.wait_rows and candidates.queue_wait is costs.queue_wait
    assert pool.rank_others is costs.rank_others and pool.cost_rows is costs.cost_rows
    assert fleet_table._native_weights is _kernels.rendezvous_weights
    assert pool._native_mark_group_rows is _kernels.mark_group_rows


class Clock:
    def __init__(self) -> None:
        self.t = 5000.0

    def __call__(self) -> float:
        return self.t


def _bits(x: float) -> int:
    """The float's bits (0.0 and -0.0 both as 0.0: no form distinguishes them)."""
    return int(np.float64(x + 0.0).view(np.uint64))


def _same(a: float, b: float) -> bool:
    return _bits(a) == _bits(b)


def _build(rng: random.Random) -> tuple[Ranker, RouteRequest, Clock]:
    clock = Clock()
    shape = EngineShape(
        chunk_tokens=rng.choice([1, 7, 512, 2048, 8192, 16384]),
        step_ms=rng.choice([0.0, 10.0, rng.uniform(0, 30)]),
        decode_ms_per_seq=rng.choice([0.0, 0.3, rng.uniform(0, 2)]),
    )
    model = PrefillModel(
        rng.choice([0.0, 25.0, rng.uniform(0, 100)]),
        rng.choice([0.0, 0.11, rng.uniform(0, 0.5)]),
        rng.choice([0.0, 0.11 / 32_768, rng.uniform(0, 1e-4)]),
    )
    fetch = FetchCosts((0.0, rng.uniform(0, 0.05), rng.uniform(0, 0.2), rng.uniform(0, 0.1)))
    costs = CostConfig(
        fetch=fetch,
        engine=shape,
        default_prefill=model,
        drain_reported_queue=rng.random() < 0.8,
        calibrate=False,
    )
    config = RankerConfig(costs=costs, prune_min_instances=0, group_min_instances=rng.choice([0, 2, 1000]))
    index = InvertedIndex()
    registry = Registry(clock=clock)
    router = build_ranker(index, registry, Calibrator.of(config.costs), config=config, clock=clock)
    router.tables  # noqa: B018 - watching before the fleet is built, as a server does
    system = [rng.getrandbits(64) for _ in range(rng.randint(0, 12))]
    tail = [rng.getrandbits(64) for _ in range(rng.randint(0, 12))]
    keys = system + tail
    for i in range(rng.randint(1, 60)):
        key = (f"w{i:03d}", rng.randint(0, 1))
        index.add_instance(key, MODEL)
        state = registry.add(key, MODEL, BS)
        state.capacity = {GPU: 10_000}
        state.local_blocks_seen = True
        if rng.random() < 0.9:
            state.last_heartbeat_at = clock.t - rng.choice([0.0, rng.uniform(0, 3), rng.uniform(0, 60)])
        if rng.random() < 0.05:
            state.stale = True  # a row that is not a candidate
        if rng.random() > 0.3:
            state.load = Load(
                running=rng.randint(0, 64),
                waiting=rng.randint(0, 10),
                waiting_prefill_tokens=rng.choice([0, rng.randint(1, 100), rng.randint(0, 300_000)]),
                kv_usage=rng.choice([0.0, 0.5, rng.random()]),
            )
        where = rng.random()
        if system and where < 0.6:
            index.store(key, GPU, system)
        elif system and where < 0.75:
            cut = rng.randint(0, len(system))
            index.store(key, GPU, system[:cut])
            index.store(key, rng.choice([CPU, DISK, SHARED]), system[cut:])
        if keys and rng.random() < 0.1:
            index.store(key, rng.choice([GPU, CPU]), keys[: rng.randint(1, len(keys))])
        for j in range(rng.choice([0, 0, 1, 3])):  # routed there since its heartbeat (the ledger)
            work = rng.choice([0.0, rng.uniform(0, 3000), rng.uniform(0, 60_000)])
            router.ledger.commit(f"{i}-{j}", key, MODEL, rng.randint(1, 9000), rng.randint(0, 9000), work)
            clock.t += rng.choice([0.0, 0.0, rng.uniform(0, 2)])
            if rng.random() < 0.2:
                router.ledger.release(f"{i}-{j}", "prefill")
    clock.t += rng.choice([0.0, 0.05, 1.0, 30.0])
    prompt = len(keys) * BS + rng.choice([0, 0, 5]) if keys else rng.choice([0, rng.randint(1, 50_000)])
    return router, RouteRequest(MODEL, keys, prompt, BS, "r"), clock


def _scalar(
    router: Ranker,
    state: InstanceState,
    prompt: int,
    miss: int,
    by_tier: tuple[int, int, int, int],
    c: ModuleType = costs,
) -> tuple[float, float, float]:
    """(wait, prefill, fetch) of the instance by the definitions in costs.py (``c``: compiled, or
    its source interpreted)."""
    config = router.config.costs
    model = router.calibrator.prefill(MODEL)
    at = state.last_heartbeat_at
    n_new, routed, _ = router.ledger.pending(state.key, at)
    rate = c.drain_rate(model, config.drain_reported_queue)
    queued = c.queued_now(state.load.waiting_prefill_tokens, at, router.clock(), rate, routed)
    running = state.load.running + n_new
    ledger = c.ledger_ms(router.ledger.busy_until(state.key), router.clock())
    f = config.fetch.per_token_ms
    return (
        c.wait_ms(c.queue_ms(model, config.engine, queued, running), ledger),
        c.prefill_ms(model, config.engine, miss, prompt, running),
        c.fetch_ms(f[1], f[2], f[3], by_tier[1], by_tier[2], by_tier[3]),
    )


def _expected_selection(pool: CandidatePool, cost: dict[int, float], top_k: int) -> set[int]:
    """The selection of the others from the scalar costs: per group, the first ``top_k`` others in
    (cost, kv, load, instance key) order."""
    table = pool.table
    group_of = pool.group_of
    by_group: dict[int, list[int]] = {}
    for i in pool.rest_rows.tolist():
        by_group.setdefault(0 if group_of is None else int(group_of[i]), []).append(i)
    chosen: set[int] = set()
    for rows in by_group.values():
        rows.sort(key=lambda i: (cost[i], pool.kv[i], pool.load[i], table.states[i].key))
        chosen |= set(rows[:top_k])
    return chosen


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([0.0, 0.5, 3.0, 17.25]))
def test_every_form_of_the_cost_model_agrees_bit_for_bit(seed: int, k: float) -> None:
    rng = random.Random(seed)
    router, request, clock = _build(rng)
    prompt = request.prompt_tokens
    states = router.registry.routable(MODEL, None)

    # The candidates against the definition, compiled and interpreted, instance by instance.
    python = interpreted()
    for cand in router.candidates(request, states, 0.0):
        wait, prefill, fetch = _scalar(router, cand.state, prompt, cand.miss_tokens, cand.tokens_by_tier)
        again = _scalar(router, cand.state, prompt, cand.miss_tokens, cand.tokens_by_tier, python)
        assert [_bits(x) for x in again] == [_bits(x) for x in (wait, prefill, fetch)], cand.state.key
        assert _same(cand.wait_ms, wait), (cand.state.key, cand.wait_ms, wait)
        assert _same(cand.prefill_ms, prefill), (cand.state.key, cand.prefill_ms, prefill)
        assert _same(cand.fetch_ms, fetch), (cand.state.key, cand.fetch_ms, fetch)
        assert _same(cand.est_ttft_ms, est_ttft_ms(wait, prefill, fetch))

    pool = router.pool(request, None, 0.0)
    if pool is None:
        return
    table = pool.table
    n = table.n
    model = router.calibrator.prefill(MODEL)
    config = router.config.costs
    shape = config.engine
    rate = drain_rate(model, config.drain_reported_queue)

    # The columns: every row's wait, prefill, est and cost against the definition, with its group's
    # answer (the template's miss and tokens by tier).
    templates = pool.templates
    group_of = pool.group_of
    est_col, cost_col = pool.est, pool.cost(k)
    cost: dict[int, float] = {}
    low = None
    for i in range(n):
        t = templates[0 if group_of is None else int(group_of[i])]
        wait, prefill, fetch = _scalar(router, table.states[i], prompt, t.miss_tokens, t.tokens_by_tier)
        assert _same(pool.wait[i], wait), (i, pool.wait[i], wait)
        assert _same(pool.prefill[i], prefill), (i, pool.prefill[i], prefill)
        est = est_ttft_ms(wait, prefill, fetch)
        assert _same(est_col[i], est), (i, est_col[i], est)
        cost[i] = weighted_cost(est, prefill, fetch, k)
        assert _same(cost_col[i], cost[i]), (i, cost_col[i], cost[i])
        low = prefill if low is None or prefill < low else low

    # The waits of any rows (listed twice, or all of them), compiled and interpreted, against the
    # columns.
    rows = np.array(sorted(rng.choices(range(n), k=rng.randint(1, 2 * n))), dtype=np.int64)
    for listed in (rows, None):
        at = np.arange(n) if listed is None else listed
        got = []
        for form in (costs, python):
            wait = np.full(n, np.nan)
            form.wait_rows(
                table.queued, table.heartbeat_at, table.tokens_new, table.queued_now, table.running_now,
                table.busy_until, table.drains.view(np.uint8),
                np.zeros(0, np.int64) if listed is None else listed,
                n if listed is None else len(listed), clock.t, model.b_ms_per_token, shape.step_ms,
                float(shape.chunk_tokens), shape.decode_ms_per_seq, rate, wait, np.empty(2 * n + 1, np.int64),
                np.zeros(n, np.uint8),
            )  # fmt: skip
            got.append((wait[at] + 0.0).view(np.uint64))
        assert np.array_equal(got[0], got[1])
        assert np.array_equal(got[0], (pool.wait[at] + 0.0).view(np.uint64))

    # The selection of the best others: compiled and interpreted (rank_others / rank_grouped), and
    # the columns' partition, against the scalar order.
    for top_k in (1, 3, 8):
        want_rows = _expected_selection(pool, cost, top_k)
        numpy_rows = set(pool.smallest(pool.cost(k), top_k).tolist())
        assert numpy_rows == want_rows
        native = pool.rank_others(k, top_k)
        with interpreted_cost_model():
            assert _picked(pool.rank_others(k, top_k)) == _picked(native)
        assert native is not None
        chosen, native_low, waiting = native
        assert set(chosen.tolist()) == want_rows
        assert _same(native_low, low)
        assert waiting == sum(1 for i in range(n) if pool.wait[i] <= low)


def _picked(ranked: tuple[np.ndarray, float, int] | None) -> tuple[list[int], int, int]:
    assert ranked is not None
    return sorted(ranked[0].tolist()), _bits(ranked[1]), ranked[2]


@settings(max_examples=200, deadline=None)
@given(
    reported=st.one_of(st.just(0), st.integers(1, 2**40)),
    age=st.one_of(st.none(), st.floats(0, 1e4)),
    routed=st.integers(0, 2**40),
    running=st.integers(0, 10_000),
    b=st.one_of(st.just(0.0), st.floats(1e-6, 10)),
    chunk=st.integers(1, 1 << 20),
    step=st.floats(0, 1e3),
    dps=st.floats(0, 10),
    drain=st.booleans(),
    busy=st.one_of(st.just(0.0), st.floats(0, 2e6)),
)
def test_the_wait_kernels_equal_the_definition_on_any_input(
    reported: int,
    age: float | None,
    routed: int,
    running: int,
    b: float,
    chunk: int,
    step: float,
    dps: float,
    drain: bool,
    busy: float,
) -> None:
    """One row at the edges (huge queues, chunk 1, no drain, no heartbeat, ledger work over or
    not), compiled and interpreted."""
    now = 1e6
    model = PrefillModel(1.0, b, 1e-6)
    shape = EngineShape(chunk_tokens=chunk, step_ms=step, decode_ms_per_seq=dps)
    rate = drain_rate(model, drain)
    at = None if age is None else now - age
    want = wait_ms(
        queue_ms(model, shape, queued_now(reported, at, now, rate, routed), running), ledger_ms(busy, now)
    )
    col = lambda x: np.array([float(x)])  # noqa: E731
    drains = np.array([bool(reported) and at is not None])
    args = (
        col(reported), col(0.0 if at is None else at), col(routed), col(reported + routed), col(running),
        col(busy),
    )  # fmt: skip
    python = interpreted()
    for form in (costs, python):
        got = np.full(1, np.nan)
        form.wait_rows(
            *args, drains.view(np.uint8), np.zeros(0, np.int64), 1, now, b, step, float(chunk), dps, rate,
            got, np.empty(1, np.int64), np.zeros(1, np.uint8),
        )  # fmt: skip
        assert _same(got[0], want), (form.__name__, got[0], want)
    defined = python.wait_ms(
        python.queue_ms(model, shape, python.queued_now(reported, at, now, rate, routed), running),
        python.ledger_ms(busy, now),
    )
    assert _same(defined, want)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(st.integers(1, 2**50), st.floats(1e-9, 2**50)),
    chunk=st.one_of(st.integers(1, 1 << 20), st.sampled_from([1, 7, 512, 8192])),
)
def test_engine_steps_are_pythons_floor_division(tokens: float, chunk: int) -> None:
    """``chunks``, compiled and interpreted, is ``-(-tokens // chunk)``: Python's float floor
    division, which the compiled build (C's floor(a / b) for ``//``) would not give at the edges."""
    want = float(-(-tokens // chunk))
    assert _same(costs.chunks(tokens, chunk), want)
    assert _same(interpreted().chunks(tokens, chunk), want)


@pytest.mark.parametrize("miss", [0, 1, 7, 8192, 8193, 100_000])
def test_prefill_terms_are_the_prefill(miss: int) -> None:
    """The columns' ``a * running + b`` is prefill_ms for every running count."""
    from kvindex.scoring.costs import prefill_terms

    model = PrefillModel(25.0, 0.11, 0.11 / 32_768)
    shape = EngineShape(chunk_tokens=8192, step_ms=10.0, decode_ms_per_seq=0.3)
    a, b = prefill_terms(model, shape, miss, 100_000)
    running = np.arange(0, 500, dtype=np.float64)
    col = a * running
    col += b
    assert [_bits(x) for x in col] == [_bits(prefill_ms(model, shape, miss, 100_000, r)) for r in range(500)]
