"""`make run`: the whole loop on one machine, with a live dashboard.

    python -m kvtools.demo                       # 8 simulated instances (GPU + CPU tiers), trace x2.5
    python -m kvtools.demo --instances 16 --cpu-blocks 0 --speed 2 --time-scale 0.5
    python -m kvtools.demo --time-scale 0.25     # x4: more than 8 instances can serve; queues grow
    python -m kvtools.demo --duration 30 --plain # no dashboard: a summary line every few seconds

It starts `kvindex serve` (which starts its embedded nats-server), a fleet of simulated vLLM-like
engines publishing real KV events and heartbeats through the worker publisher, and a traffic driver
that replays the Mooncake conversation trace: every request is routed by the real gRPC `Score`
(policy `ttft`, committed), sent to the simulated instance it chose, and released at first token and
at the end. The dashboard shows, per instance, what the index knows (blocks per tier, load, seq,
epoch as the publisher's start time, repairs) and, overall, the trace's progress, length and end,
the offered and served rates as measured next to the trace's average, whether the fleet keeps up,
hit rate, estimated vs simulated TTFT over the last 30 s and decisions per second, and a legend.
The index prices the simulated engines' own costs (``index_costs``, ``kvindex serve --cost``):
with its default, a 70B model on 8 GPUs, the first estimates of these 8B engines were 4x their TTFT
until calibration replaced it (``--costs default`` shows that).

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


RECENT_S = 30.0  # wall seconds the measured rates and the TTFT comparison look back
MIN_RATE_S = 3.0  # ... and at least this long before a rate is said

# On screen under the numbers: what the columns and counters mean.
LEGEND = (
    ("epoch", "when the instance's publisher started (its epoch, Unix µs): a restart shows a new time"),
    (
        "gaps, replays, snapshots",
        "gaps: event batches missed (seq jumped); replays: gaps filled from the worker's buffer; "
        "snapshots: full state re-read, each instance every ~{interval:.0f} s (periodic "
        "reconciliation, --reconcile-interval), or after a gap no replay could fill",
    ),
    (
        "exact / over / under",
        "the cached tokens the index predicted at the decision vs what the engine reported: equal, "
        "more (the index over-promised), fewer",
    ),
    (
        "placement reasons",
        "home(+N): a cold prompt to its first (N-th next) rendezvous home; cache: an instance holding "
        "its prefix was fastest; replica: a holder kept though another was faster (hot prefix); "
        "spill(+N): holders busy, on to the prefix's next home; capped, overflow: replica limit; "
        "fastest: no prefix (docs/scoring.md)",
    ),
    (
        "TTFT estimated vs simulated",
        "the index's estimate at the decision against the simulated engine's TTFT, same requests; "
        "they part when queues build: requests routed later can be batched ahead (docs/scoring.md)",
    ),
)


def _count_since(times: deque[float], since: float) -> int:
    n = 0
    for t in reversed(times):
        if t <= since:
            break
        n += 1
    return n


def _duration(seconds: float) -> str:
    """``1 h 02 min``, ``23 min 35 s``, ``42 s``."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


def epoch_label(epoch: int, now: float | None = None) -> str:
    """An instance's epoch as its publisher's start time (the Python publisher's epoch is Unix µs):
    ``22:52:25``, with the date when not today; other epochs (any u64 is valid) in hex."""
    seconds = epoch / 1e6
    now = time.time() if now is None else now
    if not 946_684_800 <= seconds <= now + 86_400:  # 2000-01-01 to tomorrow: a Unix time in µs
        return f"{epoch:#x}"
    started = time.localtime(seconds)
    if time.strftime("%Y-%m-%d", started) == time.strftime("%Y-%m-%d", time.localtime(now)):
        return time.strftime("%H:%M:%S", started)
    return time.strftime("%m-%d %H:%M:%S", started)


