"""gRPC Score end to end: an 8K-token prompt (8192 token ids, 512 blocks of 16) over 64 instances.

The service runs as a separate process (``python -m kvindex.cli serve``) against a nats-server this
script starts; 64 workers (their own process, heartbeating as workers do) populate it through the
real publisher library (workers_shim.publisher), each holding a prefix of the prompt of a different
length (8 to all 512 blocks, so the match walks the whole chain) plus unrelated background blocks.
Then, from this process, with a real gRPC client:

1. latency of sequential Score calls (token_ids and block_keys),
2. throughput with several outstanding calls (grpc.aio),
3. the standard gRPC health Check on the same server as a baseline for what the transport alone
   costs on this machine (Score figures are also printed as a ratio to it),
4. server CPU time per call (from /proc), which is what "calls/s per server process" needs when
   the client and the server share the same 2 cores,
5. an in-process breakdown of where a Score call's server-side time goes (same data, no gRPC).

Every measurement also reports the CPU share of each process, of everything else on the machine
("others") and stolen by the hypervisor ("steal"): on a shared 2-core VM a figure means little
without them.

Run: ``.venv/bin/python benchmarks/bench_score.py`` (``--quick`` for a < 60 s smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import nats
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvindex.api.servicer import KvIndexServicer
from kvindex.index.hybrid import MAMBA, SLIDING, GroupLayout, GroupSpec
from kvindex.keys import block_keys, keys_from_le_bytes, model_seed
from kvindex.observability.logs import configure_logging
from kvindex.scoring.base import PREFILL_ROLE, RouteRequest
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import free_port, nats_server_binary
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from workers_shim.publisher import Publisher

MODEL = "bench-model"
BLOCK_SIZE = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- processes ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc: server-side cost without py-spy."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


class CpuMeter:
    """CPU used during a window by our processes, by everything else on the machine ("others"), and
    stolen by the hypervisor ("steal"), each as a share of one core. On a shared 2-core VM a figure
    means little without these: a busy neighbour shows up as "others" or "steal"."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def snap(self) -> tuple[float, dict[str, float]]:
        busy, steal = machine_cpu_seconds()
        procs = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return time.perf_counter(), procs | {"_busy": busy, "steal": steal}

    @staticmethod
    def shares(a: tuple[float, dict[str, float]], b: tuple[float, dict[str, float]]) -> dict[str, float]:
        wall = b[0] - a[0]
        d = {k: (b[1][k] - a[1][k]) / wall for k in a[1]}
        busy = d.pop("_busy")
        steal = d.pop("steal")
        return d | {"others": max(0.0, busy - sum(d.values())), "steal": steal}


def fmt_shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 100:.0f}%" for k, v in shares.items())


