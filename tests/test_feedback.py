"""Predicted against actual (kvindex/scoring/outcomes.py, docs/feedback.md): the comparison rules as
pure logic, then the whole path over a real gRPC socket with publishers on a real nats-server:
Score with commit, Release with the engine's report, the metrics, the instance's state, the
snapshot a degradation asks for, and every kind of bad report."""

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
from kvindex.fleet.registry import InstanceState
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.scoring.outcomes import (
    DEGRADED,
    EXACT,
    OVER,
    UNDER,
    Outcome,
    OutcomeConfig,
    OutcomeTracker,
    Prediction,
    Report,
)
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MODEL = "feedback-model"
BS = 4
PROMPT = list(range(500, 500 + 8 * BS + 2))  # 34 tokens: 8 full blocks
KEYS = block_keys(PROMPT, BS, MODEL)

MakePub = Callable[..., Awaitable[Publisher]]


def prediction(blocks: int, prompt: int, event_blocks: int | None = None, at: float = 0.0) -> Prediction:
    return Prediction(
        ("w", 0), MODEL, "ttft", BS, prompt, blocks, blocks if event_blocks is None else event_blocks,
        (blocks * BS, 0, 0, 0), 10.0, 40.0, 0.0, 50.0, at,
    )  # fmt: skip


# -- the rules ---------------------------------------------------------------------------------------


def test_last_token_rule_makes_an_exact_index_exact() -> None:
    # A 24-token prompt, all 6 blocks cached: vLLM recomputes the last block, reports 20.
    assert prediction(6, 24).cached_tokens == 20
    assert prediction(6, 25).cached_tokens == 24
    assert prediction(0, 24).cached_tokens == 0
    tracker = OutcomeTracker(lambda: 1.0)
    status, outcome = tracker.compare(prediction(6, 24), Report(cached_tokens=20, ttft_ms=55.0))
    assert status == "applied" and outcome is not None
    assert outcome.outcome == EXACT and outcome.error_tokens == 0
    assert outcome.ttft_ratio == pytest.approx(1.1)
    # The calibration's sample: measured TTFT minus the predicted wait, with the engine's hit.
    assert outcome.prefill_sample() == (24, 20, 45.0)


def test_over_under_and_speculative_misses() -> None:
    tracker = OutcomeTracker(lambda: 1.0, OutcomeConfig(window=4, threshold=2))
    seen: list[Outcome] = []
    tracker.subscribe(seen.append)
    asked: list[tuple[str, int]] = []
    tracker.on_degraded = asked.append
    # Within a block either way is exact (an engine hit is whole blocks; the rule is |error| < B).
    assert tracker.compare(prediction(4, 34), Report(cached_tokens=16))[1].outcome == EXACT  # type: ignore[union-attr]
    # The index promised 4 blocks, two were speculative and the engine had only the other two: an
    # over, counted, but no evidence of a stale index.
    _, spec = tracker.compare(prediction(4, 34, event_blocks=2), Report(cached_tokens=8))
    assert spec is not None and spec.outcome == OVER and spec.error_tokens == -8 and not spec.evidence
    _, under = tracker.compare(prediction(1, 34), Report(cached_tokens=12))
    assert under is not None and under.outcome == UNDER and under.evidence
    assert not tracker.degraded_by_outcomes(("w", 0)) and asked == []
    _, over = tracker.compare(prediction(5, 34), Report(cached_tokens=0))
    assert over is not None and over.outcome == OVER and over.evidence
    assert tracker.degraded_by_outcomes(("w", 0)) and asked == [("w", 0)]
    assert tracker.outcomes == {EXACT: 1, OVER: 2, UNDER: 1} and len(seen) == 4
    # Still wrong while degraded: not asked again within the interval.
    tracker.compare(prediction(5, 34), Report(cached_tokens=0))
    assert asked == [("w", 0)] and tracker.reconciles == 1
    # A repair voids the evidence, and reports of requests committed before it do not count.
    tracker.clock = lambda: 2.0
    tracker.repaired(("w", 0))
    assert not tracker.degraded_by_outcomes(("w", 0))
    for _ in range(3):
        tracker.compare(prediction(5, 34, at=1.5), Report(cached_tokens=0))
    assert not tracker.degraded_by_outcomes(("w", 0))
    # Error histogram: buckets at multiples of the block size, 0 and +-1 block among them.
    counts = tracker.instances[("w", 0)].error_counts
    assert sum(counts) == 8


