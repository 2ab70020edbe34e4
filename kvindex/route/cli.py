"""``kvindex route``: the OpenAI-compatible routing proxy's command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvindex.api.security import ClientTLS, SecurityConfigError, add_client_options, token_from_args
from kvindex.lifecycle import Stop, run
from kvindex.observability.logs import configure_logging


def add_route(sub: Any) -> None:
    p = sub.add_parser(
        "route",
        help="OpenAI-compatible routing proxy: each request to the engine the index chooses",
        description="Serves /v1/completions, /v1/chat/completions (streaming or not), /v1/models, "
        "/health and /metrics; forwards each request to the endpoint of the instance Score ranks "
        "first (the next on a connection failure), by a consistent hash when the index is down.",
    )
    p.add_argument("--index", default="127.0.0.1:50051", help="gRPC address of kvindex serve")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--top-k", type=int, default=3, help="instances asked for: the first, then retries")
    p.add_argument(
        "--score-timeout", type=float, default=0.05, help="index deadline (s); past it the fallback decides"
    )
    p.add_argument("--connect-timeout", type=float, default=2.0, help="per engine connection attempt (s)")
    p.add_argument("--grace", type=float, default=30.0, help="in-flight requests may finish this long (s)")
    p.add_argument(
        "--refresh-interval", type=float, default=2.0, help="fallback's instance list refresh period (s)"
    )
    p.add_argument("--fallback-blocks", type=int, default=4, help="prompt blocks the fallback hashes")
    p.add_argument("--policy", default="", help="ranking policy asked of the index (default: its own)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    p.add_argument("--log-level", default="info")
    add_client_options(p)


# The route extra (pyproject.toml): aiohttp and what it brings.
_ROUTE_EXTRA = frozenset({"aiohttp", "multidict", "yarl"})


def run_route(args: argparse.Namespace) -> int:
    try:
        from kvindex.route.proxy import RouteConfig, RouteProxy, serve_until_stopped
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _ROUTE_EXTRA:
            raise
        print(
            f"kvindex route: error: the routing proxy needs {exc.name}, which is not installed: "
            "pip install 'kvindex[route]'",
            file=sys.stderr,
        )
        return 2

    configure_logging(args.log_format, args.log_level)
    try:
        tls = ClientTLS.from_args(args)
        if tls is not None:
            tls.credentials()  # read the files now: a bad path is a clear error, not a traceback
    except SecurityConfigError as exc:
        raise SystemExit(f"kvindex route: error: {exc}") from None
    config = RouteConfig(
        index=args.index,
        host=args.host,
        port=args.port,
        top_k=args.top_k,
        score_timeout=args.score_timeout,
        connect_timeout=args.connect_timeout,
        grace=args.grace,
        refresh_interval=args.refresh_interval,
        fallback_blocks=args.fallback_blocks,
        policy=args.policy,
        tls=tls,
        token=token_from_args(args),
    )

    async def main(stop: Stop) -> int:
        try:
            await serve_until_stopped(RouteProxy(config), stop)
        except OSError as exc:  # the port is taken, the host is not ours
            where = f"{args.host}:{args.port}"
            print(f"kvindex route: error: cannot listen on {where} (--host/--port): {exc}", file=sys.stderr)
            return 1
        return 0

    # SIGTERM/SIGINT/SIGHUP or the parent's exit: in-flight requests get --grace, then releases are
    # sent and connections closed (bounded); forced out 3 s after that (kvindex/lifecycle).
    return run(main, grace=args.grace + 5.0, name="kvindex-route")
