"""The Explain RPC and ``kvindex explain`` over real parts: an index on a real nats-server fed by
publishers, gRPC over a socket, the three clients (async, blocking, in-process) through the method
table. Explain answers the ranking Score would, says per instance its state and estimate, and why
the first won, and changes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvindex.cli import main
from kvindex.client import AsyncKvIndexClient, BadRequest
from kvindex.client.local import LocalKvIndexClient
from kvindex.client.sync import KvIndexClient
from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MODEL = "explain-model"
BS = 16
PROMPT = list(range(1000, 1000 + 40 * BS))
KEYS = block_keys(PROMPT, BS, MODEL)
MakePub = Callable[..., Awaitable[Publisher]]


async def fleet(service: IndexService, make_publisher: MakePub) -> dict[str, Publisher]:
    """w0 holds the prompt's first 20 blocks on the GPU, w2 the same on the CPU, w1 nothing."""
    pubs = {
        w: await make_publisher(worker=w, model=MODEL, block_size=BS, capacity={"gpu": 1000, "cpu": 1000})
        for w in ("w0", "w1", "w2")
    }
    pubs["w0"].stored(KEYS[:20])
    pubs["w2"].stored(KEYS[:20], tier="cpu")
    for p in pubs.values():
        await p.heartbeat()
    await wait_until(
        lambda: (
            len(service.registry) == 3
            and service.index.block_counts(("w0", 0))[0] == 20
            and service.index.block_counts(("w2", 0))[1] == 20
        ),
        what="fleet indexed",
    )
    return pubs


async def test_explain_says_why_the_winner_won_and_changes_nothing(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await fleet(service, make_publisher)
    ranker = service.ranker
    ttft = ranker.policies["ttft"]
    before = (ranker.rng.getstate(), ranker.picker.getstate(), vars(ttft).copy())
    score = pb.ScoreRequest(model=MODEL, token_ids=PROMPT, explain=True, request_id="r1")
    live = await stub.Score(score)
    k_after_score = ttft._k_at  # type: ignore[attr-defined]  # a ranking folds the congestion weight
    got = await stub.Explain(score)
    # The ranking is Score's (same instances, terms and reasons), nothing committed.
    assert [(r.instance_id, r.est_ttft_ms, r.explain) for r in got.ranking.ranked] == [
        (r.instance_id, r.est_ttft_ms, r.explain) for r in live.ranked
    ]
    assert not got.ranking.committed_instance_id and len(ranker.ledger) == 0
    assert ttft._k_at == k_after_score  # type: ignore[attr-defined]
    assert ranker.rng.getstate() == before[0] and ranker.picker.getstate() == before[1]
    w0, w2, w1 = got.ranking.ranked
    assert (w0.instance_id, w2.instance_id, w1.instance_id) == ("w0/0", "w2/0", "w1/0")
    # w0 and w2 hold the same prefix: the CPU copy costs its fetch, which decided.
    v = got.verdict
    assert (v.winner, v.reason, v.runner_up) == ("w0/0", "cache", "w2/0")
    assert v.deciding_term == "fetch" and v.deciding_ms == pytest.approx(w2.fetch_ms - w0.fetch_ms)
    assert v.deciding_ms > 0 and v.margin_ms == pytest.approx(w2.est_ttft_ms - w0.est_ttft_ms)
    assert v.margin == pytest.approx(w2.cost - w0.cost) and "fetch" in v.summary
    explained = {i.instance_id: i for i in got.instances}
    assert [i.instance_id for i in got.instances] == ["w0/0", "w2/0", "w1/0"]
    for r in got.ranking.ranked:
        i = explained[r.instance_id]
        assert (i.state, i.state_reason, i.credit, i.prefill_source) == ("exact", "", 1.0, "default")
        assert i.miss_tokens == len(PROMPT) - r.matched_tokens and i.in_flight == 0
    # A committed request shows in the next explanation (the ledger), which still commits nothing.
    await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT, commit=True, request_id="r2"))
    again = await stub.Explain(pb.ScoreRequest(model=MODEL, token_ids=PROMPT))
    busy = next(i for i in again.instances if i.instance_id == "w0/0")
    assert busy.in_flight == 1 and len(ranker.ledger) == 1
    assert again.ranking.ranked[0].explain  # explain is implied


