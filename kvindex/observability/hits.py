"""Prompt-cache hits as the engines reported them and as the index predicted them, per model: the
tokens of every compared outcome report (kvindex/scoring/outcomes.py). The hit rate a dashboard
shows is ``reported_cached / prompt``; ``predicted_cached / prompt`` beside it is what the index
expected for the same requests.

Fed by the outcome tracker's subscription (plain ints bumped in the event loop), exported at scrape
time like the other collectors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvindex.scoring.outcomes import Outcome, OutcomeTracker

KINDS = ("prompt", "predicted_cached", "reported_cached")


class HitCollector(Collector):
    def __init__(self, tracker: OutcomeTracker) -> None:
        self.tokens: dict[str, list[int]] = {}  # model -> tokens by KINDS
        tracker.subscribe(self._on_outcome)

    def _on_outcome(self, outcome: Outcome) -> None:
        actual = outcome.report.cached_tokens
        if actual is None:
            return  # no engine figure to set the prediction against
        p = outcome.prediction
        counts = self.tokens.get(p.model)
        if counts is None:
            counts = self.tokens[p.model] = [0, 0, 0]
        counts[0] += p.prompt_tokens
        counts[1] += p.cached_tokens
        counts[2] += actual

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "kvindex_prediction_tokens",
            "Prompt tokens of reported requests, and of them the cached tokens the index predicted and "
            "the engine reported, per model",
            labels=["model", "kind"],
        )
        for model, counts in sorted(self.tokens.items()):
            for kind, n in zip(KINDS, counts, strict=True):
                family.add_metric([model, kind], n)
        yield family