@dataclass
class Tally:
    routed: int = 0
    first_tokens: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    errors: int = 0
    est_ms: dict[str, float] = field(default_factory=dict)
    # (wall time of the first token, estimated s, simulated s)
    pairs: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=5000))
    decisions: deque[float] = field(default_factory=lambda: deque(maxlen=5000))  # decision times
    sent_at: deque[float] = field(default_factory=lambda: deque(maxlen=20_000))  # every request sent
    finished_at: deque[float] = field(default_factory=lambda: deque(maxlen=20_000))
    reasons: dict[str, int] = field(default_factory=dict)
    trace_total: int = 0  # requests the driver replays (0: still reading the trace)
    trace_span_s: float = 0.0  # arrival of the last one, simulated seconds
    started: float = 0.0  # monotonic time of the trace's time 0 (0: not replaying yet)
    speed: float = 1.0  # simulated seconds per wall second
    all_sent: bool = False
    load: str = ""  # the trace's average load, said on screen
    queued: float = 0.0  # requests waiting for admission over the fleet, averaged over ~20 s
    queued_at: float = 0.0
    # Predicted against actual: the cached tokens the index predicted for each routed request, and
    # the engine's hit minus that, recent requests (tokens).
    predicted: dict[str, int] = field(default_factory=dict)
    cache_errors: deque[int] = field(default_factory=lambda: deque(maxlen=2000))
    block_size: int = 16
    costs: str = ""  # whose costs the index prices with, said with the TTFT comparison
    reconcile_interval: float = 60.0

    def start_trace(self, shape: TraceShape, args: argparse.Namespace) -> None:
        self.trace_total = len(shape.arrivals)
        self.trace_span_s = shape.span
        self.speed = args.speed
        self.load = _offered_load(args, shape)

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

    def rates(self, now: float) -> tuple[float, float, float]:
        """(offered, served, window): requests sent and requests finished per simulated second over
        the last ``RECENT_S`` wall seconds (or since the replay started), both measured."""
        if not self.started or now - self.started < MIN_RATE_S:  # a rate needs a few seconds
            return 0.0, 0.0, 0.0
        window = min(RECENT_S, now - self.started)
        since = now - window
        per = window * self.speed
        return _count_since(self.sent_at, since) / per, _count_since(self.finished_at, since) / per, window

    def load_line(self, now: float) -> str:
        """Measured offered and served rates, then the trace's own average."""
        offered, served, window = self.rates(now)
        unit = "requests/s" if self.speed == 1 else "requests per simulated s"
        measured = (
            f"offered {offered:.1f}, served {served:.1f} {unit} (sent and finished, last {window:.0f} s)"
            if window
            else "offered and served: measuring"
        )
        nominal = f"trace average {self.load}" if self.load else ""
        return "; ".join(part for part in (measured, nominal) if part)

    def ttft(self, now: float) -> tuple[float, float, int]:
        """(estimated, simulated, count): mean TTFT of the first tokens of the last ``RECENT_S``."""
        recent = [(e, s) for t, e, s in self.pairs if now - t <= RECENT_S]
        if not recent:
            return 0.0, 0.0, 0
        return sum(e for e, _ in recent) / len(recent), sum(s for _, s in recent) / len(recent), len(recent)

    def ttft_line(self, now: float, calibration: str = "") -> str:
        est, sim, n = self.ttft(now)
        if not n:
            return "-"
        ratio = f" (x{est / sim:.2f})" if sim > 0 else ""
        said = "; ".join(part for part in (self.costs, calibration) if part)
        return f"{est:.3f} s vs {sim:.3f} s{ratio}, last {RECENT_S:.0f} s, {n:,} requests" + (
            f"; {said}" if said else ""
        )

    def progress(self, now: float) -> str:
        """Requests sent out of the trace's, how long it lasts and when it ends."""
        if not self.trace_total:
            return "reading the trace"
        wall = self.trace_span_s / self.speed
        lasts = f"the trace lasts {_duration(self.trace_span_s)}"
        if self.speed != 1:
            lasts += f" simulated, {_duration(wall)} wall (--speed {self.speed:g})"
        if not self.started:
            return f"starting; {lasts}"
        if not self.all_sent:
            left = wall - (now - self.started)
            done = self.routed + self.errors
            return (
                f"{done:,} of {self.trace_total:,} requests sent ({done / self.trace_total:.0%}); "
                f"{lasts}, last request in {_duration(left)}"
            )
        if self.finished < self.routed:
            return f"all {self.trace_total:,} requests sent; {self.routed - self.finished:,} still running"
        return f"done: all {self.trace_total:,} requests finished (Ctrl-C to quit)"


@dataclass(frozen=True)
class TraceShape:
    """What the dashboard says of the trace before the driver has read it (keys and all, ~2 s):
    per request its prompt and output tokens and its arrival, simulated seconds."""

    prompts: list[int]
    outputs: list[int]
    arrivals: list[float]

    @classmethod
    def read(cls, path: str, limit: int | None, time_scale: float) -> TraceShape:
        from workers_shim.sim.trace import mooncake_rows

        rows = list(mooncake_rows(path, limit))
        return cls(
            [int(r["input_length"]) for r in rows],
            [max(1, int(r["output_length"])) for r in rows],
            # as workers_shim.sim.trace.mooncake_requests
            [r["timestamp"] / 1000.0 * time_scale for r in rows],
        )

    @property
    def span(self) -> float:
        """Simulated seconds from the trace's start to its last arrival."""
        return self.arrivals[-1] if self.arrivals else 0.0


