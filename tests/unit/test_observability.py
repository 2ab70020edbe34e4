"""What an operator sees, the pure half (the other: tests/integration/test_observability.py, metrics of
running processes). The fleet collector (kvindex/observability/fleet.py): readiness, NATS,
per-instance heartbeat age, load and blocks per tier, and calibration per model, read from a real
registry, index and calibrator at collection time; the hit collector (hits.py) from outcome reports."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.fleet.registry import Registry
from kvindex.index.inverted import InvertedIndex
from kvindex.observability.fleet import FleetCollector
from kvindex.observability.hits import HitCollector
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.outcomes import OutcomeTracker, Prediction, Report
from kvindex.wire.schema import CPU, GPU, SHARED, Load
from kvtools.observability import alerts, generate, grafana
from kvtools.observability.alerts import ALERTS
from kvtools.observability.dashboards import DASHBOARDS
from kvtools.observability.promql import metric_names

ROOT = Path(__file__).resolve().parents[2]


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
    assert {k[1] for k in got if k[0] == "kvindex_instance_stale"} == {(("instance", "b/0"),)}
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


def test_approximate_instances_are_counted_by_why() -> None:
    """kvindex_instances_approximate{reason}: every reason always exported (0 when none), an
    instance counted once, as OutcomeTracker.state decides (no events first), pools not at all."""
    registry, index, cal = Registry(Clock()), InvertedIndex(), Calibrator()
    prom = CollectorRegistry()
    prom.register(FleetCollector(registry, index, cal, lambda: True, lambda: True))
    reason = "kvindex_instances_approximate"

    def counts() -> dict[str, float]:
        return {dict(k[1])["reason"]: v for k, v in samples(prom).items() if k[0] == reason}

    assert counts() == {"no_events": 0, "kv_groups_conflict": 0, "kv_groups": 0}
    made = {
        w: registry.add((w, 0), "m", 16) for w in ("exact", "static", "both", "conflict", "unread", "pool")
    }
    made["static"].approximate = True
    made["both"].approximate = True
    made["both"].groups_inexact = "announces no KV-cache groups; the model has ..."
    made["conflict"].groups_inexact = "KV-cache groups differ from the model's: ..."
    made["conflict"].layout_conflict = True
    made["unread"].groups_inexact = "KV-cache groups unreadable: ..."
    made["pool"].approximate = True
    made["pool"].capacity = {SHARED: 1000}  # a shared pool's publisher
    assert counts() == {"no_events": 2, "kv_groups_conflict": 1, "kv_groups": 1}


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


# -- dashboards and alerting rules as code (kvtools/observability) ----------------------------------


def test_committed_dashboards_and_rules_are_what_the_generator_writes() -> None:
    files = generate.outputs()
    assert len(files) == len(DASHBOARDS) + 2  # every board, the rules file and the PrometheusRule
    assert not generate.stale(files), (
        "deploy/observability differs from kvtools/observability: "
        "run python -m kvtools.observability.generate"
    )
    # The check itself sees a difference: a board changed by one panel title.
    board = DASHBOARDS[0]
    changed = dataclasses.replace(
        board, rows=(dataclasses.replace(board.rows[0], title=board.rows[0].title + "!"), *board.rows[1:])
    )
    path = generate.OUT / "dashboards" / f"{board.uid}.json"
    assert generate.stale({path: grafana.render(changed)}) == [path]


def test_generated_dashboards_are_grafana_json_with_every_panel_and_query() -> None:
    for board in DASHBOARDS:
        data = json.loads((generate.OUT / "dashboards" / f"{board.uid}.json").read_text())
        assert data["uid"] == board.uid and data["title"] == board.title
        panels = [p for p in data["panels"] if p["type"] != "row"]
        rows = [p["title"] for p in data["panels"] if p["type"] == "row"]
        assert rows == [r.title for r in board.rows]
        assert [p["title"] for p in panels] == [p.title for r in board.rows for p in r.panels]
        exprs = [(t["refId"], t["expr"]) for p in panels for t in p["targets"]]
        assert [e for _, e in exprs] == [q.expr for _, q in board.queries()]
        assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in panels)
        ids = [p["id"] for p in data["panels"]]
        assert len(set(ids)) == len(ids)  # Grafana keys panels by id


def test_rules_file_and_prometheus_rule_hold_the_same_groups() -> None:
    rules = yaml.safe_load(generate.RULES.read_text())
    crd = yaml.safe_load(generate.PROMETHEUS_RULE.read_text())
    assert crd["apiVersion"] == "monitoring.coreos.com/v1" and crd["kind"] == "PrometheusRule"
    assert crd["spec"]["groups"] == rules["groups"]
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert names == [a.name for a in ALERTS] and len(set(names)) == len(names)


def test_every_alert_has_a_promtool_test_and_a_runbook_section() -> None:
    tests = yaml.safe_load((generate.RULES.parent / "kvindex-rules.test.yaml").read_text())
    assert tests["rule_files"] == [generate.RULES.name]
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    missing = [a.name for a in ALERTS if a.name not in fired]
    assert not missing, f"no promtool test makes these fire: {missing}"
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    headings = {line.lstrip("#").strip() for line in runbook.splitlines() if line.startswith("## ")}
    for a in ALERTS:
        assert a.name in headings, f"docs/runbook.md has no '## {a.name}' section"
        section = runbook.split(f"## {a.name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("What it means", "What to check", "What to do"):
            assert part in section, f"docs/runbook.md, {a.name}: no '{part}'"
    rules = yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]
    assert {r["annotations"]["runbook_url"] for r in rules} == {
        f"docs/runbook.md#{a.name.lower()}" for a in ALERTS
    }


def test_live_rules_change_only_windows_and_holds() -> None:
    prod = yaml.safe_load(alerts.render_rules())["groups"][0]["rules"]
    live = yaml.safe_load(alerts.render_rules(window="30s", hold="5s"))["groups"][0]["rules"]
    for a, b in zip(prod, live, strict=True):
        assert b["for"] == "5s"
        assert b["expr"] == re.sub(r"\[\d+m\]", "[30s]", a["expr"])
        assert metric_names(a["expr"]) == metric_names(b["expr"])
        assert a["annotations"] == b["annotations"] and a["labels"] == b["labels"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("kvindex_ready == 0", {"kvindex_ready"}),
        (
            'sum by (reason) (rate(kvindex_rejects_total{reason!="x", a=~"b|c"}[$__rate_interval]))',
            {"kvindex_rejects_total"},
        ),
        (
            "histogram_quantile(0.99, sum by (job, le) (rate(kvindex_event_lag_seconds_bucket[5m]))) > 1",
            {"kvindex_event_lag_seconds_bucket"},
        ),
        ("rate(process_cpu_seconds_total[1m]) and on (job, instance) (kvindex_ready or up)", None),
        ("sum(a) / ignoring (x) group_left (y) sum(b offset 5m) unless bool c", {"a", "b", "c"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)") * 1e3 + 0x1f', {"m"}),
        ("sum without (instance) (max_over_time(g[10m:1m])) > -Inf", {"g"}),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str] | None) -> None:
    want = names if names is not None else {"process_cpu_seconds_total", "kvindex_ready", "up"}
    assert metric_names(expr) == want
