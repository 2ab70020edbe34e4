"""Explaining a ranking (kvindex/scoring/explain.py and Ranker.explain): the verdict's rules, its
terms the cost model's, and an explanation that leaves the router exactly as it was."""

from __future__ import annotations

import inspect

import pytest

from kvindex.scoring import costs
from kvindex.scoring.explain import PICK, PLACEMENT, TERMS, verdict
from kvindex.scoring.pick import PickOptions
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.schema import Load
from tests.unit.interpreted_costs import interpreted
from tests.unit.test_scoring import fleet, prompt, request


def ranked(
    name: str, wait: float, prefill: float, fetch: float, cost: float | None = None, why: str = ""
) -> pb.RankedInstance:
    est = costs.est_ttft_ms(wait, prefill, fetch)
    return pb.RankedInstance(
        instance_id=name,
        wait_ms=wait,
        prefill_ms=prefill,
        fetch_ms=fetch,
        est_ttft_ms=est,
        cost=est if cost is None else cost,
        explain=why,
    )


def test_the_terms_are_the_estimates() -> None:
    # The cost model's est_ttft_ms adds exactly these, in this order (its Python source says so).
    params = tuple(inspect.signature(interpreted().est_ttft_ms).parameters)
    assert params == tuple(field for _, field in TERMS)
    values = (3.0, 40.0, 5.0)
    assert costs.est_ttft_ms(*values) == sum(values)


def test_the_term_with_the_largest_difference_decides() -> None:
    w = ranked("a/0", wait=30.0, prefill=20.0, fetch=0.0, why="cache")
    r = ranked("b/0", wait=0.0, prefill=80.0, fetch=4.0)
    v = verdict([w, r], "ms")
    assert (v.winner, v.reason, v.runner_up) == ("a/0", "cache", "b/0")
    assert (v.deciding_term, v.deciding_ms) == ("prefill", 60.0)
    assert v.margin == v.margin_ms == 34.0
    assert "its prefill is 60.0 ms shorter (and wait -30.0, fetch +4.0 ms)" in v.summary


def test_a_rule_or_the_pick_not_a_term_decides_when_the_winner_is_slower() -> None:
    holder = ranked("a/0", wait=50.0, prefill=10.0, fetch=0.0, why="replica")
    idle = ranked("b/0", wait=0.0, prefill=40.0, fetch=0.0)
    v = verdict([holder, idle], "ms")
    assert v.deciding_term == PLACEMENT and v.margin_ms == -20.0 and v.deciding_ms == 0.0
    assert "the policy's rule 'replica' placed it first although b/0's estimate is 20.0 ms lower" in v.summary
    drawn = verdict([idle, holder], "ms", picked_rank=1)
    assert drawn.deciding_term == PICK and "rank 1" in drawn.summary
    # A peer policy's cost in its own unit: the margin in it, the estimate's terms still compared.
    peer = verdict([ranked("a/0", 0, 10, 0, cost=-8.0), ranked("b/0", 0, 30, 0, cost=-2.0)], "-blocks")
    assert peer.margin == 6.0 and peer.deciding_term == "prefill" and "by 6 -blocks" in peer.summary


def test_one_or_no_instance() -> None:
    alone = verdict([ranked("a/0", 0.0, 12.5, 0.0, why="home")], "ms")
    assert alone.winner == "a/0" and not alone.runner_up and "only instance ranked" in alone.summary
    assert alone.deciding_term == ""
    none = verdict([], "ms")
    assert none.winner == "" and none.summary == "no instance was ranked"


@pytest.mark.parametrize(("instances", "top_k"), [(6, 0), (130, 3)])  # (130, 3): the pruned ranking
def test_explain_leaves_the_router_as_it_was(instances: int, top_k: int) -> None:
    router, index, registry, clock = fleet(instances)
    keys = prompt(40)
    index.store(("w0", 0), 0, keys[:30])
    for i, state in enumerate(registry.all()):  # queues longer than the work: congested
        state.load = Load(running=4, waiting=3, waiting_prefill_tokens=20_000 + 1000 * i)
        state.last_heartbeat_at = clock.t
    ttft = router.policies["ttft"]
    softmax = PickOptions("softmax", 0.5)
    for _ in range(3):  # a Score folds the congestion weight in, and draws without a request id
        router.score(request(keys), pick=softmax, top_k=top_k)
        clock.t += 1.0
    state = (vars(ttft).copy(), router.rng.getstate(), router.picker.getstate())
    assert ttft._k > 0  # type: ignore[attr-defined]
    first = router.explain(request(keys), pick=softmax, top_k=top_k)
    for policy in ("ttft", "power_of_two", "flexlb", "round_robin", "kvaware"):
        router.explain(request(keys), policy=policy, pick=softmax, top_k=top_k)
    again = router.explain(request(keys), pick=softmax, top_k=top_k)
    assert (vars(ttft), router.rng.getstate(), router.picker.getstate()) == state
    assert [(c.candidate.state.key, c.cost, c.reason) for c in first.choices] == [
        (c.candidate.state.key, c.cost, c.reason) for c in again.choices
    ]
    assert first.committed is None and len(router.ledger) == 0
    # What a Score changes, for contrast: the same call moves the weight on.
    clock.t += 1.0
    router.score(request(keys), pick=softmax, top_k=top_k)
    assert vars(ttft) != state[0] and router.picker.getstate() != state[2]
