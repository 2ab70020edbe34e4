"""Cold start at scale: an index (re)started into a running fleet, timed to ready and to exact.

    .venv/bin/python benchmarks/bench_cold_start.py                      # 700, 2,000, 7,000 workers
    .venv/bin/python benchmarks/bench_cold_start.py --workers 7000 --configs baseline,paced
    .venv/bin/python benchmarks/bench_cold_start.py --quick              # smoke run, a few seconds

A real nats-server (with its monitoring port) and a simulated fleet in a child process: every worker
of the fleet heartbeats every ``--heartbeat-interval`` (its epoch, seq and per-tier digest, as a
``Publisher`` does) and answers snapshot requests (docs/wire.md §6) with its blocks, from one NATS
connection and one wildcard subscription (``kvindex.snapshot.*``), as many workers' shims on one host
would. The workers hold the Mooncake trace's caches at the end of benchmarks/bench_mooncake.py's
default run (1,000 unique workers, LRU engines of 16,384 blocks, ``-d 7`` copies: ~2.1 M (block,
worker) entries at 7,000 workers); a fleet of N workers is the first N of them. ``--caches empty``
gives every worker no blocks (what a worker costs apart from its entries).

For each fleet size, each configuration (``--configs``) starts an index (``IndexService``, in this
process: one core) on the running fleet and measures, from ``IndexService.start``:

- **ready**: the gRPC readiness the index reports turns true (kvindex/service/readiness.py);
- **exact**: every worker of the fleet is in the index with its blocks, per tier, equal to the
  worker's (count and xor of its keys, checked every 50 ms; the whole fleet checked again at the end);
- the peak NATS traffic (messages and bytes per second, in and out of the server, from its ``/varz``
  monitoring endpoint every 0.25 s) and the fleet's snapshot answers per second;
- the index's apply rate: snapshot entries added per second of the time to exact.

Configurations: ``baseline`` is the repairer as configured before issue 34 (4 snapshot turns, 256
pending repairs); ``paced`` is the default now (kvindex/repair/README.md, "Cold start").

Beyond 7,000 workers the fleet is further copies of the trace on workers of their own, each copy's
keys in a hash space of its own (bench_mooncake's ``--trace-duplication-factor``); ``--fleet-procs``
spreads the fleet over child processes. ``--shards 1,2`` starts the index as child processes
instead (1: one ``kvindex serve``; K: K ``serve --shard I/K`` and their front on a nats-server that
partitions the fleet) and times each to ready and exact, the front to ready, and each process's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import machine_info, markdown_table, quiet_logs, render_table  # noqa: E402

MODEL = "mooncake"
UNIQUE = 1000  # bench_mooncake's unique workers (its default run); the fleet's worker u*7+r is copy r of u
BLOCK_SIZE = 128
PREFIX = "kvindex"
EPOCH = 1_700_000_000_000_000
SNAPSHOT = "snapshot"  # kvindex.wire.subjects.SNAPSHOT
STEADY_S = 2.0  # the index's CPU is measured this long once exact and ready
SEQ = 1000  # the workers are mid-stream: the index must ask for their blocks


# -- the fleet's caches ---------------------------------------------------------------------------


def trace_caches(unique_workers: int) -> list[np.ndarray]:
    """Per unique worker, the keys its LRU engine holds at the end of bench_mooncake's default run."""
    from bench_mooncake import EVENT, Config, build_workload

    from kvindex.wire.schema import STORED

    wl = build_workload(Config(workers=unique_workers, dup=1), log=lambda _m: None)
    held: list[set[int]] = [set() for _ in range(unique_workers)]
    for w, e in zip(wl.op_worker.tolist(), wl.op_event.tolist(), strict=True):
        if e < 0:
            continue
        keys = wl.ev_keys[e]
        if wl.ev_kind[e] == STORED:
            held[w].update(keys)
        else:
            held[w].difference_update(keys)
    assert EVENT  # (imported for its meaning: events are the ops with an event index)
    return [np.fromiter(sorted(s), dtype=np.uint64, count=len(s)) for s in held]