def test_disagreements_the_index_can_explain_are_no_evidence() -> None:
    tracker = OutcomeTracker(lambda: 1.0, OutcomeConfig(window=4, threshold=1))
    p = prediction(5, 34)
    p.removals = 7
    # The index applied evictions of the instance since the decision: the engine may have evicted
    # the blocks while the request waited.
    _, evicted = tracker.compare(p, Report(cached_tokens=0), removals=9, held_now=lambda: 5)
    assert evicted is not None and evicted.outcome == OVER and evicted.excuse == "evicted"
    # The events came late: by the report the index holds what the engine hit.
    _, late = tracker.compare(prediction(1, 34), Report(cached_tokens=20), removals=7, held_now=lambda: 6)
    assert late is not None and late.outcome == UNDER and late.excuse == "late" and not late.evidence
    assert not tracker.degraded_by_outcomes(("w", 0))
    # ... or never: lost.
    _, lost = tracker.compare(prediction(1, 34), Report(cached_tokens=20), removals=7, held_now=lambda: 1)
    assert lost is not None and lost.evidence and lost.excuse == ""
    assert tracker.degraded_by_outcomes(("w", 0))


def test_state_follows_repairs_and_events() -> None:
    tracker = OutcomeTracker(lambda: 0.0)
    state = InstanceState(("w", 0), MODEL, BS)
    assert tracker.state(state) == (EXACT, "")
    state.sync, state.sync_cause = "snapshot", "periodic"  # a routine check
    assert tracker.state(state)[0] == EXACT
    state.sync, state.sync_cause = "replay", "gap"
    assert tracker.state(state) == (DEGRADED, "replay (gap)")
    state.sync, state.repair_failed = "synced", True
    assert tracker.state(state) == (DEGRADED, "repair failed")
    state.approximate = True
    assert tracker.state(state)[0] == "approximate"


def test_malformed_reports() -> None:
    assert Report(ttft_ms=-1.0).malformed()
    assert Report(ttft_ms=math.nan).malformed()
    assert Report(ttft_ms=math.inf).malformed()
    assert Report(cached_tokens=3, ttft_ms=0.0).malformed() is None
    tracker = OutcomeTracker(lambda: 0.0)
    assert tracker.compare(prediction(2, 34), Report(cached_tokens=35))[0] == "absurd"
    assert tracker.compare(prediction(2, 34), Report(ttft_ms=1e12))[0] == "absurd"
    assert (
        tracker.compare(prediction(2, 34), Report(cached_tokens=8, prompt_tokens=33))[0] == "prompt_mismatch"
    )
    assert tracker.outcomes == {EXACT: 0, OVER: 0, UNDER: 0}
    assert tracker.ignored == {"absurd": 2, "prompt_mismatch": 1}


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
    await wait_until(lambda: all(s.sync == "synced" for s in svc.registry.all()), what="start snapshots done")
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
    svc.router.outcomes.subscribe(seen.append)
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
        ignored = svc.router.outcomes.ignored
        assert ignored == {
            "already_released": 1, "unknown_request": 1, "absurd": 1, "prompt_mismatch": 1, "duplicate": 1,
            "invalid": 3,
        }  # fmt: skip
        assert _sample(svc, "kvindex_prediction_reports_ignored_total", reason="invalid") == 3
        assert svc.router.outcomes.outcomes == {
            "exact": 1,
            "over": 0,
            "under": 0,
        }  # r2's TTFT only: no verdict

        # Stale index: w1 lost its blocks but the events never said so. Two overs -> degraded.
        for rid in ("r4", "r5"):
            d = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id=rid)
            assert d.committed_instance_id == "w1/0"
            assert (await client.release_reported(rid, "finished", cached_tokens=0))[1] == "applied"
        assert svc.router.outcomes.outcomes["over"] == 2
        # The degradation asked for a snapshot at once; the worker's snapshot reconciles the index
        # (here it agrees: the worker's publisher still holds the blocks) and voids the evidence.
        await wait_until(lambda: svc.counters.snapshots_requested["degraded"] == 1, what="snapshot asked")
        await wait_until(
            lambda: svc.router.state_of(svc.registry.get(("w1", 0)))[0] == EXACT, what="exact again"
        )
        assert _sample(svc, "kvindex_prediction_reconciles_total") == 1
        # An under: w2 holds 2 blocks, the engine says 6.
        d = await client.score(MODEL, token_ids=PROMPT, commit=True, request_id="r6", candidates=["w2/0"])
        assert d.committed_instance_id == "w2/0"
        assert (await client.release_reported("r6", "finished", cached_tokens=24))[1] == "applied"
        assert svc.router.outcomes.outcomes["under"] == 1

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
        ask = svc.router.outcomes.on_degraded
        svc.router.outcomes.on_degraded = None  # held back for a moment: it would repair at once
        state.repair_failed = True  # as after a snapshot request that timed out
        svc.router.sync_changed(state)
        assert svc.router.degraded == {("w1", 0)}
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
    svc.router.outcomes.on_degraded = ask
    assert svc.router.outcomes.request_reconcile(("w1", 0))
    await wait_until(lambda: svc.counters.snapshots_requested["degraded"] == 1, what="snapshot asked")
    await wait_until(lambda: not svc.router.degraded, what="exact again")


