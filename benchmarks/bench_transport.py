"""What gRPC itself costs per Score call on this machine: the same 8K-token ScoreRequest answered by
servers that do no ranking, each in its own process, against a health Check on the same server.

Servers (``--role server --kind KIND``):

- ``aio``: grpc.aio (what ``kvindex serve`` runs), unary Score, ScoreStream and health Check;
- ``sync``: grpcio's thread-pool server (``grpc.server`` with a ThreadPoolExecutor), the same three.

The handler parses the request (protobuf, as the service does) and returns a small fixed
ScoreResponse (4 ranked instances), so the figures are the transport's floor: what a Score costs
beyond the service's own work (``bench_score.py``'s in-process breakdown). Sequential calls from a
sync client in this process: p50 and the server's CPU per call (from /proc).

Run: ``.venv/bin/python benchmarks/bench_transport.py`` (~1 min; ``--calls`` to change the count).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_score import CpuMeter, StreamCaller, fmt_shares, measure_latency

from kvindex.service.natsd import free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc


def _reply() -> pb.ScoreResponse:
    response = pb.ScoreResponse(model="m", block_size=16, total_blocks=512, prompt_tokens=8192)
    for i in range(4):
        r = response.ranked.add(instance_id=f"w{i:03d}/0", worker=f"w{i:03d}", cost=1.5 * i)
        r.load.running = i
    return response


class Echo(pb_grpc.KvIndexServicer):
    """Parses the request (as the service does: upb) and returns a fixed ranking."""

    def __init__(self) -> None:
        self.reply = _reply()

    def answer(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        _ = len(request.token_ids)  # the parse happened in the deserializer
        return self.reply


class AioEcho(Echo):
    async def Score(self, request: pb.ScoreRequest, context: Any) -> pb.ScoreResponse:
        return self.answer(request)

    async def ScoreStream(self, requests: AsyncIterator[pb.ScoreRequest], context: Any) -> Any:
        async for request in requests:
            yield self.answer(request)


class SyncEcho(Echo):
    def Score(self, request: pb.ScoreRequest, context: Any) -> pb.ScoreResponse:
        return self.answer(request)

    def ScoreStream(self, requests: Iterator[pb.ScoreRequest], context: Any) -> Iterator[pb.ScoreResponse]:
        for request in requests:
            yield self.answer(request)


OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0)]


async def serve_aio(port: int) -> None:
    server = grpc.aio.server(options=OPTIONS)
    pb_grpc.add_KvIndexServicer_to_server(AioEcho(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def serve_sync(port: int, threads: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
    pb_grpc.add_KvIndexServicer_to_server(SyncEcho(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.stop(0)


def run_server(kind: str, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "server", "--kind", kind, "--port", str(port)]
    cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"{kind} server did not start")
    return proc, f"127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=4, help="thread pool of the sync server")
    ap.add_argument("--rounds", type=int, default=2, help="servers measured in turn, this many times")
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="aio", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "server":
        if args.kind == "aio":
            asyncio.run(serve_aio(args.port))
        else:
            serve_sync(args.port, args.threads)
        return 0
    rng = random.Random(1)
    request = pb.ScoreRequest(model="m", token_ids=[rng.randrange(128_000) for _ in range(8192)], top_k=4)
    print(
        f"gRPC floor: {request.ByteSize()} B ScoreRequest (8192 token ids), a fixed 4-instance reply; "
        f"{args.calls} sequential calls per row; grpcio {grpc.__version__}; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    for rnd in range(args.rounds):
        for kind in ("aio", "sync"):
            proc, address = run_server(kind, args.threads)
            try:
                meter = CpuMeter({"server": proc.pid, "client": os.getpid()})
                with grpc.insecure_channel(address) as channel:
                    rows = {
                        "health": (
                            health_pb2_grpc.HealthStub(channel).Check,
                            health_pb2.HealthCheckRequest(),
                        ),
                        "Score": (pb_grpc.KvIndexStub(channel).Score, request),
                    }
                    results = {}
                    for name, (rpc, req) in rows.items():
                        results[name] = measure_latency(lambda r=rpc, q=req: r(q), args.calls, 200, meter)
                    caller = StreamCaller(channel)
                    results["ScoreStream"] = measure_latency(
                        lambda c=caller: c(request),  # type: ignore[misc]
                        args.calls,
                        200,
                        meter,
                    )
                    caller.close()
                label = kind if kind == "aio" else f"sync ({args.threads} threads)"
                for name, lat in results.items():
                    print(
                        f"  round {rnd + 1} {label:18s} {name:12s} p50 {lat.p50_us:5.0f} us  p99 "
                        f"{lat.p99_us:6.0f} us  server CPU/call {lat.server_cpu_us:4.0f} us  "
                        f"({fmt_shares(lat.cpu)})"
                    )
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