def write_caches(path: Path, caches: list[np.ndarray], copies: int) -> None:
    offsets = np.zeros(len(caches) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c) for c in caches])
    keys = np.concatenate(caches) if caches else np.zeros(0, np.uint64)
    np.savez(path, keys=keys, offsets=offsets, copies=np.array([copies]))


def worker_name(i: int, copies: int) -> str:
    return f"w{i // copies:06d}-{i % copies}"


def copy_keys(keys: np.ndarray, copy: int) -> np.ndarray:
    """Trace copy ``copy``'s keys: copy 0's moved into a hash space of their own (splitmix64 of the
    key and the copy), as bench_mooncake.py's ``--trace-duplication-factor`` gives each copy
    disjoint ids; copy 0 is the trace itself."""
    if copy == 0:
        return keys
    with np.errstate(over="ignore"):
        x = keys + np.uint64(copy) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class Caches:
    """Worker ``i``'s keys: the fleet is trace copies of ``unique * copies`` workers each (bench_mooncake's
    1,000 unique workers x ``-d 7``: 7,000 a copy); worker ``i`` is copy ``i // 7,000`` of unique
    worker ``i % 7,000 // 7``, in that copy's hash space."""

    def __init__(self, keys: np.ndarray, offsets: np.ndarray, copies: int) -> None:
        self.keys, self.offsets, self.copies = keys, offsets, copies
        self.unique = len(offsets) - 1
        self.per_copy = self.unique * copies

    @classmethod
    def load(cls, path: Path) -> Caches:
        data = np.load(path)
        return cls(data["keys"], data["offsets"], int(data["copies"][0]))

    def count(self, i: int) -> int:
        u = i % self.per_copy // self.copies
        return int(self.offsets[u + 1] - self.offsets[u])

    def of(self, i: int) -> np.ndarray:
        u = i % self.per_copy // self.copies
        return copy_keys(self.keys[self.offsets[u] : self.offsets[u + 1]], i // self.per_copy)


# -- the fleet (child process) --------------------------------------------------------------------


async def run_fleet(
    url: str, caches_path: Path, workers: int, heartbeat_interval: float, part: int = 0, parts: int = 1
) -> None:
    """Heartbeat workers ``part, part + parts, ...`` of the fleet every ``heartbeat_interval``
    (evenly spread) and answer their snapshot requests, until stdin closes. Each answer is encoded
    before the index starts (a worker's shim encodes its own, on its own core; the fleet's child
    processes share this machine's two). On a line on stdin, print the answers' times as JSON."""
    import nats

    from kvindex.wire import reconcile
    from kvindex.wire.codec import encode_heartbeat
    from kvindex.wire.subjects import Subjects

    subjects = Subjects(PREFIX)
    caches = Caches.load(caches_path)
    mine = range(part, workers, parts)
    names = {i: worker_name(i, caches.copies) for i in mine}
    index_of = {n: i for i, n in names.items()}

    nc = await nats.connect(url, pending_size=256 * 1024 * 1024, max_reconnect_attempts=-1)
    digests: dict[str, tuple[int, int]] = {}
    heartbeats: list[tuple[str, bytes]] = []
    answers: dict[int, list[bytes]] = {}
    for i, name in names.items():
        k = caches.of(i)
        xor = int(np.bitwise_xor.reduce(k)) if len(k) else 0
        digests[name] = (len(k), xor)
        payload = encode_heartbeat(
            worker=name,
            model=MODEL,
            epoch=EPOCH,
            seq=SEQ,
            ts=time.time(),
            block_size=BLOCK_SIZE,
            load={},
            capacity={"gpu": 16384},
            digest={"gpu": (len(k), xor)},
        )
        heartbeats.append((subjects.heartbeat(name), payload))
        answers[i] = list(reconcile.snapshot_parts(name, 0, EPOCH, SEQ, {"gpu": k.tolist()}, nc.max_payload))

    served: list[float] = []
    head = subjects.wildcard(SNAPSHOT)[:-1]

    async def on_snapshot(msg: Any) -> None:
        i = index_of.get(msg.subject[len(head) :])
        if i is None or not msg.reply:
            return  # another part's worker
        req = reconcile.decode_snapshot_request(msg.data)
        if req.dp_rank != 0:
            return
        served.append(time.time())
        for payload in answers[i]:
            await nc.publish(msg.reply, payload)

    await nc.subscribe(subjects.wildcard(SNAPSHOT), cb=on_snapshot)
    await nc.flush()

    async def heartbeat_loop() -> None:
        tick = 0.01
        n = len(heartbeats)
        per_tick = max(1, round(n * tick / heartbeat_interval))
        nxt = 0
        t = time.monotonic()
        while True:
            for _ in range(per_tick):
                subject, payload = heartbeats[nxt]
                await nc.publish(subject, payload)
                nxt = (nxt + 1) % n
            t += tick
            await asyncio.sleep(max(0.0, t - time.monotonic()))

    hb = asyncio.create_task(heartbeat_loop())
    # One full round of heartbeats before the index is started: the fleet is running.
    await asyncio.sleep(heartbeat_interval)
    print(json.dumps({"fleet": "up", "digests": digests}), flush=True)
    loop = asyncio.get_running_loop()
    while True:  # a line on stdin: report (and reset) the answers' times; end of stdin: stop
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        times, served[:] = list(served), []
        print(json.dumps({"served": times}), flush=True)
    hb.cancel()
    await nc.drain()


def peak_rate(times: Sequence[float], window: float) -> float:
    """The most events in any ``window`` seconds (sliding over the events), per second."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] < t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window


class Fleet:
    """The fleet: ``procs`` child processes, each heartbeating and answering for every procs-th worker."""

    def __init__(
        self, url: str, caches: Path, workers: int, heartbeat_interval: float, procs: int = 1
    ) -> None:
        self.procs = []
        for part in range(procs):
            cmd = [sys.executable, __file__, "--fleet-child", url, str(caches), str(workers)]
            cmd += [str(heartbeat_interval), str(part), str(procs)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.digests: dict[str, tuple[int, int]] = {}
        for proc in self.procs:
            assert proc.stdout is not None
            first = json.loads(proc.stdout.readline())
            self.digests.update({k: (v[0], v[1]) for k, v in first["digests"].items()})
        # In the fleet's order (worker index), not its processes'.
        self.digests = dict(sorted(self.digests.items()))

    def served(self) -> dict[str, Any]:
        times: list[float] = []
        for proc in self.procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("report\n")
            proc.stdin.flush()
            times += json.loads(proc.stdout.readline())["served"]
        times.sort()
        return {"served": len(times), "peak_per_s": peak_rate(times, 0.25)}

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- NATS monitoring ------------------------------------------------------------------------------


class VarzPoller:
    """Samples the server's /varz every ``every`` s (a thread: the index's loop is not disturbed)."""

    def __init__(self, port: int, every: float = 0.25) -> None:
        self.url = f"http://127.0.0.1:{port}/varz"
        self.every = every
        self.samples: list[tuple[float, int, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    v = json.load(r)
                self.samples.append(
                    (time.monotonic(), v["in_msgs"], v["out_msgs"], v["in_bytes"], v["out_bytes"])
                )
            except OSError:
                pass
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self, since: float, until: float) -> dict[str, float]:
        """Peak rates (per second) between two samples in [since, until]."""
        s = [x for x in self.samples if since - self.every <= x[0] <= until + self.every]
        out = {"in_msgs": 0.0, "out_msgs": 0.0, "in_bytes": 0.0, "out_bytes": 0.0}
        for a, b in itertools.pairwise(s):
            dt = b[0] - a[0]
            if dt <= 0:
                continue
            for j, name in enumerate(out, start=1):
                out[name] = max(out[name], (b[j] - a[j]) / dt)
        return out


# -- one index start ------------------------------------------------------------------------------


@dataclass
class Run:
    workers: int
    config: str
    entries: int
    ready_s: float | None = None
    exact_s: float | None = None
    ready_before_exact: bool = False
    nats: dict[str, float] = field(default_factory=dict)
    answers_peak: float = 0.0
    answers: int = 0
    counters: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0  # this process's CPU time (the index, and the 50 ms checks) until exact
    steady_cpu: float = 0.0  # ... per second afterwards (the fleet's heartbeats)

    @property
    def apply_rate(self) -> float:
        return self.entries / self.exact_s if self.exact_s else 0.0


CONFIGS = ("baseline", "paced")


def service_config(name: str, url: str, workers: int) -> Any:
    from kvindex.ingest.limits import IngestLimits
    from kvindex.repair.nats_repair import RepairConfig
    from kvindex.service.app import ServiceConfig

    limits = IngestLimits(max_instances_per_model=max(16384, 2 * workers))
    if name == "baseline":  # the repairer's settings before issue 34
        repair = RepairConfig(max_concurrent_snapshots=4)
        limits = IngestLimits(max_instances_per_model=max(16384, 2 * workers), max_pending_repairs=256)
    elif name == "paced":
        repair = RepairConfig()
    elif name.startswith("slots"):  # experiments: slotsN[-pendingM]
        a, _, b = name[5:].partition("-pending")
        repair = RepairConfig(max_concurrent_snapshots=int(a))
        if b:
            limits = IngestLimits(max_instances_per_model=max(16384, 2 * workers), max_pending_repairs=int(b))
    else:
        raise ValueError(f"unknown configuration {name!r}")
    return ServiceConfig(nats_url=url, grpc_host="127.0.0.1", grpc_port=0, repair=repair, limits=limits)


async def start_index(
    name: str, url: str, fleet: Fleet, varz: VarzPoller, entries: int, timeout: float, profile: bool = False
) -> Run:
    from kvindex.service.app import IndexService

    workers = len(fleet.digests)
    run = Run(workers, name, entries)
    svc = IndexService(service_config(name, url, workers))
    index, counters = svc.index, svc.counters
    todo = {(w, 0): d for w, d in fleet.digests.items()}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0, cpu0 = time.monotonic(), time.process_time()
    await svc.start()
    try:
        while time.monotonic() - t0 < timeout:
            now = time.monotonic() - t0
            ready = svc.grpc.ready
            # Every worker is mid-stream, so none is exact before a snapshot of it applies: the
            # digests are compared only from then on (comparing 7,000 every 50 ms cost the index
            # ~10 % of its core in this process).
            if todo and (ready or counters.snapshots_applied >= len(todo)):
                for key in [k for k, d in todo.items() if index.digest(k, 0) == d]:
                    del todo[key]
            if run.ready_s is None and ready:
                run.ready_s = now
                run.ready_before_exact = bool(todo)
            if not todo and run.exact_s is None:
                run.exact_s = now
                run.cpu_s = time.process_time() - cpu0
                if prof is not None:
                    prof.disable()
                    import pstats

                    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            if run.exact_s is not None and run.ready_s is not None:
                break
            await asyncio.sleep(0.05)
        end = time.monotonic()
        if run.exact_s is not None and run.ready_s is not None:
            # The fleet's steady load once exact: heartbeats only (the fleet is quiet).
            cpu1 = time.process_time()
            await asyncio.sleep(STEADY_S)
            run.steady_cpu = (time.process_time() - cpu1) / STEADY_S
        if run.exact_s is not None:  # still exact, the whole fleet
            wrong = [k for k, d in fleet.digests.items() if index.digest((k, 0), 0) != d]
            assert not wrong, f"{len(wrong)} workers no longer exact"
        run.nats = varz.peaks(t0, end)
        c = svc.counters
        run.counters = {
            "snapshots_requested": sum(c.snapshots_requested.values()),
            "snapshots_applied": c.snapshots_applied,
            "snapshots_failed": c.snapshots_failed,
            "repair_limit": c.rejects.get("repair_limit", 0),
            "slots_expired": svc.repairer.gate.expired,
            "blocks_added": c.snapshot_blocks_added,
            "instances": len(svc.registry),
            "rejects": dict(c.rejects),
        }
    finally:
        await svc.stop()
    ans = fleet.served()
    run.answers, run.answers_peak = ans["served"], ans["peak_per_s"]
    return run


# -- index processes: one `kvindex serve`, or K shards and their front ------------------------------


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class IndexProc:
    """One index process of a start (``kvindex serve``, or ``serve --shard I/K``) and its timings,
    from the moment the processes were spawned."""

    name: str
    owned: list[str]  # the workers it owns
    entries: int
    server: Any = None
    up_s: float | None = None  # its gRPC port answers (interpreter and imports done)
    up_cpu: float = 0.0
    ready_s: float | None = None
    exact_s: float | None = None
    cpu_s: float = 0.0  # its CPU time until exact, from the spawn
    steady_cpu: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProcRun:
    workers: int
    entries: int
    shards: int
    indexes: list[IndexProc]
    front_ready_s: float | None = None
    nats: dict[str, float] = field(default_factory=dict)
    answers: int = 0
    answers_peak: float = 0.0
    verified: int = 0  # workers whose blocks a Lookup found whole, after the exact check


def proc_health(address: str) -> int | None:
    """The health status, or None while the port does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            return int(
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            )
    except grpc.RpcError:
        return None


