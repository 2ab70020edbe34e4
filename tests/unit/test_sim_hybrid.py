"""Simulated engines of hybrid-attention models (workers_shim/sim/hybrid.py): vLLM's retention and hit
rule per KV-cache group, against issue 33's scenario and the real engine's captured sequences, and
the index's rule over the engine's events against the engine's truth. Over NATS into a real index:
tests/integration/test_sim_hybrid.py."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from kvindex.index.hybrid import GroupLayout, hit_limit, hit_tokens
from kvindex.keys import block_keys, group_mask
from tests.unit.test_sim_engine import TM
from tests.unit.test_sim_events import workload
from workers_shim.sim import EngineConfig, MirrorSink, SharedPool, SimEngine, SimRequest, run_until_idle
from workers_shim.sim.cli import add_sim_arguments, build_config
from workers_shim.sim.hybrid import (
    KV_GROUP_PRESETS,
    HybridSimEngine,
    OneGroupSink,
    layout_wire,
    new_engine,
    parse_kv_groups,
)

CAPTURES = Path(__file__).resolve().parents[2] / "kvtools" / "data" / "vllm_capture"
BS = 32
TINY_GEMMA = "sliding_window:64x3,full_attention"  # issue 33's model: window 64, block 32


class Serial:
    """One engine fed one request at a time (each runs to its end before the next arrives), with a
    mirror of its events, as the real-engine captures were recorded."""

    def __init__(self, groups: str, pool: int, block_size: int = BS) -> None:
        cfg = EngineConfig(
            gpu_blocks=pool, time=TM, block_size=block_size, kv_groups=groups, max_batched_tokens=2048
        )
        self.sink = MirrorSink()
        self.engine = new_engine("e", cfg, self.sink)
        assert isinstance(self.engine, HybridSimEngine)
        self.layout = self.engine.layout
        self.block_size = block_size
        self.t = 0.0

    def keys(self, tokens: list[int]) -> list[int]:
        return block_keys(tokens, self.block_size, "m")

    def predicted(self, tokens: list[int], groups: tuple[int, ...] | None = None) -> int:
        """What an index applying the rule to the events so far says (``groups``: an index told
        only those groups, as one full-attention cache)."""
        keys = self.keys(tokens)
        held = self.sink.tiers["gpu"]
        limit = min(hit_limit(len(tokens)), len(keys) * self.block_size)
        if groups is not None:
            n = 0
            while n < limit // self.block_size and all(keys[n] ^ group_mask(g) in held for g in groups):
                n += 1
            return n * self.block_size
        return hit_tokens(self.layout, lambda g, j: keys[j] ^ group_mask(g) in held, limit)

    def send(self, tokens: list[int], output: int = 16) -> int:
        """The engine's cached tokens for the prompt (vLLM's usage.prompt_tokens_details)."""
        self.t += 10.0
        req = SimRequest(f"r{self.t:g}", self.keys(tokens), len(tokens), output, arrival=self.t)
        done = run_until_idle([self.engine], [(req, self.engine)])
        self.engine.check()
        assert self.sink.tiers["gpu"] == self.engine.holds("gpu")
        (first,) = [c for c in done if c.kind == "first_token"]
        return first.reported_cached_tokens


def test_issue_33_scenario() -> None:
    """240 tokens -> 0; the same again -> 224; a prompt sharing the first 192 -> 0 (no window ends
    inside the shared prefix, where the full-attention group alone promises 192); then the engine
    keeps the window at that junction and a prompt extending the 192 tokens hits 192."""
    s = Serial(TINY_GEMMA, pool=255)
    first = list(range(10, 250))
    assert s.send(first) == 0
    held = s.engine.holds_groups()
    keys = s.keys(first)
    # Full attention keeps every full block; each sliding-window group the window before the last
    # prompt token (blocks ending at 192 and 224), as the real engine's first store.
    assert held[3] == set(keys)
    assert held[0] == held[1] == held[2] == set(keys[5:7])
    assert s.predicted(first) == 224
    assert s.send(first) == 224
    third = first[:192] + [600 + t for t in range(48)]
    assert s.predicted(third, groups=(3,)) == 192  # the full-attention group alone: false residency
    assert s.predicted(third) == 0
    assert s.send(third) == 0
    # The junction: the window ending at 192 (blocks ending at 160 and 192) is now kept.
    assert set(s.keys(third)[4:6]) <= s.engine.holds_groups()[0]
    fourth = first[:192] + [700 + t for t in range(40)]
    assert s.predicted(fourth) == 192
    assert s.send(fourth) == 192


# (layout, block size, the engine's --num-gpu-blocks-override less vLLM's null block)
CAPTURED = {
    "gemma3_main": (TINY_GEMMA, 32, 255),
    "gemma3_evict": (TINY_GEMMA, 32, 95),
    "llama4_evict": ("chunked_local_attention:64x3,full_attention", 32, 95),
    "qwen3next_main": ("mambax3,full_attention", 64, 255),
    "gptoss_short": ("sliding_window:64,full_attention", 32, 255),
    "nemotronh_short": ("mambax2,full_attention", 32, 255),
    "mamba2_short": ("mamba", 32, 255),
}


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_captured_real_engine_sequences(name: str) -> None:
    """The prompts of a real vLLM 0.32 capture, in order (resets included), through a simulated
    engine of the same layout and pool: every request's cached tokens are the real engine's, and
    the rule over the simulated engine's events predicts each of them."""
    groups, block_size, pool = CAPTURED[name]
    s = Serial(groups, pool, block_size)
    lines = (CAPTURES / f"r5_hybrid_{name}.requests.json").read_text().splitlines()
    seen = []
    for line in lines:
        rec = json.loads(line)
        if "reset" in rec:
            assert s.engine.reset_prefix_cache()
            continue
        predicted = s.predicted(rec["tokens"])
        got = s.send(rec["tokens"], len(rec["output_ids"]))
        seen.append((rec["n"], rec["label"], predicted, got, rec["engine"]))
    assert len(seen) >= 6
    assert [x for x in seen if not x[2] == x[3] == x[4]] == []
    if name == "gemma3_evict":  # the groups lost blocks at different times (group 0 first)
        assert s.engine.stats.gpu_evictions > 0


