"""Events from simulated engines: a sink that applies them always equals the engines' ground truth,
in process. Through a real publisher and index: tests/integration/test_sim_events.py."""

from __future__ import annotations

import random
import time

import pytest

from kvtools.data import mooncake_trace
from tests.unit.test_sim_engine import TM  # the same small time model as the engine's own tests
from workers_shim.sim import (
    EngineConfig,
    MirrorSink,
    SharedPool,
    SimEngine,
    SimRequest,
    run_until_idle,
)
from workers_shim.sim.trace import mooncake_requests

TRACE = mooncake_trace()


def workload(rng: random.Random, n: int, block_size: int) -> list[SimRequest]:
    """Requests sharing prefixes: a few system prompts, and conversations that grow turn by turn."""
    next_key = iter(range(1, 10**9))
    systems = [[next(next_key) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    convs: list[list[int]] = []
    reqs = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 0.004)
        j = rng.randrange(len(convs)) if convs else 0
        if convs and rng.random() < 0.5 and len(convs[j]) < 12:
            keys = convs[j] + [next(next_key) for _ in range(rng.randint(1, 4))]
            convs[j] = keys
        else:
            keys = rng.choice(systems) + [next(next_key) for _ in range(rng.randint(0, 8))]
            convs.append(keys)
        tokens = len(keys) * block_size + rng.choice([0, 0, 1, block_size - 1])
        if tokens == 0:
            tokens = 1
        reqs.append(SimRequest(f"r{i}", list(keys), tokens, rng.randint(1, 40), t))
    return reqs


def engines_with_sinks(
    pool_sink: object, with_pool: bool = True
) -> tuple[list[SimEngine], list[MirrorSink], SharedPool]:
    pool = SharedPool(60, pool_sink)  # type: ignore[arg-type]
    base = {"time": TM, "block_size": 4, "max_batched_tokens": 48, "max_running": 12}
    configs = [
        EngineConfig(gpu_blocks=40, cpu_blocks=30, disk_blocks=50, **base),  # type: ignore[arg-type]
        EngineConfig(gpu_blocks=30, cpu_blocks=20, offload="store", **base),  # type: ignore[arg-type]
        EngineConfig(gpu_blocks=50, disk_blocks=25, **base),  # type: ignore[arg-type]
    ]
    sinks = [MirrorSink() for _ in configs]
    engines = [
        SimEngine(f"e{i}", c, s, pool if with_pool and i < 2 else None)
        for i, (c, s) in enumerate(zip(configs, sinks, strict=True))
    ]
    return engines, sinks, pool


@pytest.mark.parametrize("seed", range(4))
def test_events_mirror_holds_after_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    pool_sink = MirrorSink()
    engines, sinks, pool = engines_with_sinks(pool_sink)
    reqs = workload(rng, 400, 4)

    def compare() -> None:
        for e, s in zip(engines, sinks, strict=True):
            for tier in ("gpu", "cpu", "disk"):
                assert s.tiers[tier] == e.holds(tier), (e.name, tier)
            assert s.tiers["shared"] == set()
            e.check()
        assert pool_sink.tiers["shared"] == pool.holds()

    def route(req: SimRequest, now: float) -> SimEngine:
        compare()
        if rng.random() < 0.02:
            for e in engines:
                e.reset_prefix_cache(("gpu", "cpu", "disk"))  # only idle engines accept
        return rng.choice(engines)

    done = run_until_idle(engines, reqs, route=route, on_completion=lambda c: compare())
    compare()
    assert len(done) == 2 * len(reqs)
    assert sum(e.stats.preemptions for e in engines) > 0
    assert sum(e.stats.gpu_evictions for e in engines) > 0
    assert sum(e.stats.loaded_blocks["cpu"] + e.stats.loaded_blocks["disk"] for e in engines) > 0
    assert pool.hits > 0 and pool.evicted > 0
    assert sum(s.calls for s in sinks) > 100


def test_mooncake_slice_through_16_engines_speed(capsys: pytest.CaptureFixture[str]) -> None:
    """Throughput of the simulator itself (printed, not asserted): Mooncake requests, 16 engines."""
    reqs = mooncake_requests(TRACE, model="m", limit=3000)
    cfg = EngineConfig.llama3_70b_8xa800(block_size=512)
    engines = [SimEngine(f"e{i}", cfg, MirrorSink()) for i in range(16)]

    def route(req: SimRequest, now: float) -> SimEngine:  # least queued prefill work, via load()
        return min(engines, key=lambda e: e.load(drain=False).waiting_prefill_tokens)

    t0 = time.process_time()
    done = run_until_idle(engines, reqs, route=route)
    cpu = time.process_time() - t0
    assert len(done) == 2 * len(reqs)
    steps = sum(e.stats.steps for e in engines)
    with capsys.disabled():
        print(
            f"\n[sim speed] {len(reqs)} Mooncake requests, 16 x llama3-70b-8xa800 engines: {cpu:.2f} s CPU, "
            f"{steps} engine steps, {steps / cpu:,.0f} steps/s"
        )


def test_trace_keys_are_wire_keys() -> None:
    from kvindex.keys import block_keys
    from workers_shim.sim.trace import mooncake_rows, mooncake_tokens

    rows = list(mooncake_rows(TRACE, limit=5))
    reqs = mooncake_requests(TRACE, model="m", limit=5, block_size=16)
    for row, r in zip(rows, reqs, strict=True):
        tokens = mooncake_tokens(row["hash_ids"], row["input_length"])
        assert len(tokens) == row["input_length"] == r.prompt_tokens
        assert r.keys == block_keys(tokens.tolist(), 16, "m")
        assert len(r.keys) == r.prompt_tokens // 16
    # Rows 0 and 1 share hash id 0 (one 512-token block): 32 keys of 16 tokens in common.
    assert reqs[0].keys[:32] == reqs[1].keys[:32] and reqs[0].keys[32] != reqs[1].keys[32]
