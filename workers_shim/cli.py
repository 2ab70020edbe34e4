"""`kvshim`: run a bridge beside an engine (vllm, sglang, trtllm) or a simulated fleet.

    kvshim vllm   --zmq tcp://HOST:5557 [--replay tcp://HOST:5558] --worker-id ID --model NAME [...]
    kvshim sglang --zmq tcp://HOST:5557 [--replay tcp://HOST:5558] --worker-id ID --model NAME [...]
    kvshim trtllm --zmq tcp://HOST:5557 [--replay tcp://HOST:5558] --worker-id ID --model NAME [...]
    kvshim heartbeat --worker-id ID --model NAME --block-size N --endpoint HOST:PORT [...]  (no events)

Subcommands are registered in :func:`build_parser`; each sets ``handler`` (``args -> exit code``) with
``set_defaults``, so another command (e.g. ``sim``) is one more ``add_*`` function there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from kvindex.config import NatsSettings, add_nats_arguments, parse_layered
from kvindex.config.args import LOG_FORMAT_HELP, LOG_LEVEL_HELP, SUBJECT_PREFIX_HELP, port, quiet_broken_pipe
from kvindex.config.nats import DEFAULT_URL
from kvindex.keys import MAX_GROUPS
from kvindex.lifecycle import Stop, run
from kvindex.observability.logs import configure_logging
from kvindex.wire.endpoint import BadEndpoint, check_endpoint
from kvindex.wire.role import ROLES, BadRole, check_group
from workers_shim.bridges.bridge import Bridge, BridgeConfig
from workers_shim.bridges.engines import ENGINES
from workers_shim.bridges.stats import serve_stats

_TIERS = ("gpu", "cpu", "disk", "shared")

_ENGINE_HELP = {
    "vllm": "bridge vLLM's KV events (--kv-events-config publisher zmq)",
    "sglang": "bridge SGLang's KV events (--kv-events-config publisher zmq)",
    "trtllm": "bridge TensorRT-LLM's KV events (streaming ZMQ batches)",
}


def parse_ranks(spec: str) -> tuple[int, ...]:
    """``"0"``, ``"0,2"``, ``"0-3"`` or a mix (``"0-1,4"``)."""
    ranks: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad rank list {spec!r}") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad rank range {part!r}")
        ranks.extend(r for r in range(first, last + 1) if r not in ranks)
    if not ranks:
        raise argparse.ArgumentTypeError("no dp rank given")
    return tuple(ranks)


def parse_capacity(spec: str) -> dict[str, int]:
    """``"gpu=24000,cpu=100000"``: blocks per tier for the heartbeat."""
    out: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        tier, _, value = part.partition("=")
        if tier not in _TIERS or not value.isdigit():
            raise argparse.ArgumentTypeError(f"bad capacity {part!r}: want TIER=BLOCKS, TIER in {_TIERS}")
        out[tier] = int(value)
    return out


def parse_medium(spec: str) -> tuple[str, str]:
    """``"STORAGE=shared"``: an engine medium string and the tier it maps to."""
    medium, _, tier = spec.partition("=")
    if not medium or tier not in _TIERS:
        raise argparse.ArgumentTypeError(f"bad medium mapping {spec!r}: want MEDIUM=TIER, TIER in {_TIERS}")
    return medium.upper(), tier


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def parse_kv_group(text: str) -> int:
    try:
        group = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a KV-cache group number: {text!r}") from None
    if not 0 <= group < MAX_GROUPS:
        raise argparse.ArgumentTypeError(f"KV-cache group {group} is outside 0..{MAX_GROUPS - 1}")
    return group


def parse_model_config(path: str) -> int | None:
    """A model's ``config.json``: its ``attention_chunk_size`` (top level, or ``text_config`` for
    multimodal configs such as Llama 4's); None when the model has no chunked local attention."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{path} is not a JSON object")
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and section.get("attention_chunk_size") is not None:
            chunk = section["attention_chunk_size"]
            if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
                raise argparse.ArgumentTypeError(f"{path}: attention_chunk_size {chunk!r} is not positive")
            return chunk
    return None


