"""The simulated engine: prefix caching, eviction order, ref counts, tiers, batching and timing."""

from __future__ import annotations

import random
from collections import deque

import pytest

from workers_shim.sim import (
    Completion,
    EngineConfig,
    MirrorSink,
    SharedPool,
    SimEngine,
    SimRequest,
    TimeModel,
    run_until_idle,
)

TM = TimeModel(
    a_ms=2.0, b_ms_per_token=0.01, c_ms_per_token2=1e-5, d_ms_per_decode_seq=0.02, e_ms_per_decode_ctx=1e-4
)


class Recorder(MirrorSink):
    """A mirror that also keeps the ordered list of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str | None, list[int], int | None]] = []

    def stored(self, keys: list[int], tier: str = "gpu", parent: int | None = None) -> int:
        self.events.append(("stored", tier, list(keys), parent))
        return super().stored(keys, tier, parent)

    def removed(self, keys: list[int], tier: str = "gpu") -> int:
        self.events.append(("removed", tier, list(keys), None))
        return super().removed(keys, tier)

    def cleared(self, tier: str | None = None) -> int:
        self.events.append(("cleared", tier, [], None))
        return super().cleared(tier)

    def of(self, kind: str, tier: str) -> list[list[int]]:
        return [keys for k, t, keys, _ in self.events if k == kind and t == tier]


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "gpu_blocks": 100,
        "time": TM,
        "block_size": 4,
        "max_batched_tokens": 64,
        "max_running": 16,
    }
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def req(rid: str, keys: list[int], tokens: int, out: int = 1, at: float = 0.0) -> SimRequest:
    return SimRequest(id=rid, keys=keys, prompt_tokens=tokens, output_tokens=out, arrival=at)


def run(engine: SimEngine, *reqs: SimRequest) -> dict[tuple[str, str], Completion]:
    done = run_until_idle([engine], [(r, engine) for r in reqs])
    engine.check()
    return {(c.request.id, c.kind): c for c in done}


def test_single_request_ttft_equals_time_model() -> None:
    c = EngineConfig.llama3_8b_h100(block_size=16)
    e = SimEngine("e", c)
    keys = list(range(1, 751))  # 12,000 tokens = 750 full blocks
    done = run(e, req("a", keys, 12_000, out=3, at=1.5))
    first = done[("a", "first_token")]
    # Two chunks (8192 + 3808 tokens), each with the step overhead.
    expect = c.alone_ttft_ms(12_000)
    tm = c.time
    assert expect == pytest.approx(2 * tm.a_ms + tm.chunk_ms(8192, 0) + tm.chunk_ms(3808, 8192))
    assert first.ttft == pytest.approx(expect / 1000, rel=1e-12)
    assert first.first_token_at == pytest.approx(1.5 + expect / 1000)
    assert first.queued_s == 0 and first.prefill_s == pytest.approx(expect / 1000)
    assert first.computed_tokens == 12_000 and first.hit_tokens == 0
    # Then two decode steps, each attending to the whole KV so far.
    fin = done[("a", "finished")]
    decode = sum(tm.step_ms(decode_seqs=1, decode_context=12_000 + i) for i in (1, 2))
    assert fin.finished_at == pytest.approx(first.first_token_at + decode / 1000, rel=1e-12)

    # The same prompt again: everything but the last block is a GPU hit (vLLM recomputes the last
    # token, here a whole block since 12,000 is a multiple of 16).
    done = run(e, req("b", keys, 12_000, at=10.0))
    first = done[("b", "first_token")]
    assert first.cached_tokens["gpu"] == 12_000 - 16 and first.computed_tokens == 16
    assert first.ttft == pytest.approx(c.alone_ttft_ms(12_000, cached_tokens=12_000 - 16) / 1000)
    # A longer prompt with the same prefix hits every full block of it.
    done = run(e, req("c", [*keys, 751], 12_020, at=20.0))
    assert done[("c", "first_token")].cached_tokens["gpu"] == 12_000
    assert done[("c", "first_token")].computed_tokens == 20


def test_chunked_prefill_splits_long_prompt_and_caches_per_chunk() -> None:
    sink = Recorder()
    e = SimEngine("e", cfg(max_batched_tokens=32), sink)
    keys = list(range(1, 26))  # 100 tokens: 25 full blocks
    e.submit(req("a", keys, 100), 0.0)
    ends = []
    while (t := e.next_time()) is not None:
        ends.append(t)
        e.advance(t)
    # 32 + 32 + 32 + 4 tokens, then nothing (output 1).
    assert len(ends) == 4 and e.stats.steps == 4
    # Blocks are announced as each chunk is scheduled, chained by parent.
    assert sink.events == [
        ("stored", "gpu", keys[0:8], None),
        ("stored", "gpu", keys[8:16], keys[7]),
        ("stored", "gpu", keys[16:24], keys[15]),
        ("stored", "gpu", keys[24:25], keys[23]),
    ]
    t = 0.0
    for n, s in ((32, 0), (32, 32), (32, 64), (4, 96)):
        t += TM.step_ms([(n, s)]) / 1000
    assert ends[-1] == pytest.approx(t)


def test_continuous_batching_interleaves_decode_with_prefill() -> None:
    e = SimEngine("e", cfg(max_batched_tokens=32))
    a = req("a", [1, 2], 8, out=50, at=0.0)
    e.submit(a, 0.0)
    t1 = e.next_time()
    assert t1 == pytest.approx(TM.step_ms([(8, 0)]) / 1000)
    first = e.advance(t1)
    assert [c.kind for c in first] == ["first_token"]
    # A decodes alone; B arrives in the middle of A's third decode step.
    steps = [t1]
    for i in range(1, 4):
        steps.append(steps[-1] + TM.step_ms(decode_seqs=1, decode_context=8 + i) / 1000)
    at = (steps[2] + steps[3]) / 2
    b = req("b", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 40, out=2, at=at)
    e.submit(b, at)
    assert e.load(drain=False).waiting == 1
    # The step in progress ends as planned; the next one carries A's decode and B's first chunk
    # (32 - 1 tokens of budget left), then A's decode and B's last 9 tokens.
    t = e.next_time()
    assert t == pytest.approx(steps[3])
    assert e.advance(t) == []
    mixed1 = TM.step_ms([(31, 0)], decode_seqs=1, decode_context=8 + 4)
    mixed2 = TM.step_ms([(9, 31)], decode_seqs=1, decode_context=8 + 5)
    t = e.next_time()
    assert t == pytest.approx(steps[3] + mixed1 / 1000)
    assert e.advance(t) == []
    t = e.next_time()
    assert t == pytest.approx(steps[3] + (mixed1 + mixed2) / 1000)
    out = e.advance(t)
    assert [(c.request.id, c.kind) for c in out] == [("b", "first_token")]
    assert e.load().decoding == 2
    # Both decode together: A's contexts keep growing, B's start at 40.
    t2 = e.next_time()
    assert t2 == pytest.approx(t + TM.step_ms(decode_seqs=2, decode_context=(8 + 6) + 41) / 1000)
    out = e.advance(t2)
    assert [(c.request.id, c.kind) for c in out] == [("b", "finished")]
    rest = e.advance(1e9)
    assert [(c.request.id, c.kind) for c in rest] == [("a", "finished")]
    assert e.stats.decode_tokens == 49 + 1
    e.check()


def reference_times(c: EngineConfig, reqs: list[SimRequest]) -> dict[str, tuple[float, float]]:
    """Step-by-step continuous batching with unlimited blocks and no cache: (first token, finish)."""
    tm = c.time
    pending = deque(sorted(reqs, key=lambda r: r.arrival))
    waiting: deque[dict] = deque()
    running: list[dict] = []
    out: dict[str, tuple[float, float]] = {}
    t = 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= t:
            r = pending.popleft()
            waiting.append({"r": r, "done": 0, "gen": 0, "first": None})
        if not waiting and not running:
            t = pending[0].arrival
            continue
        decoders = [x for x in running if x["done"] == x["r"].prompt_tokens]
        budget = c.max_batched_tokens - len(decoders)
        chunks = []
        for x in running:
            if x["done"] < x["r"].prompt_tokens and budget > 0:
                n = min(x["r"].prompt_tokens - x["done"], budget)
                chunks.append((x, n))
                budget -= n
        while waiting and budget > 0 and len(running) < c.max_running:
            x = waiting.popleft()
            running.append(x)
            n = min(x["r"].prompt_tokens, budget)
            chunks.append((x, n))
            budget -= n
        ctx = sum(x["r"].prompt_tokens + x["gen"] for x in decoders)
        t += tm.step_ms([(n, x["done"]) for x, n in chunks], len(decoders), ctx) / 1000
        for x in decoders:
            x["gen"] += 1
        for x, n in chunks:
            x["done"] += n
            if x["done"] == x["r"].prompt_tokens:
                x["gen"] = 1
                x["first"] = t
        for x in list(running):
            if x["gen"] >= x["r"].output_tokens:
                running.remove(x)
                out[x["r"].id] = (x["first"], t)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_decode_runs_match_step_by_step_reference(seed: int) -> None:
    """Jumping over decode runs (and cutting them at arrivals) gives the per-step schedule exactly."""
    rng = random.Random(seed)
    c = cfg(gpu_blocks=100_000, max_batched_tokens=128, max_running=rng.choice([3, 8, 64]))
    reqs = []
    t = 0.0
    for i in range(60):
        t += rng.expovariate(1 / 0.05)
        n = rng.randint(1, 400)
        reqs.append(req(f"r{i}", [], n, out=rng.randint(1, 120), at=t))
    e = SimEngine("e", c)
    done = run(e, *reqs)
    expect = reference_times(c, reqs)
    for r in reqs:
        ft, fin = expect[r.id]
        assert done[(r.id, "first_token")].first_token_at == pytest.approx(ft, rel=1e-9, abs=1e-9)
        assert done[(r.id, "finished")].finished_at == pytest.approx(fin, rel=1e-9, abs=1e-9)


def test_observing_an_engine_does_not_change_it() -> None:
    """advance()/load()/next_time() at arbitrary times leave the schedule unchanged."""
    rng = random.Random(7)
    reqs = [
        req(f"r{i}", [i * 100 + j for j in range(rng.randint(0, 20))], 0, at=i * 0.013) for i in range(40)
    ]
    for r in reqs:
        r.prompt_tokens = len(r.keys) * 4 + rng.randint(1, 5)
        r.output_tokens = rng.randint(1, 60)
    plain = run(SimEngine("e", cfg(gpu_blocks=120)), *reqs)
    e = SimEngine("e", cfg(gpu_blocks=120))
    got: list[Completion] = []
    probes = sorted(rng.uniform(0, 3) for _ in range(300))
    arrivals = deque(reqs)
    for p in probes:
        while arrivals and arrivals[0].arrival <= p:
            r = arrivals.popleft()
            while (t := e.next_time()) is not None and t < r.arrival:
                got += e.advance(t)
            e.submit(r, r.arrival)
        while (t := e.next_time()) is not None and t <= p:
            got += e.advance(t)
        got += e.advance(p)
        e.load()
        e.check()
    got += run_until_idle([e], [(r, e) for r in arrivals])
    assert {(c.request.id, c.kind): (c.first_token_at, c.finished_at) for c in got} == {
        k: (c.first_token_at, c.finished_at) for k, c in plain.items()
    }


def test_eviction_is_tail_first_then_lru() -> None:
    sink = Recorder()
    e = SimEngine("e", cfg(gpu_blocks=10), sink)
    a = [101, 102, 103, 104]
    b = [201, 202, 203, 204]
    run(e, req("a", a, 17, at=0.0))  # 4 full blocks + 1 partial
    run(e, req("b", b, 17, at=1.0))
    assert sink.of("removed", "gpu") == []  # 10 blocks: nothing evicted yet
    # A prefix hit on a1, a2 takes them out of the free queue; freed again, they are the most recent.
    done = run(e, req("a2", a[:2], 9, at=2.0))
    assert done[("a2", "first_token")].cached_tokens["gpu"] == 8
    assert sink.of("removed", "gpu") == []
    # 7 blocks needed, 2 free without a key: evict 5, oldest first and each request's tail first.
    run(e, req("c", [301, 302, 303, 304, 305, 306], 25, at=3.0))
    assert sink.of("removed", "gpu") == [[104, 103, 204, 203, 202]]
    assert e.holds("gpu") == {201, 102, 101, 301, 302, 303, 304, 305, 306}
    assert e.stats.gpu_evictions == 5


def test_shared_prefix_blocks_are_ref_counted() -> None:
    sink = Recorder()
    e = SimEngine("e", cfg(gpu_blocks=20, max_batched_tokens=128), sink)
    prefix = [1, 2, 3]
    e.submit(req("long", [*prefix, 10, 11], 21, out=30, at=0.0), 0.0)
    e.advance(0.001)
    e.submit(req("short", [*prefix, 20, 21], 21, out=2, at=0.001), 0.001)
    out: list[Completion] = []
    while not any(c.request.id == "short" and c.finished for c in out):
        out += e.advance(e.next_time())
    assert [c.cached_tokens["gpu"] for c in out if c.kind == "first_token"] == [0, 12]
    assert e._gpu[1] == 1 and 1 not in e._free  # still used by "long"
    assert list(e._free) == [21, 20]  # short's own blocks, tail first
    e.check()
    # Pressure: the newcomer needs 13 blocks, one more than the free blocks without a key: one of
    # short's blocks goes (its tail), never the prefix "long" still uses.
    e.submit(req("new", list(range(30, 43)), 52, at=e.now), e.now)
    while not any(c.request.id == "new" for c in out):
        out += e.advance(e.next_time())
        e.check()
    assert sink.of("removed", "gpu") == [[21]]
    assert set(prefix) <= e.holds("gpu") and e._gpu[1] == 1


class ClockedRecorder(Recorder):
    """Also notes the engine's clock at every removal."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: SimEngine | None = None
        self.removals: list[tuple[float, str, list[int]]] = []

    def removed(self, keys: list[int], tier: str = "gpu") -> int:
        assert self.engine is not None
        self.removals.append((self.engine.clock, tier, list(keys)))
        return super().removed(keys, tier)


