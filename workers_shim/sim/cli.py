"""``kvshim sim``: a fleet of simulated engines publishing to NATS in real time.

Not wired into ``workers_shim/cli.py`` here: register it with

    sub = subparsers.add_parser("sim", help=...)
    add_sim_arguments(sub)
    sub.set_defaults(func=main_sim)        # main_sim(args) -> exit code

Without ``--trace`` the fleet idles (heartbeats only) until stopped, for a traffic driver that calls
``SimFleet.submit``. With ``--trace`` it replays a Mooncake-format trace, routing each request with a
simple built-in policy (a real router asks kvindex instead).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from typing import Any

import structlog

from kvindex.config.args import MAX_PORT, SUBJECT_PREFIX_HELP, port
from kvindex.config.nats import (
    DEFAULT_URL,
    NatsConfigError,
    NatsConnectError,
    NatsSettings,
    add_nats_arguments,
)
from kvindex.lifecycle import Stop, finish, run
from kvindex.wire.role import check_group, check_role
from workers_shim.sim.engine import Completion, EngineConfig, SimRequest
from workers_shim.sim.fleet import SimFleet, run_fleet
from workers_shim.sim.http import serve_fleet
from workers_shim.sim.hybrid import KV_GROUP_PRESETS, parse_kv_groups
from workers_shim.sim.timemodel import PROFILES
from workers_shim.sim.trace import mooncake_requests

__all__ = ["add_sim_arguments", "build_config", "main_sim"]

log = structlog.get_logger("workers_shim.sim")


class SimSetupError(Exception):
    """A bad --roles / --pd-groups value or an HTTP port that cannot be bound."""


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)
    g = parser.add_argument_group("fleet")
    g.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    g.add_argument("--workers", type=int, default=4, help="number of simulated engines")
    g.add_argument("--worker-prefix", default="sim", help="worker ids are PREFIX-0, PREFIX-1, …")
    g.add_argument("--model", default="sim-model", help="the model name the workers serve")
    g.add_argument("--speed", type=float, default=1.0, help="virtual seconds per wall second")
    g.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    g.add_argument(
        "--endpoint-base",
        default=None,
        metavar="HOST:PORT",
        help="announce fake endpoints: worker i at HOST:PORT+i (nothing listens there)",
    )
    h = parser.add_argument_group("HTTP (an OpenAI-compatible server per worker; workers_shim/sim/http.py)")
    h.add_argument(
        "--http-port",
        type=port,
        default=None,
        help="serve /v1/completions etc.: worker i on PORT+i (0: free ports), announced as its endpoint",
    )
    h.add_argument("--http-host", default="127.0.0.1", help="address the HTTP servers bind and announce")
    h.add_argument(
        "--roles",
        default="",
        help="disaggregation role per worker, comma separated (prefill, decode, both), e.g. "
        "prefill,prefill,decode,decode; announced in heartbeats. Default: none announced (= both)",
    )
    h.add_argument("--pd-groups", default="", help="KV-transfer group per worker, comma separated")
    h.add_argument(
        "--transfer-ms-per-block",
        type=float,
        default=None,
        help="ms to receive one block's KV from a prefill instance (default: over the profile's RDMA "
        "link, as its shared-pool loads)",
    )
    e = parser.add_argument_group("engine")
    e.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="llama3-8b-h100",
        help="model and GPU whose prefill/decode times and KV capacity are simulated",
    )
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument(
        "--kv-groups",
        type=kv_groups,
        default=None,
        metavar="LAYOUT",
        help="a hybrid-attention model's KV-cache groups, announced in heartbeats and kept as vLLM "
        f"keeps them: a preset ({', '.join(KV_GROUP_PRESETS)}) or KIND[:TOKENS][xCOUNT],... e.g. "
        "sliding_window:64x3,full_attention (workers_shim/sim/hybrid.py). GPU only; --gpu-blocks then "
        "counts (block, group) pairs. Default: one full-attention cache",
    )
    e.add_argument(
        "--gpu-blocks",
        type=int,
        default=0,
        help="default: the profile's KV capacity (with --kv-groups, in (block, group) pairs)",
    )
    e.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier in blocks (0: none)")
    e.add_argument("--disk-blocks", type=int, default=0, help="disk tier in blocks (0: none)")
    e.add_argument("--pool-blocks", type=int, default=0, help="shared pool capacity (0: no pool)")
    e.add_argument(
        "--max-batched-tokens", type=int, default=8192, help="token budget per step (chunked prefill)"
    )
    e.add_argument("--max-running", type=int, default=256, help="requests running at once per engine")
    e.add_argument(
        "--offload",
        choices=("evict", "store"),
        default="evict",
        help="what goes to the CPU tier: blocks evicted from the GPU, or every computed block (store)",
    )
    e.add_argument("--fetch-overlap", action="store_true", help="overlap block loads with compute")
    t = parser.add_argument_group("traffic")
    t.add_argument("--trace", help="Mooncake-format JSONL trace to replay")
    t.add_argument("--trace-limit", type=int, default=None, help="replay only the trace's first N requests")
    t.add_argument("--time-scale", type=float, default=1.0, help="arrival times x this (0.5 = 2x load)")
    t.add_argument(
        "--route",
        choices=("round_robin", "random", "least_loaded"),
        default="least_loaded",
        help="how --trace requests are spread over the workers (a real router asks kvindex instead)",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of --route random")
    t.add_argument("--duration", type=float, default=0.0, help="stop after this many wall seconds (0: never)")


def build_config(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, object] = {
        "cpu_blocks": args.cpu_blocks,
        "disk_blocks": args.disk_blocks,
        "max_batched_tokens": args.max_batched_tokens,
        "max_running": args.max_running,
        "offload": args.offload,
        "fetch_overlap": args.fetch_overlap,
    }
    if args.gpu_blocks:
        overrides["gpu_blocks"] = args.gpu_blocks
    if getattr(args, "kv_groups", None):
        overrides["kv_groups"] = args.kv_groups
    cfg = EngineConfig.from_profile(args.profile, args.block_size, **overrides)
    transfer = getattr(args, "transfer_ms_per_block", None)
    if transfer is not None:  # (default: the profile's RDMA link, timemodel.PROFILES)
        cfg.fetch_ms_per_block = {**cfg.fetch_ms_per_block, "remote": transfer}
    return cfg


def kv_groups(text: str) -> str:
    """``--kv-groups``: a layout hybrid.parse_kv_groups reads (checked here with any block size)."""
    try:
        parse_kv_groups(text, 16)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def config_error(args: argparse.Namespace) -> str:
    """What makes the engine options unusable together ("" when they fit)."""
    if args.kv_groups and (args.cpu_blocks or args.disk_blocks or args.pool_blocks):
        return "--kv-groups: a hybrid engine is GPU only (no --cpu-blocks, --disk-blocks or --pool-blocks)"
    try:
        build_config(args)
    except ValueError as exc:
        return str(exc)
    return ""


def per_worker(text: str, n: int, check: Any, what: str) -> list[str | None]:
    """A comma-separated value per worker (empty: none for any), each checked; ValueError naming
    what is wrong."""
    if not text:
        return [None] * n
    values = [v.strip() for v in text.split(",")]
    if len(values) != n:
        raise ValueError(f"--{what}: {len(values)} values for {n} workers")
    return [check(v) for v in values]


def port_room_error(args: argparse.Namespace) -> str:
    """Worker i takes port PORT+i of ``--http-port`` and ``--endpoint-base``: what is wrong when the
    last worker's would be beyond 65535 ("" when they fit)."""
    from kvindex.wire.endpoint import BadEndpoint, parse_endpoint

    last = args.workers - 1
    if args.http_port and args.http_port + last > MAX_PORT:
        where = f"worker {last} would listen on {args.http_port + last}, > {MAX_PORT}"
        return f"--http-port {args.http_port}: {where}"
    if args.endpoint_base is not None:
        try:
            _host, base = parse_endpoint(args.endpoint_base)
        except BadEndpoint as exc:
            return f"--endpoint-base: {exc}"
        if base + last > MAX_PORT:
            where = f"worker {last} would be on port {base + last}, > {MAX_PORT}"
            return f"--endpoint-base {args.endpoint_base}: {where}"
    return ""


