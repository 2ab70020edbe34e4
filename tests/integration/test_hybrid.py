"""Hybrid-attention models over real parts: publishers with KV-cache groups -> nats-server -> kvindex ->
gRPC (the unit half, tests/unit/test_hybrid.py, checks the rule and the index's kernels)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.test_e2e import settle
from workers_shim.publisher import Publisher

MakePub = Callable[..., Awaitable[Publisher]]
MODEL = "gemma-tiny"
BS = 32
# The tiny Gemma 3 of issue 33: three sliding-window groups (window 64: two blocks), one full.
GEMMA = [{"kind": "sliding_window", "block_size": BS, "window": 64}] * 3 + [
    {"kind": "full_attention", "block_size": BS}
]
FIRST = list(range(240))
KEYS = block_keys(FIRST, BS, MODEL)  # 7 full blocks
THIRD = FIRST[:192] + [1000 + t for t in range(48)]  # shares 6 blocks with FIRST
THIRD_KEYS = block_keys(THIRD, BS, MODEL)


async def gemma_worker(make_publisher: MakePub, worker: str, groups: list[dict] | None = GEMMA) -> Publisher:
    pub = await make_publisher(worker=worker, model=MODEL, block_size=BS, capacity={"gpu": 1000})
    pub.groups = groups
    return pub


def cache_first_prompt(pub: Publisher) -> None:
    """What vLLM stores for FIRST: every block in the full-attention group, the window before the
    prompt's last token (blocks 5 and 6) in each sliding-window group."""
    pub.stored(KEYS, group=3)
    for g in (0, 1, 2):
        pub.stored(KEYS[5:7], parent=KEYS[4], group=g)


async def matched(stub: pb_grpc.KvIndexStub, tokens: list[int]) -> dict[str, int]:
    reply = await stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=tokens))
    return {m.instance_id: m.matched_blocks for m in reply.matches if m.matched_blocks}


async def instances(stub: pb_grpc.KvIndexStub) -> dict[str, pb.InstanceInfo]:
    reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
    return {i.instance_id: i for i in reply.instances}


async def announced(service: IndexService, *pubs: Publisher) -> None:
    await wait_until(
        lambda: all(
            (s := service.registry.get((p.worker, 0))) is not None and s.groups_announced != () for p in pubs
        ),
        what="layouts announced",
    )


async def test_lookup_score_and_state_follow_the_rule(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    a = await gemma_worker(make_publisher, "a")
    cache_first_prompt(a)
    await a.heartbeat()
    await settle(service, a)
    await announced(service, a)

    # The same prompt again: 224 tokens (7 blocks), as the engine reported.
    assert await matched(stub, FIRST) == {"a/0": 7}
    # A prompt sharing 192 tokens: cold (no window ends inside the shared prefix), where the
    # full-attention group alone would promise 6 blocks.
    assert await matched(stub, THIRD) == {}
    score = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=THIRD))
    assert [(r.instance_id, r.matched_tokens) for r in score.ranked] == [("a/0", 0)]
    score = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=FIRST))
    assert score.ranked[0].matched_tokens == 224

    info = (await instances(stub))["a/0"]
    assert (info.state, info.kv_groups) == ("exact", "3x sliding_window(64) + full_attention")
    assert info.blocks.gpu == 7 + 3 * 2  # (block, group) pairs

    # The engine keeps the window at the divergence point; a prompt continuing it hits 192.
    for g in (0, 1, 2):
        a.stored(THIRD_KEYS[4:6], parent=THIRD_KEYS[3], group=g)
    await settle(service, a)
    fourth = FIRST[:192] + [2000 + t for t in range(40)]
    assert await matched(stub, fourth) == {"a/0": 6}
    # One sliding-window group evicting block 5 loses the window for every prompt ending there.
    a.removed([KEYS[5]], group=1)
    await settle(service, a)
    assert await matched(stub, fourth) == {}
    assert await matched(stub, FIRST) == {}  # the window at 224 needed block 5 too


