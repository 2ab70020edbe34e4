"""What an operator sees, against running parts (the pure half: tests/unit/test_observability.py):
every metric the dashboards and alerting rules of deploy/observability name is exported by a running
index with its picker and its routing proxy, scraped over HTTP — no dangling name. (That each
query returns series under load is make e2e-observability's job, with a real Prometheus.)"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable

from prometheus_client.parser import text_string_to_metric_families

from kvindex.keys import block_keys
from kvindex.route.proxy import RouteConfig
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvtools.observability import alerts
from kvtools.observability.dashboards import DASHBOARDS
from kvtools.observability.promql import metric_names
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

# What Prometheus adds to every target itself, and the series of its own alerting.
SYNTHETIC = {"up", "ALERTS", "ALERTS_FOR_STATE"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}


def exported(text: str) -> set[str]:
    """Every sample name a /metrics page can carry, from its families (so a labelled family that has
    no sample yet, e.g. shed requests before the first shed, still counts)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def named() -> dict[str, set[str]]:
    """Metric name -> where it is named (dashboard / panel, or alert)."""
    out: dict[str, set[str]] = {}
    for board in DASHBOARDS:
        for title, q in board.queries():
            for name in metric_names(q.expr):
                out.setdefault(name, set()).add(f"{board.uid} / {title}")
    for a in alerts.ALERTS:
        for name in metric_names(a.rendered_expr()):
            out.setdefault(name, set()).add(f"alert {a.name}")
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


async def test_every_metric_a_dashboard_or_rule_names_is_exported(
    make_service: Callable[..., Awaitable[IndexService]],
    make_publisher: Callable[..., Awaitable[Publisher]],
) -> None:
    svc = await make_service(
        metrics_port=0,
        metrics_host="127.0.0.1",
        ext_proc_port=0,
        ext_proc_host="127.0.0.1",
        route=RouteConfig(index="", host="127.0.0.1", port=0),
    )
    assert svc.metrics_port and svc.route is not None
    pub = await make_publisher(
        worker="w0", model="m", block_size=16, capacity={"gpu": 100}, endpoint="127.0.0.1:9"
    )
    tokens = list(range(1, 65))
    pub.stored(block_keys(tokens, 16, "m"))
    await pub.heartbeat()
    await pub.flush()
    await wait_until(lambda: svc.index.block_counts(("w0", 0))[0] == 4, what="blocks indexed")
    await wait_until(lambda: svc.grpc.ready, what="the index ready (its first heartbeat window)")
    # One routing decision: the decisions counter and the per-instance series have a sample.
    response = svc.servicer.score_request(
        pb.ScoreRequest(model="m", token_ids=tokens, commit=True, request_id="r1")
    )
    assert response.committed_instance_id == "w0/0"

    # A shard front (docs/shards.md) exports the kvindex_shard_* series (its shards need not run).
    front = await make_service(metrics_port=0, metrics_host="127.0.0.1", shards=2)
    assert front.metrics_port
    index_page, proxy_page, front_page = await asyncio.gather(
        asyncio.to_thread(scrape, svc.metrics_port),
        asyncio.to_thread(scrape, svc.route.port),
        asyncio.to_thread(scrape, front.metrics_port),
    )
    available = exported(index_page) | exported(proxy_page) | exported(front_page) | SYNTHETIC
    wanted = named()
    assert len(wanted) > 60  # the scan found the dashboards' names, not an empty set passing vacuously
    dangling = {name: sorted(where) for name, where in wanted.items() if name not in available}
    assert not dangling, f"named by a dashboard or rule, exported by no process: {dangling}"

    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(index_page)
        for s in f.samples
    }
    assert values[("kvindex_decisions_total", (("policy", "ttft"),))] == 1
    assert values[("kvindex_ready", ())] == 1 and values[("kvindex_nats_connected", ())] == 1
    assert values[("kvindex_instance_blocks", (("instance", "w0/0"), ("tier", "gpu")))] == 4
    assert values[("process_resident_memory_bytes", ())] > 0
