"""`make run`: the whole loop on one machine, with a live dashboard.

    python -m kvtools.demo                       # 8 simulated instances (GPU + CPU tiers), Mooncake trace x4
    python -m kvtools.demo --instances 16 --cpu-blocks 0 --speed 2 --time-scale 0.5
    python -m kvtools.demo --duration 30 --plain # no dashboard: a summary line every few seconds

It starts `kvindex serve` (which starts its embedded nats-server), a fleet of simulated vLLM-like
engines publishing real KV events and heartbeats through the worker publisher, and a traffic driver
that replays the Mooncake conversation trace: every request is routed by the real gRPC `Score`
(policy `ttft`, committed), sent to the simulated instance it chose, and released at first token and
at the end. The dashboard shows, per instance, what the index knows (blocks per tier, load, seq and
epoch, repairs) and, overall, hit rate, estimated vs simulated TTFT and decisions per second.
Ctrl-C (or closing the terminal, SIGTERM, or the parent's exit) stops everything cleanly: the
demo, its `kvindex serve` and the embedded nats-server (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvindex.lifecycle import Stop, die_with_parent, finish
from kvindex.lifecycle import run as lifecycle_run
from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.data import mooncake_trace

TRACE = mooncake_trace()
MODEL = "demo-model"


@dataclass
class Tally:
    routed: int = 0
    first_tokens: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    errors: int = 0
    est_ms: dict[str, float] = field(default_factory=dict)
    pairs: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=2000)
    )  # (est, simulated) s
    decisions: deque[float] = field(default_factory=lambda: deque(maxlen=5000))  # decision times
    reasons: dict[str, int] = field(default_factory=dict)
    # Predicted against actual: the cached tokens the index predicted for each routed request, and
    # the engine's hit minus that, recent requests (tokens).
    predicted: dict[str, int] = field(default_factory=dict)
    cache_errors: deque[int] = field(default_factory=lambda: deque(maxlen=2000))
    block_size: int = 16

    def outcome_line(self, instances: list[Any]) -> str:
        """The index's verdicts (its outcome counters) and the recent error, for the dashboard."""
        exact = sum(i.outcomes_exact for i in instances)
        over = sum(i.outcomes_over for i in instances)
        under = sum(i.outcomes_under for i in instances)
        total = exact + over + under
        errors = list(self.cache_errors)
        mean = sum(abs(e) for e in errors) / len(errors) / self.block_size if errors else 0.0
        degraded = sum(1 for i in instances if i.state == "degraded")
        share = f"{exact / total:.1%}" if total else "-"
        return (
            f"exact {share} ({exact:,}), over {over:,}, under {under:,}; mean |error| {mean:.2f} blocks; "
            f"{degraded} degraded"
        )

    def decisions_per_s(self, now: float) -> float:
        recent = [t for t in self.decisions if now - t <= 5]
        return len(recent) / 5


def _spawn_service(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    port = args.grpc_port or free_port()
    exe = str(Path(sys.executable).with_name("kvindex"))
    cmd = [
        exe,
        "serve",
        "--grpc-host",
        "127.0.0.1",
        "--grpc-port",
        str(port),
        "--log-format",
        "json",
        "--log-level",
        "info",
        "--metrics-port",
        str(args.metrics_port),
        "--shutdown-grace",
        "1",  # our own calls are over by the time we stop it
    ]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # Even a SIGKILLed demo takes its service (and so the embedded nats-server) along.
        preexec_fn=die_with_parent(),
    )
    return proc, f"127.0.0.1:{port}"


async def _service_up(proc: subprocess.Popen[str]) -> str:
    """Wait for ``kvindex serve`` to serve; its embedded NATS URL."""
    nats_url = ""
    assert proc.stderr is not None
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = await loop.run_in_executor(None, proc.stderr.readline)
        if not line:
            raise RuntimeError(f"kvindex serve exited (code {proc.poll()})")
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if record.get("event") == "embedded_nats_started":
                nats_url = record["url"]
            if record.get("event") == "kvindex_serving":
                break
    # Keep draining the service's log so it never blocks on a full pipe.
    loop.run_in_executor(None, lambda: [None for _ in proc.stderr])  # type: ignore[union-attr]
    return nats_url