# -- reading the engine's usage (kvindex/route/usage.py) -------------------------------------------------


def test_include_usage_is_added_without_touching_the_rest() -> None:
    from kvindex.route.usage import add_include_usage

    raw = b'{"model": "m", "prompt": "caf\\u00e9", "stream": true}'
    assert add_include_usage(raw) == b'{"stream_options":{"include_usage":true},' + raw[1:]
    assert add_include_usage(b" {}") == b' {"stream_options":{"include_usage":true}}'
    # Present but off, or with other options: the body is re-encoded with it on.
    out = add_include_usage(b'{"stream": true, "stream_options": {"continuous_usage_stats": false}}')
    assert out is not None and json.loads(out)["stream_options"] == {
        "continuous_usage_stats": False,
        "include_usage": True,
    }
    assert add_include_usage(b'{"stream": true, "stream_options": {"include_usage": true}}') is None
    assert add_include_usage(b'{"stream": true, "stream_options": 3}') is None  # the engine says 400


def test_usage_reader_streams_split_anywhere_and_strips_the_usage_chunk() -> None:
    from kvindex.route.usage import UsageReader

    events = [
        b'data: {"choices": [{"text": " a"}]}\n\n',
        b'data: {"choices": [{"text": " b"}], "usage": null}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2, '
        b'"prompt_tokens_details": {"cached_tokens": 32}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    whole = b"".join(events)
    for cut in (1, 7, 13, len(whole)):
        pieces = [whole[i : i + cut] for i in range(0, len(whole), cut)]
        strip = UsageReader(stream=True, strip=True)
        out = b"".join(strip.feed(p) for p in pieces) + strip.finish()
        assert out == events[0] + events[1] + events[3]
        assert strip.usage is not None and (strip.usage.cached_tokens, strip.usage.prompt_tokens) == (32, 40)
        keep = UsageReader(stream=True)
        assert b"".join(keep.feed(p) for p in pieces) + keep.finish() == whole
        assert keep.usage is not None and keep.usage.completion_tokens == 2
    answer = UsageReader(stream=False)
    body = b'{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}'
    assert answer.feed(body[:5]) + answer.feed(body[5:]) == body and answer.finish() == b""
    assert (
        answer.usage is not None
        and answer.usage.cached_tokens is None
        and answer.usage.completion_tokens == 1
    )
    broken = UsageReader(stream=False)
    broken.feed(b"not json")
    broken.finish()
    assert broken.usage is None
