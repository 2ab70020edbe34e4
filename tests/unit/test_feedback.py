"""Predicted against actual (kvindex/scoring/outcomes.py, docs/feedback.md): the comparison rules as
pure logic, the usage option added to requests and the usage reader. The whole path over real parts:
tests/integration/test_feedback.py."""

from __future__ import annotations

import json
import math

import pytest

from kvindex.fleet.registry import InstanceState
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

MODEL = "feedback-model"
BS = 4


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
    state.repair.sync, state.repair.cause = "snapshot", "periodic"  # a routine check
    assert tracker.state(state)[0] == EXACT
    state.repair.sync, state.repair.cause = "replay", "gap"
    assert tracker.state(state) == (DEGRADED, "replay (gap)")
    state.repair.sync, state.repair.failed = "synced", True
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
