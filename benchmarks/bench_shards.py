"""Index shards (docs/shards.md): event throughput and Score latency, 1 process against 2 shard
processes and their front, in one run on one nats-server.

Set-up: a nats-server whose config partitions ``kvindex.events.*`` / ``kvindex.status.*`` into 2
shards (``kvindex shard-mappings 2``); the unsharded index reads the same batches under another
prefix (``plain``), which is not mapped. Every index is a ``kvindex serve`` child process.

- **ingest**: W workers' batches (one stored event of K new keys each, W x B batches), encoded
  before timing and published by this process as fast as nats-py takes them; timed from the first
  publish until every batch is applied (``Stats.batches_applied``, polled every 50 ms on each
  index), and the CPU seconds each index process spent (``/proc/<pid>/stat``). Phases alternate
  (1 process, 2 shards, ...) for ``--reps`` repetitions; medians.
- **drop-all**: the cost a shard would pay for every message it does not own if it subscribed to
  the whole fleet and filtered in Python: an unsharded index on the *mapped* prefix receives every
  partition's messages under ``kvindex.part.>`` and drops them unread; its CPU per message.
- **score**: after the ingest, ``Score`` requests (block keys of one worker's first batches: that
  worker matches the whole prompt) alternately to the unsharded index and to the front, one at a
  time from this process; p50 / p99 of the client-side latency.

Run: ``.venv/bin/python benchmarks/bench_shards.py`` (~1-2 min; ``--quick`` for a smaller fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import nats
from bench_score import ServerProcess, code_version, stop_process

from kvindex.service.natsd import free_port, nats_server_binary
from kvindex.shards.layout import nats_mappings
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.codec import encode_batch, encode_heartbeat
from kvindex.wire.subjects import Subjects

MODEL = "bench-shards"
BS = 16
TICKS = os.sysconf("SC_CLK_TCK")


class MappedNats:
    def __init__(self, shards: int) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)  # noqa: SIM115
        # Slow consumers are what the measurement provokes: let the server buffer a whole run.
        # A stopped index (--preload) reads nothing until it is continued: no write deadline.
        self.conf.write(
            "max_pending: 1GB\nmax_payload: 8MB\nwrite_deadline: 600s\n"
            + nats_mappings(Subjects("kvindex"), shards)
        )
        self.conf.close()
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-c", self.conf.name]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc, 5)
        os.unlink(self.conf.name)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_batches(
    prefix: str, workers: int, batches: int, keys: int, seed: int, names: str = "w"
) -> list[tuple[str, bytes]]:
    """Interleaved over workers (``{names}{i:04d}``), in order per worker; the same keys under every
    prefix for a seed."""
    rng = random.Random(seed)
    per_worker = [[rng.getrandbits(64) for _ in range(batches * keys)] for _ in range(workers)]
    out = []
    for w in range(workers):  # one heartbeat first: the reported capacity (no digest: no repair)
        name = f"{names}{w:04d}"
        beat = encode_heartbeat(
            worker=name,
            model=MODEL,
            epoch=1,
            seq=0,
            ts=0.0,
            block_size=BS,
            load={},
            capacity={"gpu": 1 << 20},
            digest={},
        )
        out.append((f"{prefix}.status.{name}", beat))
    for b in range(batches):
        for w in range(workers):
            name = f"{names}{w:04d}"
            chunk = per_worker[w][b * keys : (b + 1) * keys]
            event = {"type": "stored", "tier": "gpu", "keys": chunk, "parent": None}
            payload = encode_batch(
                worker=name, model=MODEL, epoch=1, seq=b + 1, ts=0.0, block_size=BS, events=[event]
            )
            out.append((f"{prefix}.events.{name}", payload))
    return out


def prompt_of(workers: int, batches: int, keys: int, seed: int, worker: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    per_worker = [[rng.getrandbits(64) for _ in range(batches * keys)] for _ in range(workers)]
    return per_worker[worker][:blocks]


_stubs: dict[str, Any] = {}


def stub(address: str) -> Any:
    """One channel per index for the whole run: a channel per poll would cost the polled index
    more CPU than the batches it is timed on."""
    if address not in _stubs:
        _stubs[address] = pb_grpc.KvIndexStub(grpc.insecure_channel(address))
    return _stubs[address]


def applied(addresses: list[str]) -> int:
    return sum(stub(a).Stats(pb.StatsRequest(), timeout=5).batches_applied for a in addresses)


def stats(addresses: list[str]) -> list[str]:
    out = []
    for address in addresses:
        s = stub(address).Stats(pb.StatsRequest(), timeout=5)
        out.append(
            f"received {s.batches_received} applied {s.batches_applied} gaps {s.gaps} "
            f"duplicates {s.batches_duplicate} rejects {dict(s.rejects_by_reason)}"
        )
    return out


def serve(url: str, extra: list[str]) -> ServerProcess:
    return ServerProcess(
        url, ["--stale-after", "600", "--forget-after", "1200", "--reconcile-interval", "0", *extra]
    )


async def publish(url: str, messages: list[tuple[str, bytes]]) -> None:
    nc = await nats.connect(url, pending_size=1 << 30)
    for subject, payload in messages:
        await nc.publish(subject, payload)
    await nc.flush(timeout=60)
    await nc.close()


def ingest(
    server: MappedNats,
    messages: list[tuple[str, bytes]],
    procs: list[ServerProcess],
    total: int,
    preload: bool = False,
) -> dict[str, Any]:
    """Publish ``messages`` and wait until ``procs`` applied ``total`` batches: the rate, and the CPU
    seconds of each index process, of the nats-server and of this process (the publisher, polling).

    ``preload``: the indexes are stopped (SIGSTOP) while the messages are published and the
    nats-server holds them; the clock starts when they are continued. What is timed is then the
    indexes draining, not the publisher (in a deployment the fleet publishes from other machines)
    competing with them for this machine's cores."""
    url = server.url
    addresses = [p.address for p in procs]
    base = applied(addresses)
    if preload:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        t = time.perf_counter()
        asyncio.run(publish(url, messages))
        published = time.perf_counter() - t
        time.sleep(0.5)  # let the server write what the stopped processes' sockets take
    cpu0 = [cpu_seconds(p.pid) for p in procs]
    others0 = cpu_seconds(server.proc.pid), time.process_time()
    t0 = time.perf_counter()
    if preload:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
    else:
        asyncio.run(publish(url, messages))
        published = time.perf_counter() - t0
    deadline = time.monotonic() + 300
    while (done := applied(addresses) - base) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{done} of {total} batches applied after 300 s: {stats(addresses)}")
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    cpu = [cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0, strict=True)]
    server_cpu, own_cpu = cpu_seconds(server.proc.pid) - others0[0], time.process_time() - others0[1]
    return {
        "wall": wall,
        "published": published,
        "cpu": cpu,
        "rate": total / wall,
        # Cores busy on average over the run: the indexes, the nats-server, this process.
        "cores": (sum(cpu) / wall, server_cpu / wall, own_cpu / wall),
    }