def code_version() -> str:
    """Which kvindex these numbers are for: the imported package's git commit, +dirty if edited."""
    import kvindex
    import kvindex.index.inverted as inverted

    root = Path(kvindex.__file__).resolve().parents[1]
    try:
        git = ["git", "-C", str(root)]
        sha = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "kvindex", "workers_shim"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        version = sha + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        version = "not a git checkout"
    native = getattr(inverted, "NATIVE", None)
    index = "" if native is None else f", native index: {native}"
    return f"kvindex from {root} ({version}{index})"


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class NatsProcess:
    """A nats-server child process (the binary kvindex ships with), output discarded."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        stop_process(self.proc, 5)


class ServerProcess:
    """``kvindex serve`` in a child process, logging to a temp file (a full pipe would stall it)."""

    def __init__(self, nats_url: str, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Lives as long as the server process; closed and removed in stop().
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="kvindex-bench-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvindex.cli",
                "serve",
                "--nats",
                nats_url,
                "--grpc-host",
                "127.0.0.1",
                "--grpc-port",
                str(self.port),
                "--metrics-port",
                "-1",
                "--log-format",
                "json",
                "--log-level",
                "warning",
                *(extra or []),
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited early; log: {self.log_file.name}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout}s; log: {self.log_file.name}")

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.log_file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log_file.name)


# -- fleet -------------------------------------------------------------------------------------


@dataclass
class Fleet:
    tokens: list[int]
    keys: list[int]
    prefix_blocks: list[int]  # prompt blocks each worker holds, by worker index
    background: int  # unrelated blocks per worker
    tiered: bool

    @property
    def entries(self) -> int:
        return sum(self.prefix_blocks) + self.background * len(self.prefix_blocks)


TAIL_DEPTHS = 8  # --shared-prefix: how many deeper prefixes of the prompt some instances hold


def make_fleet(
    instances: int,
    prompt_tokens: int,
    background: int,
    tiered: bool,
    seed: int,
    holders: int = 0,
    shared_prefix: int = 0,
    tokens: list[int] | None = None,
) -> Fleet:
    """``holders`` (0: all) of the instances hold a prefix of the prompt; the others only background.

    ``shared_prefix`` > 0 instead: every instance holds the prompt's first ``shared_prefix`` blocks
    (a system prompt the whole fleet serves), and 1-4 instances hold it to each of TAIL_DEPTHS
    deeper depths spread up to the whole prompt (the conversations that continue it)."""
    rng = random.Random(seed)
    random_tokens = [rng.randrange(128_000) for _ in range(prompt_tokens)]
    tokens = random_tokens if tokens is None else tokens  # (drawn anyway: the same rng state after)
    keys = block_keys(tokens, BLOCK_SIZE, MODEL)
    n = len(keys)
    if shared_prefix:
        shared = min(shared_prefix, n)
        prefix = [shared] * instances
        pick = rng.sample(range(instances), min(instances, 4 * TAIL_DEPTHS))
        for j in range(TAIL_DEPTHS):
            depth = shared + round((n - shared) * (j + 1) / TAIL_DEPTHS)
            for _ in range(rng.randint(1, 4)):
                if pick:
                    prefix[pick.pop()] = depth
        return Fleet(tokens, keys, prefix, background, tiered)
    holders = min(holders or instances, instances)
    # Evenly spread prefix lengths: the deepest worker holds the whole prompt, so the match loop walks
    # all n blocks before the last candidate drops out (the worst case for the index).
    prefix = [max(1, round(n * (i + 1) / holders)) for i in range(holders)] + [0] * (instances - holders)
    rng.shuffle(prefix)
    return Fleet(tokens, keys, prefix, background, tiered)


async def publish_fleet(
    nc: Any,
    fleet: Fleet,
    seed: int,
    live: bool,
    part: tuple[int, int] = (0, 1),
    layout: GroupLayout | None = None,
) -> list[Publisher]:
    """Publish the fleet through the real publisher library, all publishers sharing ``nc``.

    part: (i, n) publishes only the workers whose index is i modulo n (the fleet spread over n
    processes); what each worker holds does not depend on n.

    live: each publisher runs as a worker does (heartbeats every 0.5 s, snapshot/replay responders
    where the library has them), because the index stops ranking an instance that goes silent.
    Otherwise each is closed after publishing (last flush + heartbeat), for the in-process copy.

    layout: a hybrid-attention model (--hybrid): each worker holds its prefix in the full-attention
    group and, in every other group, what vLLM keeps there of a prompt ending at that prefix (the
    window, or the state, before its last block: kvindex/index/hybrid.py).
    """
    rng = np.random.default_rng(seed)
    pubs = []
    for i, depth in enumerate(fleet.prefix_blocks):
        if fleet.background:  # drawn for every worker, so that a worker's blocks do not depend on n
            other = rng.integers(1, 2**63, size=fleet.background, dtype=np.uint64).tolist()
        if i % part[1] != part[0]:
            continue
        pub = Publisher(nc, worker=f"w{i:03d}", model=MODEL, block_size=BLOCK_SIZE)
        if layout is not None:
            pub.groups = layout.to_wire()
        # Different queued prefill per worker, so ranking is not all ties.
        pub.set_load(
            running=i % 7, waiting=i % 3, waiting_prefill_tokens=(i * 977) % 8192, kv_usage=(i % 10) / 10
        )
        if live:
            await pub.start()  # first heartbeat registers the instance
        else:
            await pub.heartbeat()
        chain = fleet.keys[:depth]
        if not chain:
            pass
        elif layout is not None:
            _store_hybrid(pub, layout, chain)
        elif fleet.tiered and i % 4 == 0 and depth > 2:
            # Some workers offloaded the tail of their prefix to CPU: forces the tiered match path.
            half = depth // 2
            pub.stored(chain[:half], tier="gpu")
            pub.stored(chain[half:], tier="cpu", parent=chain[half - 1])
        else:
            pub.stored(chain, tier="gpu")
        if fleet.background:
            pub.stored(other, tier="gpu")
        if live:
            await pub.heartbeat()  # flushes the batches, then a heartbeat consistent with them
        else:
            pub._tasks = []  # never started: close() only flushes and sends the last heartbeat
            await pub.close()
        pubs.append(pub)
    return pubs


def _store_hybrid(pub: Publisher, layout: GroupLayout, chain: list[int]) -> None:
    """A hybrid worker holding ``chain``: every block in the full-attention group, the retained
    window (or state) at its end in the others, as vLLM keeps them for a prompt of those blocks."""
    assert layout.primary is not None
    pub.stored(chain, group=layout.primary)
    for rule in layout.rules:
        keep = rule.param if rule.rule == SLIDING else 1 if rule.rule == MAMBA else len(chain)
        tail = chain[-keep:]
        parent = chain[-keep - 1] if len(chain) > keep else None
        for g in rule.members:
            pub.stored(tail, parent=parent, group=g)


HYBRID_LAYOUTS = {
    # Gemma 3 27B's shape at this block size: 52 sliding-window layers (window 1,024) and 10 full
    # ones make vLLM groups of 10 layers, 6 sliding-window groups and 1 full-attention group.
    "gemma3": [GroupSpec("sliding_window", BLOCK_SIZE, window=1024)] * 6
    + [GroupSpec("full_attention", BLOCK_SIZE)],
    # gpt-oss: alternating sliding window (128) and full attention, one group each.
    "gpt-oss": [GroupSpec("sliding_window", BLOCK_SIZE, window=128), GroupSpec("full_attention", BLOCK_SIZE)],
    # Qwen3-Next: three linear-attention (Mamba-kind) groups and one full-attention group.
    "qwen3-next": [GroupSpec("mamba", BLOCK_SIZE)] * 3 + [GroupSpec("full_attention", BLOCK_SIZE)],
}


def hybrid_ab(fleet: Fleet, seed: int, n: int, top_k: int, name: str) -> dict[str, dict[str, float]]:
    """The same fleet and prompt as a full-attention model and as hybrid model ``name``, each in its
    own in-process service; their Score stages timed in alternating rounds (same run, same noise)."""
    layout = GroupLayout(HYBRID_LAYOUTS[name], BLOCK_SIZE)
    services = {"full attention": build_local(fleet, seed), name: build_local(fleet, seed, layout)}
    stages: dict[str, dict[str, list[float]]] = {k: {} for k in services}
    calls = {}
    for label, servicer in services.items():
        route = RouteRequest(MODEL, fleet.keys, len(fleet.tokens), BLOCK_SIZE)
        request = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=top_k)
        wire = request.SerializeToString()
        index, router = servicer.index, servicer.ranker

        def whole(servicer: KvIndexServicer = servicer, wire: bytes = wire) -> bytes:
            req = pb.ScoreRequest.FromString(wire)
            bs, ks = servicer.prompt_keys(req)
            return servicer.score(req, bs, ks, None, None, PREFILL_ROLE).SerializeToString()

        limit = len(fleet.tokens) - 1
        calls[label] = {
            "index.match": lambda index=index, limit=limit: index.match(MODEL, fleet.keys, None, limit),
            "ranker.score": lambda router=router, route=route: router.score(route, top_k=top_k),
            "in-process Score (parse..serialize)": whole,
        }
    # The hybrid answers are the rule's: a holder's prefix ends in its retained window, so it hits as
    # far as the full-attention model, except one whose window ends past the prompt's last token.
    limit_blocks = (len(fleet.tokens) - 1) // BLOCK_SIZE
    full_m = services["full attention"].index.match(MODEL, fleet.keys, None, len(fleet.tokens) - 1)
    hyb_m = services[name].index.match(MODEL, fleet.keys, None, len(fleet.tokens) - 1)
    for key, m in full_m.items():
        if m.length < limit_blocks:
            assert hyb_m[key].length == m.length, (key, m, hyb_m.get(key))
    gc.collect()
    gc.freeze()
    for _ in range(5):
        for label in services:
            for stage, fn in calls[label].items():
                stages[label].setdefault(stage, []).append(_time_us(fn, n))
    return {label: {k: min(v) for k, v in by.items()} for label, by in stages.items()}


async def fleet_main(args: argparse.Namespace) -> None:
    """``--role fleet``: the 64 workers, in their own process so that their heartbeats cost the
    benchmark client nothing; publishes, prints "ready", runs until stdin closes."""
    fleet = make_fleet(
        args.instances,
        args.prompt_tokens,
        args.background,
        args.tiered,
        args.seed,
        args.holders,
        args.shared_prefix,
        np.load(args.tokens_file).tolist() if args.tokens_file else None,
    )
    nc = await nats.connect(args.nats)
    pubs = await publish_fleet(nc, fleet, args.seed, live=True, part=(args.fleet_part, args.fleet_procs))
    await nc.flush()
    busy = asyncio.create_task(_busy_loads(pubs, args.seed)) if args.busy_fleet else None
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if busy is not None:
        busy.cancel()
    for pub in pubs:
        await pub.close()
    await nc.drain()


async def _busy_loads(pubs: list[Publisher], seed: int) -> None:
    """``--busy-fleet``: every worker's load changes between two of its heartbeats (as a loaded
    engine's running and waiting counts do), so no heartbeat repeats the previous one."""
    rng = random.Random(seed)
    while True:
        for pub in pubs:
            pub.set_load(
                running=rng.randrange(64),
                waiting=rng.randrange(16),
                waiting_prefill_tokens=rng.randrange(16_384),
                kv_usage=rng.random(),
            )
        await asyncio.sleep(0.2)