def test_decode_evictions_are_announced_when_their_step_ends() -> None:
    sink = ClockedRecorder()
    e = sink.engine = SimEngine("e", cfg(gpu_blocks=10), sink)
    run(e, req("a", [1, 2], 8))  # leaves 1, 2 cached and free (2 evicted first)
    e.submit(req("y", [], 4, out=34, at=1.0), 1.0)
    run_until_idle([e], [])
    prefill_end = 1.0 + TM.step_ms([(4, 0)]) / 1000

    def end_of(step: int) -> float:
        decode = sum(TM.step_ms(decode_seqs=1, decode_context=4 + i) for i in range(1, step + 1))
        return prefill_end + decode / 1000

    # Decode step s writes position 3 + s: steps 1, 5, …, 25 take the 7 free blocks without a key,
    # step 29 evicts key 2 and step 33 key 1, each announced when its step ends.
    assert sink.removals == [(pytest.approx(end_of(29)), "gpu", [2]), (pytest.approx(end_of(33)), "gpu", [1])]
    e.check()


def test_cpu_offload_promotion_and_fetch_cost() -> None:
    sink = Recorder()
    c = cfg(gpu_blocks=6, cpu_blocks=16, fetch_ms_per_block={"cpu": 0.5, "disk": 3.0})
    e = SimEngine("e", c, sink)
    a = [1, 2, 3, 4, 5]
    run(e, req("a", a, 21, at=0.0))
    run(e, req("b", [6, 7, 8, 9, 10], 21, at=1.0))  # evicts a's blocks, tail first, to CPU
    assert sink.of("removed", "gpu") == [[5, 4, 3, 2, 1]]
    assert sink.of("stored", "cpu") == [[5, 4, 3, 2, 1]]
    assert e.holds("cpu") == set(a) and not e.holds("gpu") & set(a)
    done = run(e, req("a-again", a, 21, at=2.0))
    first = done[("a-again", "first_token")]
    assert first.cached_tokens == {"gpu": 0, "cpu": 20, "disk": 0, "shared": 0}
    assert first.ttft == pytest.approx(c.alone_ttft_ms(21, loaded={"cpu": 5}) / 1000)
    assert first.ttft == pytest.approx((TM.a_ms + 5 * 0.5 + TM.chunk_ms(1, 20)) / 1000)
    # Promoted: back on GPU (announced with their chain), still on CPU.
    assert ("stored", "gpu", a, None) in sink.events
    assert set(a) <= e.holds("gpu") and set(a) <= e.holds("cpu")
    assert e.stats.loaded_blocks["cpu"] == 5 and e.stats.fetch_s == pytest.approx(0.0025)
    assert (
        e.stats.queried_tokens == 63
        and e.stats.miss_tokens == 43
        and e.stats.hit_rate == pytest.approx(20 / 63)
    )

    # With a disk tier under a tiny CPU tier, CPU victims go to disk and load at disk cost.
    e = SimEngine(
        "d", cfg(gpu_blocks=6, cpu_blocks=2, disk_blocks=20, fetch_ms_per_block={"cpu": 0.5, "disk": 3.0})
    )
    run(e, req("a", a, 21, at=0.0))
    run(e, req("b", [6, 7, 8, 9, 10], 21, at=1.0))
    assert e.holds("cpu") == {2, 1} and e.holds("disk") == {5, 4, 3}
    done = run(e, req("a-again", a, 21, at=2.0))
    assert done[("a-again", "first_token")].cached_tokens == {"gpu": 0, "cpu": 8, "disk": 12, "shared": 0}
    assert done[("a-again", "first_token")].ttft == pytest.approx(
        (TM.a_ms + 2 * 0.5 + 3 * 3.0 + TM.chunk_ms(1, 20)) / 1000
    )

    # Overlapped loading: the step takes max(compute, loads).
    e = SimEngine("o", cfg(gpu_blocks=6, cpu_blocks=8, fetch_ms_per_block={"cpu": 5.0}, fetch_overlap=True))
    run(e, req("a", a, 21, at=0.0))
    run(e, req("b", [6, 7, 8, 9, 10], 21, at=1.0))
    done = run(e, req("a-again", a, 21, at=2.0))
    assert done[("a-again", "first_token")].ttft == pytest.approx(25.0 / 1000)


