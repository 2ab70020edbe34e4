"""The routing proxy's cost on chat requests: ``kvindex route`` as its own process against the same
proxy inside the index (``kvindex serve --route-port``), in the same run.

Two fake OpenAI engines (this process) announce their endpoints in heartbeats on an embedded NATS
server; ``kvindex serve`` (with the test suite's Llama-3-style fixture tokenizer, 4,096 tokens of
vocabulary) runs as a subprocess, and in the ``process`` arm ``kvindex route`` as another. Each
request is a streaming ``/v1/chat/completions`` with a new 1,600-token document: what a cold prompt
costs the router (tokenizing it whole, Score with commit, both releases with the engine's report).

Reported per arm, rounds alternating between the arms: the client's time to the first SSE chunk
(p50, p90) and to it on the first request after a start; the CPU per request of each process (from
/proc, less its idle rate measured before); and the proxy's stages (``kvindex_route_stage_seconds``).
The engines answer at once, so everything measured is the router's. Run from the repo root:
``.venv/bin/python benchmarks/bench_route_chat.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvindex.service.natsd import EmbeddedNats  # noqa: E402
from kvtools.testing.tokenizer_fixtures import corpus, make_tokenizer_dir  # noqa: E402
from tests.integration.fake_openai import FakeOpenAIEngine  # noqa: E402
from workers_shim.publisher import Publisher  # noqa: E402

MODEL = "bench-chat"
BLOCK = 32
BIN = Path(sys.executable).parent
TICK = os.sysconf("SC_CLK_TCK")
STAGES = ("before_forward", "upstream_first_byte", "first_write")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICK


class Words:
    """Documents of about ``n`` tokens of the fixture tokenizer (its training word salad)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.words = sorted({w for line in corpus(600) for w in line.split()})
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        sample = " ".join(random.Random(0).choices(self.words, k=4000))
        self.per_word = len(tok.encode(sample).ids) / 4000

    def __call__(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choices(self.words, k=round(n / self.per_word)))