def proc_exact(stub: Any, p: IndexProc, digests: dict[str, tuple[int, int]]) -> bool:
    """Every worker the process owns is in sync with as many blocks as the worker holds (checked
    only once as many snapshots have applied: a ListInstances of thousands costs the index)."""
    from kvindex.v1 import kvindex_pb2 as pb

    if stub.Stats(pb.StatsRequest(), timeout=5).snapshots_applied < len(p.owned):
        return False
    got = {
        i.worker: (i.blocks.gpu, i.sync)
        for i in stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=10).instances
    }
    return len(got) == len(p.owned) and all(got.get(w) == (digests[w][0], "synced") for w in p.owned)


def proc_verify(stub: Any, p: IndexProc, caches: Caches, index_of: dict[str, int], sample: int) -> int:
    """Each worker's keys looked up on its index (``sample`` workers of it, seeded; 0: all): all of
    them held by the worker, none missing (with the counts equal, its blocks in the index are the
    worker's)."""
    import random

    from kvindex.v1 import kvindex_pb2 as pb

    owned = p.owned if not sample or sample >= len(p.owned) else random.Random(1).sample(p.owned, sample)
    ok = 0
    for w in owned:
        keys = caches.of(index_of[w]).tolist()
        if not keys:
            ok += 1
            continue
        r = stub.Lookup(pb.LookupRequest(model=MODEL, block_keys=keys, candidates=[w]), timeout=10)
        assert len(r.matches) == 1 and r.matches[0].matched_blocks == len(keys), f"{w}: not exact"
        ok += 1
    return ok