def parse_endpoint_arg(text: str) -> str:
    try:
        return check_endpoint(text)
    except BadEndpoint as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_group_arg(text: str) -> str:
    try:
        return check_group(text)
    except BadRole as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_role_arguments(p: argparse.ArgumentParser) -> None:
    """``--role`` and ``--pd-group``: what the engine does under prefill/decode disaggregation,
    announced in every heartbeat (docs/wire.md §4)."""
    p.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="prefill/decode disaggregation: the engine computes prompts (prefill), generates from "
        "transferred KV (decode) or serves whole requests (both). Default: not announced (= both)",
    )
    p.add_argument(
        "--pd-group",
        type=parse_group_arg,
        default=None,
        help="the engine's KV-transfer group (rack, NVLink/RDMA island): routers may keep a request's "
        "prefill within its decode engine's group",
    )


def add_engine_command(sub: Any, engine: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        engine, help=_ENGINE_HELP.get(engine, f"bridge {engine}"), description=_ENGINE_HELP.get(engine)
    )
    p.add_argument("--zmq", required=True, help="the engine's KV-event PUB endpoint, e.g. tcp://HOST:5557")
    p.add_argument("--replay", default=None, help="the engine's replay ROUTER endpoint, e.g. tcp://HOST:5558")
    p.add_argument("--topic", default="", help="ZMQ topic to subscribe to (default: every topic)")
    p.add_argument(
        "--metrics-url", default=None, help="the engine's Prometheus page, e.g. http://HOST:8000/metrics"
    )
    p.add_argument(
        "--endpoint",
        type=parse_endpoint_arg,
        default=None,
        help="HOST:PORT routers send this worker's requests to, announced in every heartbeat "
        "(default: the host and port of --metrics-url; none without it)",
    )
    p.add_argument("--worker-id", required=True, help="this worker's id on the wire ([A-Za-z0-9_-]{1,128})")
    p.add_argument("--model", required=True, help="served model name, as routers will ask for it")
    add_role_arguments(p)
    add_nats_arguments(p)
    p.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    p.add_argument(
        "--dp-rank",
        type=parse_ranks,
        default=(0,),
        help="data-parallel rank(s) to bridge: N, N,M or N-M. Rank r reads port+r of --zmq/--replay "
        "(the engines' convention) unless --no-port-offset or --one-endpoint",
    )
    p.add_argument("--no-port-offset", action="store_true", help="use --zmq/--replay as given for the rank")
    p.add_argument(
        "--one-endpoint",
        action="store_true",
        help="all ranks publish on --zmq; events are told apart by the batch's dp rank field",
    )
    p.add_argument(
        "--block-size",
        type=_positive(int),
        default=None,
        help="tokens per KV block, as configured in the engine. Default: taken from the engine's own "
        "KV events (or vLLM's /metrics) before anything is published. When given and the engine's "
        "events announce another size, kvshim exits non-zero naming both",
    )
    p.add_argument(
        "--capacity", type=parse_capacity, default={}, help="blocks per tier, e.g. gpu=24000,cpu=100000"
    )
    p.add_argument(
        "--medium",
        type=parse_medium,
        action="append",
        default=[],
        help="map an engine medium string to a tier, e.g. STORAGE=shared (repeatable)",
    )
    p.add_argument(
        "--kv-group",
        type=parse_kv_group,
        default=None,
        help="index only this KV-cache group, as the worker's one cache (the old behaviour). Default: every "
        "group of a hybrid-attention model, with its layout announced, so the index applies the engine's "
        "hit rule. With this flag a hybrid model is approximate: a sliding-window or Mamba group alone "
        "under-estimates hits, the full-attention group alone over-promises them",
    )
    p.add_argument(
        "--attention-chunk",
        type=_positive(int),
        default=None,
        help="tokens per chunk of the model's chunked local attention (Llama 4: attention_chunk_size in its "
        "config.json); no KV event carries it. Without it (or --model-config) such a model is approximate",
    )
    p.add_argument(
        "--model-config",
        type=parse_model_config,
        default=None,
        metavar="PATH",
        help="the model's config.json: --attention-chunk is read from its attention_chunk_size "
        "(--attention-chunk, when given too, wins)",
    )
    p.add_argument(
        "--reannounce-tier",
        choices=_TIERS,
        action="append",
        default=[],
        help="tier where a repeated store of a held block is a re-announcement (engines that re-emit "
        "prefix-cache hits), not another copy to reference-count (repeatable)",
    )
    p.add_argument(
        "--replay-timeout", type=_positive(float), default=2.0, help="seconds to wait for each replay answer"
    )
    p.add_argument(
        "--scrape-interval", type=_positive(float), default=1.0, help="seconds between /metrics scrapes"
    )
    p.add_argument(
        "--stats-port",
        type=port,
        default=None,
        help="serve the shim's own counters on /metrics at this port (0: any free port; default: none)",
    )
    p.add_argument(
        "--stats-log-interval", type=float, default=60.0, help="seconds between stats log lines; 0 off"
    )
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help=LOG_FORMAT_HELP)
    p.add_argument("--log-level", default="info", help=LOG_LEVEL_HELP)
    p.set_defaults(handler=run_engine, engine=engine)
    return p