def main_sim(args: argparse.Namespace) -> int:
    """Run until ``--duration``, SIGTERM/SIGINT/SIGHUP or the parent's exit (kvindex/lifecycle)."""
    problem = port_room_error(args) or config_error(args)
    if problem:
        print(f"kvshim sim: error: {problem}", file=sys.stderr)
        return 2

    async def main(stop: Stop) -> int:
        try:
            await _main(args, stop)
        except (NatsConfigError, NatsConnectError, SimSetupError) as exc:
            log.error("kvshim_sim_failed", error=str(exc))
            return 1
        return 0

    return run(main, grace=5.0, name="kvsim")


async def _main(args: argparse.Namespace, stop: Stop) -> None:
    cfg = build_config(args)
    loop = asyncio.get_running_loop()
    ttfts: list[float] = []

    def on_completion(worker: str, c: Completion) -> None:
        if c.kind == "first_token":
            ttfts.append(c.ttft)

    fleet = await stop.run_or_stop(
        run_fleet(
            NatsSettings.from_args(args) or DEFAULT_URL,
            args.workers,
            cfg,
            model=args.model,
            speed=args.speed,
            pool_blocks=args.pool_blocks,
            subject_prefix=args.subject_prefix,
            worker_prefix=args.worker_prefix,
            heartbeat_interval=args.heartbeat_interval,
            on_completion=on_completion,
            endpoint_base=args.endpoint_base,
        )
    )
    if fleet is None:  # stopped while connecting
        return
    servers = []
    try:
        roles = per_worker(args.roles, args.workers, check_role, "roles")
        groups = per_worker(args.pd_groups, args.workers, check_group, "pd-groups")
        for name, role, group in zip(fleet.engines, roles, groups, strict=True):
            fleet.publishers[name].role, fleet.publishers[name].pd_group = role, group
        if args.http_port is not None:
            servers = await serve_fleet(fleet, args.model, args.http_host, args.http_port)
            for server in servers:  # announced from the next heartbeat on
                fleet.publishers[server.worker].endpoint = server.endpoint
            log.info("sim_http_serving", endpoints={s.worker: s.endpoint for s in servers})
    except (ValueError, OSError) as exc:
        await fleet.close()
        raise SimSetupError(str(exc)) from None
    tasks = [asyncio.create_task(_report(fleet, ttfts))]
    if args.trace:
        tasks.append(asyncio.create_task(_replay(fleet, args, stop)))
    if args.duration > 0:
        loop.call_later(args.duration, stop.request, "duration")
    try:
        await stop.wait()
    finally:
        await finish(tasks, 1.0)
        for server in servers:
            await server.close()
        await fleet.close()
        log.info("sim_fleet_stopped", first_tokens=fleet.first_tokens, finished=fleet.completed)


