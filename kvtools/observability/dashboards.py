"""The Grafana dashboards, as data: five boards of rows of panels, a panel per line.

Add a panel by adding a line to a row (``ts(...)`` a time series, ``stat(...)`` a single value) with
its PromQL; ``make_rate``/``quantiles`` write the usual forms. Then ``python -m
kvtools.observability.generate`` rewrites ``deploy/observability/dashboards/*.json``, and
``make test`` checks that every metric named is one the processes export
(tests/integration/test_observability.py) and that the committed JSON is what this file generates
(tests/unit/test_observability.py). ``make e2e-observability`` runs every query against a real
Prometheus scraping a loaded fleet and requires series from each.

Conventions: ``$__rate_interval`` in every range (Grafana's choice for the scrape interval);
per-instance series are grouped by ``exported_instance`` (the index's own ``instance`` label, which
a Prometheus with the default ``honor_labels: false`` renames); replicas of the index report the
same fleet, so fleet-wide gauges take ``max`` over them, and per-process figures keep ``job`` and
``instance`` (the scrape target).
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""
    width: int = 8  # of 24 columns


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]

    def queries(self) -> list[tuple[str, Query]]:
        """(panel title, query) of every panel, in order."""
        return [(p.title, q) for r in self.rows for p in r.panels for q in p.queries]


QueryLike = Query | str | tuple[str, str]


def _query(q: QueryLike) -> Query:
    if isinstance(q, Query):
        return q
    if isinstance(q, str):
        return Query(q)
    return Query(*q)


def _queries(queries: tuple[QueryLike | list[Query], ...]) -> tuple[Query, ...]:
    out: list[Query] = []
    for q in queries:
        if isinstance(q, list):
            out.extend(q)
        else:
            out.append(_query(q))
    return tuple(out)


def ts(
    title: str, *queries: QueryLike | list[Query], unit: str = "short", desc: str = "", width: int = 8
) -> Panel:
    return Panel(title, _queries(queries), unit, "timeseries", desc, width)


def stat(
    title: str, *queries: QueryLike | list[Query], unit: str = "short", desc: str = "", width: int = 4
) -> Panel:
    return Panel(title, _queries(queries), unit, "stat", desc, width)


def _legend(by: tuple[str, ...]) -> str:
    return " ".join(f"{{{{{label}}}}}" for label in by)


def make_rate(metric: str, *by: str, match: str = "", legend: str | None = None) -> Query:
    """``sum by (BY) (rate(METRIC{MATCH}[$__rate_interval]))``, its legend the BY labels."""
    selector = f"{metric}{{{match}}}" if match else metric
    grouping = f" by ({', '.join(by)})" if by else ""
    return Query(f"sum{grouping} (rate({selector}[{RATE}]))", _legend(by) if legend is None else legend)


def quantiles(histogram: str, *by: str, qs: tuple[float, ...] = (0.5, 0.9), match: str = "") -> list[Query]:
    """``histogram_quantile`` of ``HISTOGRAM_bucket`` at each of ``qs``, per BY."""
    selector = f"{histogram}_bucket{{{match}}}" if match else f"{histogram}_bucket"
    labels = ", ".join((*by, "le"))
    return [
        Query(
            f"histogram_quantile({q:g}, sum by ({labels}) (rate({selector}[{RATE}])))",
            f"p{q * 100:g} {_legend(by)}".strip(),
        )
        for q in qs
    ]


def ratio(numerator: str, denominator: str, *by: str, legend: str | None = None) -> Query:
    """``sum by (BY) (rate(NUM)) / sum by (BY) (rate(DEN))``: NUM and DEN are selectors."""
    grouping = f" by ({', '.join(by)})" if by else ""
    expr = f"sum{grouping} (rate({numerator}[{RATE}])) / sum{grouping} (rate({denominator}[{RATE}]))"
    return Query(expr, _legend(by) if legend is None else legend)


# Per-process figures of every kvindex process (the index, the proxy): their process_* series, kept
# where the same target also exports a kvindex metric.
KVINDEX_TARGETS = "on (job, instance) (kvindex_ready or kvindex_route_in_flight)"
PER = "exported_instance"  # the fleet's per-instance label, as Prometheus stores it


def _each(metric: str, match: str = "", *extra: str) -> Query:
    """A per-instance gauge of the fleet (max over index replicas)."""
    selector = f"{metric}{{{match}}}" if match else metric
    by = (PER, *extra)
    return Query(f"max by ({', '.join(by)}) ({selector})", _legend(by))


# fmt: off
# (Panels one per line, as a table: the formatter would spread each over a screen.)
FLEET = Dashboard(
    "kvindex-fleet",
    "kvindex / fleet",
    "Instances as the index sees them: states, heartbeats, staleness, load and cached blocks per tier.",
    (
        Row("Instances", (
            stat("Instances known", Query("max(kvindex_instances)")),
            stat("Models", Query("max(kvindex_models)")),
            stat("Stale", Query("max(kvindex_instances_stale)")),
            stat("Degraded", Query('max(kvindex_instances_by_state{state="degraded"})')),
            ts("Instances by state", Query("max by (state) (kvindex_instances_by_state)", "{{state}}"),
               desc="exact: the index's view is trusted; degraded: recent reports disagree, or a repair is "
               "under way or failed; approximate: no KV events (predicted from routing decisions)"),
            ts("Instances not exact", _each("kvindex_instance_state", 'state!="exact"', "state"), width=12),
            ts("Approximate instances by reason", Query("max by (reason) (kvindex_instances_approximate)", "{{reason}}"), width=12, desc="no_events: no KV events (cache predicted from routing); kv_groups_conflict: a hybrid-attention model's KV-cache layout other than the model's (blocks refused); kv_groups: groups not read by the engine's rule. Each instance's exact reason: `kvindex instances` (state_reason)"),  # noqa: E501
            ts("Heartbeat age", _each("kvindex_instance_heartbeat_age_seconds"), unit="s", width=12,
               desc="Seconds since each instance's last heartbeat (every 0.5 s by default)"),
            ts("Heartbeats and staleness /s", make_rate("kvindex_status_received_total", legend="heartbeats"),
               make_rate("kvindex_instances_marked_stale_total", legend="marked stale"),
               make_rate("kvindex_instances_forgotten_total", legend="forgotten"), unit="ops", width=12),
        )),
        Row("Load", (
            ts("Running requests", _each("kvindex_instance_requests", 'queue="running"')),
            ts("Waiting requests", _each("kvindex_instance_requests", 'queue="waiting"')),
            ts("Waiting prefill tokens", _each("kvindex_instance_waiting_prefill_tokens")),
            ts("KV cache usage", _each("kvindex_instance_kv_usage"), unit="percentunit", width=12),
        )),
        Row("Cached blocks", (
            ts("Blocks per instance and tier", _each("kvindex_instance_blocks", "", "tier"), width=12),
            ts("Distinct blocks per tier", Query("max by (tier) (kvindex_index_blocks)", "{{tier}}"),
               width=12),
        )),
    ),
)

INGEST = Dashboard(
    "kvindex-ingest",
    "kvindex / ingest and repair",
    "KV events into the index: throughput, rejects, sequence gaps, replays, snapshots, event-to-visible lag.",
    (
        Row("Events", (
            ts("Events applied /s", make_rate("kvindex_events_applied_total", "type"), unit="ops"),
            ts("Batches /s", make_rate("kvindex_batches_received_total", legend="received"),
               make_rate("kvindex_batches_applied_total", legend="applied"),
               make_rate("kvindex_batches_duplicate_total", legend="duplicate"),
               make_rate("kvindex_batches_stale_epoch_total", legend="stale epoch"), unit="ops"),
            ts("Index entries changed /s", make_rate("kvindex_block_changes_total", "change"), unit="ops"),
            ts("Rejects /s by reason", make_rate("kvindex_rejects_total", "reason"),
               make_rate("kvindex_blocks_refused_total", legend="blocks refused (limit)"), unit="ops",
               desc="Malformed messages and limit refusals (kvindex/ingest/limits.py); the log names the "
               "worker"),
            ts("KV-cache group layouts refused /s", Query(f'sum by (reason) (rate(kvindex_rejects_total{{reason=~"group_layout_mismatch|bad_groups"}}[{RATE}])) or on () vector(0)', "{{reason}}"), unit="ops", desc="Heartbeats or batches of hybrid-attention instances whose KV-cache groups differ from the model's (group_layout_mismatch: their blocks are dropped until they announce the model's) or cannot be read (bad_groups); the log names the worker"),  # noqa: E501
            ts("Event → visible lag", quantiles("kvindex_event_lag_seconds", qs=(0.5, 0.9, 0.99)), unit="s",
               desc="Batch sealed by the worker -> applied here (worker and index clocks must agree)"),
        )),
        Row("Gaps and repair", (
            ts("Gaps /s", make_rate("kvindex_gaps_total", legend="gaps"),
               make_rate("kvindex_gap_missing_batches_total", legend="missing batches"),
               make_rate("kvindex_worker_restarts_total", legend="worker restarts"), unit="ops"),
            ts("Replays /s", make_rate("kvindex_replays_requested_total", legend="requested"),
               make_rate("kvindex_replays_ok_total", legend="ok"),
               make_rate("kvindex_replays_failed_total", "why", legend="failed: {{why}}"), unit="ops"),
            ts("Snapshots /s",
               make_rate("kvindex_snapshots_requested_total", "cause", legend="asked: {{cause}}"),
               make_rate("kvindex_snapshots_applied_total", legend="applied"),
               make_rate("kvindex_snapshots_failed_total", legend="failed"), unit="ops"),
            ts("Blocks reconciled /s", make_rate("kvindex_reconciled_blocks_total", "change"),
               make_rate("kvindex_digest_drift_total", legend="digest drift"), unit="ops"),
            ts("Repairs /s", make_rate("kvindex_repairs_converged_total", legend="converged"),
               make_rate("kvindex_repairs_abandoned_total", legend="abandoned"),
               make_rate("kvindex_repair_buffer_overflows_total", legend="buffer overflows"), unit="ops"),
            ts("Repair time",
               ratio("kvindex_repair_convergence_seconds_total", "kvindex_repairs_converged_total",
                     legend="mean"),
               Query("max(kvindex_repair_convergence_seconds_max)", "longest so far"), unit="s"),
        )),
    ),
)

ROUTING = Dashboard(
    "kvindex-routing",
    "kvindex / routing quality",
    "Every routing decision checked against the engine: predicted vs reported cached tokens, TTFT "
    "against the estimate, hit rate, decisions per policy, fallbacks, and the prefill model per model.",
    (
        Row("Predicted against actual", (
            ts("Prediction outcomes /s", make_rate("kvindex_prediction_outcomes_total", "outcome"),
               unit="ops",
               desc="exact: within a block; over: the index promised more than the engine had; under: "
               "the engine had more"),
            ts("Exact predictions", ratio('kvindex_prediction_outcomes_total{outcome="exact"}',
                                          "kvindex_prediction_outcomes_total", legend="exact share"),
               unit="percentunit"),
            ts("Cached tokens: engine - predicted",
               quantiles("kvindex_prediction_cached_tokens_error", PER, qs=(0.1, 0.5, 0.9))),
            ts("Hit rate: reported and predicted",
               ratio('kvindex_prediction_tokens_total{kind="reported_cached"}',
                     'kvindex_prediction_tokens_total{kind="prompt"}', "model", legend="reported {{model}}"),
               ratio('kvindex_prediction_tokens_total{kind="predicted_cached"}',
                     'kvindex_prediction_tokens_total{kind="prompt"}', "model", legend="predicted {{model}}"),
               unit="percentunit", desc="Cached share of the prompt tokens of requests reported back"),
            ts("TTFT / estimate", quantiles("kvindex_prediction_ttft_ratio", qs=(0.1, 0.5, 0.9)),
               desc="Measured TTFT over the index's estimate; 1 is right"),
            ts("Reports /s (proxy)", make_rate("kvindex_route_reports_total", "result"),
               make_rate("kvindex_prediction_reconciles_total", legend="snapshots for degraded"), unit="ops"),
        )),
        Row("Decisions", (
            ts("Decisions /s by policy", make_rate("kvindex_decisions_total", "policy"), unit="ops"),
            ts("Proxy decisions /s by how", make_rate("kvindex_route_decisions_total", "reason"), unit="ops",
               desc="index: its first choice; fallback: a hash of the prompt, the index did not decide; "
               "retry: a later choice after a connection failure"),
            ts("Fallbacks /s by why", make_rate("kvindex_route_fallbacks_total", "reason"), unit="ops"),
            ts("Picker picks /s by outcome", make_rate("kvindex_ext_proc_picks_total", "outcome"),
               unit="ops"),
            ts("Index reachable from the proxy", Query("min by (instance) (kvindex_route_index_reachable)",
                                                       "{{instance}}")),
            ts("Score time at the proxy", quantiles("kvindex_route_score_seconds", qs=(0.5, 0.99)), unit="s"),
        )),
        Row("Prefill model (calibration)", (
            ts("Instances by prefill model", Query("max by (model, source) (kvindex_calibration_instances)",
                                                   "{{model}} {{source}}"),
               desc="default: the configured model; model: the model's fit; instance: the instance's own"),
            ts("Prefill model error", Query("max by (model) (kvindex_calibration_error)", "{{model}}"),
               desc="Recent mean |ln(predicted / measured prefill)| of the model in use"),
            ts("Prefill samples", Query("max by (model) (kvindex_calibration_samples)", "{{model}}")),
        )),
    ),
)

FRONTS = (("proxy", "kvindex_route"), ("picker", "kvindex_ext_proc"))

SLO = Dashboard(
    "kvindex-slo",
    "kvindex / SLO",
    "TTFT objectives at the proxy (kvindex route) and the picker (ext_proc): goodput per model and "
    "priority, shed and held requests, queue wait, TTFT percentiles.",
    (
        Row("Goodput", (
            *(ts(f"Goodput at the {front}", ratio(f'{p}_slo_requests_total{{result="met"}}',
                                                 f"{p}_slo_requests_total", "model", "priority"),
                 unit="percentunit",
                 desc="Requests with a TTFT objective that met it, of all with one (shed ones missed it)")
              for front, p in FRONTS),
            *(ts(f"Objective results /s at the {front}", make_rate(f"{p}_slo_requests_total", "result"),
                 unit="ops")
              for front, p in FRONTS),
        )),
        Row("Admission", (
            ts("Shed /s (proxy)",
               make_rate("kvindex_route_admission_shed_total", "model", "priority", "reason"),
               unit="ops", desc="Answered 429: no instance could meet the objective in time"),
            ts("Held /s (proxy)", make_rate("kvindex_route_admission_queued_total", "reason"),
               make_rate("kvindex_route_admission_best_effort_total", legend="best effort"), unit="ops"),
            ts("Queue depth", *(Query(f"sum({p}_admission_queue_depth)", front) for front, p in FRONTS)),
            ts("Queue wait (proxy)", quantiles("kvindex_route_admission_queue_wait_seconds", "outcome"),
               unit="s"),
        )),
        Row("TTFT", (
            ts("TTFT at the proxy", quantiles("kvindex_route_ttft_seconds"), unit="s",
               desc="Request received -> first body byte from the engine"),
            ts("TTFT at the picker", quantiles("kvindex_ext_proc_ttft_seconds"), unit="s",
               desc="Request headers -> first response body byte, as Envoy passes them"),
            ts("Proxy time by stage (p90)", quantiles("kvindex_route_stage_seconds", "stage", qs=(0.9,)),
               unit="s"),
            ts("Proxy requests /s by status", make_rate("kvindex_route_requests_total", "code"),
               unit="reqps"),
            ts("In flight at the proxy", Query("sum(kvindex_route_in_flight)", "in flight")),
            ts("Upstream errors /s", make_rate("kvindex_route_upstream_errors_total", "kind"),
               make_rate("kvindex_route_retries_total", legend="retries"), unit="ops"),
        )),
    ),
)

SERVICE = Dashboard(
    "kvindex-service",
    "kvindex / service",
    "The processes themselves: RPC latency per method, CPU, memory, index entries per tier, NATS and "
    "readiness.",
    (
        Row("API", (
            ts("RPC latency p99 by method", quantiles("kvindex_rpc_latency_seconds", "method", qs=(0.99,)),
               unit="s"),
            ts("RPC latency p50 by method", quantiles("kvindex_rpc_latency_seconds", "method", qs=(0.5,)),
               unit="s"),
            ts("RPCs /s by method",
               Query(f"sum by (method) (rate(kvindex_rpc_latency_seconds_count[{RATE}]))", "{{method}}"),
               unit="ops"),
        )),
        Row("Processes", (
            ts("CPU",
               Query(f"rate(process_cpu_seconds_total[{RATE}]) and {KVINDEX_TARGETS}",
                     "{{job}} {{instance}}"),
               unit="percentunit", desc="Cores used by each kvindex process (1 = one core)"),
            ts("Resident memory", Query(f"process_resident_memory_bytes and {KVINDEX_TARGETS}",
                                        "{{job}} {{instance}}"), unit="bytes"),
            ts("Open file descriptors",
               Query(f"process_open_fds and {KVINDEX_TARGETS}", "{{job}} {{instance}}")),
        )),
        Row("Index and NATS", (
            ts("Ready and NATS connected", Query("kvindex_ready", "ready {{instance}}"),
               Query("kvindex_nats_connected", "NATS {{instance}}"),
               desc="1 while the readiness health service is SERVING / the NATS connection is up"),
            ts("Index entries per tier", Query("sum by (instance, tier) (kvindex_index_entries)",
                                               "{{instance}} {{tier}}"), desc="(block, instance) pairs held"),
            ts("Distinct blocks per tier", Query("sum by (instance, tier) (kvindex_index_blocks)",
                                                 "{{instance}} {{tier}}")),
            ts("Routing sync", Query("kvindex_routing_sync_peers", "peers {{instance}}"),
               Query("kvindex_routing_sync_pending", "pending {{instance}}"),
               desc="Replicas sharing routing state (serve --routing-sync)"),
            ts("Tokenizations /s", make_rate("kvindex_tokenize_requests_total", "form"),
               make_rate("kvindex_tokenize_errors_total", "form", legend="errors {{form}}"), unit="ops"),
        )),
        Row("Shards (a serve --shards front's view, docs/shards.md)", (
            ts("Shards up and ready", Query("kvindex_shard_up", "up {{shard}} {{instance}}"),
               Query("kvindex_shard_ready", "ready {{shard}} {{instance}}"),
               desc="1 while the shard answers the front's queries / reports itself ready"),
            ts("Shard lag", Query("kvindex_shard_answer_age_seconds", "{{shard}} {{instance}}"), unit="s",
               desc="Seconds since the shard's last answer (-1: none yet)"),
            ts("Shard round trip and fan-out", Query("kvindex_shard_rtt_seconds", "{{shard}} {{instance}}"),
               Query("kvindex_shard_fanout_seconds", "fan-out {{instance}}"), unit="s"),
            ts("Shard instances", Query("max by (shard) (kvindex_shard_instances)", "{{shard}}")),
            ts("Shard batches applied /s", make_rate("kvindex_shard_batches_total", "shard"), unit="ops"),
            ts("Shard queries and failures /s", make_rate("kvindex_shard_queries_total", "shard"),
               make_rate("kvindex_shard_failures_total", "shard", legend="failed {{shard}}"), unit="ops"),
        )),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (FLEET, INGEST, ROUTING, SLO, SERVICE)
# fmt: on
