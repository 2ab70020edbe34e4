"""The alerting rules, as data, and their two renderings from this one source: a Prometheus rules file
and a Kubernetes ``PrometheusRule`` (prometheus-operator) with the same groups.

Each alert has a runbook section in docs/runbook.md, under a heading that is the alert's name; its
``runbook_url`` annotation points there. An expression may hold ``{w}``, its range window: the
committed files use each alert's own window, and ``make e2e-observability`` renders the same
expressions with short windows and holds (``render_rules(window=..., hold=...)``) to see them fire
and clear in minutes. promtool unit tests for every alert: deploy/observability/alerts/*.test.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

# Where the runbook lives, relative to the repository; regenerate with ``--runbook-base URL`` to
# point the annotations at wherever your copy of the docs is served.
RUNBOOK = "docs/runbook.md"
GOODPUT_OBJECTIVE = 0.9  # share of requests with a TTFT objective that should meet it
GROUP = "kvindex"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str  # PromQL; ``{w}`` is the range window
    hold: str  # ``for``: how long the condition must hold before the alert fires
    severity: str  # critical (pages) or warning (a ticket)
    summary: str  # one line; may use {{ $labels.x }} and {{ $value }}
    description: str
    window: str = "5m"

    def rendered_expr(self, window: str | None = None) -> str:
        return self.expr.replace("{w}", window or self.window)

    @property
    def anchor(self) -> str:
        return self.name.lower()


def _fronts(template: str) -> str:
    """``template`` for the proxy's and the picker's metrics (``{p}``), either firing."""
    return " or ".join(f"({template.replace('{p}', p)})" for p in ("kvindex_route", "kvindex_ext_proc"))


ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvIndexNotReady",
        "kvindex_ready == 0",
        "2m",
        "critical",
        "kvindex {{ $labels.instance }} has not been ready for 2 minutes",
        "Its readiness health service says NOT_SERVING: it is starting (initial sync), stopping, or its "
        "NATS connection is down. Routers keep using other replicas; with none, they fall back to a hash.",
    ),
    Alert(
        "KvIndexNatsDisconnected",
        "kvindex_nats_connected == 0",
        "1m",
        "critical",
        "kvindex {{ $labels.instance }} has no NATS connection",
        "No KV event or heartbeat reaches this replica: its view of the fleet goes stale. It reconnects "
        "by itself and resynchronises every instance when it does.",
    ),
    Alert(
        "KvIndexInstanceDegraded",
        # (A stale instance is not ranked at all: its silence is the problem, not its cache view.)
        'max by (exported_instance) (kvindex_instance_state{state="degraded"}) == 1 '
        "unless on (exported_instance) max by (exported_instance) (kvindex_instance_stale) == 1",
        "5m",
        "warning",
        "Instance {{ $labels.exported_instance }} has been degraded for 5 minutes",
        "The index's view of this instance's cache disagrees with what the engine reports, or a repair "
        "of it failed. Its cache hits are credited at half while degraded.",
    ),
    Alert(
        "KvIndexEventLagHigh",
        "histogram_quantile(0.99, sum by (job, instance, le) "
        "(rate(kvindex_event_lag_seconds_bucket[{w}]))) > 1",
        "10m",
        "warning",
        "KV events reach kvindex {{ $labels.instance }} {{ $value | humanizeDuration }} after the engine "
        "(p99)",
        "Batches take more than a second from the worker sealing them to the index applying them: routing "
        "decisions are made on an old view of the caches.",
    ),
    Alert(
        "KvIndexRejectsSpike",
        "sum by (job, instance, reason) (rate(kvindex_rejects_total[{w}])) > 1",
        "5m",
        "warning",
        'kvindex {{ $labels.instance }} rejects {{ printf "%.2f" $value }} messages/s ({{ $labels.reason }})',
        "Messages that are malformed or over a limit are dropped and counted; a steady stream means a "
        "worker or bridge is broken or misconfigured (its id is in the index's log).",
    ),
    Alert(
        "KvIndexGoodputLow",
        _fronts(
            'sum by (job, instance, model, priority) (rate({p}_slo_requests_total{result="met"}[{w}])) '
            "/ sum by (job, instance, model, priority) (rate({p}_slo_requests_total[{w}])) "
            f"< {GOODPUT_OBJECTIVE}"
        ),
        "10m",
        "warning",
        "Goodput of {{ $labels.model }} (priority {{ $labels.priority }}) is "
        "{{ $value | humanizePercentage }}",
        f"Fewer than {GOODPUT_OBJECTIVE:.0%} of the requests with a TTFT objective met it (shed ones count "
        "as missed), at the proxy or the picker {{ $labels.instance }}.",
        window="10m",
    ),
    Alert(
        "KvIndexShedding",
        _fronts("sum by (job, instance, model, priority) (rate({p}_admission_shed_total[{w}])) > 0.1"),
        "10m",
        "warning",
        '{{ $labels.instance }} sheds {{ printf "%.2f" $value }} requests/s of {{ $labels.model }}',
        "Admission answers 429 to requests no instance can serve within their objective: the fleet is "
        "short of capacity for this load, or the objectives are too tight.",
    ),
    Alert(
        "KvIndexPredictionsOff",
        'sum by (job, instance) (rate(kvindex_prediction_outcomes_total{outcome!="exact"}[{w}])) '
        "/ sum by (job, instance) (rate(kvindex_prediction_outcomes_total[{w}])) > 0.2",
        "15m",
        "warning",
        "{{ $value | humanizePercentage }} of kvindex {{ $labels.instance }}'s cache predictions are off",
        "The engines report a cache hit more than a block away from what the index predicted for over a "
        "fifth of the requests: events are lost, late, or the engines' block accounting differs.",
        window="15m",
    ),
    Alert(
        "KvIndexTtftEstimateDrift",
        "abs(ln(histogram_quantile(0.5, sum by (job, instance, le) "
        "(rate(kvindex_prediction_ttft_ratio_bucket[{w}]))))) > 0.693",  # ln 2: x2 or x0.5
        "15m",
        "warning",
        "The median TTFT is over twice or under half what kvindex {{ $labels.instance }} estimates",
        "The median of measured TTFT / estimated TTFT is above 2 or below 0.5: the prefill model or the "
        "wait estimate no longer matches the engines, and rankings trade hits for load wrongly.",
        window="15m",
    ),
)


def groups(
    window: str | None = None, hold: str | None = None, runbook: str = RUNBOOK
) -> list[dict[str, Any]]:
    """The rule groups; ``window`` and ``hold`` override every alert's (live tests)."""
    rules = []
    for a in ALERTS:
        rules.append(
            {
                "alert": a.name,
                "expr": a.rendered_expr(window),
                "for": hold or a.hold,
                "labels": {"severity": a.severity},
                "annotations": {
                    "summary": a.summary,
                    "description": a.description,
                    "runbook_url": f"{runbook}#{a.anchor}",
                },
            }
        )
    return [{"name": GROUP, "rules": rules}]


HEADER = (
    "# Generated by `python -m kvtools.observability.generate` from kvtools/observability/alerts.py:\n"
    "# edit that, not this file. Runbook: docs/runbook.md.\n"
)


def _dump(data: Any) -> str:
    return HEADER + yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True)


def render_rules(window: str | None = None, hold: str | None = None, runbook: str = RUNBOOK) -> str:
    """A Prometheus rules file (``rule_files:``; ``promtool check rules``)."""
    return _dump({"groups": groups(window, hold, runbook)})


def render_prometheus_rule(runbook: str = RUNBOOK) -> str:
    """The same groups as a Kubernetes ``PrometheusRule`` (prometheus-operator's CRD)."""
    return _dump(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": {"name": "kvindex", "labels": {"app.kubernetes.io/name": "kvindex"}},
            "spec": {"groups": groups(runbook=runbook)},
        }
    )