def build_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The parser and its subparsers action (for adding commands)."""
    parser = argparse.ArgumentParser(prog="kvshim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for engine in ENGINES:
        add_engine_command(sub, engine)
    from workers_shim.sim.cli import add_sim_arguments, main_sim

    sim = sub.add_parser("sim", help="a fleet of simulated vLLM-like engines publishing real events")
    add_sim_arguments(sim)
    sim.set_defaults(handler=main_sim)
    from workers_shim.heartbeat_only import add_heartbeat_command

    add_heartbeat_command(sub, parse_endpoint_arg, parse_capacity, _positive(int), add_role_arguments)
    return parser, sub


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    return BridgeConfig(
        engine=args.engine,
        zmq=args.zmq,
        replay=args.replay,
        topic=args.topic,
        metrics_url=args.metrics_url,
        worker_id=args.worker_id,
        model=args.model,
        nats_url=NatsSettings.from_args(args) or DEFAULT_URL,
        subject_prefix=args.subject_prefix,
        dp_ranks=args.dp_rank,
        port_offset=not args.no_port_offset,
        one_endpoint=args.one_endpoint,
        block_size=args.block_size,
        endpoint=args.endpoint,
        role=args.role,
        pd_group=args.pd_group,
        capacity=args.capacity,
        media=dict(args.medium),
        kv_group=args.kv_group,
        attention_chunk=args.attention_chunk or args.model_config,
        set_tiers=tuple(args.reannounce_tier),
        replay_timeout=args.replay_timeout,
        scrape_interval=args.scrape_interval,
        stats_log_interval=args.stats_log_interval,
    )


# A bridge's stop: cancel its loops, each rank's bounded goodbye, a bounded NATS close (~4 s at most).
STOP_GRACE = 5.0


async def serve_bridge(config: BridgeConfig, stats_port: int | None = None, stop: Stop | None = None) -> None:
    """Run a bridge until ``stop`` is requested (SIGTERM/SIGINT/SIGHUP or the parent's exit when run
    by :func:`kvindex.lifecycle.run`) or it fails, then flush and stop; raises the bridge's fatal
    error (e.g. a block size conflict) after stopping it. A stop request during the start (NATS
    down, still connecting) cancels the start."""
    stop = stop or Stop()
    bridge = Bridge(config)
    failed = asyncio.ensure_future(bridge.failed.wait())
    try:
        # raises (bridge stopped) when the engine's history already conflicts
        await stop.run_or_stop(bridge.start())
        if stop.requested:
            return
        if stats_port is not None:
            port = serve_stats(bridge.stats, stats_port)
            bridge.log.info("kvshim_stats_serving", port=port)
        signalled = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            signalled.cancel()
    finally:
        failed.cancel()
        await bridge.stop()
    if bridge.failure is not None:
        raise bridge.failure


def _failed(args: argparse.Namespace, exc: Exception) -> int:
    import structlog

    log = structlog.get_logger("workers_shim.cli")
    log.error("kvshim_failed", error=str(exc), error_type=type(exc).__name__)
    print(f"kvshim {args.engine}: {exc}", file=sys.stderr)  # the last line an operator sees
    return 1


def run_engine(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    try:
        config = config_from_args(args)
    except Exception as exc:
        return _failed(args, exc)

    async def main(stop: Stop) -> int:
        try:
            await serve_bridge(config, args.stats_port, stop)
        except Exception as exc:
            return _failed(args, exc)
        return 0

    return run(main, grace=STOP_GRACE, name="kvshim")


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parse_layered(parser, argv)  # command line, then KVINDEX_* environment, then --config TOML
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