async def start_processes(
    shards: int, url: str, fleet: Fleet, varz: VarzPoller, caches: Caches, timeout: float, verify: int = 0
) -> ProcRun:
    """Spawn the index processes into the running fleet (``shards`` 1: one ``kvindex serve``; K: K
    ``serve --shard I/K`` and a ``serve --shards K`` front), time each to ready and to exact."""
    import grpc
    from bench_score import ServerProcess
    from grpc_health.v1 import health_pb2

    from kvindex.shards.layout import partition_of
    from kvindex.v1 import kvindex_pb2 as pb
    from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

    digests = fleet.digests
    names = list(digests)
    index_of = {w: i for i, w in enumerate(names)}
    limit = ["--max-instances-per-model", str(max(16384, 2 * len(names)))]
    if shards == 1:
        procs = [IndexProc("1 process", names, 0)]
    else:
        owned: list[list[str]] = [[] for _ in range(shards)]
        for w in names:
            owned[partition_of(w, shards)].append(w)
        procs = [IndexProc(f"shard {i}/{shards}", owned[i], 0) for i in range(shards)]
    for p in procs:
        p.entries = sum(digests[w][0] for w in p.owned)
    run = ProcRun(len(names), sum(p.entries for p in procs), shards, procs)
    serving = health_pb2.HealthCheckResponse.SERVING
    t0 = time.monotonic()
    front = None
    try:
        for i, p in enumerate(procs):
            p.server = ServerProcess(url, [*limit, *(["--shard", f"{i}/{shards}"] if shards > 1 else [])])
        if shards > 1:
            front = ServerProcess(url, ["--shards", str(shards), "--no-routing-sync", *limit])
        stubs = [pb_grpc.KvIndexStub(grpc.insecure_channel(p.server.address)) for p in procs]
        while time.monotonic() - t0 < timeout:
            for p, stub in zip(procs, stubs, strict=True):
                if p.server.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited; log: {p.server.log_file.name}")
                if p.ready_s is None:
                    status = proc_health(p.server.address)
                    now = time.monotonic() - t0
                    if status is not None and p.up_s is None:
                        p.up_s, p.up_cpu = now, cpu_seconds(p.server.pid)
                    if status == serving:
                        p.ready_s = now
                if p.up_s is not None and p.exact_s is None and proc_exact(stub, p, digests):
                    p.exact_s, p.cpu_s = time.monotonic() - t0, cpu_seconds(p.server.pid)
            if front is not None and run.front_ready_s is None and proc_health(front.address) == serving:
                run.front_ready_s = time.monotonic() - t0
            if all(p.ready_s is not None and p.exact_s is not None for p in procs) and (
                front is None or run.front_ready_s is not None
            ):
                break
            await asyncio.sleep(0.1)
        end = time.monotonic()
        if all(p.exact_s is not None for p in procs):
            cpu1 = [cpu_seconds(p.server.pid) for p in procs]
            await asyncio.sleep(STEADY_S)
            for p, c in zip(procs, cpu1, strict=True):
                p.steady_cpu = (cpu_seconds(p.server.pid) - c) / STEADY_S
            run.verified = sum(
                proc_verify(stub, p, caches, index_of, verify) for p, stub in zip(procs, stubs, strict=True)
            )
        for p, stub in zip(procs, stubs, strict=True):
            with contextlib.suppress(grpc.RpcError):
                st = stub.Stats(pb.StatsRequest(), timeout=5)
                p.counters = {
                    "snapshots_requested": dict(st.snapshots_requested),
                    "snapshots_applied": st.snapshots_applied,
                    "drift": st.drift_detected,
                    "rejects": dict(st.rejects_by_reason),
                }
        run.nats = varz.peaks(t0, end)
    finally:
        for p in procs:
            if p.server is not None:
                p.server.stop()
        if front is not None:
            front.stop()
    ans = fleet.served()
    run.answers, run.answers_peak = ans["served"], ans["peak_per_s"]
    return run


