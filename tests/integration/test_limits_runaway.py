"""A runaway worker publishing 10x its announced capacity, over a real nats-server, into a real
`kvindex serve` process: the service's memory (RSS) stays bounded and the other workers' answers
stay exact. The same flood into a service whose block limit is lifted is the baseline."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import grpc

from kvindex.keys import block_keys
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.test_cli import KVINDEX
from workers_shim.publisher import Publisher

MODEL = "llama-limits"
BS = 4
CAPACITY = 100_000  # the runaway's announced GPU capacity; it publishes 10x that
FLOOD_ROUNDS = 9


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def prompt(worker: int, i: int) -> list[int]:
    return [worker * 1_000_000 + i * 1000 + t for t in range(12 * BS)]


async def run_flood(nats_url: str, tmp: Path, run: str, *flags: str) -> dict:
    """Start `kvindex serve`, bring 3 honest workers and the runaway to steady state, flood, measure."""
    port = free_port()
    log_path = tmp / f"serve-{run}.log"
    serve = (KVINDEX, "serve", "--nats", nats_url, "--grpc-host", "127.0.0.1", "--grpc-port", str(port))
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*serve, "--metrics-port", "-1", "--log-format", "json", "--reconcile-interval", "0", *flags],
            stderr=log,
            # glibc's default trim threshold: `serve` otherwise keeps up to 64 MiB of freed heap
            # (kvindex/service/malloc.py), which would blur what RSS growth says of the index's own.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "MALLOC_TRIM_THRESHOLD_": "131072"},
        )
    try:
        await wait_until(lambda: "kvindex_serving" in log_path.read_text(), 20, "kvindex serve up")
        cap = {"gpu": 2000}
        honest = [
            await Publisher.connect(
                nats_url, worker=f"{run}-good{w}", model=MODEL, block_size=BS, capacity=cap
            )
            for w in range(3)
        ]
        runaway = await Publisher.connect(
            nats_url, worker=f"{run}-runaway", model=MODEL, block_size=BS, capacity={"gpu": CAPACITY}
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                result = await drive(pb_grpc.KvIndexStub(channel), proc.pid, honest, runaway)
        finally:
            for p in [*honest, runaway]:
                await p.close()
        result["log"] = log_path.read_text()
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def drive(stub: pb_grpc.KvIndexStub, pid: int, honest: list[Publisher], runaway: Publisher) -> dict:
    pubs = [*honest, runaway]

    async def applied() -> None:
        for p in pubs:
            await p.flush()

        async def caught_up() -> bool:
            reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
            seqs = {i.worker: i.last_seq for i in reply.instances}
            return all(seqs.get(p.worker) == p.seq for p in pubs)

        for _ in range(3000):
            if await caught_up():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the service did not apply every batch")

    held: dict[str, list[list[int]]] = {p.worker: [] for p in honest}

    def honest_step(round_: int) -> None:
        # Each honest worker stores two prompts and evicts its oldest ones: real churn.
        for w, p in enumerate(honest):
            for i in (2 * round_, 2 * round_ + 1):
                keys = block_keys(prompt(w, i), BS, MODEL)
                p.stored(keys)
                held[p.worker].append(keys)
            while len(held[p.worker]) > 6:
                p.removed(held[p.worker].pop(0))

    # Warm up: everyone at steady state, the runaway exactly at its capacity.
    honest_step(0)
    runaway.stored(range(1, CAPACITY + 1))
    await applied()
    await asyncio.sleep(0.3)  # heartbeats with the capacity have arrived
    before = rss_bytes(pid)
    stats0 = await stub.Stats(pb.StatsRequest())
    # The flood: 9 more capacities of new blocks, interleaved with the honest workers' churn.
    for r in range(FLOOD_ROUNDS):
        start = (r + 1) * CAPACITY + 1
        runaway.stored(range(start, start + CAPACITY))
        honest_step(r + 1)
        await applied()
    after = rss_bytes(pid)
    stats = await stub.Stats(pb.StatsRequest())
    reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
    blocks = {i.worker: i.blocks.gpu for i in reply.instances}

    # Every honest worker's answers are exact: what it holds matches fully, what it evicted not at all.
    for w, p in enumerate(honest):
        for i in range(2 * (FLOOD_ROUNDS + 1)):
            keys = block_keys(prompt(w, i), BS, MODEL)
            ans = await stub.Lookup(pb.LookupRequest(model=MODEL, block_keys=keys))
            matched = {m.worker: m.matched_blocks for m in ans.matches}
            want = len(keys) if keys in held[p.worker] else 0
            assert matched.get(p.worker, 0) == want, (p.worker, i)
        assert blocks[p.worker] == sum(len(k) for k in held[p.worker])
    return {
        "rss_before": before,
        "rss_after": after,
        "index_bytes_before": stats0.index_bytes,
        "index_bytes_after": stats.index_bytes,
        "runaway_blocks": blocks[runaway.worker],
        "rejects": dict(stats.rejects_by_reason),
    }


async def test_runaway_worker_leaves_memory_bounded_and_others_exact(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    limited = await run_flood(nats_server.url, tmp_path, "limited")
    # Baseline: the same flood with the block limit lifted (the index takes all 1 M blocks).
    lifted = ("--capacity-slack", "100", "--max-tier-blocks", str(1 << 30))
    unlimited = await run_flood(nats_server.url, tmp_path, "unlimited", *lifted)
    grew = limited["rss_after"] - limited["rss_before"]
    grew_unlimited = unlimited["rss_after"] - unlimited["rss_before"]
    for name, r, g in (("limited", limited, grew), ("unlimited", unlimited, grew_unlimited)):
        shown = {k: v for k, v in r.items() if k != "log"}
        print(name, json.dumps(shown), f"rss growth {g / 2**20:.1f} MiB")

    assert limited["runaway_blocks"] == int(CAPACITY * 1.25)
    assert unlimited["runaway_blocks"] == CAPACITY * (FLOOD_ROUNDS + 1)
    assert limited["rejects"].get("block_limit", 0) >= FLOOD_ROUNDS
    assert "block_limit" not in unlimited["rejects"]
    # Logged once (per instance and reason per minute), though refused batch after batch.
    refusals = [json.loads(line) for line in limited["log"].splitlines() if '"limit_refused"' in line]
    assert len(refusals) == 1 and refusals[0]["worker"] == "limited-runaway"
    # Bounded: the index grew by the quarter of a capacity the slack allows, not by 9 capacities.
    index_grew = limited["index_bytes_after"] - limited["index_bytes_before"]
    assert index_grew < 0.2 * (unlimited["index_bytes_after"] - unlimited["index_bytes_before"])
    assert grew < 0.25 * grew_unlimited, (grew, grew_unlimited)
