"""`kvshim heartbeat`: register an engine that publishes no KV events.

Older vLLM releases and other OpenAI-compatible servers cannot emit KV events. This shim only
announces the instance — model, block size, capacity, where it serves (``--endpoint``) and its load
scraped from the engine's Prometheus page — with ``events: false`` in every heartbeat. The index then
predicts the instance's prefix cache from its own routing decisions (kvindex/scoring/approximate.py)
and marks it ``approximate`` in ListInstances.

    kvshim heartbeat --worker-id W --model M --block-size 16 --endpoint HOST:8000 \\
        [--metrics-url http://HOST:8000/metrics] [--capacity gpu=24000] [--nats URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import structlog

from kvindex.config.args import LOG_FORMAT_HELP, LOG_LEVEL_HELP, SUBJECT_PREFIX_HELP
from kvindex.lifecycle import Stop, run
from workers_shim.bridges.engines import ENGINES
from workers_shim.bridges.load import LoadReader, PrefillSampler, scrape
from workers_shim.publisher import Publisher


def add_heartbeat_command(
    sub: Any, parse_endpoint: Any, parse_capacity: Any, positive_int: Any, add_role_arguments: Any = None
) -> None:
    p = sub.add_parser(
        "heartbeat",
        help="announce an engine without KV events (heartbeats only; the index predicts its cache)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--worker-id", required=True, help="this worker's id on the wire ([A-Za-z0-9_-]{1,128})")
    p.add_argument("--model", required=True, help="served model name, as routers will ask for it")
    p.add_argument("--block-size", type=positive_int, required=True, help="tokens per KV block in the engine")
    p.add_argument(
        "--endpoint", type=parse_endpoint, required=True, help="HOST:PORT routers send requests to"
    )
    p.add_argument("--metrics-url", default=None, help="the engine's Prometheus page, for its load")
    p.add_argument("--engine", choices=sorted(ENGINES), default="vllm", help="whose /metrics names to read")
    p.add_argument("--capacity", type=parse_capacity, default={}, help="blocks per tier, e.g. gpu=24000")
    if add_role_arguments is not None:
        add_role_arguments(p)
    p.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS URL")
    p.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between scrapes of --metrics-url"
    )
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help=LOG_FORMAT_HELP)
    p.add_argument("--log-level", default="info", help=LOG_LEVEL_HELP)
    p.set_defaults(handler=run_heartbeat)


def run_heartbeat(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT/SIGHUP or the parent's exit; stops within 5 s (kvindex/lifecycle)."""
    from kvindex.observability.logs import configure_logging

    configure_logging(args.log_format, args.log_level)
    return run(lambda stop: heartbeat_until_signalled(args, stop), grace=5.0, name="kvshim-heartbeat")


async def heartbeat_until_signalled(args: argparse.Namespace, stop: Stop) -> None:
    log = structlog.get_logger("workers_shim.heartbeat")
    pub = await stop.run_or_stop(  # a stop while NATS is unreachable cancels the connect
        Publisher.connect(
            args.nats,
            worker=args.worker_id,
            model=args.model,
            block_size=args.block_size,
            subject_prefix=args.subject_prefix,
            capacity=args.capacity,
            endpoint=args.endpoint,
            events=False,
            role=getattr(args, "role", None),
            pd_group=getattr(args, "pd_group", None),
            heartbeat_interval=args.heartbeat_interval,
        )
    )
    if pub is None:
        return
    log.info("kvshim_started", mode="heartbeat", worker=args.worker_id, endpoint=args.endpoint)
    reader = LoadReader(ENGINES[args.engine])
    sampler = PrefillSampler(reader)  # the engine's prefill times, for the index's calibration
    try:
        while not stop.requested:
            if args.metrics_url:
                try:
                    samples = await scrape(args.metrics_url, 2.0, reader.profile.sample_names())
                    load = reader.load(samples, 0)
                    pub.set_load(
                        running=load.running,
                        waiting=load.waiting,
                        waiting_prefill_tokens=load.waiting_prefill_tokens,
                        kv_usage=load.kv_usage,
                    )
                    prefill = sampler.sample(samples, 0)
                    if prefill is not None:
                        pub.prefill_sample(*prefill)
                except Exception as exc:  # the engine may be restarting: keep announcing
                    log.warning("kv_load_scrape_failed", url=args.metrics_url, error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.scrape_interval)
    finally:
        await pub.close()
        log.info("kvshim_stopped", mode="heartbeat")
