"""The proxy's answers that route nothing: ``/v1/models`` (merged from the engines), ``/health``
(liveness), ``/ready`` (what a load balancer should probe) and ``/metrics``.

Functions over the proxy's parts (its index client, HTTP session and metrics), so the proxy's module
holds the request path only.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.client import AsyncKvIndexClient
from kvindex.route.http import engine_models, error_kind, forward_headers, openai_error
from kvindex.route.metrics import RouteMetrics


async def models_response(
    request: web.Request,
    client: AsyncKvIndexClient,
    session: aiohttp.ClientSession,
    metrics: RouteMetrics,
    timeout_s: float,
) -> web.Response:
    """The models of every known instance, merged by id (each engine lists what it serves)."""
    if not client.instances.models():
        await client.refresh_instances(timeout=1.0)
    endpoints = sorted(
        {k.endpoint for m in client.instances.models() for k in client.instances.instances(m) if k.endpoint}
    )
    if not endpoints:
        metrics.requests.labels(request.path, "503").inc()
        return openai_error(
            503, "no instance with an endpoint is known", "service_unavailable", "no_instance"
        )
    headers = forward_headers(request.headers)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    merged, results = await engine_models(session, endpoints, headers, timeout)
    for result in results:
        if isinstance(result, BaseException):
            metrics.upstream_errors.labels(error_kind(result)).inc()
    if not merged and all(isinstance(r, BaseException) for r in results):
        metrics.requests.labels(request.path, "502").inc()
        return openai_error(502, "no instance answered /v1/models", "bad_gateway", "upstream_unreachable")
    metrics.requests.labels(request.path, "200").inc()
    return web.json_response({"object": "list", "data": list(merged.values())})


def proxy_state(client: AsyncKvIndexClient) -> dict[str, Any]:
    """What /health and /ready report: the index as last seen, the instances known to route to
    without it, and how requests are being routed now."""
    instances = [k for m in client.instances.models() for k in client.instances.instances(m)]
    routable = sum(1 for k in instances if k.endpoint)
    reachable = client.health.reachable is not False
    return {
        **client.health.json(),
        "routing": "index" if reachable else "fallback" if routable else "none",
        "instances_known": len(instances),
        "fallbacks": sum(client.stats.fallbacks.values()),
    }


def health_response(client: AsyncKvIndexClient, draining: bool) -> web.Response:
    """Liveness: 200 while the process serves, the index down included (a restart would not bring
    it back, and would forget the fleet the fallback routes over). The body says the state."""
    return web.json_response({"status": "draining" if draining else "ok", **proxy_state(client)})


def ready_response(client: AsyncKvIndexClient, draining: bool) -> web.Response:
    """Readiness: 200 while this proxy can route a request, by the index or, while the index is
    unreachable, by the fallback over instances it knows; 503 while draining, and while the index is
    unreachable with no instance known to route to (every request would get 503)."""
    state = proxy_state(client)
    if draining:
        return web.json_response({"status": "draining", **state}, status=503)
    if state["routing"] == "none":
        message = f"{client.health.describe()}, and no instance is known to route to without it"
        return web.json_response({"status": "unready", "message": message, **state}, status=503)
    return web.json_response({"status": "ready", **state})


def metrics_response(registry: Any) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
