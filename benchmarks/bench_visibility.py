"""Event visibility: time from a NATS publish until a gRPC Lookup sees the block, under ingest load.

Claim under test: "an event published on NATS is visible to Score within 10 ms (p99) at 50K events/s".

Processes (all on this machine's cores, which they share):
- nats-server and ``kvindex serve`` (separate process, as deployed),
- a load generator (this script with ``--role load``): several publishers emitting ``stored`` events
  at a paced total rate, either through the real publisher library (``--mode lib``: its bookkeeping,
  5 ms linger batching and msgpack encoding) or as pre-batched raw NATS publishes of
  ``encode_batch`` payloads (``--mode raw``: the cheapest possible producer),
- this process: a probe worker (real Publisher) that stores one fresh block every ~20 ms, flushes it
  at once (time zero = the hand-off to nats-py) and polls Lookup(block_keys=[key]) over gRPC until the
  block is reported, so the figure includes NATS delivery, the service's queue behind the load, decode,
  apply and the gRPC round trip that observes it.

Reported per phase (a low-rate baseline, then the target rate): visibility p50/p90/p99/max (the
reply-received time of the first poll that saw the block, i.e. an upper bound; the poll round trip
is the resolution), the achieved publish rate and the rate the service applied during the window
(from Stats), and every process's CPU use.

Run: ``.venv/bin/python benchmarks/bench_visibility.py`` (``--quick`` for a < 60 s smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import nats
import numpy as np
from bench_score import CpuMeter, NatsProcess, ServerProcess, code_version, fmt_shares, own_cpu_seconds

from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.codec import encode_batch, encode_heartbeat
from workers_shim.publisher import Publisher

try:  # the snapshot protocol of a self-healing index (absent from early kvindex versions)
    from kvindex.wire import reconcile
except ImportError:
    reconcile = None  # type: ignore[assignment]

MODEL = "bench-model"
BLOCK_SIZE = 16


# -- load generator (child process) ------------------------------------------------------------


class KeySource:
    """Random 63-bit block keys, drawn in large numpy chunks (keeps key generation off the profile)."""

    def __init__(self, seed: int, chunk: int = 1 << 18) -> None:
        self.rng = np.random.default_rng(seed)
        self.chunk = chunk
        self.buf: list[int] = []
        self.pos = 0

    def take(self, n: int) -> list[int]:
        if self.pos + n > len(self.buf):
            self.buf = (
                self.buf[self.pos :]
                + self.rng.integers(1, 2**63, size=max(n, self.chunk), dtype=np.uint64).tolist()
            )
            self.pos = 0
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


class RawPublisher:
    """Raw mode: one sequenced ``encode_batch`` per flush, without the library's per-block set.

    It still keeps the protocol a worker owes the index, at list-append cost: heartbeats every 0.5 s
    with the [count, xor] digest of what it published, and (where kvindex has the reconcile
    protocol) snapshot answers, so that a self-healing index neither marks it stale nor holds its
    batches waiting for a snapshot that never comes.
    """

    def __init__(self, nc: Any, worker: str, epoch: int) -> None:
        self.nc = nc
        self.worker = worker
        self.epoch = epoch
        self.seq = 0
        self.pending: list[dict[str, Any]] = []
        self.subject = f"kvindex.events.{worker}"
        self.keys: list[int] = []  # everything published (keys are unique), for snapshots
        self.xor = 0
        self._tasks: list[asyncio.Task[None]] = []

    def stored(self, keys: list[int]) -> None:
        self.pending.append({"type": "stored", "tier": "gpu", "keys": keys, "parent": None})

    def heartbeat(self) -> bytes:
        return encode_heartbeat(
            worker=self.worker,
            model=MODEL,
            epoch=self.epoch,
            seq=self.seq,
            ts=time.time(),
            block_size=BLOCK_SIZE,
            load={},
            capacity={},
            digest={"gpu": (len(self.keys), self.xor)} if self.keys else {},
        )

    async def start(self) -> None:
        if reconcile is not None:
            await self.nc.subscribe(f"kvindex.snapshot.{self.worker}", cb=self._on_snapshot)
        await self.nc.publish(f"kvindex.status.{self.worker}", self.heartbeat())
        self._tasks.append(asyncio.create_task(self._heartbeats()))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.flush()  # a heartbeat's seq and digest cover everything sent before it
            await self.nc.publish(f"kvindex.status.{self.worker}", self.heartbeat())

    async def _on_snapshot(self, msg: Any) -> None:
        assert reconcile is not None
        if not msg.reply:
            return
        await self.flush()
        tiers = {"gpu": list(self.keys)} if self.keys else {}
        for part in reconcile.snapshot_parts(
            self.worker, 0, self.epoch, self.seq, tiers, self.nc.max_payload
        ):
            await self.nc.publish(msg.reply, part)

    async def flush(self) -> None:
        if not self.pending:
            return
        self.seq += 1
        data = encode_batch(
            worker=self.worker,
            model=MODEL,
            epoch=self.epoch,
            seq=self.seq,
            ts=time.time(),
            block_size=BLOCK_SIZE,
            events=self.pending,
        )
        x = self.xor
        for ev in self.pending:
            self.keys.extend(ev["keys"])
            for k in ev["keys"]:
                x ^= k
        self.xor = x
        self.pending = []
        await self.nc.publish(self.subject, data)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.flush()
        await self.nc.publish(f"kvindex.status.{self.worker}", self.heartbeat())


async def load_main(args: argparse.Namespace) -> None:
    """Publish ``rate`` stored events/s for ``duration`` s, then print a JSON summary on stdout."""
    n = args.publishers
    conns = [await nats.connect(args.nats, pending_size=8 * 1024 * 1024) for _ in range(n)]
    epoch = time.time_ns() // 1000
    pubs: list[Any]
    if args.mode == "lib":
        pubs = [
            Publisher(c, worker=f"load-{args.tag}-{i}", model=MODEL, block_size=BLOCK_SIZE, epoch=epoch)
            for i, c in enumerate(conns)
        ]
        for p in pubs:
            await p.start()  # flush loop (5 ms linger) + 0.5 s heartbeats, as in a worker
    else:
        pubs = [RawPublisher(c, f"load-{args.tag}-{i}", epoch) for i, c in enumerate(conns)]
        for p in pubs:
            await p.start()
    keys = KeySource(args.seed)
    k = args.keys_per_event
    print("ready", flush=True)

    # Pace against the wall clock: each tick publishes what is due, so a slow tick is caught up by
    # the next one (a producer that cannot keep up shows as achieved < target, not as a silent drop).
    tick = 0.002 if args.mode == "lib" else 0.005  # raw: one batch per publisher per 5 ms, like lib
    sent = 0
    max_backlog = 0
    cpu0 = own_cpu_seconds()
    t0 = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= args.duration:
            break
        due = int(args.rate * elapsed) - sent
        if due > 0:
            max_backlog = max(max_backlog, due)
            flat = keys.take(due * k)
            for j in range(due):
                pubs[(sent + j) % n].stored(flat[j * k : (j + 1) * k])
            sent += due
            if args.mode == "raw":
                for p in pubs:
                    await p.flush()
        await asyncio.sleep(tick)
    elapsed = time.perf_counter() - t0
    cpu = own_cpu_seconds() - cpu0
    for p in pubs:
        await p.close()
    for c in conns:
        await c.drain()
    print(
        json.dumps(
            {
                "sent": sent,
                "seconds": elapsed,
                "rate": sent / elapsed,
                "max_backlog_events": max_backlog,
                "batches": sum(p.seq for p in pubs),
                "cpu_util": cpu / elapsed,
            }
        ),
        flush=True,
    )


# -- probe (this process) ----------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    target_rate: float
    mode: str
    vis_ms: list[float] = field(default_factory=list)  # upper bound per probe
    lower_ms: list[float] = field(default_factory=list)  # send time of the previous (failed) poll
    polls: list[int] = field(default_factory=list)
    poll_rtt_ms: list[float] = field(default_factory=list)
    warm_rtt_ms: list[float] = field(default_factory=list)  # the Lookup just before each publish
    at_s: list[float] = field(default_factory=list)  # probe publish time within the window
    lost: int = 0
    window_s: float = 0.0
    applied_rate: float = 0.0  # events/s the service applied in the window (new entries / keys per event)
    load: dict[str, Any] = field(default_factory=dict)
    drain_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # process -> fraction of one core
    index_entries: int = 0
    snapshots: int | None = None  # snapshots the index applied in the window (self-healing versions)

    def pct(self, values: list[float], q: float) -> float:
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")

    def summary(self) -> dict[str, Any]:
        v = self.vis_ms
        return {
            "phase": self.name,
            "mode": self.mode,
            "target_events_per_s": self.target_rate,
            "published_events_per_s": self.load.get("rate"),
            "applied_events_per_s": self.applied_rate,
            "probes": len(v),
            "lost": self.lost,
            "vis_p50_ms": self.pct(v, 0.5),
            "vis_p90_ms": self.pct(v, 0.9),
            "vis_p99_ms": self.pct(v, 0.99),
            "vis_max_ms": max(v) if v else float("nan"),
            "lower_p50_ms": self.pct(self.lower_ms, 0.5),
            "lower_p99_ms": self.pct(self.lower_ms, 0.99),
            "poll_rtt_p50_ms": self.pct(self.poll_rtt_ms, 0.5),
            "poll_rtt_p99_ms": self.pct(self.poll_rtt_ms, 0.99),
            "prepublish_rtt_p50_ms": self.pct(self.warm_rtt_ms, 0.5),
            "worst": sorted(zip(self.vis_ms, self.at_s, strict=True), reverse=True)[:5],
            "polls_per_probe_mean": statistics.fmean(self.polls) if self.polls else float("nan"),
            "drain_s": self.drain_s,
            "cpu_cores": self.cpu,
            "index_entries": self.index_entries,
            "snapshots_applied": self.snapshots,
        }


async def stats(stub: Any) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest(), timeout=10)


def entries(s: pb.StatsResponse) -> int:
    # Counted in (block, instance) entries, not events: a self-healing index may apply some blocks
    # through a snapshot instead of their event, and every key here is unique.
    return s.entries.gpu + s.entries.cpu + s.entries.disk + s.entries.shared


async def run_phase(
    args: argparse.Namespace,
    natsd: NatsProcess,
    server: ServerProcess,
    name: str,
    rate: float,
    measure_s: float,
) -> PhaseResult:
    res = PhaseResult(name, rate, args.mode)
    warmup = 2.0
    async with grpc.aio.insecure_channel(server.address) as channel:
        before = entries(await stats(pb_grpc.KvIndexStub(channel)))
    load = await asyncio.create_subprocess_exec(
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        "load",
        "--nats",
        natsd.url,
        "--rate",
        str(rate),
        "--publishers",
        str(args.publishers),
        "--duration",
        str(warmup + measure_s + 0.5),
        "--mode",
        args.mode,
        "--keys-per-event",
        str(args.keys_per_event),
        "--tag",
        name,
        "--seed",
        str(hash(name) & 0xFFFF),
        stdout=asyncio.subprocess.PIPE,
    )
    assert load.stdout is not None
    line = await asyncio.wait_for(load.stdout.readline(), 30)
    if line.strip() != b"ready":
        raise RuntimeError(f"load generator failed to start: {line!r}")

    probe = await Publisher.connect(natsd.url, worker=f"probe-{name}", model=MODEL, block_size=BLOCK_SIZE)
    rng = random.Random(7)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        await asyncio.sleep(warmup)
        meter = CpuMeter(
            {"server": server.pid, "nats-server": natsd.proc.pid, "load": load.pid, "probe": os.getpid()}
        )
        m0 = meter.snap()
        # The probe's own collector pauses are not the service's latency: no GC in this process
        # during the window (it allocates little; collected right after).
        gc.collect()
        gc.disable()
        s0, t0 = await stats(stub), time.perf_counter()
        perf = time.perf_counter
        while perf() - t0 < measure_s:
            key = rng.getrandbits(63) | 1
            req = pb.LookupRequest(model=MODEL, block_keys=[key], candidates=[probe.worker])
            # One Lookup right before publishing: the polling client is already in its tight loop
            # when the event goes out (after an idle gap the first RPC pays ~1 ms of thread and vCPU
            # wake-ups on this VM, which would swamp the figure); its RTT is the resolution.
            t_send = perf()
            reply = await stub.Lookup(req, timeout=10)
            res.warm_rtt_ms.append((perf() - t_send) * 1e3)
            assert not reply.matches or not reply.matches[0].matched_blocks
            probe.stored([key])
            t_pub = perf()
            await probe.flush()  # hand the batch to nats-py now: no linger for the probe
            prev_send, polls = t_pub, 0
            while True:
                t_send = perf()
                reply = await stub.Lookup(req, timeout=10)
                t_recv = perf()
                polls += 1
                res.poll_rtt_ms.append((t_recv - t_send) * 1e3)
                if reply.matches and reply.matches[0].matched_blocks:
                    res.vis_ms.append((t_recv - t_pub) * 1e3)
                    res.at_s.append(t_pub - t0)
                    res.lower_ms.append((prev_send - t_pub) * 1e3)
                    res.polls.append(polls)
                    break
                if t_recv - t_pub > 5.0:
                    res.lost += 1
                    break
                prev_send = t_send
            # Jittered gap so probes do not phase-lock with the publishers' 5 ms flush cycle.
            await asyncio.sleep(rng.uniform(0.01, 0.03))
        s1, t1 = await stats(stub), time.perf_counter()
        gc.enable()
        res.cpu = CpuMeter.shares(m0, meter.snap())
        res.window_s = t1 - t0
        res.applied_rate = (entries(s1) - entries(s0)) / args.keys_per_event / res.window_s
        if hasattr(s1, "snapshots_applied"):
            # Periodic reconciliation: each snapshot is applied on the service's one event loop.
            res.snapshots = s1.snapshots_applied - s0.snapshots_applied

        out, _ = await asyncio.wait_for(load.communicate(), 60)
        res.load = json.loads(out.decode().strip().splitlines()[-1])
        await probe.close()
        # Everything published must be applied: how long after the load stopped did the queue drain?
        t_end = time.perf_counter()
        want = before + res.load["sent"] * args.keys_per_event + len(res.vis_ms) + res.lost
        while True:
            s = await stats(stub)
            if entries(s) >= want or time.perf_counter() - t_end > 60:
                break
            await asyncio.sleep(0.02)
        res.drain_s = time.perf_counter() - t_end
        res.index_entries = entries(s)
        if entries(s) < want:
            print(f"  WARNING: {want - entries(s)} blocks not in the index 60 s after the load stopped")
    return res


def print_phase(r: PhaseResult) -> None:
    s = r.summary()
    cpu = fmt_shares(r.cpu)
    print(
        f"  {r.name:5s} target {r.target_rate:>7,.0f} ev/s ({r.mode}): published "
        f"{s['published_events_per_s']:>8,.0f} ev/s, applied {s['applied_events_per_s']:>8,.0f} ev/s "
        f"in the window, max producer backlog {r.load['max_backlog_events']} events"
    )
    print(
        f"        visibility (upper bound) p50 {s['vis_p50_ms']:.2f} ms  p90 {s['vis_p90_ms']:.2f} ms  "
        f"p99 {s['vis_p99_ms']:.2f} ms  max {s['vis_max_ms']:.2f} ms  over {s['probes']} probes "
        f"({r.lost} lost)"
    )
    print(
        f"        lower bound p50 {s['lower_p50_ms']:.2f} ms  p99 {s['lower_p99_ms']:.2f} ms; Lookup poll "
        f"RTT p50 {s['poll_rtt_p50_ms']:.2f} ms p99 {s['poll_rtt_p99_ms']:.2f} ms (pre-publish "
        f"{s['prepublish_rtt_p50_ms']:.2f} ms), {s['polls_per_probe_mean']:.1f} polls/probe"
    )
    worst = ", ".join(f"{v:.1f} ms @{t:.1f}s" for v, t in s["worst"])
    print(
        f"        worst probes: {worst}; drained {r.drain_s:.2f} s after the load stopped; "
        f"index {r.index_entries:,} entries"
    )
    snaps = "" if r.snapshots is None else f"; snapshots applied by the index in the window: {r.snapshots}"
    print(f"        CPU (share of one core) during the window: {cpu}{snaps}")


async def main_async(args: argparse.Namespace) -> list[PhaseResult]:
    natsd = NatsProcess()
    server = ServerProcess(natsd.url)
    results = []
    try:
        await asyncio.to_thread(server.wait_ready)
        print(f"server pid {server.pid} on {server.address}, nats {natsd.url}")
        # Long enough at the target rate for ~2,500 probes (a p99 from ~25 tail samples) and for the
        # index to grow past 3 M entries, i.e. through the table resizes a growing index goes through.
        measure = args.seconds or (6.0 if args.quick else 60.0)
        low_measure = max(4.0, measure / 3)
        for name, rate, secs in (("low", args.low_rate, low_measure), ("high", args.rate, measure)):
            r = await run_phase(args, natsd, server, name, rate, secs)
            print_phase(r)
            results.append(r)
    finally:
        server.stop()
        natsd.stop()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (< 60 s)")
    ap.add_argument("--rate", type=float, default=50_000, help="target stored events/s (all publishers)")
    ap.add_argument("--low-rate", type=float, default=1_000, help="baseline phase events/s")
    ap.add_argument("--publishers", type=int, default=8)
    ap.add_argument("--keys-per-event", type=int, default=1, help="blocks per stored event")
    ap.add_argument("--mode", choices=("lib", "raw"), default="lib", help="publisher library or raw")
    ap.add_argument("--seconds", type=float, default=None, help="measurement window of the high phase")
    ap.add_argument("--json", default=None, help="also write the results here")
    # Internal: the load generator child.
    ap.add_argument("--role", choices=("bench", "load"), default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--nats", default="", help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="x", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "load":
        asyncio.run(load_main(args))
        return 0

    from kvindex.observability.logs import configure_logging

    configure_logging("console", "warning")
    started = time.perf_counter()
    print(
        f"kvindex event visibility: stored events ({args.keys_per_event} block(s) each) from "
        f"{args.publishers} publishers ({args.mode} mode) in a separate process; probe publishes one "
        "block and polls gRPC Lookup until it is visible."
    )
    print(
        f"machine: {os.cpu_count()} cores SHARED by nats-server, the kvindex server, the load generator "
        "and this probe process; the CPU line per phase shows who used what. Load average before "
        f"start: {os.getloadavg()[0]:.2f} (anything else running skews the figures)."
    )
    print(f"code: {code_version()}")
    results = asyncio.run(main_async(args))
    high = results[-1].summary()
    print(
        f"\ntarget: visible within 10 ms (p99) at 50K events/s; this run's high phase: "
        f"{args.rate:,.0f} ev/s, {args.keys_per_event} block(s)/event, {args.mode} producer"
    )
    met_rate = (high["applied_events_per_s"] or 0) >= 0.95 * args.rate
    met_p99 = high["vis_p99_ms"] <= 10.0
    print(
        f"  applied {high['applied_events_per_s']:,.0f} ev/s ({'MET' if met_rate else 'MISSED'} rate), "
        f"p99 visibility {high['vis_p99_ms']:.2f} ms ({'MET' if met_p99 else 'MISSED'} latency); "
        f"Lookup RTT alone p99 {high['poll_rtt_p99_ms']:.2f} ms (the measuring call's own tail)"
    )
    print(f"\ndone in {time.perf_counter() - started:.0f} s (load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.summary() | {"load": r.load} for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