async def _stop_service(proc: subprocess.Popen[str], timeout: float = 8.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def _drive(
    args: argparse.Namespace, fleet: Any, stub: pb_grpc.KvIndexStub, tally: Tally, stop: Stop
) -> None:
    from workers_shim.sim.trace import mooncake_requests

    reqs = mooncake_requests(
        args.trace,
        model=MODEL,
        block_size=args.block_size,
        limit=args.limit,
        time_scale=args.time_scale,
        id_prefix="demo-",
    )
    speed = args.speed
    start = time.monotonic()
    for req in reqs:
        if stop.requested:
            return
        delay = req.arrival / speed - (time.monotonic() - start)
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.requested:
                return
        try:
            reply = await stub.Score(
                pb.ScoreRequest(
                    model=MODEL,
                    block_keys=req.keys,
                    prompt_tokens=req.prompt_tokens,
                    top_k=1,
                    commit=True,
                    request_id=req.id,
                    explain=True,
                ),
                timeout=5,
            )
        except grpc.aio.AioRpcError:
            tally.errors += 1
            continue
        if not reply.ranked:
            tally.errors += 1
            continue
        top = reply.ranked[0]
        tally.est_ms[req.id] = top.est_ttft_ms
        # vLLM's rule (the simulated engine's too): the last prompt token is always computed.
        b = args.block_size
        tally.predicted[req.id] = b * min(top.matched_blocks, (req.prompt_tokens - 1) // b)
        tally.routed += 1
        tally.decisions.append(time.monotonic())
        tally.reasons[top.explain] = tally.reasons.get(top.explain, 0) + 1
        await fleet.submit(top.worker, req)


async def _release(stub: pb_grpc.KvIndexStub, request: pb.ReleaseRequest) -> None:
    await stub.Release(request, timeout=5)


def _on_completion(tally: Tally, stub: pb_grpc.KvIndexStub, pending: set[asyncio.Task[Any]]) -> Any:
    def handle(worker: str, c: Any) -> None:
        rid = c.request.id
        if c.kind == "first_token":
            tally.first_tokens += 1
            tally.prompt_tokens += c.request.prompt_tokens
            tally.hit_tokens += c.hit_tokens
            est = tally.est_ms.pop(rid, None)
            if est is not None:
                tally.pairs.append((est / 1000, c.ttft))
            cached = c.reported_cached_tokens  # as vLLM's usage.prompt_tokens_details.cached_tokens
            predicted = tally.predicted.pop(rid, None)
            if predicted is not None:
                tally.cache_errors.append(cached - predicted)
            # The engine's answer, as a router reads it from vLLM's usage: compared by the index.
            request = pb.ReleaseRequest(
                request_id=rid,
                phase="prefill",
                cached_tokens=cached,
                ttft_ms=c.ttft * 1000,
                prompt_tokens=c.request.prompt_tokens,
            )
        else:
            tally.finished += 1
            request = pb.ReleaseRequest(request_id=rid, phase="finished")
        task = asyncio.get_running_loop().create_task(_release(stub, request))
        pending.add(task)
        task.add_done_callback(pending.discard)

    return handle


def _render(instances: list[Any], stats: Any, tally: Tally, events_per_s: float, elapsed: float) -> Any:
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"kvindex demo — {elapsed:.0f} s", expand=True)
    for col in (
        "instance",
        "gpu blocks",
        "cpu blocks",
        "running",
        "waiting",
        "kv use",
        "seq",
        "epoch",
        "gaps",
        "restarts",
        "exact/over/under",
        "state",
    ):
        t.add_column(col, justify="right" if col not in ("instance", "state") else "left")
    for i in instances:
        if i.pool:
            continue
        t.add_row(
            i.instance_id,
            f"{i.blocks.gpu:,}",
            f"{i.blocks.cpu:,}",
            str(i.load.running),
            str(i.load.waiting),
            f"{i.load.kv_usage:.0%}",
            str(i.last_seq),
            str(i.epoch % 100000),
            str(i.gaps),
            str(i.restarts),
            f"{i.outcomes_exact}/{i.outcomes_over}/{i.outcomes_under}",
            ("stale " if i.stale else "") + i.state + ("" if i.sync == "synced" else f" ({i.sync})"),
        )
    pairs = list(tally.pairs)
    est = sum(p[0] for p in pairs) / len(pairs) if pairs else 0.0
    sim = sum(p[1] for p in pairs) / len(pairs) if pairs else 0.0
    hit = tally.hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    o = Table(show_header=False, expand=True)
    o.add_row(
        "requests routed / first tokens / finished",
        f"{tally.routed:,} / {tally.first_tokens:,} / {tally.finished:,}",
    )
    o.add_row("decisions/s", f"{tally.decisions_per_s(time.monotonic()):.1f}")
    o.add_row("prefix hit rate (tokens)", f"{hit:.1%}")
    o.add_row("TTFT estimated vs simulated (mean, recent)", f"{est:.3f} s vs {sim:.3f} s")
    o.add_row("cached tokens predicted vs engine", tally.outcome_line(instances))
    o.add_row(
        "placement reasons",
        ", ".join(f"{k} {v}" for k, v in sorted(tally.reasons.items(), key=lambda kv: -kv[1])[:6]),
    )
    o.add_row(
        "index",
        f"{stats.distinct_blocks.gpu:,} gpu / {stats.distinct_blocks.cpu:,} cpu blocks, "
        f"{events_per_s:,.0f} events/s applied",
    )
    o.add_row(
        "repairs",
        f"gaps {stats.gaps}, replays {stats.replays_ok}, snapshots {stats.snapshots_applied}, "
        f"rejects {stats.rejects_total}",
    )
    return Group(t, o)


async def run(args: argparse.Namespace, stop: Stop, tally: Tally) -> None:
    from workers_shim.sim import EngineConfig
    from workers_shim.sim.fleet import run_fleet

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.duration:
        asyncio.get_running_loop().call_later(args.duration, stop.request, "duration")
    proc, address = _spawn_service(args)
    pending: set[asyncio.Task[Any]] = set()
    fleet = None
    try:
        nats_url = await stop.run_or_stop(_service_up(proc))
        if nats_url is None:
            return
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            cfg = EngineConfig.from_profile(args.profile, args.block_size, cpu_blocks=args.cpu_blocks)
            fleet = await stop.run_or_stop(
                run_fleet(
                    nats_url,
                    args.instances,
                    cfg,
                    model=MODEL,
                    speed=args.speed,
                    on_completion=_on_completion(tally, stub, pending),
                )
            )
            if fleet is None:
                return
            for _ in range(100):  # every instance announced itself
                listed = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
                if len(listed.instances) >= args.instances or stop.requested:
                    break
                await asyncio.sleep(0.05)
            driver = asyncio.create_task(_drive(args, fleet, stub, tally, stop))
            try:
                await _watch(args, stub, tally, stop)
            except grpc.aio.AioRpcError:
                # Closing the terminal signals the whole process group: the service may already
                # be stopping when we notice our own signal.
                if not stop.requested:
                    raise
            await finish([driver], 1.0)
            await fleet.close()  # no completions (and Releases) after this
            fleet = None
            for task in list(pending):
                with contextlib.suppress(Exception):
                    await task
    finally:
        if fleet is not None:
            await fleet.close()
        await _stop_service(proc)


async def _watch(args: argparse.Namespace, stub: pb_grpc.KvIndexStub, tally: Tally, stop: Stop) -> None:
    started = time.monotonic()
    last_events, last_t = 0, started
    use_rich = not args.plain and sys.stdout.isatty()
    live = None
    if use_rich:
        from rich.live import Live

        live = Live(refresh_per_second=2, screen=False)
        live.start()
    try:
        while not stop.requested:
            listed = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
            stats = await stub.Stats(pb.StatsRequest())
            now = time.monotonic()
            events = stats.events_stored + stats.events_removed + stats.events_cleared
            rate = (events - last_events) / max(now - last_t, 1e-6)
            last_events, last_t = events, now
            if live is not None:
                live.update(_render(list(listed.instances), stats, tally, rate, now - started))
            else:
                pairs = list(tally.pairs)
                est = sum(p[0] for p in pairs) / len(pairs) if pairs else 0.0
                sim = sum(p[1] for p in pairs) / len(pairs) if pairs else 0.0
                hit = tally.hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
                print(
                    f"[{now - started:5.0f} s] routed {tally.routed} first tokens {tally.first_tokens} "
                    f"hit {hit:.1%} ttft est {est:.3f}s sim {sim:.3f}s "
                    f"{tally.decisions_per_s(now):.1f} decisions/s {rate:,.0f} events/s gaps {stats.gaps} "
                    f"predicted vs engine: {tally.outcome_line(list(listed.instances))}",
                    flush=True,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5 if live is not None else args.report_every)
    finally:
        if live is not None:
            live.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvtools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-blocks", type=int, default=50_000, help="CPU offload tier per instance (0: none)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument(
        "--time-scale", type=float, default=0.25, help="trace arrival times x this (0.25: 4x the load)"
    )
    p.add_argument("--speed", type=float, default=1.0, help="virtual seconds per wall second")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: Ctrl-C)")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9400)
    p.add_argument("--plain", action="store_true", help="no dashboard: a summary line every few seconds")
    p.add_argument("--report-every", type=float, default=5.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not Path(args.trace).exists():
        print(
            f"trace not found: {args.trace} (pass --trace PATH to a Mooncake-format JSONL file)",
            file=sys.stderr,
        )
        return 2
    tally = Tally(block_size=args.block_size)
    # SIGINT (Ctrl-C), SIGTERM, SIGHUP (terminal closed) or our parent's exit stop everything.
    code = lifecycle_run(lambda stop: run(args, stop, tally), grace=12.0, name="kvtools-demo")
    print(
        f"stopped: {tally.routed} requests routed, {tally.first_tokens} first tokens, {tally.errors} errors"
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