def proc_rows(runs: list[ProcRun]) -> list[list[str]]:
    out = []
    for r in runs:
        label = "1 process" if r.shards == 1 else f"{r.shards} shards + front"
        for j, p in enumerate(r.indexes):
            out.append(
                [
                    f"{r.workers:,}" if j == 0 else "",
                    label if j == 0 else "",
                    p.name,
                    f"{len(p.owned):,} / {p.entries:,}",
                    fmt_s(p.up_s),
                    fmt_s(p.ready_s),
                    fmt_s(p.exact_s),
                    f"{p.cpu_s:.2f} s ({p.cpu_s - p.up_cpu:.2f} s)" if p.exact_s else "—",
                    f"{p.steady_cpu * 100:.0f} %" if p.steady_cpu else "—",
                    (fmt_s(r.front_ready_s) if r.shards > 1 else "—") if j == 0 else "",
                    f"{r.nats.get('in_msgs', 0):,.0f} / {r.nats.get('out_msgs', 0):,.0f}" if j == 0 else "",
                    f"{r.nats.get('in_bytes', 0) / 1e6:,.1f} / {r.nats.get('out_bytes', 0) / 1e6:,.1f}"
                    if j == 0
                    else "",
                    f"{r.answers:,} ({r.answers_peak:,.0f}/s)" if j == 0 else "",
                    f"{r.verified:,}" if j == 0 else "",
                ]
            )
    return out