class FleetProcess:
    """The workers, in ``procs`` processes of their own (one Python process cannot send the
    16.4 K heartbeats per second of 8,192 workers on a loaded 2-core machine)."""

    def __init__(self, args: argparse.Namespace, nats_url: str, procs: int = 1) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "fleet", "--nats", nats_url]
        cmd += ["--instances", str(args.instances), "--prompt-tokens", str(args.prompt_tokens)]
        cmd += ["--background", str(args.background), "--seed", str(args.seed)]
        cmd += ["--holders", str(args.holders), "--fleet-procs", str(procs)]
        cmd += ["--shared-prefix", str(args.shared_prefix)]
        cmd += ["--busy-fleet"] if getattr(args, "busy_fleet", False) else []
        cmd += ["--tiered"] if args.tiered else []
        cmd += ["--tokens-file", str(args.tokens_file)] if getattr(args, "tokens_file", None) else []
        self.procs = [
            subprocess.Popen([*cmd, "--fleet-part", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for i in range(procs)
        ]
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                self.stop()
                raise RuntimeError(f"fleet process failed: {line!r}")

    @property
    def pids(self) -> dict[str, int]:
        if len(self.procs) == 1:
            return {"fleet": self.procs[0].pid}
        return {f"fleet{i}": p.pid for i, p in enumerate(self.procs)}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_applied(address: str, fleet: Fleet, n_instances: int, timeout: float = 120.0) -> pb.StatsResponse:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        while True:
            s = stub.Stats(pb.StatsRequest(), timeout=5.0)
            entries = s.entries.gpu + s.entries.cpu + s.entries.disk + s.entries.shared
            if (
                s.instances == n_instances
                and entries == fleet.entries
                and s.batches_applied == s.batches_received
            ):
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"index not populated: {s}")
            time.sleep(0.1)


# -- measurements ------------------------------------------------------------------------------


@dataclass
class Latency:
    n: int
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    server_cpu_us: float  # server CPU time per call (all threads)
    client_cpu_us: float  # this process's CPU time per call (serialize, parse, gRPC client)
    cpu: dict[str, float]  # shares of one core during the measurement

    def row(self) -> str:
        return (
            f"p50 {self.p50_us:6.0f} us  p90 {self.p90_us:6.0f} us  p99 {self.p99_us:6.0f} us  "
            f"mean {self.mean_us:6.0f} us  CPU/call: server {self.server_cpu_us:5.0f} us, "
            f"client {self.client_cpu_us:5.0f} us"
        )


@dataclass
class Throughput:
    concurrency: int
    calls: int
    seconds: float
    server_cpu_us: float  # per call
    cpu: dict[str, float]  # shares of one core (1.0 = one core busy) during the window

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def row(self) -> str:
        return (
            f"c={self.concurrency:<3d} {self.rate:6.0f} calls/s  server CPU/call {self.server_cpu_us:5.0f} us"
            f" (=> {1e6 / self.server_cpu_us:5.0f} calls/s per server core); CPU: {fmt_shares(self.cpu)}"
        )


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure_latency(call: Callable[[], Any], n: int, warmup: int, meter: CpuMeter) -> Latency:
    """Sequential calls on a sync stub: one in flight, so this is the per-call round trip."""
    for _ in range(warmup):
        call()
    samples: list[float] = []
    perf = time.perf_counter_ns
    m0 = meter.snap()
    for _ in range(n):
        t0 = perf()
        call()
        samples.append((perf() - t0) / 1000)
    m1 = meter.snap()
    cpu, own = m1[1]["server"] - m0[1]["server"], m1[1]["client"] - m0[1]["client"]
    samples.sort()
    return Latency(
        n,
        quantile(samples, 0.50),
        quantile(samples, 0.90),
        quantile(samples, 0.99),
        statistics.fmean(samples),
        cpu / n * 1e6,
        own / n * 1e6,
        CpuMeter.shares(m0, m1),
    )


async def _throughput(
    make_call: Callable[[Any], Callable[[], Any]],
    address: str,
    concurrency: int,
    seconds: float,
    meter: CpuMeter,
) -> Throughput:
    async with grpc.aio.insecure_channel(address) as channel:
        call = make_call(channel)
        for _ in range(50):
            await call()
        stop = False
        counts = [0] * concurrency

        async def worker(i: int) -> None:
            while not stop:
                await call()
                counts[i] += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(0.3)  # let the pipeline fill before counting
        c0, m0 = sum(counts), meter.snap()
        await asyncio.sleep(seconds)
        c1, m1 = sum(counts), meter.snap()
        stop = True
        await asyncio.gather(*tasks)
    calls, wall = c1 - c0, m1[0] - m0[0]
    server_cpu = m1[1]["server"] - m0[1]["server"]
    return Throughput(concurrency, calls, wall, server_cpu / calls * 1e6, CpuMeter.shares(m0, m1))


def measure_throughput(
    make_call: Callable[[Any], Callable[[], Any]],
    address: str,
    concurrency: int,
    seconds: float,
    meter: CpuMeter,
) -> Throughput:
    return asyncio.run(_throughput(make_call, address, concurrency, seconds, meter))


async def _stream_throughput(
    address: str, request: pb.ScoreRequest, window: int, seconds: float, meter: CpuMeter
) -> Throughput:
    """One ScoreStream with up to ``window`` requests awaiting their response (a router's pipeline)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.KvIndexStub(channel).ScoreStream()
        room = asyncio.Semaphore(window)
        answered = 0
        stop = False

        async def writer() -> None:
            while not stop:
                await room.acquire()
                await call.write(request)
            await call.done_writing()

        async def reader() -> None:
            nonlocal answered
            async for reply in call:
                assert not reply.error, reply.error
                answered += 1
                room.release()

        tasks = [asyncio.create_task(writer()), asyncio.create_task(reader())]
        await asyncio.sleep(0.3)  # let the pipeline fill before counting
        c0, m0 = answered, meter.snap()
        await asyncio.sleep(seconds)
        c1, m1 = answered, meter.snap()
        stop = True
        room.release()  # wake the writer if it waits for room
        await asyncio.gather(*tasks)
    calls, wall = c1 - c0, m1[0] - m0[0]
    server_cpu = m1[1]["server"] - m0[1]["server"]
    return Throughput(window, calls, wall, server_cpu / calls * 1e6, CpuMeter.shares(m0, m1))


class StreamCaller:
    """Sequential calls over one ScoreStream on a sync channel: send one request, wait for its answer."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.SimpleQueue[pb.ScoreRequest | None] = queue.SimpleQueue()
        self._replies = pb_grpc.KvIndexStub(channel).ScoreStream(iter(self._requests.get, None))

    def __call__(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        self._requests.put(request)
        return next(self._replies)

    def close(self) -> None:
        self._requests.put(None)
        for _ in self._replies:  # drain to the end of the stream
            pass


# -- in-process breakdown ----------------------------------------------------------------------


def _time_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(max(3, n // 10)):
        fn()
    best = float("inf")
    # Best of 5 rounds: each stage is deterministic, so the minimum is the least noisy estimate on a
    # shared machine.
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


class _CaptureNats:
    """Stands in for a NATS connection: keeps what the publishers send, in order."""

    is_closed = False
    is_connected = True  # the publisher's close() sends its goodbye only on a live connection

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, data))

    async def flush(self, timeout: float | None = None) -> None:
        pass


def build_local(
    fleet: Fleet, seed: int, layout: GroupLayout | None = None, tokenizers: dict[str, str] | None = None
) -> KvIndexServicer:
    """The same fleet in an in-process service (not started: no NATS, no gRPC), fed the publishers'
    exact wire messages; its servicer is the one the server runs, metrics included."""
    config = ServiceConfig(nats_url="nats://unused", grpc_host="127.0.0.1", grpc_port=0)
    config.tokenizers = tokenizers or {}
    service = IndexService(config)
    nc = _CaptureNats()
    asyncio.run(publish_fleet(nc, fleet, seed, live=False, layout=layout))
    for subject, data in nc.sent:
        if ".events." in subject:
            service.consumer.on_events(subject, data)
        else:
            service.consumer.on_heartbeat(subject, data)
    return service.servicer


def breakdown(fleet: Fleet, seed: int, n: int, top_k: int) -> list[tuple[str, float]]:
    """Per-stage server-side cost of one Score call (token_ids path, default policy), in microseconds."""
    servicer = build_local(fleet, seed)
    registry, index, router = servicer.registry, servicer.index, servicer.ranker
    request = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=top_k)
    wire = request.SerializeToString()
    req_keys = pb.ScoreRequest(model=MODEL, block_keys=fleet.keys, top_k=top_k)
    wire_keys = req_keys.SerializeToString()
    seed_ = model_seed(MODEL)
    raw = np.array(request.token_ids, dtype=np.uint32).tobytes()
    keys = keys_from_le_bytes(raw, BLOCK_SIZE, seed_)
    assert keys == fleet.keys, "in-process keys differ from kvindex.keys"
    states = registry.routable(MODEL, None)
    inst = [s.key for s in states]
    matches = index.match(MODEL, keys, inst)
    assert max(m.length for m in matches.values()) == len(keys)
    route = RouteRequest(MODEL, keys, len(fleet.tokens), BLOCK_SIZE)
    policy = router.policy(None)
    cands = router.candidates(route, states, policy.speculative_ttl)

    def score(req: pb.ScoreRequest) -> pb.ScoreResponse:
        return servicer.score(req, BLOCK_SIZE, keys, None, None, PREFILL_ROLE)

    response = score(request)
    assert len(response.ranked) == (top_k or len(fleet.prefix_blocks))

    def whole() -> bytes:
        req = pb.ScoreRequest.FromString(wire)
        bs, ks = servicer.prompt_keys(req)
        return servicer.score(req, bs, ks, None, None, PREFILL_ROLE).SerializeToString()

    full = _time_us(whole, n)
    parse = _time_us(lambda: pb.ScoreRequest.FromString(wire), n)
    to_bytes = _time_us(lambda: np.array(request.token_ids, dtype=np.uint32).tobytes(), n)
    hashing = _time_us(lambda: keys_from_le_bytes(raw, BLOCK_SIZE, seed_), n)
    prompt_keys = _time_us(lambda: servicer.prompt_keys(request), n)
    routable = _time_us(lambda: registry.routable(MODEL, None), n)
    match = _time_us(lambda: index.match(MODEL, keys, inst), n)
    candidates = _time_us(lambda: router.candidates(route, states, policy.speculative_ttl), n)
    rank = _time_us(lambda: policy.rank(route, cands, router.context), n)
    routed = _time_us(lambda: router.score(route), n)
    total = _time_us(lambda: score(request), n)
    serialize = _time_us(response.SerializeToString, n)
    parse_keys = _time_us(lambda: pb.ScoreRequest.FromString(wire_keys), n)
    keys_list = _time_us(lambda: list(req_keys.block_keys), n)
    shown = top_k or len(fleet.prefix_blocks)
    n_tok, n_keys, n_inst = len(fleet.tokens), len(keys), len(states)
    return [
        (f"parse request ({n_tok} token_ids, protobuf)", parse),
        ("token_ids -> LE bytes (numpy)", to_bytes),
        (f"block keys ({n_keys} x xxh3_64 chain, native)", hashing),
        ("  prompt_keys() total (checks + both above)", prompt_keys),
        (f"registry.routable ({n_inst} instances)", routable),
        (f"index.match (walks {n_keys} blocks)", match),
        (f"  router.candidates (match + TTFT terms, {n_inst})", candidates),
        (f"policy.rank ({policy.name}, {n_inst} candidates)", rank),
        ("  router.score total (routable..rank)", routed),
        (f"build ScoreResponse ({shown} ranked, nested msgs)", total - routed),
        ("  servicer.score total", total),
        ("serialize response", serialize),
        ("SUM parse..serialize (in-process Score)", full),
        (f"block_keys path: parse request ({n_keys} u64)", parse_keys),
        ("block_keys path: list(request.block_keys)", keys_list),
    ]


def profile_score(fleet: Fleet, seed: int, calls: int, top_k: int) -> None:
    """cProfile of the in-process Score (parse, keys, ranking, response, serialize) on ``fleet``."""
    import cProfile
    import pstats

    servicer = build_local(fleet, seed)
    wire = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=top_k).SerializeToString()

    def whole() -> bytes:
        req = pb.ScoreRequest.FromString(wire)
        bs, ks = servicer.prompt_keys(req)
        return servicer.score(req, bs, ks, None, None, PREFILL_ROLE).SerializeToString()

    whole()
    samples = []
    prof = cProfile.Profile()
    for _ in range(calls):
        t0 = time.perf_counter()
        prof.enable()
        whole()
        prof.disable()
        samples.append(time.perf_counter() - t0)
    p50 = statistics.median(samples) * 1e3
    print(f"in-process Score, {calls} calls: p50 {p50:.2f} ms (under the profiler)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (< 60 s)")
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--background", type=int, default=2048, help="unrelated blocks per worker")
    ap.add_argument("--tiered", action="store_true", help="put some prefixes' tails on the CPU tier")
    ap.add_argument("--top-k", type=int, default=0, help="Score top_k (0: rank and return all)")
    ap.add_argument("--concurrency", default="8,32", help="comma-separated outstanding-call counts")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per throughput measurement")
    ap.add_argument("--calls", type=int, default=None, help="sequential calls per latency measurement")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the in-process stage breakdown")
    ap.add_argument("--hold", type=float, default=0.0, help="keep Score load running N s (for py-spy)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="cProfile CALLS in-process Scores (token_ids path, no gRPC), print the top and exit",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--holders", type=int, default=0, help="instances holding a prefix (0: all)")
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="BLOCKS",
        help="every instance holds the prompt's first BLOCKS blocks (a fleet-wide system prompt) and "
        f"1-4 instances each of {TAIL_DEPTHS} deeper prefixes (replaces --holders)",
    )
    ap.add_argument(
        "--sweep",
        default="",
        help="fleet sizes, e.g. 64,1024,8192: Score latency, server CPU and heartbeat ingest per size "
        "(--holders of them, default 64, hold prefixes; the rest only background blocks)",
    )
    # Internal: the workers' process.
    ap.add_argument("--role", choices=("bench", "fleet"), default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--nats", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `kvindex serve` argument for the sweep's server (repeatable), e.g. "
        "--serve-arg=--reconcile-interval --serve-arg=0",
    )
    ap.add_argument(
        "--busy-fleet",
        action="store_true",
        help="every worker's load changes between its heartbeats (default: constant loads, an idle fleet)",
    )
    ap.add_argument(
        "--hybrid",
        choices=sorted(HYBRID_LAYOUTS),
        default=None,
        help="in process, no gRPC: Score for the same fleet and prompt as a full-attention model and "
        "as this hybrid-attention model, same run (issue 33: the hybrid rule's cost)",
    )
    ap.add_argument(
        "--chat",
        action="store_true",
        help="long contexts: the prompt is a chat of --prompt-tokens tokens (bench_tokenize.py's), which the "
        "server tokenizes: Score with token_ids, messages (the same chat, and grown by a turn) and prompt, "
        "sequential latency, and each call's memory in process",
    )
    ap.add_argument("--tokens-file", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fleet-procs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--fleet-part", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    configure_logging("console", "warning")
    if args.role == "fleet":
        asyncio.run(fleet_main(args))
        return 0  # the in-process breakdown's consumer logs every join
    if args.sweep:
        return sweep(args)
    if args.hybrid:
        return hybrid_main(args)
    if args.chat:
        return chat_main(args)
    seconds = args.seconds or (2.0 if args.quick else 6.0)
    n_calls = args.calls or (500 if args.quick else 3000)
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    started = time.perf_counter()

    fleet = make_fleet(
        args.instances,
        args.prompt_tokens,
        args.background,
        args.tiered,
        args.seed,
        args.holders,
        args.shared_prefix,
    )
    print(
        f"kvindex gRPC Score benchmark: {args.prompt_tokens} tokens = {len(fleet.keys)} blocks of "
        f"{BLOCK_SIZE}, {args.instances} instances holding prefixes of "
        f"{min(fleet.prefix_blocks)}..{max(fleet.prefix_blocks)} blocks, {args.background} background "
        f"blocks each{', some tails on CPU tier' if args.tiered else ''}"
    )
    print(
        f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}. "
        "Client (this process), server process and nats-server SHARE these cores: the figures include "
        "client-side contention; 'server CPU/call' is the server's own cost. "
        f"Load average before start: {os.getloadavg()[0]:.2f} (anything else running skews the figures)."
    )
    print(f"code: {code_version()}")
    if args.profile:
        profile_score(fleet, args.seed, args.profile, args.top_k)
        return 0

    results: dict[str, Any] = {"config": vars(args) | {"json": None}, "cores": os.cpu_count()}
    natsd = NatsProcess()
    server = ServerProcess(natsd.url)
    fleet_proc: FleetProcess | None = None
    try:
        server.wait_ready()
        print(f"server pid {server.pid} on {server.address}, nats {natsd.url}")
        meter = CpuMeter({"server": server.pid, "client": os.getpid(), "nats-server": natsd.proc.pid})
        fleet_proc = FleetProcess(args, natsd.url)
        meter.pids |= fleet_proc.pids
        t0 = time.perf_counter()
        stats = wait_applied(server.address, fleet, args.instances)
        print(
            f"populated: {stats.instances} instances, {stats.entries.gpu + stats.entries.cpu} entries, "
            f"{stats.distinct_blocks.gpu + stats.distinct_blocks.cpu} distinct blocks, "
            f"{stats.batches_applied} batches (applied {time.perf_counter() - t0:.1f}s after publish)"
        )

        token_req = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=args.top_k)
        keys_req = pb.ScoreRequest(model=MODEL, block_keys=fleet.keys, top_k=args.top_k)
        health_req = health_pb2.HealthCheckRequest(service="")
        print(
            f"request sizes: token_ids {token_req.ByteSize()} B, block_keys {keys_req.ByteSize()} B; "
            f"top_k={args.top_k} ({'all instances ranked and returned' if not args.top_k else 'truncated'})"
        )

        variants: dict[str, tuple[Callable[[Any], Any], Any]] = {
            "health": (lambda ch: health_pb2_grpc.HealthStub(ch).Check, health_req),
            "score_tokens": (lambda ch: pb_grpc.KvIndexStub(ch).Score, token_req),
            "score_keys": (lambda ch: pb_grpc.KvIndexStub(ch).Score, keys_req),
        }
        with grpc.insecure_channel(server.address) as channel:
            reply = pb_grpc.KvIndexStub(channel).Score(token_req, timeout=5)
            best = reply.ranked[0]
            print(
                f"check: total_blocks={reply.total_blocks}, ranked={len(reply.ranked)}, best "
                f"{best.instance_id} matched {best.matched_blocks} blocks, cost {best.cost:.1f}"
            )
            assert reply.total_blocks == len(fleet.keys)
            assert len(reply.ranked) == (min(args.top_k, args.instances) or args.instances)
            keys_reply = pb_grpc.KvIndexStub(channel).Score(keys_req, timeout=5)
            # The same prompt either way: every instance matches as many blocks. (Not the same order:
            # reported queues drain between the two calls, so near-tied costs may cross.)
            assert {r.instance_id: r.matched_blocks for r in keys_reply.ranked} == {
                r.instance_id: r.matched_blocks for r in reply.ranked
            }

            print(f"\n(1) sequential latency, sync client, {n_calls} calls each")
            lat: dict[str, Latency] = {}
            for name, (make, req) in variants.items():
                rpc = make(channel)
                lat[name] = measure_latency(lambda rpc=rpc, req=req: rpc(req), n_calls, 200, meter)
                print(f"  {name:13s} {lat[name].row()}")
                print(f"  {'':13s} CPU: {fmt_shares(lat[name].cpu)}")
            for name, req in (("stream_tokens", token_req), ("stream_keys", keys_req)):
                caller = StreamCaller(channel)
                streamed = caller(req)  # (rankings move with heartbeats: compare shapes only)
                assert not streamed.error and streamed.total_blocks == reply.total_blocks
                assert len(streamed.ranked) == len(reply.ranked)
                lat[name] = measure_latency(lambda caller=caller, req=req: caller(req), n_calls, 200, meter)
                caller.close()
                print(f"  {name:13s} {lat[name].row()}")
                print(f"  {'':13s} CPU: {fmt_shares(lat[name].cpu)}")
            results["latency"] = {k: vars(v) for k, v in lat.items()}
        base = lat["health"]
        for name in ("score_tokens", "score_keys"):
            v = lat[name]
            print(
                f"  {name} / health: p50 x{v.p50_us / base.p50_us:.2f}, p99 x{v.p99_us / base.p99_us:.2f}, "
                f"server CPU x{v.server_cpu_us / base.server_cpu_us:.2f} "
                f"(p50 minus health p50: {v.p50_us - base.p50_us:.0f} us)"
            )

        print(f"\n(2) throughput, grpc.aio client in this process, {seconds:.0f} s each")
        thr: dict[str, list[Throughput]] = {}
        for name, (make, req) in variants.items():
            for c in concurrency:

                def make_call(ch: Any, make: Any = make, req: Any = req) -> Callable[[], Any]:
                    rpc = make(ch)
                    return lambda: rpc(req)

                t = measure_throughput(make_call, server.address, c, seconds, meter)
                thr.setdefault(name, []).append(t)
                print(f"  {name:13s} {t.row()}")
        for name, req in (("stream_tokens", token_req), ("stream_keys", keys_req)):
            for c in concurrency:
                t = asyncio.run(_stream_throughput(server.address, req, c, seconds, meter))
                thr.setdefault(name, []).append(t)
                print(f"  {name:13s} {t.row()}  (one ScoreStream, {c} requests in flight)")
        results["throughput"] = {k: [vars(t) | {"rate": t.rate} for t in v] for k, v in thr.items()}
        for name in ("score_tokens", "score_keys", "stream_tokens", "stream_keys"):
            for t, b in zip(thr[name], thr["health"], strict=True):
                print(
                    f"  {name} / health at c={t.concurrency}: rate x{t.rate / b.rate:.2f}, "
                    f"server CPU/call x{t.server_cpu_us / b.server_cpu_us:.2f}"
                )

        if args.hold:
            make, req = variants["score_tokens"]

            def make_hold(ch: Any) -> Callable[[], Any]:
                rpc = make(ch)
                return lambda: rpc(req)

            print(f"\nholding Score load for {args.hold:.0f} s (server pid {server.pid}) ...", flush=True)
            measure_throughput(make_hold, server.address, max(concurrency), args.hold, meter)

        with grpc.insecure_channel(server.address) as channel:
            # Guard: every instance must still have been ranked at the end (none went stale).
            ranked = len(pb_grpc.KvIndexStub(channel).Score(token_req, timeout=5).ranked)
            if ranked != len(reply.ranked):
                print(f"WARNING: {ranked} instances ranked at the end, {len(reply.ranked)} at the start")

        lt = lat["score_tokens"]
        print("\ntargets:")
        print(f"  Score p50 <= 1 ms (token_ids): {lt.p50_us / 1000:.2f} ms -> {_ok(lt.p50_us <= 1000)}")
        for name, label in (("score_tokens", "unary Score"), ("stream_tokens", "ScoreStream")):
            th = max(thr[name], key=lambda t: t.rate)
            print(
                f"  >= 3000 calls/s per server process, {label} (token_ids): measured {th.rate:.0f} "
                f"calls/s with the client on the same 2 cores -> {_ok(th.rate >= 3000)}; server CPU/call "
                f"{th.server_cpu_us:.0f} us => {1e6 / th.server_cpu_us:.0f} calls/s if the server had a "
                f"core to itself -> {_ok(1e6 / th.server_cpu_us >= 3000)}"
            )
        for name in ("score_keys", "stream_keys"):
            best_keys = max(thr[name], key=lambda t: t.rate)
            print(
                f"  ({name}: {best_keys.rate:.0f} calls/s measured, "
                f"{1e6 / best_keys.server_cpu_us:.0f} calls/s per server core)"
            )
    finally:
        if fleet_proc is not None:
            fleet_proc.stop()
        server.stop()
        natsd.stop()

    if not args.no_breakdown:
        print(
            "\n(3) in-process breakdown of the server side of one Score call (no gRPC; best of 5; "
            f"load average {os.getloadavg()[0]:.2f})"
        )
        stages = breakdown(fleet, args.seed, 200 if args.quick else 1000, args.top_k)
        for label, us in stages:
            print(f"  {label:46s} {us:8.1f} us")
        results["breakdown_us"] = dict(stages)
        total = dict(stages)["SUM parse..serialize (in-process Score)"]
        print(
            f"  => server CPU/call measured over gRPC minus in-process work = gRPC/asyncio overhead: "
            f"{lt.server_cpu_us:.0f} - {total:.0f} = {lt.server_cpu_us - total:.0f} us "
            f"(health Check costs the server {base.server_cpu_us:.0f} us/call)"
        )

    print(f"\ndone in {time.perf_counter() - started:.0f} s (load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _peak_bytes(fn: Callable[[], Any]) -> int:
    """tracemalloc peak of one call (Python objects and numpy arrays; not the tokenizers library's Rust
    allocations: bench_tokenize.py measures those as RSS)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def chat_main(args: argparse.Namespace) -> int:
    """``--chat``: a long agent conversation through the server's tokenizer, against its token ids."""
    from bench_tokenize import build_chat  # benchmarks/ is this script's directory

    from kvindex.tokenize import Tokenizers
    from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir

    started = time.perf_counter()
    n_calls = args.calls or (50 if args.quick else 300)
    tmp = tempfile.TemporaryDirectory()
    directory = str(make_tokenizer_dir(Path(tmp.name) / "llama3", "llama3"))
    toks = Tokenizers.from_dirs({MODEL: directory})
    chat = build_chat(toks, MODEL, args.prompt_tokens, random.Random(args.seed))
    ids = toks.encode_chat(MODEL, chat)
    text = toks.render_chat(MODEL, chat).replace("<|", "< |")  # a completions prompt, no special tokens
    args.tokens_file = Path(tmp.name) / "tokens.npy"
    np.save(args.tokens_file, ids)
    fleet = make_fleet(
        args.instances, len(ids), args.background, False, args.seed, args.holders, 0, ids.tolist()
    )
    rng = random.Random(args.seed)
    questions = [
        f"Question {k}: " + " ".join(rng.choices(chat[-1]["content"].split(), k=6)) for k in range(64)
    ]
    messages = json.dumps(chat)
    grown = [json.dumps([*chat, {"role": "user", "content": q}]) for q in questions]
    print(code_version())
    print(
        f"long context: a chat of {len(chat)} messages, {len(ids)} tokens ({len(fleet.keys)} blocks of "
        f"{BLOCK_SIZE}, {len(messages)} bytes as messages JSON), {args.instances} instances holding prefixes "
        f"of {min(fleet.prefix_blocks)}..{max(fleet.prefix_blocks)} blocks, {args.background} background "
        f"blocks each; top_k {args.top_k}; load average {os.getloadavg()[0]:.2f}"
    )
    requests = {
        "token_ids": [pb.ScoreRequest(model=MODEL, token_ids=ids.tolist(), top_k=args.top_k)],
        "messages, the same chat": [pb.ScoreRequest(model=MODEL, messages=messages, top_k=args.top_k)],
        "messages, grown by a turn": [
            pb.ScoreRequest(model=MODEL, messages=g, top_k=args.top_k) for g in grown
        ],
        "prompt (completions text), the same": [pb.ScoreRequest(model=MODEL, prompt=text, top_k=args.top_k)],
    }
    results: dict[str, Any] = {"config": vars(args) | {"json": None, "tokens_file": None}, "tokens": len(ids)}

    # In process: each form's whole server-side Score (parse..serialize) and its memory.
    servicer = build_local(fleet, args.seed, tokenizers={MODEL: directory})

    def whole(wire: bytes) -> bytes:
        req = pb.ScoreRequest.FromString(wire)
        prompt = servicer.resolve(req)
        return servicer.score(
            req, prompt.block_size, prompt.keys, None, None, PREFILL_ROLE, prompt.tokens
        ).SerializeToString()

    wires = {name: [r.SerializeToString() for r in reqs] for name, reqs in requests.items()}
    first = pb.ScoreResponse.FromString(whole(wires["messages, the same chat"][0]))
    assert first.total_blocks == len(fleet.keys) and first.prompt_tokens == len(ids), "tokenized differently"
    servicer.tokenizers.clear_cache()
    memory = {"messages, cold (first call)": _peak_bytes(lambda: whole(wires["messages, the same chat"][0]))}
    for name, ws in wires.items():
        memory[name] = _peak_bytes(lambda ws=ws: whole(ws[-1]))
    in_process: dict[str, float] = {}
    for name, ws in wires.items():
        samples = []
        for k in range(min(n_calls, 100)):
            t0 = time.perf_counter()
            whole(ws[k % len(ws)])
            samples.append((time.perf_counter() - t0) * 1e3)
        in_process[name] = statistics.median(samples)
    servicer.tokenizers.clear_cache()
    t0 = time.perf_counter()
    whole(wires["messages, the same chat"][0])
    in_process["messages, cold (first call)"] = (time.perf_counter() - t0) * 1e3
    print(f"\nin process (parse .. serialized response), median of {min(n_calls, 100)} calls:")
    for name in in_process:
        print(f"  {name:40s} {in_process[name]:8.2f} ms   tracemalloc peak {memory[name] / 2**20:6.1f} MiB")
    results["in_process_ms"] = in_process
    results["in_process_peak_bytes"] = memory

    natsd = NatsProcess()
    server = ServerProcess(natsd.url, ["--tokenizer", f"{MODEL}={directory}"])
    fleet_proc: FleetProcess | None = None
    try:
        server.wait_ready()
        meter = CpuMeter({"server": server.pid, "client": os.getpid(), "nats-server": natsd.proc.pid})
        fleet_proc = FleetProcess(args, natsd.url)
        meter.pids |= fleet_proc.pids
        wait_applied(server.address, fleet, args.instances)
        lat: dict[str, Latency] = {}
        with grpc.insecure_channel(server.address) as channel:
            score = pb_grpc.KvIndexStub(channel).Score
            t0 = time.perf_counter()
            reply = score(requests["messages, the same chat"][0], timeout=30)
            cold_ms = (time.perf_counter() - t0) * 1e3
            assert reply.total_blocks == len(fleet.keys) and reply.ranked[0].matched_blocks == len(fleet.keys)
            by_ids = score(requests["token_ids"][0], timeout=30)
            assert {r.instance_id: r.matched_blocks for r in by_ids.ranked} == {
                r.instance_id: r.matched_blocks for r in reply.ranked
            }
            print(
                f"\nover gRPC, sequential, {n_calls} calls each (first messages call, cold: {cold_ms:.1f} ms)"
            )
            health = health_pb2_grpc.HealthStub(channel).Check
            lat["health"] = measure_latency(
                lambda: health(health_pb2.HealthCheckRequest()), n_calls, 20, meter
            )
            print(f"  {'health':36s} {lat['health'].row()}")
            for name, reqs in requests.items():
                cycle = iter(range(1 << 62))

                def call(reqs: list[pb.ScoreRequest] = reqs, cycle: Any = cycle) -> Any:
                    return score(reqs[next(cycle) % len(reqs)], timeout=30)

                lat[name] = measure_latency(call, n_calls, 10, meter)
                print(f"  {name:36s} {lat[name].row()}")
                print(f"  {'':36s} CPU: {fmt_shares(lat[name].cpu)}")
        results["latency"] = {k: vars(v) for k, v in lat.items()}
        results["cold_ms"] = cold_ms
    finally:
        if fleet_proc is not None:
            fleet_proc.stop()
        server.stop()
        natsd.stop()
        tmp.cleanup()
    p50 = lat["token_ids"].p50_us / 1000
    print(f"\ntarget: token_ids p50 <= 10 ms over gRPC: {p50:.2f} ms -> {_ok(p50 <= 10)}")
    print(f"done in {time.perf_counter() - started:.0f} s (load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def hybrid_main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    fleet = make_fleet(
        args.instances,
        args.prompt_tokens,
        args.background,
        False,
        args.seed,
        args.holders,
        args.shared_prefix,
    )
    n = 100 if args.quick else 500
    print(code_version())
    print(
        f"Score in process, {args.instances} instances, {args.prompt_tokens}-token prompt "
        f"({len(fleet.keys)} blocks of {BLOCK_SIZE}), top_k {args.top_k}: full attention vs {args.hybrid} "
        f"({GroupLayout(HYBRID_LAYOUTS[args.hybrid], BLOCK_SIZE).describe()}); best of 5 alternating rounds "
        f"of {n} calls (load average {os.getloadavg()[0]:.2f})"
    )
    got = hybrid_ab(fleet, args.seed, n, args.top_k, args.hybrid)
    full, hyb = got["full attention"], got[args.hybrid]
    print(f"  {'stage':38s} {'full attention':>15s} {args.hybrid:>12s} {'ratio':>7s}")
    for stage in full:
        print(f"  {stage:38s} {full[stage]:12.1f} us {hyb[stage]:9.1f} us {hyb[stage] / full[stage]:6.2f}x")
    print(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(got, indent=2))
    return 0


# -- fleet-size sweep --------------------------------------------------------------------------


def _in_process(fleet: Fleet, seed: int, top_k: int, n: int) -> dict[str, float]:
    """Server-side stages for this fleet, in process (no gRPC): match, ranking, the whole Score."""
    servicer = build_local(fleet, seed)
    router, index = servicer.ranker, servicer.index
    route = RouteRequest(MODEL, fleet.keys, len(fleet.tokens), BLOCK_SIZE)
    request = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=top_k)
    wire = request.SerializeToString()

    def whole() -> bytes:
        req = pb.ScoreRequest.FromString(wire)
        bs, ks = servicer.prompt_keys(req)
        return servicer.score(req, bs, ks, None, None, PREFILL_ROLE).SerializeToString()

    # Both rankings from the same state: the same instant (queues drain with time) and weight.
    ttft = router.policies["ttft"]
    saved = (ttft._k, ttft._k_at)  # type: ignore[attr-defined]
    clock, now = router.clock, router.clock()
    router.clock = lambda: now
    pruned = router.score(route, top_k=top_k).choices
    ttft._k, ttft._k_at = saved  # type: ignore[attr-defined]
    full = router.score(route).choices
    router.clock = clock
    gc.collect()
    gc.freeze()  # time the code, not collections of the fleet's objects (see the README)
    assert [c.candidate.state.key for c in pruned] == [c.candidate.state.key for c in full[:top_k]]
    return {
        "index.match": _time_us(lambda: index.match(MODEL, fleet.keys), n),
        "router.score top_k": _time_us(lambda: router.score(route, top_k=top_k), n),
        "router.score all (exhaustive)": _time_us(lambda: router.score(route), max(5, n // 20)),
        "in-process Score (parse..serialize)": _time_us(whole, n),
    }


def sweep(args: argparse.Namespace) -> int:
    """Score as the fleet grows with a fixed number of prefix holders; each size in a fresh server,
    nats-server and fleet process (every worker heartbeating every 0.5 s)."""
    sizes = [int(x) for x in args.sweep.split(",") if x]
    holders = args.holders or 64
    top_k = args.top_k or 4
    n_calls = args.calls or (300 if args.quick else 1500)
    idle_s = 4.0 if args.quick else 8.0
    who = (
        f"every instance holds its first {args.shared_prefix} blocks and 1-4 instances each of "
        f"{TAIL_DEPTHS} deeper prefixes"
        if args.shared_prefix
        else f"{holders} instances hold prefixes of it, the others"
    )
    print(
        f"kvindex Score fleet-size sweep: {args.prompt_tokens} tokens = {args.prompt_tokens // BLOCK_SIZE} "
        f"blocks; {who}, {args.background} background blocks each; top_k={top_k}; sizes {sizes}"
    )
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; code: {code_version()}")
    rows: list[dict[str, Any]] = []
    for size in sizes:
        args.instances = size
        args.holders = min(holders, size)
        fleet = make_fleet(
            size,
            args.prompt_tokens,
            args.background,
            args.tiered,
            args.seed,
            args.holders,
            args.shared_prefix,
        )
        natsd = NatsProcess()
        server = ServerProcess(natsd.url, args.serve_arg)
        fleet_proc: FleetProcess | None = None
        row: dict[str, Any] = {"instances": size, "holders": args.holders}
        try:
            server.wait_ready()
            meter = CpuMeter({"server": server.pid, "client": os.getpid(), "nats-server": natsd.proc.pid})
            t0 = time.perf_counter()
            fleet_proc = FleetProcess(args, natsd.url, procs=max(1, min(4, size // 2048)))
            meter.pids |= fleet_proc.pids
            wait_applied(server.address, fleet, size, timeout=120 + size * 0.05)
            row["populate_s"] = time.perf_counter() - t0
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.KvIndexStub(channel)
                time.sleep(2.0)  # let the first heartbeat round settle
                s0, m0 = stub.Stats(pb.StatsRequest()), meter.snap()
                time.sleep(idle_s)
                s1, m1 = stub.Stats(pb.StatsRequest()), meter.snap()
                shares = CpuMeter.shares(m0, m1)
                wall = m1[0] - m0[0]
                row["heartbeats_per_s"] = (s1.status_received - s0.status_received) / wall
                row["idle_server_core"] = shares["server"]
                row["idle_cpu"] = shares
                token_req = pb.ScoreRequest(model=MODEL, token_ids=fleet.tokens, top_k=top_k)
                reply = stub.Score(token_req, timeout=10)
                assert len(reply.ranked) == min(top_k, size), reply
                health = health_pb2_grpc.HealthStub(channel).Check
                hreq = health_pb2.HealthCheckRequest(service="")
                row["health"] = vars(
                    measure_latency(lambda h=health, r=hreq: h(r), n_calls, 100, meter)  # type: ignore[misc]
                )
                lat = measure_latency(
                    lambda s=stub, r=token_req: s.Score(r),  # type: ignore[misc]
                    n_calls,
                    100,
                    meter,
                )
                row["score"] = vars(lat)
                # The server also ingests the fleet's heartbeats meanwhile: its CPU per call net of
                # that background (the idle share over the calls' wall time).
                row["net_server_cpu_us"] = lat.server_cpu_us - row["idle_server_core"] * lat.mean_us
                # The same calls over one ScoreStream (what kvindex.client sends): no per-call
                # stream setup in grpcio.
                caller = StreamCaller(channel)
                stream = measure_latency(
                    lambda c=caller, r=token_req: c(r),  # type: ignore[misc]
                    n_calls,
                    100,
                    meter,
                )
                caller.close()
                row["stream"] = vars(stream)
                row["net_stream_cpu_us"] = stream.server_cpu_us - row["idle_server_core"] * stream.mean_us
                end = stub.Stats(pb.StatsRequest())
                row["stale_at_end"] = end.instances_stale
        finally:
            if fleet_proc is not None:
                fleet_proc.stop()
            server.stop()
            natsd.stop()
        row["in_process_us"] = _in_process(fleet, args.seed, top_k, 100 if args.quick else 300)
        rows.append(row)
        sc, h = row["score"], row["health"]
        print(
            f"  {size:5d} instances: Score p50 {sc['p50_us']:6.0f} us p99 {sc['p99_us']:6.0f} us, server "
            f"CPU/call {sc['server_cpu_us']:5.0f} us, net of heartbeat ingest "
            f"{row['net_server_cpu_us']:5.0f} us (health p50 {h['p50_us']:4.0f} us, "
            f"CPU {h['server_cpu_us']:4.0f});"
            f" idle: {row['heartbeats_per_s']:6.0f} heartbeats/s cost the server "
            f"{row['idle_server_core'] * 100:4.1f}% of a core; stale at end {row['stale_at_end']}; "
            f"populated in {row['populate_s']:.0f} s"
        )
        st = row["stream"]
        print(
            f"        ScoreStream: p50 {st['p50_us']:6.0f} us p99 {st['p99_us']:6.0f} us, server CPU/call "
            f"{st['server_cpu_us']:5.0f} us, net {row['net_stream_cpu_us']:5.0f} us"
        )
        print(f"        CPU during Score calls: {fmt_shares(sc['cpu'])}")
        print("        in process: " + ", ".join(f"{k} {v:.0f} us" for k, v in row["in_process_us"].items()))
    base = rows[0]
    print(f"\nratios to the {base['instances']}-instance figures (same run):")
    paths = (("score", "net_server_cpu_us", "Score"), ("stream", "net_stream_cpu_us", "ScoreStream"))
    for row in rows[1:]:
        limit = 1.25 if row["instances"] <= 1024 else 2.0
        rh = row["health"]["p50_us"] / base["health"]["p50_us"]
        for name, net, label in paths:
            r50 = row[name]["p50_us"] / base[name]["p50_us"]
            rcpu = row[net] / base[net]
            print(
                f"  {row['instances']:5d}: {label} p50 x{r50:.2f} (target <= x{limit}: {_ok(r50 <= limit)}), "
                f"server CPU/call (net) x{rcpu:.2f}; health p50 x{rh:.2f}"
            )
    for row in rows:
        for name, _net, label in paths:
            rs = row[name]["p50_us"] / row["health"]["p50_us"]
            target = f" (target <= x2: {_ok(rs <= 2)})" if row is base else ""
            print(f"  {row['instances']:5d}: {label} p50 / health p50 x{rs:.2f}{target}")
    for row in rows:
        print(
            f"  heartbeat ingest at {row['instances']}: {row['idle_server_core'] * 100:.1f}% of a core "
            f"(target < 10%: {_ok(row['idle_server_core'] < 0.10)})"
        )
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, "sweep": rows}, indent=2))
    return 0


def _ok(met: bool) -> str:
    return "MET" if met else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
