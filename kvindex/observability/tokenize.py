"""Prometheus view of the tokenizers (kvindex/tokenize): requests, errors, time, and the piece cache.

Read at scrape time from the registry's plain counters, like the ingest counters (no lock per call).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.tokenize import Tokenizers

FORMS = ("prompt", "chat")


class TokenizeCollector(Collector):
    def __init__(self, tokenizers: Tokenizers) -> None:
        self._t = tokenizers

    def collect(self) -> Iterator[Any]:
        stats = self._t.stats
        cache = self._t.cache
        c = cache.stats
        requests = CounterMetricFamily(
            "kvindex_tokenize_requests", "Text prompts (prompt) and chats (chat) tokenized", labels=["form"]
        )
        errors = CounterMetricFamily(
            "kvindex_tokenize_errors", "Tokenizations refused (bad input, no tokenizer)", labels=["form"]
        )
        seconds = CounterMetricFamily(
            "kvindex_tokenize_seconds", "Time spent rendering and tokenizing", labels=["form"]
        )
        for form in FORMS:
            requests.add_metric([form], stats.requests[form])
            errors.add_metric([form], stats.errors[form])
            seconds.add_metric([form], stats.seconds[form])
        yield requests
        yield errors
        yield seconds
        lookups = CounterMetricFamily(
            "kvindex_tokenize_cache_lookups",
            "Text pieces looked up in the tokenization cache",
            labels=["result"],
        )
        lookups.add_metric(["hit"], c.hits)
        lookups.add_metric(["miss"], c.misses)
        yield lookups
        tokens = CounterMetricFamily(
            "kvindex_tokenize_cache_tokens",
            "Tokens served from the cache (hit) or encoded (miss)",
            labels=["result"],
        )
        tokens.add_metric(["hit"], c.hit_tokens)
        tokens.add_metric(["miss"], c.miss_tokens)
        yield tokens
        yield CounterMetricFamily(
            "kvindex_tokenize_cache_evictions",
            "Pieces evicted to stay within the cache's bytes",
            value=c.evictions,
        )
        yield CounterMetricFamily(
            "kvindex_tokenize_cache_uncached",
            "Pieces encoded but not kept: larger than a quarter of the cache, or beyond the call's budget",
            value=c.uncached,
        )
        yield CounterMetricFamily(
            "kvindex_tokenize_cache_prefix_hits",
            "Prompts that reused a remembered prompt's ids up to the text they share",
            value=c.prefix_hits,
        )
        yield CounterMetricFamily(
            "kvindex_tokenize_cache_prefix_tokens",
            "Tokens taken from remembered prompts (also counted as hit tokens)",
            value=c.prefix_tokens,
        )
        yield GaugeMetricFamily(
            "kvindex_tokenize_cache_bytes",
            "Bytes held by the tokenization cache (pieces and remembered prompts)",
            value=cache.bytes + self._t.memo.bytes,
        )
        yield GaugeMetricFamily(
            "kvindex_tokenize_cache_prompts", "Prompts remembered whole", value=len(self._t.memo)
        )
        yield GaugeMetricFamily(
            "kvindex_tokenize_cache_entries", "Pieces held by the tokenization cache", value=len(cache)
        )
        yield GaugeMetricFamily(
            "kvindex_tokenize_models", "Models with a tokenizer configured", value=len(self._t.models())
        )