PROC_HEADER = [
    "workers",
    "deployment",
    "index process",
    "its workers / entries",
    "gRPC up",
    "ready",
    "exact",
    "CPU to exact (after gRPC up)",
    "CPU after",
    "front ready",
    "NATS peak msgs/s in / out",
    "NATS peak MB/s in / out",
    "snapshot answers (peak)",
    "workers verified",
]


# -- driver ---------------------------------------------------------------------------------------


def fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def rows(runs: list[Run]) -> list[list[str]]:
    out = []
    for r in runs:
        out.append(
            [
                f"{r.workers:,}",
                f"{r.entries:,}",
                r.config,
                fmt_s(r.ready_s) + (" (before exact)" if r.ready_before_exact else ""),
                fmt_s(r.exact_s),
                f"{r.nats.get('in_msgs', 0):,.0f} / {r.nats.get('out_msgs', 0):,.0f}",
                f"{r.nats.get('in_bytes', 0) / 1e6:,.1f} / {r.nats.get('out_bytes', 0) / 1e6:,.1f}",
                f"{r.answers:,} ({r.answers_peak:,.0f}/s)",
                f"{r.apply_rate / 1e6:.2f} M/s" if r.exact_s else "—",
                f"{r.cpu_s:.2f} s" if r.exact_s else "—",
                f"{r.steady_cpu * 100:.0f} %" if r.steady_cpu else "—",
            ]
        )
    return out


