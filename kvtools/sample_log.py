"""``python -m kvtools.sample_log --out FILE``: a small event log for the docs (``make sample-log``).

A real service with ``--capture`` on an embedded nats-server; a simulated fleet (three engines and a
shared pool, ``workers_shim.sim``) serving requests that the service routes (Score with commit, then
Release when they finish); and one flaky worker (``kvtools.testing.faults``) that loses batches (gaps
repaired by replay, a replay too old for its history -> snapshot), restarts, and finally goes
silent (stale, then forgotten). About ten seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from pathlib import Path

import grpc
import nats

from kvindex.capture.format import zstd_available
from kvindex.capture.recorder import CaptureConfig
from kvindex.fleet.liveness import LivenessConfig
from kvindex.keys import block_keys
from kvindex.observability.logs import configure_logging
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import FaultyPublisher
from workers_shim.sim import EngineConfig, SimRequest, TimeModel
from workers_shim.sim.fleet import run_fleet

MODEL = "sim-model"
BLOCK = 16
# Four "system prompts" shared by many requests, as in a chat fleet.
SYSTEMS = [[1000 * s + i for i in range(BLOCK * 6)] for s in range(4)]


def prompt(rng: random.Random, system: int) -> list[int]:
    return SYSTEMS[system] + [rng.randrange(50_000) for _ in range(rng.randrange(BLOCK, BLOCK * 5))]


async def generate(out: Path, seconds: float, zstd: bool) -> list[int]:
    rng = random.Random(7)
    natsd = EmbeddedNats(jetstream=True)
    await natsd.start()
    svc = IndexService(
        ServiceConfig(
            nats_url=natsd.url,
            grpc_host="127.0.0.1",
            grpc_port=0,
            repair=RepairConfig(reconcile_interval=3.0, replay_timeout=0.5, tick=0.1),
            liveness=LivenessConfig(stale_after=1.0, forget_after=2.5, tick=0.1),
            capture=CaptureConfig(str(out), zstd=zstd, check_interval=1.0),
        )
    )
    await svc.start()
    cfg = EngineConfig(
        gpu_blocks=160,
        cpu_blocks=80,
        block_size=BLOCK,
        max_batched_tokens=512,
        max_running=8,
        time=TimeModel(a_ms=2.0, b_ms_per_token=0.02, d_ms_per_decode_seq=4.0),
    )
    channel = grpc.aio.insecure_channel(svc.grpc.address)
    stub = pb_grpc.KvIndexStub(channel)
    done: asyncio.Queue[str] = asyncio.Queue()
    fleet = await run_fleet(
        natsd.url,
        3,
        cfg,
        model=MODEL,
        pool_blocks=120,
        heartbeat_interval=0.25,
        on_completion=lambda _w, c: done.put_nowait(c.request.id) if c.kind == "finished" else None,
    )
    flaky: FaultyPublisher | None = None
    try:

        async def flaky_worker(history: int = 1024) -> FaultyPublisher:
            nc = await nats.connect(natsd.url)
            pub = FaultyPublisher(
                nc, worker="flaky", model=MODEL, block_size=BLOCK, heartbeat_interval=0.25, history=history
            )
            pub._owns_nc = True
            await pub.start()
            return pub

        async def releaser() -> None:
            while True:
                rid = await done.get()
                await stub.Release(pb.ReleaseRequest(request_id=rid, phase="finished"))

        release_task = asyncio.create_task(releaser())
        flaky = await flaky_worker(history=4)
        step = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            step += 1
            tokens = prompt(rng, rng.randrange(len(SYSTEMS)))
            rid = f"req-{step}"
            resp = await stub.Score(
                pb.ScoreRequest(model=MODEL, token_ids=tokens, commit=True, request_id=rid)
            )
            worker = resp.committed_instance_id.partition("/")[0]
            keys = block_keys(tokens, BLOCK, MODEL)
            if worker in fleet.engines:
                await fleet.submit(worker, SimRequest(rid, keys, len(tokens), rng.randrange(4, 24)))
            elif flaky is not None and worker == flaky.worker:
                flaky.stored(keys)  # the flaky worker "serves" it by caching its blocks
                await stub.Release(pb.ReleaseRequest(request_id=rid, phase="finished"))
            if flaky is not None:
                if step % 6 == 0:
                    flaky.stored(block_keys(prompt(rng, 3), BLOCK, MODEL))
                if step in (10, 20):
                    # 10: one batch lost, a replay repairs it; 20: six lost, more than the worker
                    # keeps (history 4), so the replay is too old and a snapshot repairs it.
                    lost = 1 if step == 10 else 6
                    flaky.faults.only_seqs = set(range(flaky.seq + 1, flaky.seq + 1 + lost))
                    for _ in range(lost + 1):
                        flaky.stored(block_keys(prompt(rng, 2), BLOCK, MODEL))
                        await flaky.flush()
                    flaky.faults.quiet()
                if step == 40:
                    await flaky.close()  # restart: same worker id, new epoch, cache kept
                    flaky = await flaky_worker()
                    flaky.stored(block_keys(SYSTEMS[3], BLOCK, MODEL))
                if step == 70:
                    flaky.faults.partitioned = True  # silent from now on: stale, then forgotten
            await asyncio.sleep(0.05)
        await asyncio.sleep(3.0)  # long enough for the silent worker to be forgotten
        release_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await release_task
    finally:
        await fleet.close()
        if flaky is not None:
            await flaky.close()
        await channel.close()
        await svc.stop()
        await natsd.stop()
    return SYSTEMS[1] + list(range(7, 7 + BLOCK * 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="log file to write")
    parser.add_argument("--query-out", help="also write a prompt (JSON) sharing a system prompt")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of traffic")
    parser.add_argument("--no-zstd", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("console", "error")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = asyncio.run(generate(out, args.seconds, zstd=zstd_available() and not args.no_zstd))
    if args.query_out:
        Path(args.query_out).write_text(json.dumps({"model": MODEL, "token_ids": tokens}) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
