"""``kvindex route``: the OpenAI-compatible routing proxy's command line."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

import structlog

from kvindex.config.args import LOG_FORMAT_HELP, LOG_LEVEL_HELP, port, positive
from kvindex.lifecycle import Stop, run
from kvindex.observability.logs import configure_logging
from kvindex.route.admission_args import add_admission_options, admission_from_args
from kvindex.security import ClientTLS, SecurityConfigError, add_client_options, token_from_args

if TYPE_CHECKING:  # (the proxy needs the route extra: imported when it runs)
    from kvindex.route.proxy import RouteProxy


def add_route(sub: Any) -> None:
    p = sub.add_parser(
        "route",
        help="OpenAI-compatible routing proxy: each request to the engine the index chooses",
        description="Serves /v1/completions, /v1/chat/completions (streaming or not), /v1/models, "
        "/health (liveness), /ready (readiness) and /metrics; forwards each request to the endpoint "
        "of the instance Score ranks first (the next on a connection failure), by a consistent hash "
        "when the index is down.",
    )
    p.add_argument("--index", default="127.0.0.1:50051", help="gRPC address of kvindex serve")
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address the proxy listens on: 0.0.0.0 (default) every interface, 127.0.0.1 this machine only",
    )
    p.add_argument("--port", type=port, default=8080, help="port the proxy listens on (0: any free port)")
    p.add_argument("--top-k", type=positive, default=3, help="instances asked for: the first, then retries")
    p.add_argument(
        "--score-timeout", type=float, default=0.05, help="index deadline (s); past it the fallback decides"
    )
    p.add_argument("--connect-timeout", type=float, default=2.0, help="per engine connection attempt (s)")
    p.add_argument("--grace", type=float, default=30.0, help="in-flight requests may finish this long (s)")
    p.add_argument(
        "--refresh-interval", type=float, default=2.0, help="fallback's instance list refresh period (s)"
    )
    p.add_argument("--fallback-blocks", type=int, default=4, help="prompt blocks the fallback hashes")
    p.add_argument(
        "--fallback-instance",
        action="append",
        default=[],
        type=_fallback_instance,
        metavar="MODEL=[ID=]HOST:PORT",
        help="an engine serving MODEL, for the fallback to route to while the index is unreachable and "
        "has not told this proxy the model's instances (a start with the index down); ID as the index "
        "names it (node-3/0; a worker id means rank 0), else HOST:PORT; repeatable",
    )
    p.add_argument("--policy", default="", help="ranking policy asked of the index (default: its own)")
    p.add_argument(
        "--pick",
        choices=("best", "softmax"),
        default="",
        help="how the index picks from its ranking: its first choice, or a softmax over estimated TTFT "
        "among the --top-k (default: the index's --pick)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="softmax: the TTFT excess, in units of the request's own prefill, that costs a factor e "
        "in probability (default: the index's)",
    )
    add_pd_arguments(p)
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help=LOG_FORMAT_HELP)
    p.add_argument("--log-level", default="info", help=LOG_LEVEL_HELP)
    add_client_options(p)
    add_admission_options(
        p.add_argument_group("admission: TTFT objectives, priorities, queueing and shedding (429)"),
        named=True,
    )


def _fallback_instance(text: str) -> tuple[str, str]:
    from kvindex.client.fallback import static_instances

    model, sep, entry = text.partition("=")
    if not sep or not model or not entry:
        raise argparse.ArgumentTypeError(f"{text!r}: want MODEL=HOST:PORT or MODEL=ID=HOST:PORT")
    try:
        static_instances({model: [entry]})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(exc).partition(': ')[2]}") from None
    return model, entry


def _pair_cost(text: str) -> tuple[tuple[str, str], float]:
    from kvindex.route.pd import parse_pair_cost

    try:
        return parse_pair_cost(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "prefill/decode disaggregation",
        "--pd serves each request in two steps, as vLLM's disaggregated proxies do (kv_transfer_params): "
        "a prefill instance computes the prompt's KV, a decode instance loads it and generates "
        "(instances announce their role: kvshim --role). docs/pd.md",
    )
    g.add_argument("--pd", action="store_true", help="disaggregated prefill/decode serving")
    g.add_argument(
        "--pd-min-input-tokens",
        type=int,
        default=2048,
        help="prompts shorter than this are prefilled by the decode instance itself (default 2048)",
    )
    g.add_argument(
        "--pd-min-uncached-share",
        type=float,
        default=0.7,
        help="...and so are prompts the decode instance holds so much of that the uncached share is "
        "below this (default 0.7)",
    )
    g.add_argument(
        "--pd-transfer-ms-per-1k",
        type=float,
        default=2.0,
        help="KV transfer cost (ms per 1,000 tokens) for a pair with no given or measured cost",
    )
    g.add_argument(
        "--pd-pair-cost",
        type=_pair_cost,
        action="append",
        default=[],
        metavar="PREFILL=DECODE:MS",
        help="KV transfer cost of one (prefill, decode) pair, ms per 1,000 tokens; worker or instance ids "
        "(repeatable)",
    )
    g.add_argument(
        "--pd-no-measure",
        action="store_true",
        help="do not learn pair costs from the decode steps' first-byte times",
    )
    g.add_argument(
        "--pd-same-group",
        action="store_true",
        help="prefill within the decode instance's --pd-group when one is there",
    )
    g.add_argument("--pd-prefill-top-k", type=int, default=8, help="prefill instances compared per request")


def pd_config_from_args(args: argparse.Namespace) -> Any:
    """The PdConfig of ``--pd*`` (None without --pd); SystemExit naming a bad value."""
    if not args.pd:
        return None
    from kvindex.route.pd import PdConfig

    try:
        return PdConfig(
            min_input_tokens=args.pd_min_input_tokens,
            min_uncached_share=args.pd_min_uncached_share,
            transfer_ms_per_1k=args.pd_transfer_ms_per_1k,
            pair_ms_per_1k=dict(args.pd_pair_cost),
            measure=not args.pd_no_measure,
            same_group=args.pd_same_group,
            prefill_top_k=args.pd_prefill_top_k,
        )
    except ValueError as exc:
        raise SystemExit(f"kvindex route: error: --pd: {exc}") from None


def _by_model(pairs: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for model, entry in pairs:
        out.setdefault(model, []).append(entry)
    return out


# The route extra (pyproject.toml): aiohttp and what it brings.
_ROUTE_EXTRA = frozenset({"aiohttp", "multidict", "yarl"})


def run_route(args: argparse.Namespace) -> int:
    try:
        from kvindex.route.proxy import RouteConfig, RouteProxy
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
        admission, objectives = admission_from_args(args)
    except (SecurityConfigError, ValueError) as exc:
        raise SystemExit(f"kvindex route: error: {exc}") from None
    if args.temperature is not None and (args.temperature < 0 or args.temperature != args.temperature):
        raise SystemExit("kvindex route: error: --temperature must be a number >= 0")
    if args.temperature is not None and args.pick != "softmax":
        raise SystemExit("kvindex route: error: --temperature applies to --pick softmax")
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
        pick=args.pick,
        temperature=args.temperature,
        tls=tls,
        token=token_from_args(args),
        admission=admission,
        objectives=objectives,
        pd=pd_config_from_args(args),
        fallback_instances=_by_model(args.fallback_instance),
    )

    from kvindex.api.listen import ROUTE_FIX, route_exposure, warn_unprotected

    exposed = route_exposure(args.host, args.port)
    if exposed is not None:  # as kvindex serve warns about its own listeners (docs/deploy.md)
        warn_unprotected(structlog.get_logger("kvindex.route"), [exposed], fix=f"{ROUTE_FIX} (--host)")

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


async def serve_until_stopped(proxy: RouteProxy, stop: Stop) -> None:
    """Serve until ``stop`` is requested (SIGTERM, SIGINT, SIGHUP or the parent's exit, under
    :func:`kvindex.lifecycle.run`), then finish in-flight requests within the grace and return."""
    try:
        await stop.run_or_stop(proxy.start())
        if not stop.requested:
            await stop.wait()
            structlog.get_logger("kvindex.route").info("route_draining", grace=proxy.config.grace)
    finally:
        await proxy.stop()  # what did start (index channel, engine session) is closed
