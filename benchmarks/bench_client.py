"""What the router client (kvindex.client) costs over the bare gRPC stubs, against `kvindex serve`.

One ``kvindex serve`` process (plaintext, on a nats-server this script starts, empty index: the
model is unknown, so the server does no index work and the figures are transport + client). In each
round every way of calling Score is measured in turn, from this process; medians over the rounds:

1. sequential calls (one in flight): bare unary ``Score`` on a grpc.aio channel (the baseline), bare
   ``ScoreStream`` (write one, read one), ``AsyncKvIndexClient.score`` (stream + deadline + matching +
   decision), ``KvIndexClient.score`` (the same through its loop thread);
2. throughput with 8 outstanding calls: bare unary vs ``AsyncKvIndexClient.score``;
3. the fallback decision alone (prefix hash + rendezvous over 8 and 64 known instances), in process.

Run: ``.venv/bin/python benchmarks/bench_client.py`` (``--quick`` for a ~15 s run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench_grpc_security import REQUEST, Server
from bench_score import NatsProcess, code_version

from kvindex.client import AsyncKvIndexClient, KvIndexClient, RendezvousFallback, prefix_key
from kvindex.client.fallback import KnownInstance
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

TOKENS = list(REQUEST.token_ids)
MODEL = REQUEST.model


async def _sequential(call: Callable[[], Awaitable[Any]], n: int) -> dict[str, float]:
    for _ in range(100):
        await call()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await call()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return {"p50": samples[n // 2], "p99": samples[int(n * 0.99)]}


async def _rate(call: Callable[[], Awaitable[Any]], seconds: float) -> float:
    stop, counts = False, [0] * 8

    async def worker(i: int) -> None:
        while not stop:
            await call()
            counts[i] += 1

    tasks = [asyncio.create_task(worker(i)) for i in range(8)]
    await asyncio.sleep(0.3)
    n0, t0 = sum(counts), time.perf_counter()
    await asyncio.sleep(seconds)
    n1, t1 = sum(counts), time.perf_counter()
    stop = True
    await asyncio.gather(*tasks)
    return (n1 - n0) / (t1 - t0)


async def _round(address: str, n: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with AsyncKvIndexClient(address, timeout=5, refresh_interval=0) as client:
        stub = pb_grpc.KvIndexStub(client.channel)  # the same channel, bare

        async def unary() -> Any:
            return await stub.Score(REQUEST)

        stream = stub.ScoreStream()

        async def streamed() -> Any:
            await stream.write(REQUEST)
            return await stream.read()

        async def ours() -> Any:
            return await client.score(MODEL, token_ids=TOKENS)

        out["unary"] = await _sequential(unary, n)
        out["stream"] = await _sequential(streamed, n)
        out["async client"] = await _sequential(ours, n)
        stream.cancel()
        out["rate unary"] = await _rate(unary, seconds)
        out["rate async client"] = await _rate(ours, seconds)
    blocking = KvIndexClient(address, timeout=5, refresh_interval=0)
    try:
        for _ in range(100):
            blocking.score(MODEL, token_ids=TOKENS)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            blocking.score(MODEL, token_ids=TOKENS)
            samples.append((time.perf_counter_ns() - t0) / 1000)
        samples.sort()
        out["blocking client"] = {"p50": samples[n // 2], "p99": samples[int(n * 0.99)]}
    finally:
        blocking.close()
    return out


def fallback_cost(instances: int, n: int = 20_000) -> float:
    known = [KnownInstance(f"w{i}/0", f"10.0.{i // 250}.{i % 250}:8000", 0.0) for i in range(instances)]
    chooser = RendezvousFallback()
    t0 = time.perf_counter_ns()
    for i in range(n):
        chooser.choose(prefix_key(token_ids=TOKENS, block_size=16 + (i & 1)), known)
    return (time.perf_counter_ns() - t0) / n / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    calls, seconds, rounds = (300, 0.5, 2) if args.quick else (1000, 1.0, 5)
    started = time.monotonic()
    nats = NatsProcess()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-client-") as tmp:
        server = Server(nats.url, [], Path(tmp) / "serve.log")
        try:
            server.wait_ready(None, None)
            for _ in range(rounds):
                results.append(asyncio.run(_round(server.address, calls, seconds)))
        finally:
            server.stop()
            nats.stop()

    def med(name: str, key: str | None = None) -> float:
        return statistics.median(r[name][key] if key else r[name] for r in results)

    base = med("unary", "p50")
    print(
        f"{code_version()}; {rounds} rounds of {calls} sequential calls and {seconds:.1f} s at 8 "
        f"outstanding; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print("| Score via | p50 us (x bare unary) | p99 us |")
    print("|---|---|---|")
    for name in ("unary", "stream", "async client", "blocking client"):
        p50 = med(name, "p50")
        print(f"| {name} | {p50:.0f} ({p50 / base:.2f}x) | {med(name, 'p99'):.0f} |")
    rate_base, rate = med("rate unary"), med("rate async client")
    print(
        f"8 outstanding: bare unary {rate_base:,.0f} calls/s, async client {rate:,.0f} calls/s "
        f"({rate / rate_base:.2f}x)"
    )
    print(
        f"fallback decision: {fallback_cost(8):.1f} us (8 instances), "
        f"{fallback_cost(64):.1f} us (64 instances)"
    )
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
