"""Prometheus view of the fleet as the index sees it, and of the service's own state: readiness, the
NATS connection, per instance its heartbeat age, load and blocks per tier, the instances known only
approximately by why, and per model where the prefill model that ranks its instances comes from and
how wrong it recently was.

Read at scrape time (prometheus_client's HTTP thread) from the registry, the index and the
calibrator, like the ingest counters: nothing on the hot path. The per-instance label is
``instance`` (``worker/dp_rank``, as in ``outcomes.py``); a Prometheus scraping with the default
``honor_labels: false`` stores it as ``exported_instance``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.fleet.registry import Registry
from kvindex.index.base import KvBlockIndex
from kvindex.scoring.calibration import DEFAULT, OWN, SHARED, Calibrator
from kvindex.wire.schema import TIER_NAMES

SOURCES = (DEFAULT, SHARED, OWN)
# Why an instance's cache is not known exactly (kvindex_instances_approximate{reason}), bounded:
# no KV events (predicted from routing); a hybrid-attention model's KV-cache layout other than the
# model's (its blocks refused, kvindex/ingest/layouts.py); other groups not read by the engine's rule
# (unreadable, not announced, a group its layout lacks). ListInstances' state_reason says which.
NO_EVENTS, KV_GROUPS_CONFLICT, KV_GROUPS = "no_events", "kv_groups_conflict", "kv_groups"
APPROXIMATE_REASONS = (NO_EVENTS, KV_GROUPS_CONFLICT, KV_GROUPS)


class FleetCollector(Collector):
    """``ready`` and ``connected`` are read on every scrape (plain attribute reads of the service)."""

    def __init__(
        self,
        registry: Registry,
        index: KvBlockIndex,
        calibrator: Calibrator,
        ready: Callable[[], bool],
        connected: Callable[[], bool],
    ) -> None:
        self._registry = registry
        self._index = index
        self._calibrator = calibrator
        self._ready = ready
        self._connected = connected

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "kvindex_ready", "1 while the readiness health service says SERVING", value=int(self._ready())
        )
        yield GaugeMetricFamily(
            "kvindex_nats_connected", "1 while the NATS connection is up", value=int(self._connected())
        )
        now = self._registry.clock()
        states = sorted(self._registry.all(), key=lambda s: s.key)  # a copy: the loop may change it
        stale = GaugeMetricFamily("kvindex_instances_stale", "Instances excluded for missing heartbeats")
        each_stale = GaugeMetricFamily(
            "kvindex_instance_stale",
            "1 for each instance excluded for missing heartbeats",
            labels=["instance"],
        )
        age = GaugeMetricFamily(
            "kvindex_instance_heartbeat_age_seconds", "Seconds since the last heartbeat", labels=["instance"]
        )
        requests = GaugeMetricFamily(
            "kvindex_instance_requests",
            "Requests the instance last reported, by queue (running, waiting)",
            labels=["instance", "queue"],
        )
        prefill = GaugeMetricFamily(
            "kvindex_instance_waiting_prefill_tokens",
            "Prompt tokens waiting for prefill the instance last reported",
            labels=["instance"],
        )
        usage = GaugeMetricFamily(
            "kvindex_instance_kv_usage",
            "KV cache usage the instance last reported (0-1)",
            labels=["instance"],
        )
        blocks = GaugeMetricFamily(
            "kvindex_instance_blocks",
            "Blocks the index holds for the instance, per tier",
            labels=["instance", "tier"],
        )
        approximate = dict.fromkeys(APPROXIMATE_REASONS, 0)
        n_stale = 0
        for state in states:
            name = state.instance_id
            if state.is_pool:
                pass  # (not an instance that serves: no state, as kvindex_instances_by_state)
            elif state.approximate:  # the order of OutcomeTracker.state
                approximate[NO_EVENTS] += 1
            elif state.groups_inexact:
                approximate[KV_GROUPS_CONFLICT if state.layout_conflict else KV_GROUPS] += 1
            if state.stale:
                n_stale += 1
                each_stale.add_metric([name], 1)
            seconds = state.heartbeat_age(now)
            if seconds is not None:
                age.add_metric([name], seconds)
            load = state.load
            requests.add_metric([name, "running"], load.running)
            requests.add_metric([name, "waiting"], load.waiting)
            prefill.add_metric([name], load.waiting_prefill_tokens)
            usage.add_metric([name], load.kv_usage)
            capacity = state.capacity
            for tier, n in enumerate(self._index.block_counts(state.key)):
                if n or capacity.get(tier):  # the tiers it has, not four series per instance
                    blocks.add_metric([name, TIER_NAMES[tier]], n)
        stale.add_metric([], n_stale)
        yield stale
        yield _approximate_by_reason(approximate)
        yield each_stale
        yield age
        yield requests
        yield prefill
        yield usage
        yield blocks
        yield from self._calibration(states)

    def _calibration(self, states: list[Any]) -> Iterator[Any]:
        cal = self._calibrator
        ranked_by = GaugeMetricFamily(
            "kvindex_calibration_instances",
            "Instances per model by the prefill model ranking them: default (configured), model (the "
            "model's fit), instance (its own fit)",
            labels=["model", "source"],
        )
        error = GaugeMetricFamily(
            "kvindex_calibration_error",
            "Recent mean |ln(predicted / measured prefill)| of the model's prefill model in use",
            labels=["model"],
        )
        samples = GaugeMetricFamily(
            "kvindex_calibration_samples",
            "Prefill samples the model's shared fit learned from",
            labels=["model"],
        )
        by_model: dict[str, Counter[str]] = {}
        for state in states:
            if not state.is_pool:
                by_model.setdefault(state.model, Counter())[
                    cal.status(state.model, state.instance_id).source
                ] += 1
        for model in sorted(by_model):
            for source in SOURCES:
                ranked_by.add_metric([model, source], by_model[model][source])
        for model, fit in sorted(cal.models.items()):
            samples.add_metric([model], fit.samples)
            if fit.scored:
                error.add_metric([model], fit.error_fit if fit.accepted else fit.error_prior)
        yield ranked_by
        yield error
        yield samples


def _approximate_by_reason(counts: dict[str, int]) -> GaugeMetricFamily:
    by_reason = GaugeMetricFamily(
        "kvindex_instances_approximate",
        "Instances whose cache the index does not know exactly, by why: no_events (predicted from "
        "routing), kv_groups_conflict (a hybrid-attention layout other than the model's), kv_groups "
        "(KV-cache groups not read by the engine's rule)",
        labels=["reason"],
    )
    for reason, n in counts.items():
        by_reason.add_metric([reason], n)
    return by_reason