async def test_explain_shows_a_degraded_instance_and_its_halved_credit(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await fleet(service, make_publisher)
    outcomes = service.ranker.outcomes
    ask, outcomes.on_degraded = outcomes.on_degraded, None  # held back: its snapshot repairs at once
    # Two reports of w0 that disagree with what the index predicted: degraded.
    for n in range(2):
        rid = f"bad-{n}"
        await stub.Commit(pb.CommitRequest(request_id=rid, instance_id="w0/0", model=MODEL, token_ids=PROMPT))
        await stub.Release(pb.ReleaseRequest(request_id=rid, phase="finished", cached_tokens=0))
    got = await stub.Explain(pb.ScoreRequest(model=MODEL, token_ids=PROMPT, candidates=["w0/0", "w1/0"]))
    w0 = next(i for i in got.instances if i.instance_id == "w0/0")
    assert w0.state == "degraded" and w0.state_reason.startswith("outcomes 2/")
    assert w0.credit == service.ranker.config.outcomes.degraded_credit
    ranked = {r.instance_id: r for r in got.ranking.ranked}
    held = min(ranked["w0/0"].matched_blocks * BS, len(PROMPT) - 1)  # (the last token is recomputed)
    assert ranked["w0/0"].matched_tokens == held // 2  # credited half of what it holds
    assert w0.miss_tokens == len(PROMPT) - ranked["w0/0"].matched_tokens
    outcomes.on_degraded = ask


async def test_bad_arguments_are_invalid_argument_for_every_client(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await fleet(service, make_publisher)
    cases = [
        (pb.ScoreRequest(model=MODEL, token_ids=PROMPT, commit=True, request_id="x"), "never commits"),
        (pb.ScoreRequest(token_ids=PROMPT), "model is required"),
        (pb.ScoreRequest(model=MODEL, token_ids=PROMPT, policy="nope"), "unknown policy 'nope'"),
        (pb.ScoreRequest(model=MODEL), "the prompt is empty"),
    ]
    for request, said in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Explain(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in (err.value.details() or "")
    assert len(service.ranker.ledger) == 0
    # The clients call it by its name in the method table (kvindex/api/methods.py).
    request = pb.ScoreRequest(model=MODEL, token_ids=PROMPT)
    remote = AsyncKvIndexClient(service.grpc.address)
    local = LocalKvIndexClient(service.servicer)
    try:
        for client in (remote, local):
            answer = await client.call("Explain", request)
            assert answer.verdict.winner == "w0/0"
            with pytest.raises(BadRequest, match="never commits"):
                await client.call("Explain", model=MODEL, token_ids=PROMPT, commit=True, request_id="x")
    finally:
        await remote.close()
        await local.close()

    def blocking() -> str:
        with KvIndexClient(service.grpc.address) as client:
            with pytest.raises(BadRequest, match="unknown policy"):
                client.call("Explain", model=MODEL, token_ids=PROMPT, policy="nope")
            return str(client.call("Explain", request).verdict.winner)

    assert await asyncio.to_thread(blocking) == "w0/0"


async def test_cli_explains_and_says_what_is_wrong(
    service: IndexService, make_publisher: MakePub, capsys: pytest.CaptureFixture[str]
) -> None:
    await fleet(service, make_publisher)
    server = ["--server", service.grpc.address]
    tokens = ",".join(map(str, PROMPT))

    async def run(*argv: str) -> int:
        return await asyncio.to_thread(main, ["explain", *server, *argv])

    assert await run("--model", MODEL, "--tokens", tokens, "--plain") == 0
    out = capsys.readouterr().out
    assert "w0/0" in out and "why: w0/0 (cache) beats w2/0" in out and "its fetch is" in out
    keys = ",".join(map(str, KEYS))
    assert await run("--model", MODEL, "--block-keys", keys, "--top-k", "2", "--json") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["verdict"]["winner"] == "w0/0" and len(answer["instances"]) == 2
    assert await run("--model", MODEL, "--tokens", tokens, "--policy", "nope") == 2
    assert "kvindex explain: error: unknown policy 'nope'" in capsys.readouterr().err
    assert await run("--model", "ghost", "--tokens", tokens) == 2
    assert "no instance of model 'ghost'" in capsys.readouterr().err


async def test_explain_says_why_a_hybrid_models_instance_is_approximate(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    """A hybrid-attention model (tests/integration/test_hybrid.py's tiny Gemma 3): an instance whose
    KV-cache groups differ from the model's is approximate, and the explanation says why."""
    from tests.integration import test_hybrid as hybrid

    a = await hybrid.gemma_worker(make_publisher, "a")
    hybrid.cache_first_prompt(a)
    other = [{**g, "window": 128} if g["kind"] == "sliding_window" else g for g in hybrid.GEMMA]
    b = await hybrid.gemma_worker(make_publisher, "b", other)
    for pub in (a, b):
        await pub.heartbeat()
        await hybrid.settle(service, pub)
    await hybrid.announced(service, a, b)
    await wait_until(lambda: service.registry.get(("b", 0)).layout_conflict, what="b's conflict seen")
    got = await stub.Explain(pb.ScoreRequest(model=hybrid.MODEL, token_ids=hybrid.FIRST))
    states = {i.instance_id: (i.state, i.state_reason) for i in got.instances}
    assert states["a/0"] == ("exact", "")
    assert states["b/0"][0] == "approximate" and "KV-cache groups differ from the model's" in states["b/0"][1]
    assert got.verdict.winner == "a/0" and got.ranking.ranked[0].matched_blocks == 7