def test_write_through_offload_mode() -> None:
    e = SimEngine("e", cfg(cpu_blocks=50, offload="store"))
    e.submit(req("a", [1, 2, 3], 13), 0.0)
    t = e.next_time()
    e.advance(t / 2)
    assert e.holds("gpu") == {1, 2, 3} and e.holds("cpu") == set()  # computed at the step's end
    e.advance(t)
    assert e.holds("cpu") == {1, 2, 3}


def test_shared_pool_hits_across_engines() -> None:
    pool_sink = Recorder()
    pool = SharedPool(100, pool_sink)
    c = cfg(fetch_ms_per_block={"shared": 1.0})
    s1, s2 = Recorder(), Recorder()
    e1, e2 = SimEngine("e1", c, s1, pool), SimEngine("e2", c, s2, pool)
    keys = [1, 2, 3, 4, 5, 6]
    e1.submit(req("x", keys, 26), 0.0)
    t = e1.next_time()
    e1.advance(t / 2)
    assert pool.holds() == set()  # written when the step that computes them ends
    run_until_idle([e1, e2], [])
    assert pool.holds() == set(keys)
    assert pool_sink.events == [("stored", "shared", keys, None)]
    done = run(e2, req("y", [*keys, 7], 30, at=1.0))
    first = done[("y", "first_token")]
    assert first.cached_tokens == {"gpu": 0, "cpu": 0, "disk": 0, "shared": 24}
    assert first.ttft == pytest.approx(c.alone_ttft_ms(30, loaded={"shared": 6}) / 1000)
    assert e2.holds("gpu") == {*keys, 7} and e2.holds("shared") == set()
    assert pool.hits == 6 and pool.holds() == {*keys, 7}
    assert pool_sink.tiers["shared"] == pool.holds()
    # Per engine, fastest tier first: e1 still has them on GPU.
    done = run(e1, req("z", [*keys, 7, 8], 36, at=2.0))
    assert done[("z", "first_token")].cached_tokens == {"gpu": 24, "cpu": 0, "disk": 0, "shared": 4}

    # The pool evicts LRU past its capacity, announcing removals.
    small = SharedPool(4, Recorder())
    e = SimEngine("e", c, pool=small)
    run(e, req("a", [1, 2, 3, 4, 5, 6], 24))
    assert small.holds() == {3, 4, 5, 6} and small.evicted == 2
    assert small.sink.of("removed", "shared") == [[1, 2]]  # type: ignore[union-attr]