async def _replay(fleet: SimFleet, args: argparse.Namespace, stop: Stop) -> None:
    reqs = mooncake_requests(
        args.trace,
        model=args.model,
        block_size=args.block_size,
        limit=args.trace_limit,
        time_scale=args.time_scale,
    )
    workers = list(fleet.engines)
    rr = itertools.cycle(workers)
    rng = random.Random(args.seed)

    def route(req: SimRequest) -> str:
        if args.route == "round_robin":
            return next(rr)
        if args.route == "random":
            return rng.choice(workers)
        return min(workers, key=lambda w: (fleet.load(w).waiting_prefill_tokens, fleet.load(w).running))

    start = fleet.vnow()
    for req in reqs:
        delay = (start + req.arrival - fleet.vnow()) / fleet.speed
        if delay > 0:
            await asyncio.sleep(delay)
        await fleet.submit(route(req), req)
    log.info("trace_replayed", requests=len(reqs))
    while fleet.completed < len(reqs):
        await asyncio.sleep(0.2)
    if args.duration <= 0:
        stop.request("trace_done")


async def _report(fleet: SimFleet, ttfts: list[float], every: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every)
        recent, ttfts[:] = list(ttfts), []
        loads = [fleet.load(w) for w in fleet.engines]
        log.info(
            "sim_fleet",
            vtime=round(fleet.vnow(), 1),
            first_tokens=fleet.first_tokens,
            finished=fleet.completed,
            ttft_mean_s=round(sum(recent) / len(recent), 3) if recent else None,
            running=sum(ld.running for ld in loads),
            waiting=sum(ld.waiting for ld in loads),
            kv_usage_max=round(max(ld.kv_usage for ld in loads), 3),
            wall=time.strftime("%H:%M:%S"),
        )