def test_rule_over_events_is_the_engines_truth_under_eviction() -> None:
    """Random prompts sharing prefixes and diverging anywhere, one at a time in a small pool: before
    each request the rule over the events the engine published equals the hit the engine then
    finds; an index of the full-attention group alone over-promises some of them."""
    rng = random.Random(7)
    s = Serial("sliding_window:64x2,mamba,full_attention", pool=150)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(40, 400))] for _ in range(6)]
    over = 0
    for _ in range(150):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(1000) for _ in range(rng.randrange(60))
        ]
        predicted = s.predicted(tokens)
        over += s.predicted(tokens, groups=(3,)) > predicted
        assert s.send(tokens, rng.randrange(1, 40)) == predicted
    assert over > 0 and s.engine.stats.gpu_evictions > 0


@pytest.mark.parametrize(
    "groups",
    [
        TINY_GEMMA,
        "chunked_local_attention:8x2,full_attention",
        "mambax2,full_attention,sliding_window:12",
        "mamba",
    ],
)
def test_events_mirror_the_engines_groups_under_load(groups: str) -> None:
    """Concurrent requests, chunked prefill, preemptions, evictions and resets: a sink applying the
    events always equals the engine's blocks per group, and the pair accounting holds."""
    rng = random.Random(3)
    base = {"time": TM, "block_size": 4, "max_batched_tokens": 48, "max_running": 12}
    configs = [EngineConfig(gpu_blocks=n, kv_groups=groups, **base) for n in (120, 200)]  # type: ignore[arg-type]
    sinks = [MirrorSink(), MirrorSink()]
    engines = [new_engine(f"e{i}", c, s) for i, (c, s) in enumerate(zip(configs, sinks, strict=True))]

    def compare() -> None:
        for e, sink in zip(engines, sinks, strict=True):
            assert sink.tiers["gpu"] == e.holds("gpu")
            e.check()

    def route(req: SimRequest, now: float) -> SimEngine:
        compare()
        if rng.random() < 0.02:
            for e in engines:
                e.reset_prefix_cache()  # only idle engines accept
        return rng.choice(engines)

    done = run_until_idle(engines, workload(rng, 300, 4), route=route, on_completion=lambda c: compare())
    compare()
    assert len(done) == 600
    assert sum(e.stats.gpu_evictions for e in engines) > 0
    assert sum(e.stats.hit_tokens["gpu"] for e in engines) > 0
    if groups != "mamba":
        assert sum(e.stats.preemptions for e in engines) > 0