def test_preemption_under_memory_pressure() -> None:
    e = SimEngine("e", cfg(gpu_blocks=24, max_batched_tokens=64))
    reqs = [req(f"r{i}", [i * 10 + j for j in range(4)], 18, out=40, at=i * 0.0001) for i in range(5)]
    done = run(e, *reqs)
    assert e.stats.preemptions > 0
    assert all((r.id, "finished") in done for r in reqs)
    assert any(c.preemptions for c in done.values())
    # Recomputing after a preemption finds the request's own blocks still cached.
    assert sum(e.stats.hit_tokens.values()) > 0
    # ... which vLLM does not report: its cached_tokens is the first admission's hit, nothing here
    # (no two prompts share a block).
    assert all(c.reported_cached_tokens == 0 for c in done.values())


def test_load_report() -> None:
    e = SimEngine("e", cfg(gpu_blocks=100, max_batched_tokens=48, max_running=2))
    e.submit(req("a", list(range(1, 11)), 40, out=10), 0.0)
    e.submit(req("b", list(range(11, 21)), 40, out=10), 0.0)
    e.submit(req("c", list(range(1, 11)), 41, out=10), 0.0)
    t = e.next_time()
    load = e.load()
    # a takes 40 tokens, b the remaining 8; c waits (max_running=2). c's estimated cached part (a's
    # blocks, announced when scheduled) is not counted.
    assert (load.running, load.waiting, load.prefilling, load.decoding) == (2, 1, 2, 0)
    assert load.waiting_prefill_tokens == 40 + 40 + 41
    assert load.kv_usage == pytest.approx(12 / 100)
    e.advance(t)
    load = e.load()
    assert (load.running, load.waiting, load.decoding) == (2, 1, 1)
    assert load.waiting_prefill_tokens == 32 + 41
    assert load.prefill_samples == [(40, 0, pytest.approx(t * 1000))]
    assert e.load().prefill_samples == []  # drained
    run_until_idle([e], [])
    load = e.load()
    assert (load.running, load.waiting, load.waiting_prefill_tokens, load.kv_usage) == (0, 0, 0, 0.0)
    assert [s[:2] for s in load.prefill_samples] == [(40, 0), (41, 40)]
    assert load.wire()["running"] == 0 and isinstance(load.wire()["waiting"], int)