def drop_all(url: str, messages: list[tuple[str, bytes]], proc: ServerProcess) -> float:
    """CPU seconds per message of a process that receives every message and drops it."""
    c0 = cpu_seconds(proc.pid)
    asyncio.run(publish(url, messages))
    last, still = cpu_seconds(proc.pid), 0
    while still < 5:  # done when its CPU time stops moving (5 x 100 ms)
        time.sleep(0.1)
        now = cpu_seconds(proc.pid)
        still = still + 1 if now == last else 0
        last = now
    return (last - c0) / len(messages)


def score_latency(single: str, front: str, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    times: tuple[list[float], list[float]] = ([], [])
    with grpc.insecure_channel(single) as a, grpc.insecure_channel(front) as b:
        stubs = (pb_grpc.KvIndexStub(a), pb_grpc.KvIndexStub(b))
        for n, keys in enumerate(prompts * 2):
            request = pb.ScoreRequest(model=MODEL, block_keys=keys, prompt_tokens=len(keys) * BS)
            order = (0, 1) if n % 2 else (1, 0)
            answers = {}
            for i in order:
                t = time.perf_counter()
                answers[i] = stubs[i].Score(request, timeout=10)
                times[i].append(time.perf_counter() - t)
            if [r.instance_id for r in answers[0].ranked] != [r.instance_id for r in answers[1].ranked]:
                raise AssertionError("the front ranked differently from the unsharded index")
    return times


def fanout_costs(workers: int, batches: int, keys: int, prompts: list[list[int]]) -> dict[str, float]:
    """The fan-out's CPU, in one process and without NATS (what scheduling on a busy machine hides):
    per Score, the unsharded match; per shard answer, the shard's side (decode the query, match,
    encode) and the front's (encode the query, decode the answer, apply it, merge); per instance
    state row a shard sends (a heartbeat's changes), the front's apply. Medians, in seconds."""
    from kvindex.core import CoreConfig, build_core
    from kvindex.shards.front import MirrorIndex, ShardFront
    from kvindex.shards.layout import ShardSpec
    from kvindex.shards.messages import Query, answer_decoder, query_decoder, query_encoder
    from kvindex.shards.shard import ShardResponder

    core = build_core()
    for subject, payload in make_batches("kvindex", workers, batches, keys, 1000, "r0w"):
        if ".status." in subject:
            core.consumer.on_heartbeat(subject, payload)
        else:
            core.consumer.on_events(subject, payload)
    shard = ShardResponder(
        ShardSpec(0, 2), Subjects(), core.index, core.registry, core.consumer, lambda: (True, "")
    )
    mirror = MirrorIndex()
    fcore = build_core(CoreConfig(index=mirror))
    front = ShardFront(Subjects(), 2, mirror, fcore.registry, fcore.calibrator, fcore.rankers)
    health = front.shards[0]
    t = time.perf_counter()
    full = answer_decoder.decode(shard.answer(Query("", [], None, None, 0, "")))
    front._apply(health, full, fcore.registry.clock())
    rows = max(1, len(full.states))
    first_row = (time.perf_counter() - t) / rows
    t = time.perf_counter()
    front._apply(health, full, fcore.registry.clock())  # known instances: a heartbeat's update
    state_row = (time.perf_counter() - t) / rows
    match, shard_side, front_side = [], [], []
    for keys in prompts:
        t0 = time.perf_counter()
        core.index.match(MODEL, keys, None, None)
        t1 = time.perf_counter()
        q = query_encoder.encode(Query(MODEL, keys, None, None, health.since, health.replica))
        t2 = time.perf_counter()
        data = shard.answer(query_decoder.decode(q))
        t3 = time.perf_counter()
        answer = answer_decoder.decode(data)
        front._apply(health, answer, 0.0)
        merged = {(w, r): (n, (a, b, c, d)) for w, r, n, a, b, c, d in answer.matches}
        mirror.set_answer(MODEL, keys, None, merged)  # type: ignore[arg-type]
        t4 = time.perf_counter()
        match.append(t1 - t0)
        shard_side.append(t3 - t2)
        front_side.append((t2 - t1) + (t4 - t3))
    return {
        "match": statistics.median(match),
        "shard": statistics.median(shard_side),
        "front": statistics.median(front_side),
        "state_row": state_row,
        "first_row": first_row,
        "rows": rows,
    }


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--batches", type=int, default=400, help="batches per worker")
    ap.add_argument("--keys", type=int, default=8, help="new keys per batch")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scores", type=int, default=200, help="Score requests to each (x2 prompts sets)")
    ap.add_argument(
        "--preload",
        action="store_true",
        help="publish each phase's batches while the indexes are stopped; time their drain only",
    )
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.workers, args.batches, args.reps, args.scores = 64, 200, 1, 50
    total = args.workers * args.batches
    print(f"kvindex {code_version()}; {args.workers} workers x {args.batches} batches x {args.keys} keys")
    if args.preload:
        print("preload: batches published while the indexes are stopped; their drain is timed")
    print(f"load average before: {os.getloadavg()}")
    server = MappedNats(2)
    procs: list[ServerProcess] = []
    try:
        single = serve(server.url, ["--subject-prefix", "plain", "--no-routing-sync"])
        shards = [serve(server.url, ["--shard", f"{i}/2"]) for i in range(2)]
        procs = [single, *shards]
        for p in procs:
            p.wait_ready()
        front = serve(server.url, ["--shards", "2", "--no-routing-sync"])
        procs.append(front)
        front.wait_ready()
        one_runs, two_runs = [], []
        for rep in range(args.reps):
            # Fresh workers each repetition (an epoch per run would do too): new ids, new keys.
            seed, names = 1000 + rep, f"r{rep}w"
            plain = make_batches("plain", args.workers, args.batches, args.keys, seed, names)
            sharded = make_batches("kvindex", args.workers, args.batches, args.keys, seed, names)
            one_runs.append(ingest(server, plain, [single], total, args.preload))
            two_runs.append(ingest(server, sharded, shards, total, args.preload))
            rates = one_runs[-1]["rate"], two_runs[-1]["rate"]
            print(f"rep {rep}: 1 process {rates[0]:,.0f} batches/s, 2 shards {rates[1]:,.0f}")
        one_rate = statistics.median(r["rate"] for r in one_runs)
        two_rate = statistics.median(r["rate"] for r in two_runs)
        one_cpu = statistics.median(r["cpu"][0] for r in one_runs) / total
        two_cpu = [statistics.median(r["cpu"][i] for r in two_runs) / (total / 2) for i in range(2)]
        publish_rate = statistics.median(total / r["published"] for r in one_runs + two_runs)
        prompts = [
            prompt_of(args.workers, args.batches, args.keys, 1000, w, 256)
            for w in range(0, args.workers, max(1, args.workers // args.scores))
        ][: args.scores]
        single_t, front_t = score_latency(single.address, front.address, prompts)
        mem = [rss_mb(p.pid) for p in (single, *shards, front)]
        for p in procs:
            p.stop()
        procs = []
        dropper = serve(server.url, ["--no-routing-sync"])  # prefix kvindex: sees every partition, owns none
        procs = [dropper]
        dropper.wait_ready()
        extra = make_batches("kvindex", args.workers, args.batches, args.keys, 7, "d")
        drop = drop_all(server.url, extra, dropper)
    finally:
        for p in procs:
            p.stop()
        server.stop()
    print(f"load average after: {os.getloadavg()}")
    costs = fanout_costs(args.workers, args.batches, args.keys, prompts)
    print()
    rows = [
        (
            "ingest, batches/s (wall, until all applied)",
            f"{one_rate:,.0f}",
            f"{two_rate:,.0f}",
            two_rate / one_rate,
        ),
        (
            "index CPU per batch it owns, us",
            f"{one_cpu * 1e6:.1f}",
            " / ".join(f"{c * 1e6:.1f}" for c in two_cpu),
            0,
        ),
        (f"Score p50, ms (256 blocks, {args.workers * args.reps} instances)", *ms(single_t, front_t, 0.5)),
        ("Score p99, ms", *ms(single_t, front_t, 0.99)),
        ("RSS after the runs, MB", f"{mem[0]:.0f}", f"{mem[1]:.0f} + {mem[2]:.0f} + front {mem[3]:.0f}", 0),
    ]
    print("| measurement | 1 process | 2 shards (+ front) | ratio |")
    print("|---|---|---|---|")
    for name, one, two, ratio in rows:
        print(f"| {name} | {one} | {two} | {f'{ratio:.2f}x' if ratio else '-'} |")
    print()
    print(f"- publisher (this process): {publish_rate:,.0f} batches/s offered")
    for name, runs in (("1 process", one_runs), ("2 shards", two_runs)):
        cores = [statistics.median(r["cores"][i] for r in runs) for i in range(3)]
        print(
            f"- cores busy during ingest, {name}: indexes {cores[0]:.2f}, nats-server {cores[1]:.2f}, "
            f"publisher and polling {cores[2]:.2f} (of 2)"
        )
    print(
        f"- in one process, no NATS: unsharded match {costs['match'] * 1e6:.0f} us; per shard answer, "
        f"shard side {costs['shard'] * 1e6:.0f} us, front side {costs['front'] * 1e6:.0f} us; "
        f"front's apply of a changed state row {costs['state_row'] * 1e6:.1f} us (a new instance's "
        f"{costs['first_row'] * 1e6:.1f} us; {costs['rows']} rows)"
    )
    print(f"- drop-all receiver (a shard filtering the fleet in Python): {drop * 1e6:.1f} us CPU per message")


def ms(single: list[float], front: list[float], q: float) -> tuple[str, str, float]:
    a, b = pct(single, q), pct(front, q)
    return f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", b / a


if __name__ == "__main__":
    main()