def test_layouts_and_their_errors() -> None:
    assert parse_kv_groups("gemma3-tiny", 32) == parse_kv_groups(TINY_GEMMA, 32)
    layout = GroupLayout(parse_kv_groups("gemma3", 512), 512)
    assert layout.describe() == "5x sliding_window(1024) + full_attention"
    for name in KV_GROUP_PRESETS:
        assert GroupLayout(parse_kv_groups(name, 64), 64).understood
    for text, says in [
        ("sliding_window", "needs a window"),
        ("chunked_local_attention,full_attention", "needs a chunk size"),
        ("full_attention:64", "takes no token count"),
        ("linear", "one of"),
        ("sliding_window:64x0", "count must be >= 1"),
        ("sliding window:64", "expected KIND"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_kv_groups(text, 32)
    # One full-attention group is the plain engine; a profile's capacity counts pairs.
    plain = EngineConfig(gpu_blocks=10, time=TM, kv_groups="full_attention")
    assert plain.layout() is None and type(new_engine("e", plain)) is SimEngine
    cfg = EngineConfig.from_profile("llama3-70b-8xa800", 512, kv_groups="gemma3")
    assert cfg.gpu_blocks == 6 * (1_205_000 // 512)
    assert layout_wire(cfg) == layout.to_wire()
    with pytest.raises(ValueError, match="HybridSimEngine"):
        SimEngine("e", cfg)
    with pytest.raises(ValueError, match="no CPU or disk tier"):
        EngineConfig(gpu_blocks=10, time=TM, kv_groups="gemma3", cpu_blocks=5)
    with pytest.raises(ValueError, match="no shared pool"):
        HybridSimEngine("e", cfg, pool=SharedPool(10))
    engine = HybridSimEngine("e", cfg)
    with pytest.raises(ValueError, match="no transferred blocks"):
        engine.submit(SimRequest("r", [1], 600, 1, remote_blocks=1), 0.0)
    with pytest.raises(ValueError, match="more KV blocks than the GPU has"):
        HybridSimEngine("e", EngineConfig(gpu_blocks=12, time=TM, block_size=4, kv_groups=TINY_GEMMA)).submit(
            SimRequest("r", [], 13, 1), 0.0
        )


def test_one_group_sink_is_an_index_of_one_group() -> None:
    mirror = MirrorSink()
    s = Serial(TINY_GEMMA, pool=255)
    s.engine.attach(OneGroupSink(mirror, 3))
    tokens = list(range(240))
    s.t += 10
    run_until_idle([s.engine], [(SimRequest("a", s.keys(tokens), 240, 2, s.t), s.engine)])
    assert mirror.tiers["gpu"] == s.engine.holds_groups()[3] == set(s.keys(tokens))
    assert s.engine.reset_prefix_cache() and mirror.tiers["gpu"] == set()


def test_kv_groups_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--kv-groups", "gemma3-tiny", "--block-size", "32", "--gpu-blocks", "400"])
    cfg = build_config(args)
    assert cfg.gpu_blocks == 400 and cfg.layout() == GroupLayout(parse_kv_groups(TINY_GEMMA, 32), 32)
    assert build_config(parser.parse_args([])).layout() is None  # the default stays one cache
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--kv-groups", "sliding_window:x3"])
    assert exc.value.code == 2
    assert "argument --kv-groups: KV-cache group 'sliding_window:x3'" in capsys.readouterr().err

    from workers_shim.cli import main

    assert main(["sim", "--nats", "nats://127.0.0.1:1", "--kv-groups", "gemma3", "--cpu-blocks", "9"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("kvshim sim: error: --kv-groups: a hybrid engine is GPU only") and err.count("\n") == 1
    )