def index_costs(profile_name: str, cfg: Any, shape: TraceShape) -> dict[str, float]:
    """``kvindex serve --cost`` values that describe the simulated engines in the index's terms, so
    that its TTFT estimate prices what they do (issue 31: with its default, a 70B model on 8 GPUs,
    the first estimates of these 8B engines were 4x their TTFT until calibration took over).

    The engine prefills ``n`` tokens after ``s`` in one step of ``a + b·n + c·n·(s + (n+1)/2)`` ms
    (workers_shim/sim/timemodel.py), chunk after chunk; the index's prefill is ``a + b·miss +
    c·miss·L``. So: ``a`` as is, ``b`` plus the next chunks' ``a`` spread over their tokens, and ``c``
    halved (exact for a cold prompt; the trace's prompts mostly are: on its prompts, cold, a quarter
    or half cached, 4 % off on average). A decoding request costs each step ``d + e·`` its context
    (the trace's mean: its prompt and half its output); fetches cost the profile's KV bytes over its
    links. Calibration then fits ``a``, ``b``, ``c`` from the engines' samples as in production."""
    from workers_shim.sim.timemodel import PROFILES

    tm = cfg.time
    n = max(1, len(shape.prompts))
    context = (sum(shape.prompts) + sum(shape.outputs) / 2) / n
    profile = PROFILES[profile_name]
    links = profile.link_gbps
    return {
        "prefill_a_ms": tm.a_ms,
        "prefill_b_ms_per_token": tm.b_ms_per_token + tm.a_ms / cfg.max_batched_tokens,
        "prefill_c_ms_per_token2": tm.c_ms_per_token2 / 2,
        "chunk_tokens": cfg.max_batched_tokens,
        "step_ms": tm.a_ms,
        "decode_ms_per_seq": tm.d_ms_per_decode_seq + tm.e_ms_per_decode_ctx * context,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "pcie_gbps": links["cpu"],
        "disk_gbps": links["disk"],
        "network_gbps": links["shared"],
    }


def _spawn_service(args: argparse.Namespace, costs: dict[str, float]) -> tuple[subprocess.Popen[str], str]:
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
    for name, value in costs.items():
        cmd += ["--cost", f"{name}={value:.6g}"]
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
    speed = args.speed
    start = tally.started = time.monotonic()
    for req in reqs:
        if stop.requested:
            return
        delay = req.arrival / speed - (time.monotonic() - start)
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.requested:
                return
        tally.sent_at.append(time.monotonic())
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


