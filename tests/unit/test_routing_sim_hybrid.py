"""The routing simulation's hybrid presets measure what they say (benchmarks/routing_sim.py): on a
fleet of hybrid engines the group-aware index's answer is, at every decision, what the chosen engine
holds; an index told only the full-attention group promises hits the sliding-window groups cannot
serve (issue 33's scenario: a shared system prompt with nothing retained at its end). Deterministic."""

from __future__ import annotations

from benchmarks.routing_sim import Cluster, Simulation, shared_prefix_groups
from workers_shim.sim.hybrid import HybridSimEngine


def run(index_groups: str) -> dict[str, float]:
    reqs = shared_prefix_groups(
        groups=6, prefix_tokens=1024, users=3, question_tokens=200, output_tokens=8,
        qps=20, requests=120, block_size=16, seed=0,
    )  # fmt: skip
    engine = {"profile": "llama3-8b-h100", "block_size": 16, "kv_groups": "gemma3-tiny"}
    sim = Simulation("ttft", reqs, Cluster(4, engine, index_groups=index_groups), seed=0)
    assert all(isinstance(e, HybridSimEngine) for e in sim.engines.values())
    sim.run()
    result = sim.result("x", 0.0)
    assert result.requests == len(reqs)
    return result.extra


def test_group_aware_index_is_exact_and_a_full_attention_index_over_promises() -> None:
    groups, full = run("all"), run("full")
    assert groups["promised"] > 20 and groups["short"] == 0 and groups["exact"] == 1.0
    assert full["short"] > 0 and full["cold"] > 0 and full["missing_share"] > 0
    assert full["exact"] < 1.0