def test_kv_usage_during_a_decode_run() -> None:
    e = SimEngine("e", cfg(gpu_blocks=100))
    e.submit(req("a", [1], 4, out=30), 0.0)
    e.advance(e.next_time())  # prefill: 1 block
    run_end = e.next_time()
    assert e.load().kv_usage == pytest.approx(0.01)
    e.advance((run_end + e.now) / 2)  # half way through 29 decode steps: ~15 more tokens
    assert 0.04 <= e.load().kv_usage <= 0.05
    e.check()


def test_reset_prefix_cache_and_validation() -> None:
    sink = Recorder()
    e = SimEngine("e", cfg(), sink)
    e.submit(req("a", [1, 2], 9, out=5), 0.0)
    e.advance(e.next_time())
    assert not e.reset_prefix_cache()
    run_until_idle([e], [])
    assert e.reset_prefix_cache()
    assert e.holds("gpu") == set() and sink.events[-1] == ("cleared", "gpu", [], None)
    e.check()
    with pytest.raises(ValueError):
        e.submit(req("bad", [1, 2, 3], 9), e.now)  # more keys than full blocks
    with pytest.raises(ValueError):
        e.submit(req("huge", [], 4 * 101), e.now)  # can never fit
    with pytest.raises(ValueError):
        e.advance(e.now - 1)
    with pytest.raises(ValueError):
        cfg(max_batched_tokens=8, max_running=16)
