"""What an operator sees, the pure half (the other: tests/integration/test_observability.py, metrics of
running processes). The fleet collector (kvindex/observability/fleet.py): readiness, NATS,
per-instance heartbeat age, load and blocks per tier, and calibration per model, read from a real
registry, index and calibrator at collection time; the hit collector (hits.py) from outcome reports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.fleet.registry import Registry
from kvindex.index.inverted import InvertedIndex
from kvindex.observability.fleet import FleetCollector
from kvindex.observability.hits import HitCollector
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.outcomes import OutcomeTracker, Prediction, Report
from kvindex.wire.schema import CPU, GPU, Load


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_fleet_collector_reads_the_registry_index_and_calibrator() -> None:
    clock = Clock()
    registry, index, cal = Registry(clock), InvertedIndex(), Calibrator()
    state = {"ready": False, "connected": True}
    prom = CollectorRegistry()
    prom.register(FleetCollector(registry, index, cal, lambda: state["ready"], lambda: state["connected"]))
    for worker in ("a", "b"):
        s = registry.add((worker, 0), "m", 16)
        index.add_instance((worker, 0), "m")
        s.last_heartbeat_at = clock.now
        s.capacity = {GPU: 100}
    a, b = registry.get(("a", 0)), registry.get(("b", 0))
    assert a is not None and b is not None
    a.load = Load(running=3, waiting=2, waiting_prefill_tokens=4096, kv_usage=0.25)
    index.store(("a", 0), GPU, [1, 2, 3])
    index.store(("a", 0), CPU, [4])
    b.stale = True
    cal.add("m", [(1000.0, 0.0, 50.0 + i) for i in range(30)], instance="a/0")
    clock.now = 102.5

    got = samples(prom)
    assert got[("kvindex_ready", ())] == 0 and got[("kvindex_nats_connected", ())] == 1
    assert got[("kvindex_instances_stale", ())] == 1
    age = "kvindex_instance_heartbeat_age_seconds"
    assert got[(age, (("instance", "a/0"),))] == got[(age, (("instance", "b/0"),))] == 2.5
    assert got[("kvindex_instance_requests", (("instance", "a/0"), ("queue", "running")))] == 3
    assert got[("kvindex_instance_requests", (("instance", "a/0"), ("queue", "waiting")))] == 2
    assert got[("kvindex_instance_waiting_prefill_tokens", (("instance", "a/0"),))] == 4096
    assert got[("kvindex_instance_kv_usage", (("instance", "a/0"),))] == 0.25
    blocks = {k[1]: v for k, v in got.items() if k[0] == "kvindex_instance_blocks"}
    # a: its GPU blocks and the CPU tier it has blocks in; b: an empty GPU tier it announced capacity for
    assert blocks == {
        (("instance", "a/0"), ("tier", "gpu")): 3,
        (("instance", "a/0"), ("tier", "cpu")): 1,
        (("instance", "b/0"), ("tier", "gpu")): 0,
    }
    ranked = {k[1]: v for k, v in got.items() if k[0] == "kvindex_calibration_instances"}
    assert sum(ranked.values()) == 2
    assert {dict(k)["source"] for k in ranked} == {"default", "model", "instance"}
    assert got[("kvindex_calibration_samples", (("model", "m"),))] == 30
    assert got[("kvindex_calibration_error", (("model", "m"),))] >= 0

    state["ready"] = True
    registry.remove(("b", 0))
    got = samples(prom)
    assert got[("kvindex_ready", ())] == 1 and got[("kvindex_instances_stale", ())] == 0
    assert not any(dict(k[1]).get("instance") == "b/0" for k in got)


def test_hit_collector_counts_the_tokens_of_compared_reports() -> None:
    tracker = OutcomeTracker(Clock())
    prom = CollectorRegistry()
    prom.register(HitCollector(tracker))

    def prediction(model: str, blocks: int, prompt: int) -> Prediction:
        return Prediction(
            ("w", 0),
            model,
            "ttft",
            16,
            prompt,
            blocks,
            blocks,
            (blocks * 16, 0, 0, 0),
            1.0,
            2.0,
            0.0,
            3.0,
            0.0,
        )

    tracker.compare(prediction("m", 4, 100), Report(cached_tokens=64, ttft_ms=5.0))  # predicted 64
    tracker.compare(prediction("m", 2, 33), Report(cached_tokens=0, ttft_ms=5.0))  # predicted 32
    tracker.compare(prediction("m", 2, 40), Report(ttft_ms=5.0))  # no engine figure: not counted
    tracker.compare(prediction("n", 1, 17), Report(cached_tokens=16))
    got = {k: v for k, v in samples(prom).items() if k[0] == "kvindex_prediction_tokens_total"}
    assert got == {
        ("kvindex_prediction_tokens_total", (("kind", kind), ("model", model))): n
        for model, kind, n in [
            ("m", "prompt", 133), ("m", "predicted_cached", 96), ("m", "reported_cached", 64),
            ("n", "prompt", 17), ("n", "predicted_cached", 16), ("n", "reported_cached", 16),
        ]
    }  # fmt: skip
