"""`make run`: the whole loop on one machine, with a live dashboard.

    python -m kvtools.demo                       # 8 simulated instances (GPU + CPU tiers), trace x2.5
    python -m kvtools.demo --instances 16 --cpu-blocks 0 --speed 2 --time-scale 0.5
    python -m kvtools.demo --time-scale 0.25     # x4: more than 8 instances can serve; queues grow
    python -m kvtools.demo --duration 30 --plain # no dashboard: a summary line every few seconds

It starts `kvindex serve` (which starts its embedded nats-server), a fleet of simulated vLLM-like
engines publishing real KV events and heartbeats through the worker publisher, and a traffic driver
that replays the Mooncake conversation trace: every request is routed by the real gRPC `Score`
(policy `ttft`, committed), sent to the simulated instance it chose, and released at first token and
at the end. The dashboard shows, per instance, what the index knows (blocks per tier, load, seq and
epoch, repairs) and, overall, the trace's progress, the load and whether the fleet keeps up, hit
rate, estimated vs simulated TTFT and decisions per second.

The default load, the trace at 2.5x its rate, is one the 8 instances serve with TTFT routing (in the
trace-driven simulation, `benchmarks/routing_sim.py demo`, over the whole trace: TTFT mean 0.63 s,
p90 1.27 s, steady) but not with round robin, whose queues build (mean 6.0 s, p90 18.9 s). At 4x
(--time-scale 0.25) even TTFT routing saturates this fleet (mean 16 s over the first 2,000
requests, rising): TTFT becomes queueing that no estimate foresees.
Ctrl-C (or closing the terminal, SIGTERM, or the parent's exit) stops everything cleanly: the
demo, its `kvindex serve` and the embedded nats-server (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
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

from kvindex.config.args import port, port_or_off
from kvindex.lifecycle import Stop, die_with_parent, finish
from kvindex.lifecycle import run as lifecycle_run
from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.data import mooncake_trace

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
    trace_total: int = 0  # requests the driver replays (0: still reading the trace)
    trace_span_s: float = 0.0  # arrival of the last one, simulated seconds
    all_sent: bool = False
    load: str = ""  # the offered load, said on screen
    queued: float = 0.0  # requests waiting for admission over the fleet, averaged over ~20 s
    queued_at: float = 0.0
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
        # Its own session: Ctrl-C in the terminal signals only the demo, which stops the simulated
        # workers first and the service (and its NATS) after them, so no worker loses its server.
        start_new_session=True,
    )
    return proc, f"127.0.0.1:{port}"


async def _service_up(proc: subprocess.Popen[str]) -> str:
    """Wait for ``kvindex serve`` to serve; its embedded NATS URL."""
    nats_url = ""
    assert proc.stderr is not None
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30
    why = ""
    while time.monotonic() < deadline:
        line = await loop.run_in_executor(None, proc.stderr.readline)
        if not line:
            # Its own error says what to change (e.g. a port in use and the flag that sets it).
            raise RuntimeError(f"kvindex serve exited (code {proc.wait()}){': ' + why if why else ''}")
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            record = json.loads(line)
            if record.get("level") == "error":
                why = str(record.get("error") or record.get("event"))
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
    tally.trace_total = len(reqs)
    tally.trace_span_s = reqs[-1].arrival if reqs else 0.0
    tally.load = _offered_load(args, reqs)
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
    tally.all_sent = True


def _offered_load(args: argparse.Namespace, reqs: list[Any]) -> str:
    """What the replayed trace offers, per simulated second, over the whole replay."""
    where = f"trace x{1 / args.time_scale:.1f} (--time-scale {args.time_scale:g})"
    if len(reqs) < 2 or reqs[-1].arrival <= 0:
        return where
    span = reqs[-1].arrival
    tokens = sum(r.prompt_tokens for r in reqs)
    per_instance = len(reqs) / span / args.instances
    return (
        f"{where}: {len(reqs) / span:.1f} requests/s, {tokens / span / 1000:,.0f}k prompt tokens/s "
        f"({per_instance:.2f} requests/s per instance)"
    )


def _fleet_state(instances: list[Any], tally: Tally) -> str:
    """Whether the fleet keeps up, from what the index knows of it: requests waiting for admission,
    averaged over ~20 s (a burst queues a few for a moment). Beyond two per instance queues are
    building: TTFT is then mostly waiting, which no estimate foresees."""
    engines = [i for i in instances if not i.pool]
    if not engines:
        return ""
    waiting = sum(i.load.waiting for i in engines)
    now = time.monotonic()
    weight = 1 - math.exp(-(now - tally.queued_at) / 20) if tally.queued_at else 1.0
    tally.queued += weight * (waiting - tally.queued)
    tally.queued_at = now
    kv = sum(i.load.kv_usage for i in engines) / len(engines)
    per_instance = tally.queued / len(engines)
    if per_instance <= 1:
        state = "keeping up"
    elif per_instance <= 2:
        state = "busy: short queues"
    else:
        state = "SATURATED: queues building, TTFT is mostly waiting"
    return f"{state} ({waiting} waiting now, {tally.queued:.0f} on average; mean KV use {kv:.0%})"


def _progress(tally: Tally) -> str:
    if not tally.trace_total:
        return "reading the trace"
    if not tally.all_sent:
        return f"{tally.routed:,} of {tally.trace_total:,} requests sent"
    if tally.finished < tally.routed:
        return f"all {tally.trace_total:,} requests sent; {tally.routed - tally.finished:,} still running"
    return f"done: all {tally.trace_total:,} requests finished (Ctrl-C to quit)"


async def _release(stub: pb_grpc.KvIndexStub, request: pb.ReleaseRequest) -> None:
    # A release the service cannot take (it is stopping) loses nothing: its ledger entry expires.
    with contextlib.suppress(grpc.aio.AioRpcError):
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


def _clock(elapsed: float, speed: float) -> str:
    """The simulated fleet runs ``speed`` simulated seconds per wall second."""
    if speed == 1:
        return f"{elapsed:.0f} s (simulated = wall clock)"
    return f"simulated {elapsed * speed:.0f} s (wall {elapsed:.0f} s, --speed {speed:g})"


def _render(
    instances: list[Any], stats: Any, tally: Tally, events_per_s: float, elapsed: float, speed: float = 1.0
) -> Any:
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"kvindex demo — {_clock(elapsed, speed)}", expand=True)
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
    o.add_row("trace", _progress(tally))
    o.add_row("load", "; ".join(s for s in (tally.load, _fleet_state(instances, tally)) if s) or "-")
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
    load_said = False
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
                live.update(_render(list(listed.instances), stats, tally, rate, now - started, args.speed))
            else:
                if tally.load and not load_said:
                    print(f"load: {tally.load}", flush=True)
                    load_said = True
                pairs = list(tally.pairs)
                est = sum(p[0] for p in pairs) / len(pairs) if pairs else 0.0
                sim = sum(p[1] for p in pairs) / len(pairs) if pairs else 0.0
                hit = tally.hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
                print(
                    f"[{now - started:5.0f} s wall] {_progress(tally)}: "
                    f"routed {tally.routed} first tokens {tally.first_tokens} "
                    f"hit {hit:.1%} ttft est {est:.3f}s sim {sim:.3f}s "
                    f"{tally.decisions_per_s(now):.1f} decisions/s {rate:,.0f} events/s gaps {stats.gaps} "
                    f"predicted vs engine: {tally.outcome_line(list(listed.instances))}; "
                    f"{_fleet_state(list(listed.instances), tally)}",
                    flush=True,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5 if live is not None else args.report_every)
    finally:
        if live is not None:
            live.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from workers_shim.sim.timemodel import PROFILES

    p = argparse.ArgumentParser(
        prog="python -m kvtools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--instances", type=int, default=8, help="simulated engine instances in the fleet")
    p.add_argument(
        "--profile",
        default="llama3-8b-h100",
        choices=sorted(PROFILES),
        help="model and hardware each instance simulates (time model and GPU KV capacity)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (as vLLM's)")
    p.add_argument("--cpu-blocks", type=int, default=50_000, help="CPU offload tier per instance (0: none)")
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format trace (.jsonl or .jsonl.gz); default: the conversation trace shipped in "
        "kvtools/data",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests of the trace")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.4,
        help="trace arrival times x this: 0.4 (default) is 2.5x the trace's rate, 0.25 is 4x (saturates 8 "
        "instances)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="simulated seconds per wall second (2: the fleet runs and the trace plays twice as fast)",
    )
    p.add_argument(
        "--duration", type=float, default=0.0, help="stop after this many wall seconds (0: at Ctrl-C)"
    )
    p.add_argument(
        "--grpc-port", type=port, default=50051, help="gRPC port of its kvindex serve (0: any free port)"
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=9400,
        help="its Prometheus /metrics port (0: any free, -1: none)",
    )
    p.add_argument("--plain", action="store_true", help="no dashboard: a summary line every few seconds")
    p.add_argument(
        "--report-every", type=float, default=5.0, help="seconds between summary lines with --plain"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        args.trace = args.trace or str(mooncake_trace())
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not Path(args.trace).exists():
        print(
            f"trace not found: {args.trace} (--trace takes a Mooncake-format .jsonl or .jsonl.gz)",
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