def _offered_load(args: argparse.Namespace, shape: TraceShape) -> str:
    """What the replayed trace offers, per simulated second, on average over the whole replay."""
    where = f"x{1 / args.time_scale:.1f} (--time-scale {args.time_scale:g})"
    span, n = shape.span, len(shape.arrivals)
    if n < 2 or span <= 0:
        return where
    per_instance = n / span / args.instances
    return (
        f"{n / span:.1f} requests/s, {sum(shape.prompts) / span / 1000:,.0f}k prompt tokens/s "
        f"({per_instance:.2f} requests/s per instance) at {where}"
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
                tally.pairs.append((time.monotonic(), est / 1000, c.ttft))
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
            tally.finished_at.append(time.monotonic())
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


INSTANCE_COLUMNS = (
    "instance",
    "gpu\nblocks",
    "cpu\nblocks",
    "running/\nwaiting",
    "kv\nuse",
    "seq",
    "epoch\n(started)",
    "gaps/\nrestarts",
    "exact/\nover/under",
    "state",
)


def instance_row(i: Any) -> tuple[str, ...]:
    """One instance (``InstanceInfo``) under ``INSTANCE_COLUMNS``."""
    return (
        i.instance_id,
        f"{i.blocks.gpu:,}",
        f"{i.blocks.cpu:,}",
        f"{i.load.running}/{i.load.waiting}",
        f"{i.load.kv_usage:.0%}",
        str(i.last_seq),
        epoch_label(i.epoch),
        f"{i.gaps}/{i.restarts}",
        f"{i.outcomes_exact:,}/{i.outcomes_over:,}/{i.outcomes_under:,}",
        ("stale " if i.stale else "") + i.state + ("" if i.sync == "synced" else f" ({i.sync})"),
    )


def calibration_state(instances: list[Any]) -> str:
    """Which prefill model ranks the instances (``InstanceInfo.prefill.source``), in words."""
    engines = [i for i in instances if not i.pool]
    if not engines:
        return ""
    fitted = sum(1 for i in engines if i.prefill.source not in ("", "default"))
    if not fitted:
        return "prefill model: the configured one (no fit from the engines' samples did better yet)"
    return f"prefill model calibrated from the engines' samples on {fitted} of {len(engines)} instances"


def repairs_line(stats: Any, interval: float) -> str:
    """The repair counters, saying where snapshots without gaps come from."""
    why = f" (periodic: each instance every ~{interval:.0f} s)" if stats.snapshots_applied else ""
    return (
        f"gaps {stats.gaps}, replays {stats.replays_ok}, snapshots {stats.snapshots_applied}{why}, "
        f"rejects {stats.rejects_total}"
    )


def legend(interval: float) -> list[tuple[str, str]]:
    return [(name, text.format(interval=interval)) for name, text in LEGEND]


def _render(
    instances: list[Any],
    stats: Any,
    tally: Tally,
    events_per_s: float,
    elapsed: float,
    speed: float = 1.0,
    now: float | None = None,
) -> Any:
    from rich.console import Group
    from rich.table import Table

    now = time.monotonic() if now is None else now
    t = Table(title=f"kvindex demo — {_clock(elapsed, speed)}", expand=True)
    # Two-line headers and paired columns keep the table within ~105 columns; no value is ever cut
    # (an epoch cut to its last digits read as another number).
    for col in INSTANCE_COLUMNS:
        left = col in ("instance", "state")
        t.add_column(col, justify="left" if left else "right", no_wrap=col != "state")
    for i in instances:
        if not i.pool:
            t.add_row(*instance_row(i))
    hit = tally.hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    o = Table(show_header=False, expand=True)
    o.add_row("trace", tally.progress(now))
    o.add_row("load", tally.load_line(now) or "-")
    o.add_row("fleet", _fleet_state(instances, tally) or "-")
    o.add_row(
        "requests routed / first tokens / finished",
        f"{tally.routed:,} / {tally.first_tokens:,} / {tally.finished:,}",
    )
    o.add_row("decisions/s", f"{tally.decisions_per_s(now):.1f}")
    o.add_row("prefix hit rate (tokens)", f"{hit:.1%}")
    o.add_row("TTFT estimated vs simulated (mean)", tally.ttft_line(now, calibration_state(instances)))
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
    o.add_row("repairs", repairs_line(stats, tally.reconcile_interval))
    keys = Table(show_header=False, expand=True, box=None, title="legend", title_style="dim")
    for name, text in legend(tally.reconcile_interval):
        keys.add_row(f"[dim]{name}[/dim]", f"[dim]{text}[/dim]")
    return Group(t, o, keys)


async def run(args: argparse.Namespace, stop: Stop, tally: Tally) -> None:
    from kvindex.repair.nats_repair import RepairConfig
    from workers_shim.sim import EngineConfig
    from workers_shim.sim.fleet import run_fleet

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.duration:
        asyncio.get_running_loop().call_later(args.duration, stop.request, "duration")
    cfg = EngineConfig.from_profile(args.profile, args.block_size, cpu_blocks=args.cpu_blocks)
    shape = TraceShape.read(args.trace, args.limit, args.time_scale)
    tally.start_trace(shape, args)
    costs = index_costs(args.profile, cfg, shape) if args.costs == "engines" else {}
    tally.costs = (
        "the index prices these engines' own costs"
        if costs
        else "the index's default costs (a 70B model on 8 GPUs) until calibrated"
    )
    tally.reconcile_interval = RepairConfig().reconcile_interval  # what serve runs with here
    proc, address = _spawn_service(args, costs)
    pending: set[asyncio.Task[Any]] = set()
    fleet = None
    try:
        nats_url = await stop.run_or_stop(_service_up(proc))
        if nats_url is None:
            return
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
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
                live.update(
                    _render(list(listed.instances), stats, tally, rate, now - started, args.speed, now)
                )
            else:
                if tally.load and not load_said:
                    print(f"load: trace average {tally.load}; {tally.progress(now)}", flush=True)
                    load_said = True
                est, sim, _n = tally.ttft(now)
                offered, served, window = tally.rates(now)
                rates = "offered -/s served -/s"  # too early to say
                if window:
                    rates = f"offered {offered:.1f}/s served {served:.1f}/s"
                hit = tally.hit_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
                print(
                    f"[{now - started:5.0f} s wall] {tally.progress(now)}: "
                    f"routed {tally.routed} first tokens {tally.first_tokens} "
                    f"{rates} "
                    f"hit {hit:.1%} ttft est {est:.3f}s sim {sim:.3f}s (last {RECENT_S:.0f} s) "
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
    p.add_argument(
        "--costs",
        choices=("engines", "default"),
        default="engines",
        help="what the index's TTFT estimate prices: the simulated engines' own costs (kvindex serve "
        "--cost, derived from --profile), or its default, a 70B model on 8 GPUs, until calibration "
        "takes over (docs/scoring.md)",
    )
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
