"""Pruned rankings (Ranker.score with top_k: holders + the best few others) give the same first
top_k as the exhaustive ranking of every instance, over random fleets."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex, _pytable
from kvindex.scoring import fleet_table
from kvindex.scoring.base import Choice, RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.fleet_table import median_of, rendezvous_weights, smallest
from kvindex.scoring.policies import POLICY_CLASSES, POLICY_NAMES
from kvindex.scoring.ranker import Ranker, RankerConfig, build_ranker
from kvindex.wire.schema import CPU, DISK, GPU, SHARED, Load
from tests.unit.interpreted_costs import interpreted_cost_model

MODEL = "m"
BS = 16
PRUNED = [name for name in (*POLICY_NAMES, "decode") if hasattr(POLICY_CLASSES[name], "rank_top")]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _view(choices: list[Choice]) -> list[tuple]:
    return [
        (
            ch.candidate.state.key,
            ch.cost,
            ch.reason,
            ch.candidate.blocks,
            ch.candidate.tokens_by_tier,
            ch.candidate.wait_ms,
            ch.candidate.prefill_ms,
            ch.candidate.fetch_ms,
            ch.candidate.inflight,
        )
        for ch in choices
    ]


def _policy_state(router: Ranker, name: str) -> tuple:
    p = router.policies[name]
    return tuple(getattr(p, a) for a in ("_k", "_k_at") if hasattr(p, a))


def _restore(router: Ranker, name: str, saved: tuple) -> None:
    p = router.policies[name]
    if saved:
        p._k, p._k_at = saved  # type: ignore[attr-defined]


def build_fleet(
    rng: random.Random,
    n: int,
    n_prompts: int,
    backend: str,
    all_routable: bool = False,
    shared: bool = False,
) -> tuple[Ranker, list[list[int]], Clock]:
    """``shared``: the prompts start with one system prompt that most instances hold (on the GPU,
    or partly on other tiers, or a shorter part of it), and 1-4 instances hold each prompt deeper:
    the pruned rankings see match groups (ranked by columns) besides single holders."""
    clock = Clock()
    index = InvertedIndex(_pytable if backend == "python" else None)
    registry = Registry(clock=clock)
    config = RankerConfig(prune_min_instances=0, group_min_instances=rng.choice([0, 1, 3, 16]))
    router = build_ranker(index, registry, Calibrator.of(config.costs), config=config, clock=clock)
    router.tables  # noqa: B018 - start watching before the fleet is built, as a server would
    system = [rng.getrandbits(64) for _ in range(rng.randint(1, 24))] if shared else []
    prompts = [
        system[: rng.choice([len(system), len(system), rng.randint(0, len(system))])]
        + [rng.getrandbits(64) for _ in range(rng.randint(0, 40))]
        for _ in range(n_prompts)
    ]
    pooled = shared and rng.random() < 0.15  # someone offloads the system prompt to the pool
    for i in range(n):
        key = (f"w{rng.randint(0, n * 2)}-{i}", rng.randint(0, 2))
        index.add_instance(key, MODEL)
        state = registry.add(key, MODEL, BS)
        kind = 1.0 if all_routable else rng.random()
        if kind < 0.05:
            state.capacity = {SHARED: 1000}  # a pool: never ranked
        elif kind < 0.1:
            pass  # never heard from: routable until it publishes only shared blocks
        else:
            state.capacity = {GPU: 10_000}
            state.local_blocks_seen = True
        if rng.random() < 0.9:
            state.last_heartbeat_at = clock.t - rng.random() * 2
        if rng.random() < 0.05 and not all_routable:
            state.stale = True
        busy = rng.random()
        if busy < 0.3:
            state.load = Load()  # idle: many exact ties
        else:
            state.load = Load(
                running=rng.randint(0, 40),
                waiting=rng.randint(0, 10),
                waiting_prefill_tokens=rng.choice([0, rng.randint(0, 60_000)]),
                kv_usage=rng.choice([0.0, 0.5, rng.random()]),
            )
        if system:
            part = rng.random()
            if pooled and i == 0:
                index.store(key, SHARED, system)
            elif part < 0.8:
                index.store(key, GPU, system)
            elif part < 0.88:  # the system prompt's tail offloaded to the CPU (or disk)
                cut = rng.randint(0, len(system))
                index.store(key, GPU, system[:cut])
                index.store(key, rng.choice([CPU, DISK]), system[cut:])
            elif part < 0.95:
                index.store(key, GPU, system[: rng.randint(0, len(system))])
        # Holders: a prefix of some prompt, on a random tier (with a system prompt: past it).
        for keys in prompts:
            if keys and rng.random() < (rng.randint(1, 4) if shared else 3) / max(n, 3):
                depth = rng.randint(min(len(system), len(keys) - 1) + 1, len(keys))
                tier = rng.choice([GPU, GPU, CPU, DISK, SHARED])
                index.store(key, tier, keys[:depth])
    return router, prompts, clock


def _requests(rng: random.Random, router: Ranker, prompts: list[list[int]]) -> list[RouteRequest]:
    out = []
    for j, keys in enumerate(prompts):
        tokens = len(keys) * BS + rng.choice([0, 0, 7])
        out.append(RouteRequest(MODEL, keys, tokens, BS, f"r{j}-{rng.random()}"))
    return out


def _check(router: Ranker, name: str, req: RouteRequest, candidates: list[str] | None, top_k: int) -> None:
    saved = _policy_state(router, name)
    full = router.score(req, candidates, name).choices
    after_full = _policy_state(router, name)
    _restore(router, name, saved)
    pruned = router.score(req, candidates, name, top_k=top_k).choices
    assert _policy_state(router, name) == after_full
    assert _view(pruned) == _view(full[:top_k])


@contextlib.contextmanager
def _natives(backend: str) -> Iterator[None]:
    """ "python": no native code at all, as without a compiler (the cost model runs as Python)."""
    if backend == "native":
        yield
        return
    with interpreted_cost_model():
        yield


def _exercise(
    rng: random.Random, router: Ranker, prompts: list[list[int]], clock: Clock, top_ks: list[int]
) -> None:
    registry = router.registry
    states = registry.all()
    for step in range(6):
        for req in _requests(rng, router, prompts):
            name = rng.choice(PRUNED)
            candidates = None
            if rng.random() < 0.25 and states:
                picked = rng.sample(states, min(len(states), rng.randint(1, 6)))
                candidates = [s.instance_id if rng.random() < 0.7 else s.worker for s in picked]
                candidates.append("nobody/0")
            for top_k in top_ks:
                _check(router, name, req, candidates, top_k)
            # Evolve: commit (ledger + speculative keys + heat), release, heartbeats, time.
            if rng.random() < 0.6:
                router.score(req, None, name, commit=True, top_k=rng.choice(top_ks))
            if rng.random() < 0.3 and len(router.ledger):
                rid = rng.choice(list(router.ledger._entries))
                router.release(rid, rng.choice(["prefill", "finished"]))
        # Degraded instances (their match credited in part): holders and members of match groups.
        if states and rng.random() < 0.5:
            router.degraded ^= {s.key for s in rng.sample(states, min(len(states), rng.randint(1, 3)))}
        clock.t += rng.choice([0.01, 0.2, 1.0, 7.0])
        for state in rng.sample(states, min(len(states), 5)):
            state.last_heartbeat_at = clock.t
            if rng.random() < 0.4:
                continue  # a heartbeat that moved only its time (the tables' time-only rows)
            state.load = Load(running=rng.randint(0, 30), waiting_prefill_tokens=rng.randint(0, 30_000))
            if rng.random() < 0.2:
                state.stale = not state.stale
        # Without a reported capacity, a first batch without local blocks makes an instance a pool,
        # and a later local block makes it routable again (neither field is watched: re-read).
        unsure = [s for s in states if not s.capacity and not s.local_blocks_seen]
        if unsure and rng.random() < 0.5:
            who = rng.choice(unsure)
            if who.batches and rng.random() < 0.5:
                who.local_blocks_seen = True
            else:
                who.batches += 1
        if step == 3 and states:
            gone = rng.choice(states)
            registry.remove(gone.key)
            router.index.drop_instance(gone.key)
            states.remove(gone)


def _exercise_congested(
    rng: random.Random,
    router: Ranker,
    prompts: list[list[int]],
    clock: Clock,
    backend: str,
    congestion: float,
) -> None:
    """``_exercise`` with the ttft policy at a drawn congestion weight (and smoothed state)."""
    ttft = router.policies["ttft"]
    ttft.congestion = congestion  # type: ignore[attr-defined]
    ttft._k = rng.choice([0.0, 0.5, 3.0])  # type: ignore[attr-defined]
    with _natives(backend):
        _exercise(rng, router, prompts, clock, [1, 2, 4, 9])


@pytest.mark.parametrize("backend", ["native", "python"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 120), congestion=st.sampled_from([0.0, 10.0]))
def test_pruned_top_k_equals_exhaustive_small_fleets(
    backend: str, seed: int, n: int, congestion: float
) -> None:
    rng = random.Random(seed)
    router, prompts, clock = build_fleet(rng, n, 4, backend)
    _exercise_congested(rng, router, prompts, clock, backend, congestion)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_pruned_top_k_equals_exhaustive_thousands(seed: int) -> None:
    rng = random.Random(seed)
    router, prompts, clock = build_fleet(rng, rng.choice([700, 2500]), 3, "native")
    _exercise(rng, router, prompts, clock, [1, 4])


@pytest.mark.parametrize("backend", ["native", "python"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), congestion=st.sampled_from([0.0, 10.0]))
def test_pruned_top_k_equals_exhaustive_every_instance_routable(
    backend: str, seed: int, n: int, congestion: float
) -> None:
    """No pools or stale instances at first: the pruned ranking's shortcuts for a fleet where every
    row is a candidate (selection without listing the others, the congestion bound, cached waits
    and tie order) run, with many idle instances tied on cost."""
    rng = random.Random(seed)
    router, prompts, clock = build_fleet(rng, n, 4, backend, all_routable=True)
    _exercise_congested(rng, router, prompts, clock, backend, congestion)


@pytest.mark.parametrize("backend", ["native", "python"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 300),
    congestion=st.sampled_from([0.0, 10.0]),
    all_routable=st.booleans(),
)
def test_pruned_top_k_equals_exhaustive_shared_prefix(
    backend: str, seed: int, n: int, congestion: float, all_routable: bool
) -> None:
    """Most instances hold the prompts' system prompt and differ in tails, tiers, loads and ledger
    entries: their answers form match groups, ranked by columns like the non-holders."""
    rng = random.Random(seed)
    router, prompts, clock = build_fleet(rng, n, 4, backend, all_routable=all_routable, shared=True)
    _exercise_congested(rng, router, prompts, clock, backend, congestion)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_pruned_top_k_equals_exhaustive_shared_prefix_thousands(seed: int) -> None:
    rng = random.Random(seed)
    router, prompts, clock = build_fleet(rng, rng.choice([700, 2500]), 3, "native", shared=True)
    _exercise(rng, router, prompts, clock, [1, 4])


def test_smallest_is_exact_with_ties() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 60))
        cols = [rng.integers(0, 3, n).astype(float), rng.integers(0, 3, n).astype(float), rng.permutation(n)]
        rows = np.flatnonzero(rng.random(n) < 0.8)
        m = int(rng.integers(1, 10))
        got = sorted(smallest(cols, rows, m).tolist())
        want = sorted(sorted(rows.tolist(), key=lambda i: (cols[0][i], cols[1][i], cols[2][i]))[:m])
        assert got == want


@pytest.mark.parametrize("native", [True, False])
def test_median_and_weights_match_the_reference(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import statistics

    import numpy as np
    import xxhash

    if not native:  # the fallback without the extension: one Python call per id
        monkeypatch.setattr(fleet_table, "_native_weights", None)
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 11):
        vals = [rng.choice([0.0, 1.5, rng.random()]) for _ in range(n)]
        assert median_of(np.array(vals)) == statistics.median(vals)
    ids = [f"w{i}/0".encode() for i in range(50)]
    assert rendezvous_weights(ids, 2**64 - 5).tolist() == [
        xxhash.xxh3_64_intdigest(i, 2**64 - 5) for i in ids
    ]


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_heartbeat_that_moves_only_its_time_refreshes_a_draining_wait(backend: str) -> None:
    """A heartbeat with the same Load object (the tables write its time alone) restarts the drain
    of its reported queue: the kept wait column must see it (ModelTable.write_times)."""
    with _natives(backend):
        clock = Clock()
        index = InvertedIndex(_pytable if backend == "python" else None)
        registry = Registry(clock=clock)
        router = build_ranker(
            index,
            registry,
            Calibrator.of(CostConfig()),
            config=RankerConfig(prune_min_instances=0),
            clock=clock,
        )
        router.tables  # noqa: B018 - watching before the fleet is built
        states = []
        for i in range(200):
            key = (f"w{i:03d}", 0)
            index.add_instance(key, MODEL)
            state = registry.add(key, MODEL, BS)
            state.capacity = {GPU: 10_000}
            state.local_blocks_seen = True
            state.last_heartbeat_at = clock.t
            # Everyone but w000 has a small queue that is still draining; w000's is the largest.
            state.load = Load(running=2, waiting_prefill_tokens=60_000 if i == 0 else 2_000 + i)
            states.append(state)
        req = RouteRequest(MODEL, [], 4096, BS, "r")
        first = router.score(req).choices
        assert _view(router.score(req, top_k=4).choices) == _view(first[:4])
        clock.t += 600.0  # every reported queue has drained to 0: no row is still draining
        drained = router.score(req).choices
        assert _view(router.score(req, top_k=4).choices) == _view(drained[:4])
        assert drained[0].candidate.state.key == ("w000", 0)  # all tied: key order
        states[0].last_heartbeat_at = clock.t  # its queue is 60 K again (same Load object)
        again = router.score(req).choices
        assert _view(router.score(req, top_k=4).choices) == _view(again[:4])
        rank = {c.candidate.state.key: i for i, c in enumerate(again)}
        assert rank[("w000", 0)] == 199  # last again, as before the drain
        assert {c.candidate.state.key: i for i, c in enumerate(first)}[("w000", 0)] == 199
