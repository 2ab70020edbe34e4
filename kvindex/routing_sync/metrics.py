"""Prometheus view of the routing sync: plain counters in RoutingSync, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvindex.observability.counters import counter_makers
from kvindex.routing_sync.sync import DELAY_BUCKETS, RoutingSync


class SyncCollector(Collector):
    def __init__(self, sync: RoutingSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Any]:
        s = self.sync

        counter, labeled = counter_makers("kvindex_routing_sync_")

        yield labeled("published", "Routing decisions published to the other replicas", "op", s.published)
        yield counter("messages_published", "Routing-sync messages published", s.messages_published)
        yield labeled("applied", "Other replicas' routing decisions applied here", "op", s.applied)
        yield counter("messages_applied", "Other replicas' messages applied", s.messages_applied)
        yield labeled("dropped", "Decisions not shared or not applied, by reason", "reason", s.dropped)
        yield labeled("rejects", "Routing-sync messages rejected by reason", "reason", s.rejects)
        yield counter("truncated", "Commits shared with only their first keys", s.truncated)
        yield GaugeMetricFamily(
            "kvindex_routing_sync_peers", "Other replicas heard from in the last minute", value=s.peers()
        )
        yield GaugeMetricFamily(
            "kvindex_routing_sync_pending", "Decisions queued for publishing", value=s.pending()
        )
        delay = HistogramMetricFamily(
            "kvindex_routing_sync_delay_seconds", "Decision on another replica -> applied here"
        )
        cumulative = 0
        buckets = []
        for edge, n in zip((*DELAY_BUCKETS, float("inf")), s.delay.counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if edge == float("inf") else str(edge), cumulative))
        delay.add_metric([], buckets, s.delay.sum)
        yield delay
