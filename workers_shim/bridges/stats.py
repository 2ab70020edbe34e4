"""Counters for everything a bridge does or skips, throttled log lines, and a Prometheus view.

Field reality is messy; every frame, event or block the bridge does not turn into an index change is
counted by reason here and logged (the first time per reason, then at most every ``interval`` seconds
with the number suppressed), so a misconfigured engine is loud without flooding the logs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import structlog

# Families exported as kvshim_<family>_total{<label>=...}; see stats_names() for their meaning.
FAMILIES: dict[str, tuple[str, str]] = {
    "frames": ("kind", "ZMQ messages received (live, replay)"),
    "batches": ("outcome", "engine batches: applied, duplicate, garbage"),
    "events": ("type", "engine events decoded (stored, removed, cleared, ignored)"),
    "skipped": ("reason", "engine events or blocks not turned into index changes, by reason"),
    "garbage": ("reason", "frames or batches that could not be decoded, by reason"),
    "keys": ("op", "block keys published (stored, removed)"),
    "recovery": ("action", "gaps, replays, rebuilds, resyncs and engine restarts"),
    "load": ("outcome", "Prometheus scrapes of the engine (ok, error)"),
    "prefill": ("outcome", "prefill samples from the engine's histograms, sent for calibration"),
}


class BridgeStats:
    """Counters by family and label; shared by every part of one bridge process."""

    def __init__(self, log: Any = None, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.counts: dict[str, Counter[str]] = {family: Counter() for family in FAMILIES}
        self.log = log if log is not None else structlog.get_logger("workers_shim.bridges")
        self._interval = interval
        self._clock = clock
        self._last_log: dict[str, tuple[float, int]] = {}

    def add(self, family: str, label: str, n: int = 1) -> None:
        self.counts[family][label] += n

    def get(self, family: str, label: str) -> int:
        return self.counts[family][label]

    def skip(self, reason: str, n: int = 1, *, level: str = "warning", **context: Any) -> None:
        """An engine event (or ``n`` blocks of it) was not applied."""
        self.counts["skipped"][reason] += n
        self.throttled(f"skipped:{reason}", level, "kv_event_skipped", reason=reason, blocks=n, **context)

    def garbage(self, reason: str, **context: Any) -> None:
        self.counts["garbage"][reason] += 1
        self.throttled(f"garbage:{reason}", "warning", "kv_garbage_frame", reason=reason, **context)

    def throttled(self, key: str, level: str, event: str, **kw: Any) -> None:
        now = self._clock()
        last = self._last_log.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last_log[key] = (last[0], last[1] + 1)
            return
        if last is not None and last[1]:
            kw["suppressed_since_last"] = last[1]
        self._last_log[key] = (now, 0)
        getattr(self.log, level)(event, **kw)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {family: dict(counter) for family, counter in self.counts.items() if counter}

    # -- Prometheus exposition (``kvshim --stats-port``) ----------------------------------------

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        for family, (label, doc) in FAMILIES.items():
            metric = CounterMetricFamily(f"kvshim_{family}", doc, labels=[label])
            for value, n in sorted(self.counts[family].items()):
                metric.add_metric([value], n)
            yield metric


def serve_stats(stats: BridgeStats, port: int, host: str = "0.0.0.0") -> int:
    """Serve ``stats`` as Prometheus metrics on ``host:port`` (0 picks a port); returns the port."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(stats)  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])
