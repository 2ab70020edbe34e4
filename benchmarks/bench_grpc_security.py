"""What gRPC security costs: the same calls against `kvindex serve` in plaintext, TLS, mutual TLS, a
bearer token, and mutual TLS + token; ratios against plaintext measured in the same run.

One ``kvindex serve`` process per mode (on a nats-server this script starts, empty index), all
running; in each round every mode is measured in turn, from this process with the real client code
(``kvindex.security.open_channel``); medians over the rounds:

1. sequential Score calls on one open channel (one call in flight: the per-call round trip; the
   model is unknown, so the server does no index work and the figure is the transport's),
2. throughput with 8 outstanding calls on one grpc.aio channel,
3. server CPU time per call (from /proc) during 1 and 2,
4. connection set-up: a new channel and its first call (TCP + TLS handshake + the call).

Certificates (trustme's defaults) are made at start. Run: ``.venv/bin/python
benchmarks/bench_grpc_security.py`` (``--quick`` for a ~15 s run; the full run takes ~1 min).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import trustme
from bench_score import NatsProcess, code_version, cpu_seconds, stop_process

from kvindex.security import ClientTLS, open_channel
from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

REQUEST = pb.ScoreRequest(model="unknown-model", token_ids=list(range(256)))
TOKEN = "bench-token-0123456789abcdef"


def make_pki(d: Path) -> dict[str, Path]:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    files = {"ca": d / "ca.pem", "token": d / "token"}
    for name, cert in (("server", ca.issue_cert("127.0.0.1")), ("client", ca.issue_cert("bench.client"))):
        cert.cert_chain_pems[0].write_to_path(str(d / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(d / f"{name}.key"))
        files[name], files[f"{name}-key"] = d / f"{name}.pem", d / f"{name}.key"
    files["token"].write_text(TOKEN + "\n")
    return files


def modes(f: dict[str, Path]) -> list[tuple[str, list[str], ClientTLS | None, str | None]]:
    tls = ["--tls-cert", str(f["server"]), "--tls-key", str(f["server-key"])]
    mtls = [*tls, "--tls-client-ca", str(f["ca"])]
    token = ["--auth-token-file", str(f["token"])]
    server_only = ClientTLS(ca=f["ca"])
    client_cert = ClientTLS(ca=f["ca"], cert=f["client"], key=f["client-key"])
    return [
        ("plaintext", [], None, None),
        ("tls", tls, server_only, None),
        ("mtls", mtls, client_cert, None),
        ("token (plaintext)", token, None, TOKEN),
        ("mtls + token", [*mtls, *token], client_cert, TOKEN),
    ]


class Server:
    def __init__(self, nats_url: str, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log.open("w")
        argv = [sys.executable, "-m", "kvindex.cli", "serve", "--nats", nats_url, "--grpc-host", "127.0.0.1"]
        argv += ["--grpc-port", str(self.port), "--metrics-port", "-1", "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, tls: ClientTLS | None, token: str | None) -> None:
        deadline = time.monotonic() + 30
        with open_channel(self.address, tls, token) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            while True:
                try:
                    stub.Score(REQUEST, timeout=1)
                    return
                except grpc.RpcError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"server not ready; log: {self.log.name}") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.log.close()


def latency(server: Server, tls: ClientTLS | None, token: str | None, n: int) -> dict[str, float]:
    with open_channel(server.address, tls, token) as channel:
        call = pb_grpc.KvIndexStub(channel).Score
        for _ in range(200):
            call(REQUEST)
        samples = []
        c0 = cpu_seconds(server.proc.pid)
        for _ in range(n):
            t0 = time.perf_counter_ns()
            call(REQUEST)
            samples.append((time.perf_counter_ns() - t0) / 1000)
        cpu = cpu_seconds(server.proc.pid) - c0
    samples.sort()
    return {"p50": samples[n // 2], "p99": samples[int(n * 0.99)], "server_cpu": cpu / n * 1e6}


async def _throughput(server: Server, tls: ClientTLS | None, token: str | None, seconds: float) -> dict:
    async with open_channel(server.address, tls, token, aio=True) as channel:
        call = pb_grpc.KvIndexStub(channel).Score
        stop, counts = False, [0] * 8

        async def worker(i: int) -> None:
            while not stop:
                await call(REQUEST)
                counts[i] += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(8)]
        await asyncio.sleep(0.3)
        n0, c0, t0 = sum(counts), cpu_seconds(server.proc.pid), time.perf_counter()
        await asyncio.sleep(seconds)
        n1, c1, t1 = sum(counts), cpu_seconds(server.proc.pid), time.perf_counter()
        stop = True
        await asyncio.gather(*tasks)
    return {"calls_s": (n1 - n0) / (t1 - t0), "server_cpu": (c1 - c0) / (n1 - n0) * 1e6}


def connect(server: Server, tls: ClientTLS | None, token: str | None, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        with open_channel(server.address, tls, token) as channel:
            pb_grpc.KvIndexStub(channel).Score(REQUEST)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="measurement rounds (modes alternate)")
    args = ap.parse_args()
    calls, seconds, connects = (300, 0.5, 5) if args.quick else (1000, 1.0, 10)
    rounds = args.rounds or (2 if args.quick else 5)
    started = time.monotonic()
    nats = NatsProcess()
    servers: list[tuple[str, Server, ClientTLS | None, str | None]] = []
    results: dict[str, list[tuple[dict, dict, float]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvindex-bench-sec-") as tmp:
            files = make_pki(Path(tmp))
            for i, (name, flags, tls, token) in enumerate(modes(files)):
                servers.append((name, Server(nats.url, flags, Path(tmp) / f"serve-{i}.log"), tls, token))
            for _name, server, tls, token in servers:
                server.wait_ready(tls, token)
            # Modes alternate within each round, so a busy neighbour on this shared machine weighs on
            # all of them alike; medians over the rounds.
            for _ in range(rounds):
                for name, server, tls, token in servers:
                    lat = latency(server, tls, token, calls)
                    thr = asyncio.run(_throughput(server, tls, token, seconds))
                    results.setdefault(name, []).append((lat, thr, connect(server, tls, token, connects)))
    finally:
        for _name, server, _tls, _token in servers:
            server.stop()
        nats.stop()

    def med(name: str, part: int, key: str | None = None) -> float:
        return statistics.median(r[part][key] if key else r[part] for r in results[name])

    plain = servers[0][0]
    print(
        f"{code_version()}; {rounds} rounds of {calls} sequential calls, {seconds:.1f} s at 8 outstanding "
        f"and {connects} connects per mode; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        "| mode | Score p50 us (x plain) | p99 us | server CPU us/call | 8 outstanding: calls/s (x plain) "
        "| server CPU us/call | new channel + first call us |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in results:
        p50, rate = med(name, 0, "p50"), med(name, 1, "calls_s")
        print(
            f"| {name} | {p50:.0f} ({p50 / med(plain, 0, 'p50'):.2f}x) | {med(name, 0, 'p99'):.0f} "
            f"| {med(name, 0, 'server_cpu'):.0f} | {rate:,.0f} ({rate / med(plain, 1, 'calls_s'):.2f}x) "
            f"| {med(name, 1, 'server_cpu'):.0f} | {med(name, 2):,.0f} |"
        )
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