class Arm:
    """One way of running the proxy: its processes, its port, what it measured."""

    def __init__(self, name: str, nats_url: str, tokenizer_dir: Path) -> None:
        self.name = name
        self.port = _free_port()
        grpc_port = _free_port()
        serve = [
            str(BIN / "kvindex"), "serve", "--nats", nats_url, "--grpc-host", "127.0.0.1",
            "--grpc-port", str(grpc_port), "--metrics-port", "-1", "--no-routing-sync",
            "--tokenizer", f"{MODEL}={tokenizer_dir}", "--log-level", "warning",
        ]  # fmt: skip
        if name == "in-process":
            serve += ["--route-host", "127.0.0.1", "--route-port", str(self.port)]
        self.procs = {"serve": subprocess.Popen(serve, stderr=subprocess.DEVNULL)}
        if name == "process":
            self.procs["route"] = subprocess.Popen(
                [str(BIN / "kvindex"), "route", "--index", f"127.0.0.1:{grpc_port}", "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "warning"],
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.first: list[float] = []
        self.firsts: list[float] = []
        self.cpu: dict[str, float] = dict.fromkeys(self.procs, 0.0)
        self.idle: dict[str, float] = {}

    def cpu_now(self) -> dict[str, float]:
        return {k: _cpu_ms(p.pid) for k, p in self.procs.items()}

    async def ready(self, http: aiohttp.ClientSession, instances: int) -> None:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(self.url + "/health") as resp:
                    if resp.status == 200 and (await resp.json()).get("instances_known") == instances:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name}: the proxy never knew the engines")

    async def stages(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "kvindex_route_stage_seconds":
                for s in family.samples:
                    target = (
                        sums if s.name.endswith("_sum") else counts if s.name.endswith("_count") else None
                    )
                    if target is not None:
                        target[s.labels["stage"]] = s.value
        return {k: sums[k] / counts[k] * 1000 for k in sums if counts.get(k)}

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.wait(30)


async def one(http: aiohttp.ClientSession, url: str, document: str) -> float:
    body = {"model": MODEL, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": document + "\nWhat is it about?"}]}  # fmt: skip
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        await resp.content.readuntil(b"\n\n")
        first = time.perf_counter() - started
        await resp.read()
    return first


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-route-chat-"))
    tokenizer_dir = make_tokenizer_dir(tmp / "tok", "llama3", vocab_size=4096)
    words = Words(tokenizer_dir)
    rng = random.Random(args.seed)
    natsd = EmbeddedNats()
    await natsd.start()
    engines = [await FakeOpenAIEngine(f"e{i}", MODEL, tokens=4).start() for i in range(2)]
    nc = await nats.connect(natsd.url)
    pubs = []
    for i, e in enumerate(engines):
        pub = Publisher(
            nc, worker=f"e{i}", model=MODEL, block_size=BLOCK, capacity={"gpu": 4000}, endpoint=e.endpoint
        )
        await pub.start()
        pubs.append(pub)
    arms = [Arm(name, natsd.url, tokenizer_dir) for name in ("process", "in-process")]
    began = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as http:
            for arm in arms:
                await arm.ready(http, len(engines))
            await asyncio.sleep(1.0)
            for arm in arms:  # idle CPU rate of each process, before any request
                arm.idle = arm.cpu_now()
            await asyncio.sleep(3.0)
            for arm in arms:
                arm.idle = {k: (v - arm.idle[k]) / 3.0 for k, v in arm.cpu_now().items()}
            for arm in arms:  # the first request after a start, then a warm-up
                arm.first.append(await one(http, arm.url, words(rng, args.tokens)))
                for _ in range(10):
                    await one(http, arm.url, words(rng, args.tokens))
            for _ in range(args.rounds):  # alternating, so that both see the same machine
                for arm in arms:
                    cpu0, t0 = arm.cpu_now(), time.perf_counter()
                    for _ in range(args.per_round):
                        arm.firsts.append(await one(http, arm.url, words(rng, args.tokens)))
                    await asyncio.sleep(0.05)  # the releases after the last answer
                    wall = time.perf_counter() - t0
                    for k, v in arm.cpu_now().items():
                        arm.cpu[k] += v - cpu0[k] - arm.idle[k] * wall
            stages = {arm.name: await arm.stages(http) for arm in arms}
    finally:
        for arm in arms:
            arm.stop()
        for pub in pubs:
            await pub.close()
        await nc.close()
        for e in engines:
            await e.close()
        await natsd.stop()
    took = time.perf_counter() - began
    n = args.rounds * args.per_round
    print(
        f"Command: .venv/bin/python benchmarks/bench_route_chat.py --rounds {args.rounds} "
        f"--per-round {args.per_round} (took {took:.0f} s)"
    )
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(
        f"{n} streaming chat requests per arm, each a new {args.tokens}-token document, engines answering "
        "at once; arms alternating"
    )
    print()
    print(
        "| proxy | first chunk p50 (ms) | p90 (ms) | first request after start (ms) | CPU per request (ms) "
        "| before_forward / upstream_first_byte / first_write (ms) |"
    )
    print("|---|---|---|---|---|---|")
    base = statistics.median(arms[0].firsts)
    for arm in arms:
        xs = sorted(arm.firsts)
        cpu = " + ".join(f"{k} {v / n:.2f}" for k, v in arm.cpu.items())
        total = sum(arm.cpu.values()) / n
        st = stages[arm.name]
        print(
            f"| {arm.name} | {statistics.median(xs) * 1000:.2f} ({statistics.median(xs) / base:.2f}x) | "
            f"{xs[int(0.9 * len(xs))] * 1000:.2f} | {arm.first[0] * 1000:.1f} | "
            f"{total:.2f} ({cpu}) | "
            + " / ".join(
                f"{st.get(k, 0.0):.2f}" for k in ("before_forward", "upstream_first_byte", "first_write")
            )
            + " |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--tokens", type=int, default=1600)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
