"""Prometheus metrics of the routing proxy, in a registry of their own (``/metrics`` serves it).

Everything is counted where it happens, at the proxy: TTFT from the request's arrival to the first
body byte from the engine, routing decisions by how they were made, fallbacks by why the index did
not decide, retries, upstream errors by kind, ledger releases, requests by final status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvindex.client import ClientStats

# Seconds: from a cached short prompt (a few ms) to a long prefill behind a queue (tens of s).
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
    15.0, 30.0, 60.0,
)  # fmt: skip
SCORE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class _ClientStatsCollector(Collector):
    """The index client's own counters (its stream, refreshes), read at scrape time."""

    def __init__(self, stats: Callable[[], ClientStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        for name, value, doc in (
            ("streams_opened", stats.streams_opened, "ScoreStream calls opened to the index"),
            ("streams_broken", stats.streams_broken, "ScoreStream calls that broke"),
            ("score_resent", stats.retries, "Score requests re-sent once on a new stream"),
            ("refreshes", stats.refreshes, "ListInstances refreshes of the fallback's instance list"),
            ("refresh_errors", stats.refresh_errors, "failed ListInstances refreshes"),
        ):
            yield CounterMetricFamily(f"kvindex_route_index_{name}", doc, value=value)


class RouteMetrics:
    def __init__(self, client_stats: Callable[[], ClientStats | None] = lambda: None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvindex_route_requests", "requests by path and final status (499: client went away)",
            ["path", "code"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvindex_route_ttft_seconds",
            "request received -> first body byte from the engine (streams: the first SSE chunk)",
            ["stream"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "kvindex_route_request_seconds", "request received -> last byte sent to the client",
            ["stream"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.stages = Histogram(
            "kvindex_route_stage_seconds",
            "one request's time by stage: before_forward (received -> sent to the engine: body, "
            "admission, Score), upstream_first_byte (sent -> first body byte from the engine: the "
            "engine's own TTFT as seen here), first_write (that byte -> written to the client)",
            ["stage"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.score_latency = Histogram(
            "kvindex_route_score_seconds", "time to a routing decision (index answer or fallback)",
            buckets=SCORE_BUCKETS, registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "kvindex_route_decisions",
            "requests forwarded, by how the instance served was chosen: index (its first choice), "
            "fallback (consistent hash, the index did not decide), retry (a later choice after a "
            "connection failure)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "kvindex_route_fallbacks",
            "decisions made without the index, by why: unavailable, deadline, stream_broken, error, "
            "index_empty (it lost a model it served), rejected (it refused the request), "
            "text_unsupported (its API takes no text prompts)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvindex_route_retries", "forwards retried on the next instance after a connection failure",
            registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "kvindex_route_upstream_errors",
            "engine failures by kind: connect, timeout, disconnected (before the response), stream "
            "(during the body), http_5xx (answered with a server error, passed through)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.releases = Counter(
            "kvindex_route_releases", "ledger releases sent to the index, by phase and result "
            "(found, not_found, error)", ["phase", "result"], registry=r,
        )  # fmt: skip
        self.reports = Counter(
            "kvindex_route_reports",
            "outcome reports (the engine's cached tokens, the measured TTFT) sent with the final release, "
            "by what the index did with them: applied, or why ignored (error: not delivered)",
            ["result"], registry=r,
        )  # fmt: skip
        self.recommits = Counter(
            "kvindex_route_recommits",
            "ledger entries moved to the instance actually used after a retry (committed, failed)",
            ["result"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("kvindex_route_in_flight", "requests being proxied", registry=r)
        self.index_reachable = Gauge(
            "kvindex_route_index_reachable",
            "1 while the index answers, 0 while it is unreachable (requests then go by the fallback)",
            registry=r,
        )
        r.register(_ClientStatsCollector(client_stats))
        ProcessCollector(registry=r)  # the proxy's own CPU and memory (process_*)
