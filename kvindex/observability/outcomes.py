"""Prometheus view of predicted against actual (kvindex/scoring/outcomes.py) and of the instances'
states. Read at scrape time from the tracker's plain counts, like the ingest counters.

The error histogram's buckets are multiples of each instance's block size (one model per instance),
so its ``le`` edges differ between instances of models with different block sizes: aggregate it per
model, or use the outcome counter, which has the same meaning everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvindex.fleet.registry import instance_id
from kvindex.observability.counters import counter_makers
from kvindex.scoring.outcomes import ERROR_BLOCKS, OUTCOMES, RATIO_BUCKETS, STATES, OutcomeTracker


def _cumulative(edges: list[float], counts: list[int]) -> list[tuple[str, int]]:
    out = []
    total = 0
    for edge, n in zip((*edges, float("inf")), counts, strict=True):
        total += n
        out.append(("+Inf" if edge == float("inf") else repr(edge), total))
    return out


class OutcomeCollector(Collector):
    def __init__(self, tracker: OutcomeTracker, states: Callable[[], dict[str, list[str]]]) -> None:
        self._t = tracker
        self._states = states

    def collect(self) -> Iterator[Any]:
        t = self._t
        counter, labeled = counter_makers("kvindex_prediction_")
        yield labeled(
            "outcomes",
            "Reported requests by verdict: exact (within one block), over (the index promised more than "
            "the engine had), under (the engine had more)",
            "outcome",
            {o: t.outcomes[o] for o in OUTCOMES},
        )
        yield labeled("reports_ignored", "Outcome reports not compared, by reason", "reason", t.ignored)
        yield counter("reconciles", "Snapshots asked for because an instance was degraded", t.reconciles)
        error = HistogramMetricFamily(
            "kvindex_prediction_cached_tokens_error",
            "Engine-reported minus predicted cached tokens per request (buckets: multiples of a block)",
            labels=["instance"],
        )
        ratio = HistogramMetricFamily(
            "kvindex_prediction_ttft_ratio",
            "Measured TTFT / the TTFT the index estimated, per request",
            labels=["instance"],
        )
        for key, inst in sorted(t.instances.items()):
            name = instance_id(key)
            if sum(inst.error_counts):
                edges = [float(e * inst.block_size) for e in ERROR_BLOCKS]
                error.add_metric([name], _cumulative(edges, inst.error_counts), float(inst.error_sum))
            if inst.ratio_n:
                ratio.add_metric([name], _cumulative(list(RATIO_BUCKETS), inst.ratio_counts), inst.ratio_sum)
        yield error
        yield ratio
        states = self._states()
        by_state = GaugeMetricFamily(
            "kvindex_instances_by_state",
            "Instances per state: exact, degraded, approximate",
            labels=["state"],
        )
        each = GaugeMetricFamily(
            "kvindex_instance_state", "1 for each instance's current state", labels=["instance", "state"]
        )
        for state in STATES:
            ids = states.get(state, [])
            by_state.add_metric([state], len(ids))
            for name in sorted(ids):
                each.add_metric([name, state], 1)
        yield by_state
        yield each
