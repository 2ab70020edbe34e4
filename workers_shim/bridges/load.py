"""Engine load from its Prometheus ``/metrics`` page, for the heartbeat's ``load``, and prefill
samples for the index's calibration (``PrefillSampler``).

Per data-parallel rank: running and waiting requests, KV-cache usage (0..1), and queued prompt tokens
(``waiting_prefill_tokens``). No engine exports the last one directly today, so unless the profile
names a gauge for it, it is estimated as waiting requests x the mean prompt length (from the engine's
prompt-token histogram or counters). Series are picked per rank by the profile's rank labels (vLLM
``engine``, SGLang ``dp_rank``…); series that differ only by tensor-parallel rank count once.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvindex.wire.schema import Load  # the heartbeat's load, as the index decodes it
from workers_shim.bridges.engines import EngineProfile

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(slots=True)
class CacheInfo:
    block_size: int | None = None
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None


def parse_samples(text: str, names: Collection[str] | None = None) -> Samples:
    """Samples by name; with ``names``, only those samples' lines are parsed (the rest are skipped
    by name before the Prometheus parser sees them, which is what makes a scrape cheap)."""
    if names is not None:
        lines = text.splitlines()
        kept = [line for line in lines if _sample_name(line) in names]
        if not kept and any(line.strip() and line[0] != "#" for line in lines):
            # Not a page of this engine's metrics (an error page, another engine, garbage): say so
            # instead of reading it as an idle engine.
            raise ValueError(f"none of the {len(names)} samples read for this engine is on the page")
        text = "\n".join(kept)
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


def _sample_name(line: str) -> str:
    """A sample line's metric name ("" for comments): what precedes its labels or its value."""
    if not line or line[0] == "#":
        return ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop, 0, end)
        if at >= 0:
            end = at
    return line[:end]


class LoadReader:
    """Reads one engine's load per DP rank from a parsed /metrics page."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile

    def _series(self, samples: Samples, names: Iterable[str], rank: int) -> list[float] | None:
        for name in names:
            series = samples.get(name)
            if not series:
                continue
            picked = []
            for labels, value in series:
                if labels.get("tp_rank", "0") != "0":
                    continue
                rank_label = next((labels[k] for k in self.profile.rank_labels if k in labels), None)
                if rank_label is not None and rank_label != str(rank):
                    continue
                picked.append(value)
            if picked:
                return picked
        return None

    def _sum(self, samples: Samples, names: Iterable[str], rank: int) -> float | None:
        values = self._series(samples, names, rank)
        return None if values is None else sum(values)

    def load(self, samples: Samples, rank: int) -> Load:
        p = self.profile
        running = self._sum(samples, p.running, rank) or 0.0
        waiting = self._sum(samples, p.waiting, rank) or 0.0
        usage_values = self._series(samples, p.kv_usage, rank)
        usage = max(usage_values) if usage_values else 0.0
        if usage > 1.0:  # a percentage after all
            usage /= 100.0
        tokens = self._sum(samples, p.waiting_tokens, rank)
        if tokens is None:
            tokens = 0.0
            for sum_name, count_name in p.prompt_mean:
                total, count = self._sum(samples, (sum_name,), rank), self._sum(samples, (count_name,), rank)
                if total is not None and count:
                    tokens = waiting * total / count
                    break
        return Load(int(running), int(waiting), round(tokens), min(max(usage, 0.0), 1.0))

    def cache_info(self, samples: Samples, rank: int) -> CacheInfo:
        info = CacheInfo()
        if self.profile.cache_info is None:
            return info
        for labels, _value in samples.get(self.profile.cache_info, ()):
            rank_label = next((labels[k] for k in self.profile.rank_labels if k in labels), None)
            if rank_label is not None and rank_label != str(rank):
                continue
            info.block_size = _int_label(labels, "block_size")
            info.gpu_blocks = _int_label(labels, "num_gpu_blocks")
            info.cpu_blocks = _int_label(labels, "num_cpu_blocks")
            break
        return info


class PrefillSampler:
    """Prefill samples from the engine's per-request histograms, one per rank and scrape.

    Between two scrapes, the histograms' counts and sums grew by the requests that finished in
    between: their mean prompt length, mean cached tokens (prompt minus computed) and mean prefill
    time make one sample ``(prompt tokens, cached tokens, ms)`` for the heartbeat. The scrape interval
    (1 s) keeps a sample to a few requests at the loads where ranking matters. A counter that went
    back (the engine restarted) starts over; an engine without the histograms gives no samples.
    """

    def __init__(self, reader: LoadReader) -> None:
        self.reader = reader
        # Per rank: the totals of the last scrape (requests, seconds, prompt tokens, computed tokens).
        self._last: dict[int, tuple[float, float, float, float]] = {}
        self._queued: dict[int, bool] = {}  # per rank: requests waiting at the last scrape
        self.skipped_queued = 0  # intervals not sampled: requests were waiting

    def _totals(self, samples: Samples, rank: int) -> tuple[float, float, float, float] | None:
        p = self.reader.profile
        if p.prefill_seconds is None or p.prefill_prompt is None:
            return None
        s = self.reader._sum
        n = s(samples, (p.prefill_seconds + "_count",), rank)
        seconds = s(samples, (p.prefill_seconds + "_sum",), rank)
        prompt = s(samples, (p.prefill_prompt + "_sum",), rank)
        prompt_n = s(samples, (p.prefill_prompt + "_count",), rank)
        if n is None or seconds is None or prompt is None or prompt_n != n:
            return None  # absent, or not observed for the same requests
        computed = None
        if p.prefill_computed is not None:
            computed_n = s(samples, (p.prefill_computed + "_count",), rank)
            if computed_n == n:
                computed = s(samples, (p.prefill_computed + "_sum",), rank)
        if computed is None:
            cached = s(samples, p.prefill_cached, rank) if p.prefill_cached else None
            if cached is None:
                return None
            computed = prompt - cached
        return (n, seconds, prompt, computed)

    def sample(self, samples: Samples, rank: int) -> tuple[int, int, float] | None:
        """The mean prefill of the requests finished since the last call, or None.

        None too when the engine had requests waiting at this scrape or the last: their prefills
        ran batched with others' (vLLM's prefill time is from scheduling to first token, so a
        short prompt batched with a long one takes the long one's step), and a fit fed with them
        learns the load instead of the compute (the index prices queueing separately)."""
        totals = self._totals(samples, rank)
        if totals is None:
            return None
        last = self._last.get(rank)
        self._last[rank] = totals
        queued = self.reader.load(samples, rank).waiting > 0
        was_queued = self._queued.get(rank, False)
        self._queued[rank] = queued
        if last is None:
            return None
        if queued or was_queued:
            self.skipped_queued += 1
            return None
        n, seconds, prompt, computed = (now - before for now, before in zip(totals, last, strict=True))
        if n <= 0 or seconds < 0 or prompt < 0 or computed < 0 or computed > prompt:
            return None  # nothing finished, or the engine restarted (counters went back)
        mean_prompt = round(prompt / n)
        return (mean_prompt, max(0, mean_prompt - round(computed / n)), seconds / n * 1000.0)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    value = labels.get(name)
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: Any = response.read()
    return body.decode("utf-8", "replace")


async def scrape(url: str, timeout: float, names: Collection[str] | None = None) -> Samples:
    text = await asyncio.to_thread(fetch, url, timeout)
    return parse_samples(text, names)