HEADER = [
    "workers",
    "entries",
    "config",
    "ready",
    "exact",
    "NATS peak msgs/s in / out",
    "NATS peak MB/s in / out",
    "snapshot answers (peak)",
    "entries/s to exact",
    "index CPU to exact",
    "index CPU after",
]


async def bench(args: argparse.Namespace) -> tuple[list[Run], list[ProcRun]]:
    from kvindex.service.natsd import EmbeddedNats, free_port
    from kvindex.shards.layout import nats_mappings
    from kvindex.wire.subjects import Subjects

    quiet_logs()
    sizes = sorted(args.workers)
    copies = 7
    t = time.perf_counter()
    if args.caches == "trace":
        unique_caches = trace_caches(UNIQUE)
    else:
        unique_caches = [np.zeros(0, np.uint64) for _ in range(UNIQUE)]
    print(f"[caches] {args.caches}: {UNIQUE:,} unique workers in {time.perf_counter() - t:.1f} s", flush=True)
    runs: list[Run] = []
    proc_runs: list[ProcRun] = []
    # 0: the index in this process (the configurations); K >= 1: index processes (K shards)
    deployments = args.shards or [0]
    with tempfile.TemporaryDirectory(prefix="kvindex-cold-") as tmp:
        path = Path(tmp) / "caches.npz"
        write_caches(path, unique_caches, copies)
        caches = Caches.load(path)
        for n in sizes:
            entries = sum(caches.count(i) for i in range(n))
            for k in deployments:
                mon = free_port()
                conf = Path(tmp) / "nats.conf"
                text = f"http: 127.0.0.1:{mon}\nmax_payload: 1048576\n"
                if k > 1:  # the fleet partitioned by the server (docs/shards.md)
                    text += nats_mappings(Subjects(PREFIX), k)
                conf.write_text(text)
                server = EmbeddedNats(config=conf)
                await server.start()
                varz = VarzPoller(mon)
                fleet = None
                try:
                    t = time.perf_counter()
                    fleet = Fleet(server.url, path, n, args.heartbeat_interval, args.fleet_procs)
                    print(f"[fleet] {n:,} workers up in {time.perf_counter() - t:.1f} s", flush=True)
                    for name in args.configs if k == 0 else ["paced"]:
                        for _ in range(args.repeat):
                            if k == 0:
                                r = await start_index(
                                    name, server.url, fleet, varz, entries, args.timeout, args.profile
                                )
                                if args.label:
                                    r.config = f"{args.label} {r.config}"
                                runs.append(r)
                                render_table(f"cold start, {n:,} workers", HEADER, rows([r]))
                                print(markdown_table(HEADER, rows([r])), flush=True)
                                print(f"  counters: {r.counters}", flush=True)
                            else:
                                pr = await start_processes(
                                    k, server.url, fleet, varz, caches, args.timeout, args.verify
                                )
                                proc_runs.append(pr)
                                render_table(f"cold start, {n:,} workers", PROC_HEADER, proc_rows([pr]))
                                print(markdown_table(PROC_HEADER, proc_rows([pr])), flush=True)
                                for ip in pr.indexes:
                                    print(f"  {ip.name}: {ip.counters}", flush=True)
                            await asyncio.sleep(1.0)  # the fleet's answers to the stopped index drain
                finally:
                    if fleet is not None:
                        fleet.close()
                    varz.stop()
                    await server.stop()
    return runs, proc_runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[700, 2000, 7000])
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    p.add_argument("--caches", choices=("trace", "empty"), default="trace")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="give up on a start after this long (s)")
    p.add_argument(
        "--label",
        default="",
        help="prefix of the configurations' names in the table (e.g. 'before': this script run on the "
        "code of an earlier commit with PYTHONPATH, benchmarks/README.md)",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the index until exact")
    p.add_argument(
        "--shards",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="index processes instead of the index in this process: 1 is one `kvindex serve`, K >= 2 "
        "is K `serve --shard I/K` and their front on a nats-server partitioning the fleet; e.g. 1,2",
    )
    p.add_argument(
        "--verify",
        type=int,
        default=1000,
        help="with --shards: workers per index process whose keys are looked up once exact (0: all)",
    )
    p.add_argument(
        "--fleet-procs",
        type=int,
        default=1,
        help="child processes the fleet is spread over (1 is one connection)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 70 workers, a few seconds")
    args = p.parse_args(argv)
    for c in args.configs:
        if c not in CONFIGS and not c.startswith("slots"):
            p.error(f"--configs: unknown configuration {c!r} (choose from {', '.join(CONFIGS)})")
    if any(k < 1 for k in args.shards):
        p.error("--shards: each deployment is 1 (one process) or K >= 2 shards")
    if args.fleet_procs < 1:
        p.error("--fleet-procs: at least 1")
    if args.quick:
        args.workers = [70]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--fleet-child":
        url, caches, workers, hb, part, parts = argv[1:7]
        asyncio.run(run_fleet(url, Path(caches), int(workers), float(hb), int(part), int(parts)))
        return 0
    args = parse_args(argv)
    load = os.getloadavg()
    runs, proc_runs = asyncio.run(bench(args))
    print()
    if runs:
        print(markdown_table(HEADER, rows(runs)))
    if proc_runs:
        print(markdown_table(PROC_HEADER, proc_rows(proc_runs)))
    end = os.getloadavg()
    print(f"\n{machine_info()}; load average {load[0]:.2f} at the start, {end[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
