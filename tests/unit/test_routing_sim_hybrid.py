"""The routing simulation's hybrid preset measures what it says (benchmarks/routing_sim.py): on a fleet
of hybrid engines the group-aware index never promises a hit the engine does not find (it may find
more: a prefix cached while the request waited), an index told only the full-attention group promises
some that are cold. Deterministic for a seed."""

from __future__ import annotations

from benchmarks.routing_sim import MODEL, TRACE, Cluster, Simulation
from workers_shim.sim.hybrid import HybridSimEngine
from workers_shim.sim.trace import mooncake_requests


def run(index_groups: str) -> dict[str, float]:
    reqs = mooncake_requests(TRACE, model=MODEL, block_size=512, limit=200, time_scale=0.5)
    engine = {"profile": "llama3-70b-8xa800", "block_size": 512, "kv_groups": "gemma3"}
    sim = Simulation("ttft", reqs, Cluster(4, engine, index_groups=index_groups), seed=0)
    assert all(isinstance(e, HybridSimEngine) for e in sim.engines.values())
    sim.run()
    result = sim.result("x", 0.0)
    assert result.requests == len(reqs)
    return result.extra


def test_group_aware_index_never_over_promises_a_full_attention_index_does() -> None:
    groups, full = run("all"), run("full")
    assert groups["promised"] > 50 and groups["short"] == 0
    assert full["short"] > 0 and full["cold"] > 0 and full["missing_share"] > 0
    assert full["exact"] < groups["exact"]
