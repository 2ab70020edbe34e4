"""`make soak`: hundreds of randomized fault schedules, then a sustained-load run.

    python -m kvtools.testing.soak                        # 300 schedules + 60 s at 50 K events/s
    python -m kvtools.testing.soak --schedules 0 --load-seconds 600 --rate 80000

The sustained-load run starts a nats-server, a `kvindex serve` process and load-generator processes
(each runs several publishers with the real publisher library), calls `Score` concurrently over gRPC,
and every few seconds reports: events published vs applied, lag (worker seal -> applied), Score
latency, service memory, gaps. With no faults injected every gap is a false gap, so it must stay 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

import structlog

from kvtools.testing.chaos import ChaosConfig, run_schedule, summarize

MODEL = "soak-model"
BLOCK_SIZE = 16


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


async def schedules(n: int, first_seed: int) -> bool:
    results = []
    started = time.monotonic()
    for seed in range(first_seed, first_seed + n):
        results.append(await run_schedule(seed, ChaosConfig()))
        if len(results) % 25 == 0:
            print(f"  {len(results)}/{n} schedules, {time.monotonic() - started:.0f} s", flush=True)
    print(summarize(results))
    return all(r.converged for r in results)


# -- load generator (child process) ---------------------------------------------------------------


async def load_role(url: str, rate: float, publishers: int, seconds: float, seed: int, tag: str) -> None:
    """Publishes ~``rate`` stored/removed events per second across ``publishers`` workers."""
    from workers_shim.publisher import Publisher

    rng = random.Random(seed)
    pubs = [
        await Publisher.connect(
            url, worker=f"{tag}-{i}", model=MODEL, block_size=BLOCK_SIZE, capacity={"gpu": 20_000}
        )
        for i in range(publishers)
    ]
    # Per worker, its blocks oldest first (a deque: evicting from a list's head would copy 20 K keys
    # per event and make the load generator, not the index, the bottleneck).
    held: list[deque[int]] = [deque() for _ in pubs]
    published = 0
    tick = 0.005
    per_tick = rate * tick / len(pubs)
    carry = 0.0
    start = time.monotonic()
    next_tick = start
    while time.monotonic() - start < seconds:
        carry += per_tick
        n = int(carry)
        carry -= n
        for i, pub in enumerate(pubs):
            chain = held[i]
            for _ in range(n):
                # Mostly stores of 4-block chains; evict the oldest once a worker holds 20 K blocks.
                if len(chain) > 20_000:
                    pub.removed([chain.popleft() for _ in range(4)])
                else:
                    keys = [rng.getrandbits(64) for _ in range(4)]
                    pub.stored(keys)
                    chain.extend(keys)
                published += 1
            pub.set_load(
                running=rng.randint(0, 8), waiting=rng.randint(0, 4), kv_usage=min(1.0, len(chain) / 20_000)
            )
        next_tick += tick
        await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
    seconds_run = time.monotonic() - start
    for pub in pubs:
        await pub.heartbeat()  # everything published, and a heartbeat that says up to which seq
    # What each worker holds now: the parent checks the index against it while the publishers stay
    # up (answering replays and snapshots) until it writes a line to our stdin.
    workers = {pub.worker: [pub.seq, len(pub.blocks["gpu"])] for pub in pubs}
    print(json.dumps({"published": published, "seconds": seconds_run, "workers": workers}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for pub in pubs:
        await pub.close()


# -- sustained load (parent) ----------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _lag_quantile(text: str, q: float) -> float:
    buckets = []
    for line in text.splitlines():
        if line.startswith("kvindex_event_lag_seconds_bucket"):
            edge = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if edge == "+Inf" else float(edge), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    total = buckets[-1][1]
    for edge, cum in buckets:
        if cum >= q * total:
            return edge
    return float("inf")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sustained(
    seconds: float,
    rate: float,
    processes: int,
    publishers: int,
    score_rate: float,
    service_log: str | None = None,
) -> bool:
    import grpc

    from kvindex.keys import block_keys
    from kvindex.service.natsd import EmbeddedNats, free_port
    from kvindex.v1 import kvindex_pb2 as pb
    from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
    from kvtools.testing.serve import serve_argv

    natsd = EmbeddedNats()
    await natsd.start()
    grpc_port, metrics_port = free_port(), free_port()
    service = subprocess.Popen(
        serve_argv(
            natsd.url,
            grpc_port,
            metrics_port,
            "--log-level",
            "info" if service_log else "warning",
            "--log-format",
            "json",
        ),
        stderr=open(service_log, "w") if service_log else subprocess.DEVNULL,  # noqa: SIM115
    )
    loaders: list[subprocess.Popen[str]] = []
    ok = True
    try:
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        for _ in range(100):
            try:
                urllib.request.urlopen(metrics_url, timeout=1).read()
                break
            except OSError:
                await asyncio.sleep(0.1)
        for p in range(processes):
            loaders.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvtools.testing.soak",
                        "--role",
                        "load",
                        "--nats",
                        natsd.url,
                        "--rate",
                        str(rate / processes),
                        "--publishers",
                        str(publishers),
                        "--load-seconds",
                        str(seconds),
                        "--seed",
                        str(p),
                        "--tag",
                        f"p{p}",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        prompt = list(range(8192))
        keys = block_keys(prompt, BLOCK_SIZE, MODEL)
        latencies: list[float] = []
        errors = 0
        print(
            f"{'t':>5} {'applied ev/s':>12} {'lag p50':>8} {'lag p99':>8} {'score p50':>9} {'score p99':>9} "
            f"{'rss MB':>7} {'gaps':>5} {'instances':>9}"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.KvIndexStub(channel)
            start = time.monotonic()
            last_report, last_events = start, 0.0
            window: list[float] = []
            while time.monotonic() - start < seconds + 2:
                t0 = time.perf_counter()
                try:
                    await stub.Score(pb.ScoreRequest(model=MODEL, block_keys=keys, top_k=4), timeout=5)
                    window.append(time.perf_counter() - t0)
                except grpc.aio.AioRpcError:
                    errors += 1
                await asyncio.sleep(max(0.0, 1 / score_rate - (time.perf_counter() - t0)))
                now = time.monotonic()
                if now - last_report >= 5:
                    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
                    events = _metric(text, "kvindex_events_applied_total")
                    window.sort()
                    p50 = window[len(window) // 2] * 1000 if window else float("nan")
                    p99 = window[int(len(window) * 0.99)] * 1000 if window else float("nan")
                    print(
                        f"{now - start:5.0f} {(events - last_events) / (now - last_report):12,.0f} "
                        f"{_lag_quantile(text, 0.5) * 1000:6.0f}ms {_lag_quantile(text, 0.99) * 1000:6.0f}ms "
                        f"{p50:7.2f}ms {p99:7.2f}ms {_rss_mb(service.pid):7.0f} "
                        f"{_metric(text, 'kvindex_gaps_total'):5.0f} "
                        f"{_metric(text, 'kvindex_instances'):9.0f}",
                        flush=True,
                    )
                    latencies += window
                    window = []
                    last_report, last_events = now, events
        loop = asyncio.get_running_loop()
        published, rate_reached = 0, 0.0
        expected: dict[str, list[int]] = {}
        for loader in loaders:
            assert loader.stdout is not None
            line = await asyncio.wait_for(loop.run_in_executor(None, loader.stdout.readline), 60)
            report = json.loads(line)
            published += report["published"]
            rate_reached += report["published"] / report["seconds"]
            expected.update(report["workers"])
        # The index must now agree with every worker (in sync at its last seq, with as many GPU blocks),
        # whichever way it got there: batches, replays or snapshots.
        t_end = time.monotonic()
        matched, behind = False, expected
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.KvIndexStub(channel)
            while time.monotonic() - t_end < 20:
                listing = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=5)
                held = {i.worker: [i.last_seq, i.blocks.gpu] for i in listing.instances if i.sync == "synced"}
                behind = {w: v for w, v in expected.items() if held.get(w) != v}
                if not behind:
                    matched = True
                    break
                await asyncio.sleep(0.05)
        converge = time.monotonic() - t_end
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        applied = _metric(text, "kvindex_events_applied_total")
        gaps = _metric(text, "kvindex_gaps_total")
        rejects = _metric(text, "kvindex_rejects_total")
        for loader in loaders:
            loader.communicate("done\n", timeout=30)
        latencies.sort()
        print(
            f"published {published:,} events in {seconds:.0f} s "
            f"({rate_reached:,.0f}/s of {rate:,.0f}/s asked); "
            f"applied as batches {applied:,.0f} (the rest arrived through snapshots); "
            f"false gaps {gaps:.0f}; rejects {rejects:.0f}; Score calls {len(latencies):,} "
            f"(p50 {latencies[len(latencies) // 2] * 1000:.2f} ms, errors {errors}); "
            f"service RSS {_rss_mb(service.pid):.0f} MB"
        )
        if matched:
            print(
                f"index equals all {len(expected)} workers' blocks "
                f"{converge * 1000:.0f} ms after the load stopped"
            )
        else:
            print(f"index differs from {len(behind)} of {len(expected)} workers 20 s after the load stopped")
        # A machine too small to generate the asked rate fails the run: the figure would mean nothing.
        ok = gaps == 0 and matched and errors == 0 and rejects == 0 and rate_reached >= 0.95 * rate
    finally:
        for loader in loaders:
            if loader.poll() is None:
                loader.kill()
        service.terminate()
        service.wait(timeout=10)
        await natsd.stop()
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtools.testing.soak", description=__doc__)
    parser.add_argument("--schedules", type=int, default=300)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--load-seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=50_000.0, help="events/s across all load processes")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--publishers", type=int, default=16, help="workers per load process")
    parser.add_argument("--score-rate", type=float, default=200.0, help="Score calls/s during the load")
    parser.add_argument("--service-log", help="write the service's JSON log (level info) to this file")
    parser.add_argument("--role", choices=("main", "load"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="p0", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _quiet()
    if args.role == "load":
        asyncio.run(load_role(args.nats, args.rate, args.publishers, args.load_seconds, args.seed, args.tag))
        return 0
    ok = True
    if args.schedules:
        print(f"== {args.schedules} randomized fault schedules")
        ok &= asyncio.run(schedules(args.schedules, args.first_seed))
    if args.load_seconds > 0:
        print(
            f"== sustained load: {args.rate:,.0f} events/s for {args.load_seconds:.0f} s, "
            f"{args.processes} x {args.publishers} publishers, {args.score_rate:.0f} Score/s"
        )
        ok &= asyncio.run(
            sustained(
                args.load_seconds,
                args.rate,
                args.processes,
                args.publishers,
                args.score_rate,
                args.service_log,
            )
        )
    print("SOAK PASSED" if ok else "SOAK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
