"""Predicted against actual (kvindex/scoring/outcomes.py, docs/feedback.md), the whole path over a real
gRPC socket with publishers on a real nats-server: Score with commit, Release with the engine's
report, the metrics, the instance's state, the snapshot a degradation asks for, and every kind of bad
report. The comparison rules alone: tests/unit/test_feedback.py."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvindex.client import AsyncKvIndexClient, BadRequest
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.scoring.outcomes import (
    DEGRADED,
    EXACT,
    Outcome,
)
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.unit.test_feedback import BS, MODEL
from workers_shim.publisher import Publisher

PROMPT = list(range(500, 500 + 8 * BS + 2))  # 34 tokens: 8 full blocks
KEYS = block_keys(PROMPT, BS, MODEL)


MakePub = Callable[..., Awaitable[Publisher]]


# -- over gRPC, with a real fleet ----------------------------------------------------------------------


async def _fleet(svc: IndexService, make_publisher: MakePub) -> dict[str, Publisher]:
    pubs = {
        w: await make_publisher(worker=w, model=MODEL, block_size=BS, capacity={"gpu": 100})
        for w in ("w1", "w2")
    }
    pubs["w1"].stored(KEYS[:6])
    pubs["w2"].stored(KEYS[:2])
    for p in pubs.values():
        await p.flush()
    await wait_until(
        lambda: svc.index.block_counts(("w1", 0))[0] == 6 and svc.index.block_counts(("w2", 0))[0] == 2,
        what="fleet indexed",
    )
    await wait_until(
        lambda: all(s.repair.sync == "synced" for s in svc.registry.all()), what="start snapshots done"
    )
    return pubs


def _sample(svc: IndexService, name: str, **labels: str) -> float:
    value = svc.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_reports_over_grpc(
    make_service: Callable[..., Awaitable[IndexService]], make_publisher: MakePub
) -> None:
    svc = await make_service(RepairConfig(reconcile_interval=0))
    await _fleet(svc, make_publisher)
    seen: list[Outcome] = []
    svc.ranker.outcomes.subscribe(seen.append)
    async with AsyncKvIndexClient(svc.grpc.address, timeout=5, refresh_interval=0) as client:
        d = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="r1")
        assert d.committed_instance_id == "w1/0" and d.response is not None
        est = d.response.ranked[0].est_ttft_ms
        assert await client.release("r1", "prefill")
        # The engine found the 6 blocks (24 tokens) the index promised, and took 1.5x the estimate.
        found, status = await client.release_reported(
            "r1", "finished", cached_tokens=24, ttft_ms=1.5 * est, prompt_tokens=len(PROMPT)
        )
        assert (found, status) == (True, "applied")
        assert len(seen) == 1 and seen[0].outcome == EXACT and seen[0].instance == ("w1", 0)
        assert seen[0].prediction.policy == "ttft" and seen[0].prediction.tokens_by_tier == (24, 0, 0, 0)
        assert _sample(svc, "kvindex_prediction_outcomes_total", outcome="exact") == 1
        assert _sample(svc, "kvindex_prediction_cached_tokens_error_bucket", instance="w1/0", le="0.0") == 1
        assert _sample(svc, "kvindex_prediction_cached_tokens_error_bucket", instance="w1/0", le="-4.0") == 0
        assert _sample(svc, "kvindex_prediction_ttft_ratio_bucket", instance="w1/0", le="1.5") == 1
        assert _sample(svc, "kvindex_prediction_ttft_ratio_bucket", instance="w1/0", le="1.25") == 0

        # Bad reports: counted and ignored, the release itself still done.
        assert await client.release_reported("r1", "finished", cached_tokens=24) == (
            False,
            "already_released",
        )
        assert await client.release_reported("nobody", "finished", cached_tokens=0) == (
            False,
            "unknown_request",
        )
        await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="r2")
        assert await client.release_reported("r2", "prefill", cached_tokens=99) == (True, "absurd")
        assert await client.release_reported("r2", "prefill", cached_tokens=24, prompt_tokens=7) == (
            True,
            "prompt_mismatch",
        )
        assert await client.release_reported("r2", "prefill", ttft_ms=30.0) == (True, "applied")
        assert await client.release_reported("r2", "finished", cached_tokens=24) == (True, "duplicate")
        for bad in (-1.0, math.nan, math.inf):
            with pytest.raises(BadRequest, match="ttft_ms"):
                await client.release_reported("r3", "finished", ttft_ms=bad)
        ignored = svc.ranker.outcomes.ignored
        assert ignored == {
            "already_released": 1, "unknown_request": 1, "absurd": 1, "prompt_mismatch": 1, "duplicate": 1,
            "invalid": 3,
        }  # fmt: skip
        assert _sample(svc, "kvindex_prediction_reports_ignored_total", reason="invalid") == 3
        assert svc.ranker.outcomes.outcomes == {
            "exact": 1,
            "over": 0,
            "under": 0,
        }  # r2's TTFT only: no verdict

        # Stale index: w1 lost its blocks but the events never said so. Two overs -> degraded.
        for rid in ("r4", "r5"):
            d = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id=rid)
            assert d.committed_instance_id == "w1/0"
            assert (await client.release_reported(rid, "finished", cached_tokens=0))[1] == "applied"
        assert svc.ranker.outcomes.outcomes["over"] == 2
        # The degradation asked for a snapshot at once; the worker's snapshot reconciles the index
        # (here it agrees: the worker's publisher still holds the blocks) and voids the evidence.
        await wait_until(lambda: svc.counters.snapshots_requested["degraded"] == 1, what="snapshot asked")
        await wait_until(
            lambda: svc.ranker.state_of(svc.registry.get(("w1", 0)))[0] == EXACT, what="exact again"
        )
        assert _sample(svc, "kvindex_prediction_reconciles_total") == 1
        # An under: w2 holds 2 blocks, the engine says 6.
        d = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="r6", candidates=["w2/0"])
        assert d.committed_instance_id == "w2/0"
        assert (await client.release_reported("r6", "finished", cached_tokens=24))[1] == "applied"
        assert svc.ranker.outcomes.outcomes["under"] == 1

    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        listed = await pb_grpc.KvIndexStub(channel).ListInstances(pb.ListInstancesRequest(model=MODEL))
    by_id = {i.instance_id: i for i in listed.instances}
    assert (
        by_id["w1/0"].state == EXACT
        and by_id["w1/0"].outcomes_exact == 1
        and by_id["w1/0"].outcomes_over == 2
    )
    assert by_id["w2/0"].outcomes_under == 1
    assert _sample(svc, "kvindex_instances_by_state", state="exact") == 2
    assert _sample(svc, "kvindex_instance_state", instance="w1/0", state="exact") == 1


async def test_degraded_state_shows_and_discounts_the_cache(
    make_service: Callable[..., Awaitable[IndexService]], make_publisher: MakePub
) -> None:
    """A degraded instance is listed as such, with the reason, and its match credited at half."""
    svc = await make_service(RepairConfig(reconcile_interval=0))
    await _fleet(svc, make_publisher)
    async with AsyncKvIndexClient(svc.grpc.address, timeout=5, refresh_interval=0) as client:
        before = (await client.score(MODEL, token_ids=PROMPT, candidates=["w1/0"])).response
        state = svc.registry.get(("w1", 0))
        ask = svc.ranker.outcomes.on_degraded
        svc.ranker.outcomes.on_degraded = None  # held back for a moment: it would repair at once
        state.repair.failed = True  # as after a snapshot request that timed out
        svc.ranker.sync_changed(state)
        assert svc.ranker.degraded == {("w1", 0)}
        after = (await client.score(MODEL, token_ids=PROMPT, candidates=["w1/0"])).response
        listed = await client.list_instances(MODEL)
        # `kvindex instances` shows it too.
        cli = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "kvindex"), "instances", "--server", svc.grpc.address,
            "--model", MODEL, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(cli.communicate(), 30)
        shown = {i["instanceId"]: i for i in json.loads(out)["instances"]}
        assert shown["w1/0"]["state"] == DEGRADED and shown["w1/0"]["stateReason"] == "repair failed"
        assert shown["w2/0"]["state"] == EXACT
    assert before is not None and after is not None
    assert before.ranked[0].matched_tokens == 24 and after.ranked[0].matched_tokens == 12
    assert after.ranked[0].matched_blocks == 6  # what the index holds is shown as it is
    assert after.ranked[0].prefill_ms > before.ranked[0].prefill_ms
    w1 = next(i for i in listed if i.instance_id == "w1/0")
    assert (w1.state, w1.state_reason) == (DEGRADED, "repair failed")
    # A degraded instance asks for a snapshot, whose success makes it exact again.
    svc.ranker.outcomes.on_degraded = ask
    assert svc.ranker.outcomes.request_reconcile(("w1", 0))
    await wait_until(lambda: svc.counters.snapshots_requested["degraded"] == 1, what="snapshot asked")
    await wait_until(lambda: not svc.ranker.degraded, what="exact again")
