"""What ``kvindex route`` adds to time to first token: the same streaming requests sent to a fake
OpenAI engine directly and through the proxy, alternating, in the same run.

The index (embedded NATS, gRPC) and the fake engine run in this process, ``kvindex route`` in its
own, as deployed; the engine announces its endpoint in heartbeats. Through the proxy a request pays
the proxy's HTTP hop both ways, a Score with commit on the index and the releases (in the
background). Run from the repo root: ``.venv/bin/python benchmarks/bench_route.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import nats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvindex.keys import block_keys  # noqa: E402
from kvindex.service.app import IndexService, ServiceConfig  # noqa: E402
from kvindex.service.natsd import EmbeddedNats  # noqa: E402
from tests.integration.fake_openai import FakeOpenAIEngine  # noqa: E402
from workers_shim.publisher import Publisher  # noqa: E402

MODEL = "bench-model"
BS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds to the first SSE chunk and to the end of the stream."""
    started = time.perf_counter()
    async with http.post(url, json={"model": MODEL, "prompt": prompt, "stream": True}) as resp:
        assert resp.status == 200, resp.status
        await resp.content.readuntil(b"\n\n")
        first = time.perf_counter() - started
        await resp.read()
    return first, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000


async def main(requests: int) -> None:
    nats_server = EmbeddedNats()
    await nats_server.start()
    svc = IndexService(ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0))
    await svc.start()
    engine = await FakeOpenAIEngine("e1", MODEL, tokens=4).start()
    nc = await nats.connect(nats_server.url)
    pub = Publisher(
        nc, worker="e1", model=MODEL, block_size=BS, capacity={"gpu": 100000}, endpoint=engine.endpoint
    )
    await pub.start()
    prompts = [[i] * BS + list(range(1000, 1000 + 63 * BS)) for i in range(requests)]  # 1 K tokens
    pub.stored(block_keys(prompts[0][BS:], BS, MODEL))
    await pub.flush()
    port = _free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "kvindex.cli", "route", "--index", svc.grpc.address, "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ}, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    direct_url = f"http://{engine.endpoint}/v1/completions"
    proxied_url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):  # until the proxy listens and the index knows the engine
                try:
                    await _one(http, proxied_url, prompts[0])
                    break
                except (aiohttp.ClientConnectorError, AssertionError):
                    await asyncio.sleep(0.1)
            for p in prompts[:20]:  # warm both paths
                await _one(http, direct_url, p)
                await _one(http, proxied_url, p)
            direct: list[tuple[float, float]] = []
            proxied: list[tuple[float, float]] = []
            began = time.perf_counter()
            for p in prompts:  # alternating: both see the same machine load
                direct.append(await _one(http, direct_url, p))
                proxied.append(await _one(http, proxied_url, p))
            took = time.perf_counter() - began
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                metrics = await resp.text()
    finally:
        proxy.terminate()
        proxy.wait(15)
        await pub.close()
        await nc.close()
        await engine.close()
        await svc.stop()
        await nats_server.stop()
    fallbacks = [ln for ln in metrics.splitlines() if ln.startswith("kvindex_route_fallbacks_total")]
    print(f"Command: .venv/bin/python benchmarks/bench_route.py --requests {requests} (took {took:.0f} s)")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{requests} streaming /v1/completions (1 K-token prompts, 4 tokens out), sequential, alternating")
    print("| path | first chunk p50 ms | p90 ms | whole stream p50 ms | p90 ms |")
    print("|---|---|---|---|---|")
    for name, rows in (("direct to the engine", direct), ("through kvindex route", proxied)):
        firsts = [r[0] for r in rows]
        totals = [r[1] for r in rows]
        print(
            f"| {name} | {_pct(firsts, 0.5):.2f} | {_pct(firsts, 0.9):.2f} | "
            f"{_pct(totals, 0.5):.2f} | {_pct(totals, 0.9):.2f} |"
        )
    added = [p[0] - d[0] for d, p in zip(direct, proxied, strict=True)]
    print(f"added to the first chunk, per pair: median {statistics.median(added) * 1000:.2f} ms")
    print("fallbacks during the run:", fallbacks or "none")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    asyncio.run(main(parser.parse_args().requests))
