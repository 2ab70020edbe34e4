"""The reach of a hybrid-attention model's instances (docs/scoring.md, "Reach"): the full-attention
prefix an instance holds where no window ends, which the engine cannot reuse for this request but
keeps a window at once this request diverges there. The estimate stays exact; the ttft ranking
counts the prefix as where it lives. Unit level: a real index, registry and ranker, no sockets."""

from __future__ import annotations

import pytest

from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.index.hybrid import GroupLayout, GroupSpec
from kvindex.keys import group_key
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.ledger import SpeculativeKeys
from kvindex.scoring.ranker import Ranker, RankerConfig
from kvindex.wire.schema import GPU, Load
from tests.unit.test_scoring import Clock, fleet, prompt

MODEL = "m"
BS = 16
# Three sliding-window groups (a 32-token window: two blocks) and one full-attention group.
LAYOUT = GroupLayout([GroupSpec("sliding_window", BS, window=32)] * 3 + [GroupSpec("full_attention", BS)], BS)
FULL = 3


def hybrid_fleet(n: int, prune: bool, **ttft: object) -> tuple[Ranker, InvertedIndex, Registry, Clock]:
    config = RankerConfig(prune_min_instances=0) if prune else None
    return fleet(n, layout=LAYOUT, config=config, policy_options={"ttft": dict(ttft)})


def cache(index: InvertedIndex, worker: str, keys: list[int]) -> None:
    """What vLLM keeps of a prompt of ``keys``: every block in the full-attention group, the window
    before its last token (its last two blocks) in the sliding-window groups."""
    index.store((worker, 0), GPU, [group_key(k, FULL) for k in keys])
    for g in range(3):
        index.store((worker, 0), GPU, [group_key(k, g) for k in keys[-2:]])


SYSTEM = prompt(96, seed=1)  # 1,536 shared tokens


def question(seed: int, blocks: int = 24) -> list[int]:
    return SYSTEM + prompt(blocks, seed=seed)


def request(keys: list[int], rid: str = "") -> RouteRequest:
    return RouteRequest(MODEL, keys, len(keys) * BS, BS, rid)


def score(router: Ranker, keys: list[int], prune: bool, rid: str = "") -> list:
    return router.score(request(keys, rid), commit=bool(rid), top_k=4 if prune else 0).choices


@pytest.mark.parametrize("prune", [False, True], ids=["exhaustive", "pruned"])
def test_the_full_attention_holder_wins_a_tie_and_stays_exact(prune: bool) -> None:
    router, index, _registry, _clock = hybrid_fleet(4, prune)
    cache(index, "w3", question(10))  # w3 served a sibling: the system prompt's full-attention blocks
    keys = question(11)
    ranked = score(router, keys, prune)
    first = ranked[0].candidate
    assert first.state.worker == "w3" and ranked[0].reason in ("cache", "replica")
    # Exact: the engine reuses nothing of it on w3 (no window ends at the system prompt), and every
    # instance's estimate is the same cold one.
    assert first.hit_tokens == 0 and first.blocks == 0
    assert first.reach == len(SYSTEM) and 0 < first.reach_prefill_ms < first.prefill_ms
    assert {c.candidate.est_ttft_ms for c in ranked} == {first.est_ttft_ms}
    assert ranked[0].cost == first.est_ttft_ms  # (the reported cost is the estimate)


@pytest.mark.parametrize("prune", [False, True], ids=["exhaustive", "pruned"])
def test_without_the_term_the_tie_goes_by_home(prune: bool) -> None:
    """What the exact index did before the reach: a cold prompt everywhere, placed by rendezvous or
    key order, whichever instance that is."""
    router, index, _registry, _clock = hybrid_fleet(4, prune, reach_credit=0.0, reach_holders=False)
    cache(index, "w3", question(10))
    ranked = score(router, question(11), prune)
    assert ranked[0].reason.startswith("home")
    assert all(c.candidate.reach == len(SYSTEM) for c in ranked if c.candidate.state.worker == "w3")


@pytest.mark.parametrize("prune", [False, True], ids=["exhaustive", "pruned"])
def test_the_credit_follows_the_prefix_heat(prune: bool) -> None:
    """A reach holder with a longer wait than an idle instance: it wins only once the prefix is hot
    (later requests will hit the window this one makes), by no more than the prefill it saves them."""
    router, index, registry, clock = hybrid_fleet(4, prune, replica_by_wait=False)
    cache(index, "w3", question(10))
    w3 = registry.get(("w3", 0))
    assert w3 is not None
    w3.load = Load(waiting_prefill_tokens=600)  # a queue shorter than the prefix's prefill
    keys = question(11)
    cold = score(router, keys, prune)
    assert cold[0].candidate.state.worker != "w3" and cold[0].candidate.wait_ms == 0.0
    holder = next(c.candidate for c in cold if c.candidate.state.worker == "w3")
    saved = holder.prefill_ms - holder.reach_prefill_ms
    assert 0 < holder.wait_ms < saved
    ttft = router.policies["ttft"]
    for i in range(3):  # three requests of the prefix committed (anywhere): full heat
        ttft.on_commit(request(question(20 + i)), holder, router.context)
    hot = score(router, keys, prune)
    assert hot[0].candidate.state.worker == "w3"
    assert hot[0].candidate.hit_tokens == 0 and hot[0].candidate.est_ttft_ms > hot[1].candidate.est_ttft_ms
    # A queue longer than the whole saving: the idle instance again, however hot.
    w3.load = Load(waiting_prefill_tokens=200_000)
    clock.t += 0.001
    assert score(router, keys, prune)[0].candidate.state.worker != "w3"


def test_a_committed_prompt_gives_its_instance_reach_and_the_junction() -> None:
    """Before any stored event: a sibling sees the committed prompt's full-attention blocks as reach
    (it goes there), and the one after it the window vLLM keeps at the junction (a hit)."""
    router, _index, _registry, _clock = hybrid_fleet(4, prune=False)
    first = score(router, question(10), False, rid="a")[0].candidate.state.key
    second = {c.candidate.state.key: c.candidate for c in score(router, question(11), False)}
    assert (second[first].blocks, second[first].reach) == (0, len(SYSTEM))
    assert all(c.reach == 0 for k, c in second.items() if k != first)
    assert router.commit(request(question(11), "b"), first)
    third = {c.candidate.state.key: c.candidate for c in score(router, question(12), False)}
    assert (third[first].blocks, third[first].reach) == (len(SYSTEM), 0)


def test_speculative_reach_and_junction_marks() -> None:
    clock = Clock()
    spec = SpeculativeKeys(clock, ttl=10.0)
    keys = prompt(10)
    spec.add(("a", 0), keys, boundary=9, junction=4)
    other = keys[:4] + prompt(6, seed=3)
    assert spec.extend(("a", 0), other, 0) == 4  # the junction's window
    assert spec.extend(("a", 0), keys, 0) == 9  # the replay boundary's
    assert spec.reach(("a", 0), other, 0) == 4 and spec.reach(("a", 0), keys, 2) == 10
    spec.settle(("a", 0), keys, clock.t + 1.0)
    clock.t += 1.5
    assert spec.extend(("a", 0), other, 0) == 0 and spec.reach(("a", 0), keys, 0) == 0
    spec.expire()
    assert len(spec) == 0 and not spec.instances()