async def test_layout_conflicts_and_unreadable_layouts(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    a = await gemma_worker(make_publisher, "a")
    cache_first_prompt(a)
    await a.heartbeat()
    await settle(service, a)
    await announced(service, a)
    # Another worker of the model announcing a different window is refused whole.
    other = [{**g, "window": 128} if g["kind"] == "sliding_window" else g for g in GEMMA]
    b = await gemma_worker(make_publisher, "b", other)
    cache_first_prompt(b)
    await b.heartbeat()
    await settle(service, b)
    await announced(service, b)
    await wait_until(lambda: service.registry.get(("b", 0)).layout_conflict, what="conflict seen")
    assert await matched(stub, FIRST) == {"a/0": 7}  # b's blocks are not read by a's rule
    b.stored(THIRD_KEYS, group=3)
    await settle(service, b)
    assert service.index.block_counts(("b", 0)) == (0, 0, 0, 0)
    info = (await instances(stub))["b/0"]
    assert info.state == "approximate" and "differ from the model's" in info.state_reason
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.rejects_by_reason["group_layout_mismatch"] >= 2  # its heartbeat and its batch

    # A worker whose layout cannot be read, and one whose events name a group its layout lacks.
    c = await gemma_worker(make_publisher, "c", [{"kind": "sliding_window"}, {"kind": "full_attention"}])
    d = await gemma_worker(make_publisher, "d", None)
    d.stored(KEYS[:2], group=5)
    await c.heartbeat()
    await d.heartbeat()
    await settle(service, c, d)
    await announced(service, c, d)

    async def states() -> dict[str, tuple[str, str]]:
        return {k: (i.state, i.state_reason) for k, i in (await instances(stub)).items()}

    await wait_until(lambda: service.registry.get(("d", 0)).groups_inexact != "", what="d approximate")
    await wait_until(
        lambda: "unreadable" in service.registry.get(("c", 0)).groups_inexact, what="c unreadable"
    )
    seen = await states()
    assert seen["c/0"][0] == "approximate" and "has no window" in seen["c/0"][1]
    assert seen["d/0"][0] == "approximate"
    # d announces no layout and sends events of group 5.
    assert "events of KV-cache group 5, and no layout announced" in seen["d/0"][1]
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.rejects_by_reason["bad_groups"] >= 1
    # The honest worker is untouched.
    assert seen["a/0"] == ("exact", "")
    assert await matched(stub, FIRST) == {"a/0": 7}


async def test_score_prefers_the_full_attention_holder_on_a_tie_and_stays_exact(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    """Issue 33's third prompt on two idle instances: ``b`` served FIRST (its full-attention group
    holds the 192 shared tokens, no window ends there), ``a`` holds nothing. Both are cold for it —
    Score says so — but the engine keeps the window at that junction after it, so the ranking puts
    it on ``b`` (docs/scoring.md, "Reach"); ``a`` is its rendezvous home and first by key."""
    a = await gemma_worker(make_publisher, "a")
    b = await gemma_worker(make_publisher, "b")
    cache_first_prompt(b)
    for pub in (a, b):
        await pub.heartbeat()
    await settle(service, a, b)
    await announced(service, a, b)

    for top_k in (0, 2):
        score = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=THIRD, top_k=top_k, explain=True))
        ranked = [(r.instance_id, r.matched_tokens, r.matched_blocks) for r in score.ranked]
        assert ranked == [("b/0", 0, 0), ("a/0", 0, 0)], top_k
        assert score.ranked[0].est_ttft_ms == score.ranked[1].est_ttft_ms  # the tie: both cold
        assert score.ranked[0].explain in ("cache", "replica")
    # The prompt b can serve is still priced as the hit it is.
    score = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=FIRST))
    assert [(r.instance_id, r.matched_tokens) for r in score.ranked] == [("b/0", 224), ("a/0", 0)]
