"""Replicas that agree: a burst of requests sharing a few long prefixes, asked alternately of two
``kvindex serve`` processes, placed with and without routing sync, against one process alone.

Set-up: a nats-server and 8 simulated workers (real publishers, this process; heartbeats every 30 s
so that during a burst the replicas know the queues only from what they routed, as between two real
heartbeats); per burst shape and mode, fresh ``kvindex serve --nats`` processes:

- ``one``: one replica gets every request (the reference placement);
- ``two, no sync``: two replicas (``--no-routing-sync``), request i to replica i mod 2;
- ``two, sync``: the same with routing sync on (the default with ``--nats``).

Requests are ``Score`` with ``commit=true`` (the ttft policy), one every ``--gap-ms`` (0: back to
back, each sent when the previous answer came: the next request to the other replica may then
overtake the previous decision's message). A prefix's *copies* are the distinct instances its
requests were placed on. The propagation delay is read from the replicas' own histogram
(``kvindex_routing_sync_delay_seconds``: the decision's wall time on the sender -> applied on the
receiver; same host, same clock), p50/p99 interpolated within its buckets.

Run: ``.venv/bin/python benchmarks/bench_replicas.py`` (~1 min; ``--quick``: one shape, ~20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import nats
from bench_score import NatsProcess, code_version, stop_process

from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from workers_shim.publisher import Publisher

MODEL = "bench-replicas"
BS = 16
INSTANCES = 8
# (prefixes, requests per prefix, prefix blocks, suffix blocks): 4096-token prefixes, 1-2K suffixes.
SHAPES = [(3, 48, 256, 128), (2, 64, 256, 128), (4, 32, 256, 64)]
MODES = [("one", 1, False), ("two, no sync", 2, False), ("two, sync", 2, True)]


class Replica:
    def __init__(self, nats_url: str, name: str, sync: bool, log_dir: Path) -> None:
        self.name = name
        self.port, self.metrics = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = (log_dir / f"{name}.log").open("w")
        argv = [sys.executable, "-m", "kvindex.cli", "serve", "--nats", nats_url, "--grpc-host", "127.0.0.1"]
        argv += [
            "--grpc-port",
            str(self.port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics),
        ]
        argv += [
            "--log-format",
            "json",
            "--log-level",
            "warning",
            "--stale-after",
            "120",
            "--replica-id",
            name,
        ]
        argv += ["--routing-sync" if sync else "--no-routing-sync", "--reconcile-interval", "0"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def scrape(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("kvindex_") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.log.close()


def quantile(metrics: dict[str, float], q: float) -> float:
    """Quantile ``q`` of the delay histogram, linear within its bucket (seconds)."""
    prefix = "kvindex_routing_sync_delay_seconds_bucket{le="
    edges = sorted(
        (float("inf") if k[len(prefix) + 1 : -2] == "+Inf" else float(k[len(prefix) + 1 : -2]), v)
        for k, v in metrics.items()
        if k.startswith(prefix)
    )
    total = edges[-1][1] if edges else 0
    if not total:
        return float("nan")
    rank = q * total
    lo_edge, lo_count = 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            if edge == float("inf"):
                return lo_edge
            return lo_edge + (edge - lo_edge) * (rank - lo_count) / max(count - lo_count, 1e-9)
        lo_edge, lo_count = edge, count
    return lo_edge


def burst(shape: tuple[int, int, int, int], seed: int) -> list[tuple[int, list[int]]]:
    prefixes, per_prefix, prefix_blocks, suffix_blocks = shape
    rng = random.Random(seed)
    heads = [[rng.getrandbits(64) for _ in range(prefix_blocks)] for _ in range(prefixes)]
    return [
        (p, heads[p] + [rng.getrandbits(64) for _ in range(suffix_blocks)])
        for _ in range(per_prefix)
        for p in range(prefixes)
    ]


async def wait_ready(replicas: list[Replica], fleet: list[Publisher]) -> None:
    deadline = time.monotonic() + 60
    for r in replicas:
        async with grpc.aio.insecure_channel(r.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            while True:
                if r.proc.poll() is not None:
                    raise RuntimeError(f"{r.name} exited; see its log")
                try:
                    reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=1)
                    if len(reply.instances) == INSTANCES:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{r.name} did not see the fleet")
                for p in fleet:  # a replica learns of a worker from its heartbeat
                    await p.heartbeat()
                await asyncio.sleep(0.2)


async def run_mode(
    nats_url: str,
    fleet: list[Publisher],
    n: int,
    sync: bool,
    requests: list[tuple[int, list[int]]],
    gap: float,
    logs: Path,
) -> dict[str, Any]:
    replicas = [Replica(nats_url, f"replica-{i}", sync, logs) for i in range(n)]
    try:
        await wait_ready(replicas, fleet)
        channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
        stubs = [pb_grpc.KvIndexStub(c) for c in channels]
        placed: dict[int, set[str]] = {}
        latency = []
        loop = asyncio.get_running_loop()
        for i, (p, keys) in enumerate(requests):
            start = loop.time()
            reply = await stubs[i % n].Score(
                pb.ScoreRequest(model=MODEL, block_keys=keys, commit=True, request_id=f"q{i}")
            )
            latency.append(loop.time() - start)
            placed.setdefault(p, set()).add(reply.committed_instance_id)
            if gap:
                await asyncio.sleep(max(0.0, start + gap - loop.time()))
        await asyncio.sleep(0.5)  # the last messages arrive
        for c in channels:
            await c.close()
        metrics = [r.scrape() for r in replicas]
    finally:
        for r in replicas:
            r.stop()
    copies = [len(placed[p]) for p in sorted(placed)]
    out: dict[str, Any] = {"copies": copies, "score_ms": statistics.median(latency) * 1e3}
    if sync:
        # Both directions pooled: merge the two histograms.
        merged: dict[str, float] = {}
        for m in metrics:
            for k, v in m.items():
                if k.startswith("kvindex_routing_sync_delay_seconds_bucket"):
                    merged[k] = merged.get(k, 0.0) + v
        out["p50_ms"] = quantile(merged, 0.5) * 1e3
        out["p99_ms"] = quantile(merged, 0.99) * 1e3
        out["messages"] = sum(m.get("kvindex_routing_sync_messages_applied_total", 0) for m in metrics)
        out["applied"] = sum(m.get('kvindex_routing_sync_applied_total{op="commit"}', 0) for m in metrics)
        out["dropped"] = sum(
            v for m in metrics for k, v in m.items() if k.startswith("kvindex_routing_sync_dropped")
        )
    return out


def row(shape: tuple[int, int, int, int], gap: float, res: dict[str, dict[str, Any]]) -> str:
    def copies(name: str) -> str:
        c = res[name]["copies"]
        return f"{c} = {sum(c)}"

    s = res["two, sync"]
    delay = (
        f"{s['p50_ms']:.2f} / {s['p99_ms']:.2f} ms ({s['messages']:.0f} msgs, "
        f"{s['applied']:.0f} commits applied, {s['dropped']:.0f} dropped)"
    )
    score = " / ".join(f"{res[m]['score_ms']:.2f}" for m in ("one", "two, no sync", "two, sync"))
    return (
        f"| {shape[0]} x {shape[1]}, {shape[2] * BS} + {shape[3] * BS} | {gap * 1e3:g} ms | {copies('one')} "
        f"| {copies('two, no sync')} | {copies('two, sync')} | {delay} | {score} ms |"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one burst shape")
    ap.add_argument("--gaps-ms", default="0,5", help="pauses between requests to try (ms)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    natsd = NatsProcess()
    logs = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    fleet = []
    try:
        for i in range(INSTANCES):
            nc = await nats.connect(natsd.url)
            pub = Publisher(
                nc,
                worker=f"w{i}",
                model=MODEL,
                block_size=BS,
                capacity={"gpu": 100_000},
                heartbeat_interval=30.0,
            )
            pub._owns_nc = True
            await pub.start()
            fleet.append(pub)
        print(f"{code_version()}, {os.cpu_count()} cores, {INSTANCES} workers, policy ttft\n")
        print(
            "| burst: prefixes x requests, prefix + suffix tokens | gap | one replica | two, no sync "
            "| two, sync | sync delay p50 / p99 | Score median: one / no sync / sync |"
        )
        print("|---|---|---|---|---|---|---|")
        for shape in shapes:
            requests = burst(shape, args.seed)
            for gap in gaps:
                res = {
                    name: await run_mode(natsd.url, fleet, n, sync, requests, gap, logs)
                    for name, n, sync in MODES
                }
                print(row(shape, gap, res), flush=True)
    finally:
        for pub in fleet:
            await pub.close()
        natsd.stop()


if __name__ == "__main__":
    asyncio.run(main())
