"""Ingest and API counters: plain ints on the hot path, exported to Prometheus at scrape time.

Incrementing a prometheus_client Counter takes a lock per call; the ingest path bumps several
counters per batch, so it keeps plain ints and a custom collector reads them when scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvindex.wire.schema import OP_NAMES, TIER_NAMES

LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LagHistogram:
    """Seconds from a batch being sealed by its worker (its ``ts``) to being applied here.

    Plain counts (no lock) because it is bumped once per batch on the ingest path. Worker and index
    clocks must agree for the absolute value to mean anything; on one host they do.
    """

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LAG_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (inf if beyond the last bucket)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return LAG_BUCKETS[i] if i < len(LAG_BUCKETS) else float("inf")
        return float("inf")


@dataclass(slots=True)
class IngestCounters:
    batches_received: int = 0
    batches_applied: int = 0
    duplicates: int = 0
    stale_epochs: int = 0
    gaps: int = 0
    missing_batches: int = 0
    restarts: int = 0
    joins_mid_stream: int = 0
    heartbeats_received: int = 0
    events_applied: list[int] = field(default_factory=lambda: [0, 0, 0])
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_cleared: int = 0
    rejects: Counter[str] = field(default_factory=Counter)

    rejects_by_worker: Counter[str] = field(default_factory=Counter)
    blocks_refused: int = 0  # stored keys dropped beyond an (instance, tier) block limit
    # repairs
    replays_requested: int = 0
    replays_ok: int = 0
    replays_failed: Counter[str] = field(default_factory=Counter)  # too_old, wrong_epoch, timeout...
    snapshots_requested: Counter[str] = field(default_factory=Counter)  # by cause
    snapshots_applied: int = 0
    snapshots_failed: int = 0
    snapshot_blocks_added: int = 0
    snapshot_blocks_removed: int = 0
    buffer_overflows: int = 0
    drift_detected: int = 0
    repairs_abandoned: int = 0
    repairs_converged: int = 0
    convergence_seconds_total: float = 0.0
    convergence_seconds_max: float = 0.0
    stale_marked: int = 0
    instances_forgotten: int = 0
    lag: LagHistogram = field(default_factory=LagHistogram)

    def converged(self, seconds: float) -> None:
        self.repairs_converged += 1
        self.convergence_seconds_total += seconds
        self.convergence_seconds_max = max(self.convergence_seconds_max, seconds)

    def reject(self, reason: str, worker: str | None) -> None:
        self.rejects[reason] += 1
        # Bounded: a flood of invented worker ids must not grow memory without limit.
        if worker is not None and (worker in self.rejects_by_worker or len(self.rejects_by_worker) < 65_536):
            self.rejects_by_worker[worker] += 1

    @property
    def rejects_total(self) -> int:
        return sum(self.rejects.values())


CounterMaker = Callable[[str, str, float], CounterMetricFamily]
LabeledMaker = Callable[[str, str, str, Mapping[str, int]], CounterMetricFamily]


def counter_makers(prefix: str) -> tuple[CounterMaker, LabeledMaker]:
    """Two helpers for a collector's counters named ``prefix + name``: a plain one, and one with a
    label whose values are a mapping (sorted, so scrapes are stable)."""

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(prefix + name, doc, value=value)

    def labeled(name: str, doc: str, label: str, values: Mapping[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(prefix + name, doc, labels=[label])
        for key, n in sorted(values.items()):
            family.add_metric([key], n)
        return family

    return counter, labeled


class _Collector(Collector):
    def __init__(self, counters: IngestCounters, gauges: Callable[[], dict[str, Any]]) -> None:
        self._c = counters
        self._gauges = gauges

    def collect(self) -> Iterator[Any]:
        c = self._c

        counter, labeled = counter_makers("kvindex_")

        yield counter("batches_received", "Event batches received from the wire", c.batches_received)
        yield counter("batches_applied", "Event batches applied to the index", c.batches_applied)
        yield counter("batches_duplicate", "Batches dropped as already applied", c.duplicates)
        yield counter("batches_stale_epoch", "Batches dropped from a retired epoch", c.stale_epochs)
        yield counter("gaps", "Sequence gaps detected", c.gaps)
        yield counter("gap_missing_batches", "Batches known missing across all gaps", c.missing_batches)
        yield counter("worker_restarts", "Epoch changes (worker restarts) seen", c.restarts)
        yield counter("status_received", "Heartbeats received", c.heartbeats_received)
        events = CounterMetricFamily("kvindex_events_applied", "Events applied by type", labels=["type"])
        for op, name in enumerate(OP_NAMES):
            events.add_metric([name], c.events_applied[op])
        yield events
        blocks = CounterMetricFamily("kvindex_block_changes", "Index entries changed", labels=["change"])
        blocks.add_metric(["stored"], c.blocks_stored)
        blocks.add_metric(["removed"], c.blocks_removed)
        blocks.add_metric(["cleared"], c.blocks_cleared)
        yield blocks
        yield counter("replays_requested", "Replay requests sent to workers", c.replays_requested)
        yield counter("replays_ok", "Replays answered with the missing batches", c.replays_ok)
        yield labeled("replays_failed", "Replays that did not help", "why", c.replays_failed)
        yield labeled("snapshots_requested", "Snapshot requests by cause", "cause", c.snapshots_requested)
        yield counter("snapshots_applied", "Snapshots applied as a diff", c.snapshots_applied)
        yield counter("snapshots_failed", "Snapshot requests that timed out or failed", c.snapshots_failed)
        yield labeled(
            "reconciled_blocks",
            "Blocks changed by snapshots",
            "change",
            {"added": c.snapshot_blocks_added, "removed": c.snapshot_blocks_removed},
        )
        yield counter("repair_buffer_overflows", "Repair buffers that overflowed", c.buffer_overflows)
        yield counter("digest_drift", "Heartbeat digests that disagreed with the index", c.drift_detected)
        yield counter("repairs_abandoned", "Repairs given up (holes accepted)", c.repairs_abandoned)
        yield counter("repairs_converged", "Repairs that brought an instance in sync", c.repairs_converged)
        yield counter(
            "repair_convergence_seconds", "Time from repair start to in sync", c.convergence_seconds_total
        )
        yield GaugeMetricFamily(
            "kvindex_repair_convergence_seconds_max", "Longest repair so far", value=c.convergence_seconds_max
        )
        yield counter("instances_marked_stale", "Instances excluded for missing heartbeats", c.stale_marked)
        yield counter("instances_forgotten", "Instances dropped after long silence", c.instances_forgotten)
        lag = HistogramMetricFamily("kvindex_event_lag_seconds", "Batch sealed by the worker -> applied here")
        cumulative = 0
        buckets = []
        for edge, n in zip((*LAG_BUCKETS, float("inf")), c.lag.counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if edge == float("inf") else str(edge), cumulative))
        lag.add_metric([], buckets, c.lag.sum)
        yield lag
        rejects = CounterMetricFamily("kvindex_rejects", "Messages rejected by reason", labels=["reason"])
        for reason, n in sorted(c.rejects.items()):
            rejects.add_metric([reason], n)
        yield rejects
        yield counter(
            "blocks_refused", "Stored blocks dropped beyond an instance's per-tier limit", c.blocks_refused
        )
        g = self._gauges()
        yield GaugeMetricFamily("kvindex_instances", "Instances known", value=g["instances"])
        yield GaugeMetricFamily("kvindex_models", "Models known", value=g["models"])
        distinct = GaugeMetricFamily("kvindex_index_blocks", "Distinct block keys per tier", labels=["tier"])
        entries = GaugeMetricFamily(
            "kvindex_index_entries", "(block, instance) pairs per tier", labels=["tier"]
        )
        for t, name in enumerate(TIER_NAMES):
            distinct.add_metric([name], g["distinct_blocks"][t])
            entries.add_metric([name], g["entries"][t])
        yield distinct
        yield entries


class Metrics:
    """One registry per service, so several services can live in one process (tests, replay)."""

    def __init__(self, counters: IngestCounters, gauges: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.counters = counters
        self.registry.register(_Collector(counters, gauges))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        self.rpc_latency = Histogram(
            "kvindex_rpc_latency_seconds",
            "Server-side latency of API calls",
            ["method"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=self.registry,
        )
        # Requests committed to an instance by Score, by ranking policy (the servicer counts; plain
        # ints, read at scrape time like the ingest counters).
        self.decisions: Counter[str] = Counter()
        self.registry.register(_DecisionsCollector(self.decisions))


class _DecisionsCollector(Collector):
    def __init__(self, decisions: Counter[str]) -> None:
        self._decisions = decisions

    def collect(self) -> Iterator[Any]:
        _counter, labeled = counter_makers("kvindex_")
        yield labeled(
            "decisions",
            "Requests committed to an instance by Score, by ranking policy",
            "policy",
            dict(self._decisions),
        )
