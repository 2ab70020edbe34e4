"""Index benchmark: our InvertedIndex (fed wire bytes through the real Consumer) vs NVIDIA Dynamo's
RadixTree (fed JSON KvCacheEvents through its Python API), on the same event stream and queries.

    .venv/bin/python benchmarks/bench_index.py                  # full size (1-2 min on 2 cores)
    .venv/bin/python benchmarks/bench_index.py --quick          # reduced size (~10 s)
    .venv/bin/python benchmarks/bench_index.py --write-readme   # also update benchmarks/README.md
    .venv/bin/python benchmarks/bench_index.py --profile        # cProfile of our paths only

Measures (medians over repetitions; encoding is done before any timing):
1. ingest of 4-block stored events, events/s: ours with one event per wire batch and with batches as
   the publisher seals them, Dynamo with one apply_event per event;
2. ingest of 512-block stored events, blocks/s;
3. prefix match of 512-block requests over 64 workers: p50/p99 latency, and per-worker agreement of
   both structures with a plain-set oracle;
4. memory per distinct block at 1M distinct blocks, each structure in a fresh subprocess.
Install the peer with ``make install-bench``; without it, ours runs alone.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import re
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    MODEL,
    Chain,
    ChainGen,
    Event,
    encode_dynamo,
    encode_ours,
    fleet_stream,
    interleave,
    machine_info,
    markdown_table,
    median,
    percentile,
    quiet_logs,
    render_table,
    rss_bytes,
    split_events,
    worker_name,
)

from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index.base import InstanceMatch
from kvindex.index.inverted import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.observability.counters import IngestCounters
from kvindex.sequencer.cursor import Sequencer

try:
    from dynamo._core import RadixTree
except ImportError:  # the bench extra is not installed: run ours alone
    RadixTree = None  # type: ignore[assignment,misc]

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
SECTION = "## Index: ingest, match, memory (vs NVIDIA Dynamo RadixTree)"
RESULTS_START = "<!-- bench_index:results:start -->"
RESULTS_END = "<!-- bench_index:results:end -->"
WORKERS = 64
REQUEST_BLOCKS = 512


@dataclass(frozen=True)
class Sizes:
    reps: int
    small_distinct: int  # distinct blocks of the 4-block-event stream in test 1
    large_events_per_worker: int  # 512-block events per worker in test 2
    match_background_blocks: int  # unrelated distinct blocks in the match state
    match_families: int
    match_queries: int
    memory_blocks: int
    memory_reps: int
    memory_extra_points: tuple[int, ...] = ()  # more sizes, one run each (not held to the target)


FULL = Sizes(
    reps=7,
    small_distinct=240_000,
    large_events_per_worker=24,
    match_background_blocks=400_000,
    match_families=24,
    match_queries=400,
    memory_blocks=1_000_000,
    memory_reps=3,
    memory_extra_points=(750_000,),
)
QUICK = Sizes(
    reps=3,
    small_distinct=50_000,
    large_events_per_worker=6,
    match_background_blocks=60_000,
    match_families=8,
    match_queries=100,
    memory_blocks=200_000,
    memory_reps=1,
)


@dataclass
class Row:
    """One line of the result table."""

    name: str
    unit: str
    ours: float
    dynamo: float | None
    higher_is_better: bool
    target: str
    target_ratio: float  # ours/dynamo (or dynamo/ours when lower is better) must reach this
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.dynamo is None or not self.dynamo or not self.ours:
            return None
        return self.ours / self.dynamo if self.higher_is_better else self.dynamo / self.ours

    @property
    def met(self) -> str:
        r = self.ratio
        if r is None:
            return "n/a"
        return "met" if r >= self.target_ratio else "MISSED"


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit in ("events/s", "blocks/s"):
        return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.1f} k"
    if unit == "us":
        return f"{x:.1f}"
    return f"{x:.1f}"


# -- drivers ----------------------------------------------------------------------------------------


# The table module InvertedIndex uses: None is its default (native when built); --backend python
# selects the pure-Python twin it falls back to without a C compiler.
TABLES: Any = None


def new_index() -> InvertedIndex:
    return InvertedIndex() if TABLES is None else InvertedIndex(TABLES)


def new_consumer() -> Consumer:
    return build_consumer(new_index(), Registry(), sequencer=Sequencer(), counters=IngestCounters())


def settle() -> None:
    """Collect, then move every live object out of the collector's sight. The benchmark's own workload
    (hundreds of thousands of tracked lists and tuples) must not be traversed by garbage collections
    that the timed code triggers: a service does not carry it. Objects made later are still collected."""
    gc.collect()
    gc.freeze()


def ingest_ours(payloads: Sequence[tuple[str, bytes]]) -> tuple[float, Consumer]:
    """Seconds to feed pre-encoded batches through Consumer.on_events into a fresh index."""
    consumer = new_consumer()
    on_events = consumer.on_events
    settle()
    t0 = time.perf_counter()
    for subject, payload in payloads:
        on_events(subject, payload)
    elapsed = time.perf_counter() - t0
    c = consumer.counters
    # Every batch must have been applied in order; a reject or gap would make the number meaningless.
    assert c.rejects_total == 0 and c.gaps == 0, (c.rejects, c.gaps)
    assert c.batches_applied == len(payloads), (c.batches_applied, len(payloads))
    return elapsed, consumer


def pin_to_one_cpu() -> int | None:
    """Run this process, and the threads it starts later, on one CPU.

    Dynamo's Python API hands every call to the tree's own thread and waits for the answer. When that
    thread sits on another, idle vCPU, each call pays a cross-CPU wake-up, which on a VM varied from
    ~5 to ~60 us between runs (Dynamo's 4-block ingest measured 16k..155k events/s on the same data).
    On one CPU the hand-off is a same-core switch: Dynamo's numbers are stable and at their best, and
    ours (single-threaded) are unaffected. ``--no-pin`` measures the other way.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0))  # the last CPU: CPU 0 usually takes more interrupts
    os.sched_setaffinity(0, {cpu})
    return cpu


def dynamo_round_trip_us(tree: Any, calls: int = 2000) -> float:
    """p50 of a find_matches that matches nothing: the per-call cost of reaching the tree's thread."""
    clock = time.perf_counter_ns
    lat = []
    for _ in range(calls):
        t0 = clock()
        tree.find_matches([0])
        lat.append((clock() - t0) / 1e3)
    return percentile(lat, 50)


def ingest_dynamo(payloads: Sequence[tuple[int, bytes]]) -> tuple[float, Any]:
    """Seconds to apply pre-encoded JSON events, one apply_event call per event, into a fresh tree."""
    assert RadixTree is not None
    tree = RadixTree()
    apply = tree.apply_event
    settle()
    t0 = time.perf_counter()
    for worker, payload in payloads:
        apply(worker, payload)
    # The tree runs operations on its own thread, in order: a query after the last event is a barrier,
    # so the time cannot stop before all events are applied.
    tree.find_matches([0])
    return time.perf_counter() - t0, tree


def count_blocks(events: Sequence[Event]) -> int:
    return sum(len(ev.keys) for ev in events)


def check_entries(consumer: Consumer, tree: Any, expected: int) -> None:
    """Both structures must hold every (block, worker) pair of the stream: a silently skipped event
    (Dynamo logs and drops a store whose parent it does not know) would flatter its numbers."""
    got = consumer.index.stats().entries[0]
    assert got == expected, f"ours holds {got} (block, worker) entries, the stream has {expected}"
    if tree is not None:
        dumped = (json.loads(e)["event"]["data"]["stored"]["blocks"] for e in tree.dump_tree_as_events())
        got = sum(len(blocks) for blocks in dumped)
        assert got == expected, f"Dynamo holds {got} (block, worker) entries, the stream has {expected}"


# -- 1 + 2: ingest ----------------------------------------------------------------------------------


def small_stream(sizes: Sizes, seed: int) -> tuple[list[Event], int]:
    """4-block events: each request's newly computed blocks reported 4 at a time; 32 system prefixes
    of 8..256 blocks shared across workers, unique tails of 4..64 blocks."""
    return fleet_stream(
        ChainGen(seed),
        np.random.default_rng(seed + 1),
        workers=WORKERS,
        target_blocks=sizes.small_distinct,
        per_event=4,
        granule=4,
        groups=32,
        prefix_blocks=(8, 256),
        tail_blocks=(4, 64),
    )


def bench_ingest_small(sizes: Sizes, seed: int, res: Results, dyn: bool) -> None:
    events, distinct = small_stream(sizes, seed)
    assert all(len(ev.keys) == 4 for ev in events)
    n_events = len(events)
    singles = encode_ours(events, per_batch=1)
    batched = encode_ours(events, per_batch=64)
    dyn_payloads = encode_dynamo(events) if dyn else []
    res.facts.append(
        f"4-block stream: {n_events:,} stored events ({n_events * 4:,} blocks, {distinct:,} distinct) on "
        f"{WORKERS} workers; {len(singles):,} single-event batches or {len(batched):,} publisher batches "
        f"(<= 64 events, mean {n_events / len(batched):.1f} events/batch)"
    )
    t_single: list[float] = []
    t_batched: list[float] = []
    t_dyn: list[float] = []
    for _ in range(sizes.reps):
        # Alternate the contenders so that machine noise hits all of them alike.
        t_single.append(ingest_ours(singles)[0])
        t, consumer = ingest_ours(batched)
        t_batched.append(t)
        tree = None
        if dyn:
            t, tree = ingest_dynamo(dyn_payloads)
            t_dyn.append(t)
    check_entries(consumer, tree, count_blocks(events))
    if tree is not None:
        res.facts.append(
            f"Dynamo per-call round trip (find_matches of an unknown block) after this step: p50 "
            f"{dynamo_round_trip_us(tree):.1f} us; 4-block ingest over the repetitions: "
            f"{n_events / max(t_dyn) / 1e3:.0f}k..{n_events / min(t_dyn) / 1e3:.0f}k events/s"
        )
    d = n_events / median(t_dyn) if dyn else None
    res.rows.append(
        Row(
            "ingest 4-block events, 1 event/batch",
            "events/s",
            n_events / median(t_single),
            d,
            True,
            ">= 10x",
            10.0,
        )
    )
    res.rows.append(
        Row(
            "ingest 4-block events, <=64 events/batch",
            "events/s",
            n_events / median(t_batched),
            d,
            True,
            ">= 10x",
            10.0,
            "Dynamo: 1 call/event in both rows",
        )
    )


def large_stream(sizes: Sizes, seed: int) -> list[Event]:
    """512-block prompts (long-context prefill): one of 32 shared prefixes of 0..448 blocks + a unique
    tail; each worker serves each prefix at most once, so every event's blocks are new for it."""
    gen = ChainGen(seed)
    rng = np.random.default_rng(seed + 1)
    n_groups = max(32, sizes.large_events_per_worker)
    prefixes = [gen.extend(None, int(n)) for n in rng.integers(0, 15, n_groups) * 32]
    per_worker: list[list[Event]] = []
    for w in range(WORKERS):
        evs = []
        for g in rng.permutation(n_groups)[: sizes.large_events_per_worker]:
            prefix = prefixes[int(g)]
            parent = prefix.keys[-1] if len(prefix) else None
            chain = prefix + gen.extend(parent, REQUEST_BLOCKS - len(prefix))
            evs.append(Event(w, None, chain.keys, chain.local))
        per_worker.append(evs)
    return interleave(per_worker)


def bench_ingest_large(sizes: Sizes, seed: int, res: Results, dyn: bool) -> None:
    events = large_stream(sizes, seed)
    blocks = count_blocks(events)
    ours = encode_ours(events, per_batch=1)  # a 512-block event is a batch of its own (4096-key cap)
    dyn_payloads = encode_dynamo(events) if dyn else []
    distinct = len({k for ev in events for k in ev.keys})
    res.facts.append(
        f"512-block stream: {len(events):,} stored events ({blocks:,} blocks, {distinct:,} distinct) on "
        f"{WORKERS} workers, one event per wire batch"
    )
    t_ours: list[float] = []
    t_dyn: list[float] = []
    for _ in range(sizes.reps):
        t, consumer = ingest_ours(ours)
        t_ours.append(t)
        tree = None
        if dyn:
            t, tree = ingest_dynamo(dyn_payloads)
            t_dyn.append(t)
    check_entries(consumer, tree, blocks)
    res.rows.append(
        Row(
            "ingest 512-block events",
            "blocks/s",
            blocks / median(t_ours),
            blocks / median(t_dyn) if dyn else None,
            True,
            ">= 1x",
            1.0,
        )
    )


# -- 3: match ---------------------------------------------------------------------------------------


def new_part(held: set[int], chain: Chain) -> tuple[int | None, Chain]:
    """The part of ``chain`` a worker does not hold yet (engines report only newly cached blocks)."""
    i = 0
    while i < len(chain) and chain.keys[i] in held:
        i += 1
    return (chain.keys[i - 1] if i else None), chain.slice(i, len(chain))


@dataclass
class MatchState:
    events: list[Event]
    held: list[set[int]]  # oracle: the keys each worker holds
    queries: list[Chain]


def match_state(sizes: Sizes, seed: int) -> MatchState:
    """Conversations ("families") of 512 blocks behind 4 shared system prompts; each worker has cached
    prefixes of several families, of varying length, half of them followed by a private branch (a
    different continuation), on top of unrelated background traffic."""
    gen = ChainGen(seed)
    rng = np.random.default_rng(seed + 1)
    system = [gen.extend(None, n) for n in (8, 32, 64, 128)]
    trunks = []
    for f in range(sizes.match_families):
        s = system[f % len(system)]
        trunks.append(s + gen.extend(s.keys[-1], REQUEST_BLOCKS - len(s)))
    held: list[set[int]] = [set() for _ in range(WORKERS)]
    per_worker: list[list[Event]] = [[] for _ in range(WORKERS)]

    def store(w: int, chain: Chain) -> None:
        parent, new = new_part(held[w], chain)
        if len(new):
            held[w].update(new.keys)
            per_worker[w].extend(split_events(w, parent, new, 64))

    background, _ = fleet_stream(
        gen,
        rng,
        workers=WORKERS,
        target_blocks=sizes.match_background_blocks,
        per_event=64,
        groups=16,
        prefix_blocks=(8, 128),
        tail_blocks=(8, 256),
    )
    for ev in background:
        held[ev.worker].update(ev.keys)
        per_worker[ev.worker].append(ev)
    lengths: dict[int, list[int]] = {}
    per_family = max(4, WORKERS * 6 // sizes.match_families)
    for f, trunk in enumerate(trunks):
        for w in rng.choice(WORKERS, size=min(WORKERS, per_family), replace=False):
            # Skewed towards short cached prefixes, with some near-complete ones.
            n = int(min(REQUEST_BLOCKS, max(1, rng.exponential(120))))
            lengths.setdefault(f, []).append(n)
            chain = trunk.slice(0, n)
            if rng.random() < 0.5 and n < REQUEST_BLOCKS:
                chain = chain + gen.extend(chain.keys[-1], int(rng.integers(1, REQUEST_BLOCKS - n + 1)))
            store(int(w), chain)
    queries = []
    for _ in range(sizes.match_queries):
        f = int(rng.integers(len(trunks)))
        # Query the whole conversation, or diverge where some worker's cached prefix ends, or anywhere.
        r = rng.random()
        if r < 0.4:
            q = REQUEST_BLOCKS
        elif r < 0.7:
            q = int(rng.choice(lengths[f]))
        else:
            q = int(rng.integers(0, REQUEST_BLOCKS + 1))
        head = trunks[f].slice(0, q)
        queries.append(head + gen.extend(head.keys[-1] if q else None, REQUEST_BLOCKS - q))
    return MatchState(interleave(per_worker), held, queries)


def oracle_overlap(held: list[set[int]], keys: list[int]) -> dict[int, int]:
    out = {}
    for w, keys_of_w in enumerate(held):
        n = 0
        for k in keys:
            if k not in keys_of_w:
                break
            n += 1
        if n:
            out[w] = n
    return out


def bench_match(sizes: Sizes, seed: int, res: Results, dyn: bool) -> None:
    state = match_state(sizes, seed)
    ours_payloads = encode_ours(state.events, per_batch=64)
    _, consumer = ingest_ours(ours_payloads)
    index = consumer.index
    assert isinstance(index, InvertedIndex)
    tree = ingest_dynamo(encode_dynamo(state.events))[1] if dyn else None
    check_entries(consumer, tree, count_blocks(state.events))
    stats = index.stats()
    names = {worker_name(w): w for w in range(WORKERS)}
    res.facts.append(
        f"match state: {stats.distinct_blocks[0]:,} distinct blocks, {stats.entries[0]:,} (block, worker) "
        f"entries on {stats.instances} workers; {len(state.queries)} queries of {REQUEST_BLOCKS} blocks"
    )

    # Agreement: both structures against the oracle, on every query.
    def ours_scores(keys: list[int]) -> dict[int, int]:
        found: dict[Any, InstanceMatch] = index.match(MODEL, keys)
        return {names[inst[0]]: m.length for inst, m in found.items() if m.length}

    bad = 0
    hits: list[int] = []
    for i, q in enumerate(state.queries):
        truth = oracle_overlap(state.held, q.keys)
        hits.append(len(truth))
        got = {"ours": ours_scores(q.keys)}
        if tree is not None:
            got["dynamo"] = {w: n for (w, _rank), n in tree.find_matches(q.local).scores.items() if n}
        for who, scores in got.items():
            if scores != truth:
                bad += 1
                if len(res.mismatches) < 10:
                    diff = {w: (truth.get(w, 0), scores.get(w, 0)) for w in set(truth) | set(scores)}
                    diff = {w: d for w, d in diff.items() if d[0] != d[1]}
                    res.mismatches.append(
                        f"query {i}: {who} differs from oracle (worker: (truth, got)) {diff}"
                    )
    checked = "ours and Dynamo" if tree is not None else "ours"
    res.facts.append(
        f"agreement: {checked} vs a plain-set oracle on all {len(state.queries)} queries: "
        f"{bad} mismatching results; workers matching per query: median {median(hits):.0f}, max {max(hits)}"
    )

    # Latency: every query once per repetition, contenders alternating per query.
    match = index.match
    lat_ours: list[list[float]] = []
    lat_dyn: list[list[float]] = []
    lat_dyn_raw: list[list[float]] = []
    order = list(range(len(state.queries)))
    clock = time.perf_counter_ns
    for rep in range(sizes.reps):
        random.Random(rep).shuffle(order)
        lo, ld, lr = [], [], []
        settle()
        for i in order:
            q = state.queries[i]
            keys, local = q.keys, q.local
            # Who goes first alternates by repetition, so neither always runs on a cache the other warmed.
            if rep % 2 == 0:
                t0 = clock()
                match(MODEL, keys)
                lo.append((clock() - t0) / 1e3)
            if tree is not None:
                t0 = clock()
                _ = tree.find_matches(local).scores
                ld.append((clock() - t0) / 1e3)
                t0 = clock()
                tree.find_matches(local)
                lr.append((clock() - t0) / 1e3)
            if rep % 2 == 1:
                t0 = clock()
                match(MODEL, keys)
                lo.append((clock() - t0) / 1e3)
        lat_ours.append(lo)
        lat_dyn.append(ld)
        lat_dyn_raw.append(lr)

    def pct(samples: list[list[float]], q: float) -> float | None:
        return median(percentile(s, q) for s in samples) if samples and samples[0] else None

    note = "Dynamo timed with .scores: a Python dict, as ours returns"
    res.rows.append(
        Row(
            "match 512 blocks, 64 workers: p50",
            "us",
            pct(lat_ours, 50) or 0,
            pct(lat_dyn, 50),
            False,
            "<= 1x",
            1.0,
            note,
        )
    )
    res.rows.append(
        Row(
            "match 512 blocks, 64 workers: p99",
            "us",
            pct(lat_ours, 99) or 0,
            pct(lat_dyn, 99),
            False,
            "-",
            0.0,
        )
    )
    if tree is not None:
        res.facts.append(
            f"Dynamo find_matches without reading .scores: p50 {pct(lat_dyn_raw, 50):.1f} us, "
            f"p99 {pct(lat_dyn_raw, 99):.1f} us"
        )


# -- 4: memory --------------------------------------------------------------------------------------


def memory_events(blocks: int, seed: int) -> tuple[list[Event], int]:
    """1M-distinct-block fleet: 64 shared system prefixes of 16..256 blocks, unique tails of 8..256
    blocks, reported in chunks of up to 128 blocks (a chunked-prefill step)."""
    gen = ChainGen(seed)
    rng = np.random.default_rng(seed + 1)
    return fleet_stream(
        gen,
        rng,
        workers=WORKERS,
        target_blocks=blocks,
        per_event=128,
        groups=64,
        prefix_blocks=(16, 256),
        tail_blocks=(8, 256),
    )


def memory_child(kind: str, blocks: int, seed: int) -> dict[str, Any]:
    """Runs in a fresh interpreter: build one structure and measure what it added."""
    quiet_logs()
    events, distinct = memory_events(blocks, seed)
    entries = count_blocks(events)
    # Inputs stay referenced through both readings, so the build cannot reuse memory they freed.
    ours_payloads = encode_ours(events, per_batch=64) if kind.startswith("ours") else []
    dyn_payloads = encode_dynamo(events) if kind == "dynamo" else []
    gc.collect()
    if kind == "ours-tracemalloc":
        tracemalloc.start()
    before = rss_bytes()
    keep: Any
    if kind == "dynamo":
        keep = ingest_dynamo(dyn_payloads)[1]
    else:
        keep = ingest_ours(ours_payloads)[1]
        assert keep.index.stats().distinct_blocks[0] == distinct, "60-bit key collision or generator bug"
    gc.collect()
    out: dict[str, Any] = {
        "kind": kind,
        "distinct": distinct,
        "entries": entries,
        "rss_delta": rss_bytes() - before,
    }
    if kind == "ours-tracemalloc":
        # tracemalloc sees Python objects only; the native tables report their own bytes.
        out["traced"] = tracemalloc.get_traced_memory()[0]
        out["nbytes"] = getattr(keep.index.stats(), "nbytes", 0)  # 0: no native tables
        out["self_reported"] = out["traced"] + out["nbytes"]
        tracemalloc.stop()
    del keep, ours_payloads, dyn_payloads, events
    return out


def run_memory_child(kind: str, blocks: int, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--memory-child", kind, "--blocks", str(blocks), "--seed", str(seed)]
    if TABLES is not None:
        cmd += ["--backend", "python"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("MEMORY "):
            return json.loads(line[len("MEMORY ") :])
    raise RuntimeError(f"memory child {kind} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def per_block(runs: list[dict[str, Any]], field_name: str = "rss_delta") -> float:
    """Median bytes per distinct block over the runs of one memory child kind."""
    return median(r[field_name] / r["distinct"] for r in runs)


def bench_memory(sizes: Sizes, seed: int, res: Results, dyn: bool) -> None:
    kinds = ["ours", "ours-tracemalloc"] + (["dynamo"] if dyn else [])
    for n_blocks, reps, target in (
        (sizes.memory_blocks, sizes.memory_reps, True),
        *((n, 1, False) for n in sizes.memory_extra_points),
    ):
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds if target or k != "ours-tracemalloc"}
        for _ in range(reps):
            for kind in runs:
                runs[kind].append(run_memory_child(kind, n_blocks, seed))
        first = runs["ours"][0]
        distinct, entries = first["distinct"], first["entries"]

        res.facts.append(
            f"memory fleet @ {distinct / 1e6:.2f}M: {distinct:,} distinct blocks, {entries:,} "
            f"(block, worker) entries on {WORKERS} workers; RSS delta in a fresh process per "
            f"structure, median of {reps}"
        )
        res.rows.append(
            Row(
                f"memory per distinct block @ {distinct / 1e6:.2f}M (RSS)",
                "B",
                per_block(runs["ours"]),
                per_block(runs["dynamo"]) if dyn else None,
                False,
                "<= 1x" if target else "-",
                1.0 if target else 0.0,
                "" if target else "table fill varies with size (power-of-two growth); 1 run",
            )
        )
        if target:
            traced = runs["ours-tracemalloc"]
            res.rows.append(
                Row(
                    f"memory per distinct block @ {distinct / 1e6:.2f}M (ours, self-reported)",
                    "B",
                    per_block(traced, "self_reported"),
                    None,
                    False,
                    "-",
                    0.0,
                    f"stats().nbytes {per_block(traced, 'nbytes'):.1f} + tracemalloc "
                    f"{per_block(traced, 'traced'):.1f}",
                )
            )


# -- profiling (ours only) --------------------------------------------------------------------------


def profile_ours(sizes: Sizes, seed: int) -> None:
    """cProfile of our ingest and match paths, top functions by own time."""
    events, _ = small_stream(sizes, seed)

    def feed(payloads: list[tuple[str, bytes]]) -> Callable[[], None]:
        consumer = new_consumer()  # built outside the profiled call, like the timed runs

        def run() -> None:
            for subject, payload in payloads:
                consumer.on_events(subject, payload)

        return run

    cases: list[tuple[str, Callable[[], object]]] = [
        ("ingest 4-block, 1 event/batch", feed(encode_ours(events, 1))),
        ("ingest 4-block, <=64 events/batch", feed(encode_ours(events, 64))),
        ("ingest 512-block", feed(encode_ours(large_stream(sizes, seed), 1))),
    ]
    state = match_state(sizes, seed)
    index = ingest_ours(encode_ours(state.events, 64))[1].index

    def run_match() -> None:
        for _ in range(20):
            for q in state.queries:
                index.match(MODEL, q.keys)

    cases.append(("match x20", run_match))
    for label, fn in cases:
        prof = cProfile.Profile()
        prof.runcall(fn)
        print(f"\n=== cProfile: {label} ===")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


# -- output -----------------------------------------------------------------------------------------


HEADER = ["measurement", "unit", "ours", "Dynamo", "ratio", "target", "status"]


# -- fleet-size sweep -----------------------------------------------------------------------------


def sweep_child(instances: int, blocks: int, seed: int, calls: int) -> dict[str, Any]:
    """Runs in a fresh interpreter: one model with ``instances`` instances sharing ``blocks`` distinct
    background blocks (1.31 entries per block, as in the memory test), plus one instance holding a
    512-block prompt. Measures the prompt's match, a cold prompt's match, memory per distinct block,
    and the heartbeat path of the whole fleet."""
    from kvindex.core import CoreConfig, build_core
    from workers_shim.publisher import WorkerLog

    quiet_logs()
    rng = np.random.default_rng(seed)
    keys = rng.integers(1, 2**63, size=blocks, dtype=np.uint64)
    first = rng.integers(0, instances, size=blocks)
    second = rng.integers(0, instances, size=blocks)
    twice = rng.random(blocks) < 0.31
    per: list[list[int]] = [[] for _ in range(instances)]
    for k, a, b, t in zip(keys.tolist(), first.tolist(), second.tolist(), twice.tolist(), strict=True):
        per[a].append(k)
        if t and b != a:
            per[b].append(k)
    prompt = rng.integers(1, 2**63, size=512, dtype=np.uint64).tolist()
    cold = rng.integers(1, 2**63, size=512, dtype=np.uint64).tolist()
    holder = int(rng.integers(0, instances))
    names = [(f"w{i:05d}", 0) for i in range(instances)]
    gc.collect()
    before = rss_bytes()
    ix = new_index()
    for inst, held in zip(names, per, strict=True):
        ix.add_instance(inst, "m")
        ix.store(inst, 0, held)
    ix.store(names[holder], 0, prompt)
    gc.collect()
    rss = rss_bytes() - before
    stats = ix.stats()
    distinct = stats.distinct_blocks[0]
    assert ix.match("m", prompt) == {names[holder]: InstanceMatch(512, (512, 0, 0, 0))}
    assert ix.match("m", cold) == {}
    settle()

    def timed(fn: Callable[[], Any]) -> tuple[float, float]:
        for _ in range(50):
            fn()
        samples = []
        perf = time.perf_counter_ns
        for _ in range(calls):
            t0 = perf()
            fn()
            samples.append((perf() - t0) / 1000)
        return percentile(samples, 50), percentile(samples, 99)

    match = timed(lambda: ix.match("m", prompt))
    cold_match = timed(lambda: ix.match("m", cold))
    # The heartbeat path: every worker's heartbeat through the consumer (steady state: the
    # instances are known), then the router's per-model columns catching up with them.
    core = build_core(CoreConfig(index_tables=TABLES))
    consumer, router = core.consumer, core.ranker
    router.tables  # noqa: B018 - watching, as in a server that ranks with top_k
    logs = [WorkerLog(worker=n[0], model="m", block_size=16, capacity={"gpu": 100_000}) for n in names]
    for i, log in enumerate(logs):
        log.set_load(running=i % 7, waiting=i % 3, waiting_prefill_tokens=(i * 977) % 8192)
    for log in logs:
        for subject, data in log.heartbeat_messages():
            consumer.on_heartbeat(subject, data)
    router.tables.refresh()
    # A server refreshes the columns at each ranking: with 16 K heartbeats/s and ~500 Scores/s, about
    # 32 rows at a time, soon after their heartbeats.
    chunk = 32
    rounds = []
    for _ in range(5):
        payloads = [m for log in logs for m in log.heartbeat_messages()]
        heartbeat = refresh = 0.0
        for start in range(0, len(payloads), chunk):
            t0 = time.perf_counter()
            for subject, data in payloads[start : start + chunk]:
                consumer.on_heartbeat(subject, data)
            t1 = time.perf_counter()
            router.tables.refresh()
            t2 = time.perf_counter()
            heartbeat += t1 - t0
            refresh += t2 - t1
        rounds.append((heartbeat / len(payloads), refresh / len(payloads)))
    heartbeat_s, refresh_s = min(r[0] for r in rounds), min(r[1] for r in rounds)
    # The service's liveness sweep walks every instance, but only when one can find something
    # (kvindex/fleet/liveness.py: sweep_next's deadline): part of what a large fleet costs the server while
    # idle, besides the heartbeats themselves. Here every instance was heard in the last moments.
    from kvindex.fleet.liveness import sweep_next

    t0 = time.perf_counter()
    for _ in range(20):
        now = time.monotonic()
        _, _, due = sweep_next(core.registry.all(), now, 5.0, 120.0)
    sweep_s = (time.perf_counter() - t0) / 20
    return {
        "sweep_ms": sweep_s * 1e3,
        "sweep_every_s": max(due - now, 0.25),  # a tick is 0.25 s
        "instances": instances,
        "distinct": distinct,
        "entries": stats.entries[0],
        "rss_per_block": rss / distinct,
        "nbytes_per_block": stats.nbytes / distinct,
        "match_p50_us": match[0],
        "match_p99_us": match[1],
        "cold_p50_us": cold_match[0],
        "cold_p99_us": cold_match[1],
        "heartbeat_us": heartbeat_s * 1e6,
        "refresh_us": refresh_s * 1e6,
    }


def fleet_sweep(sizes: list[int], blocks: int, seed: int, calls: int) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        cmd = [sys.executable, __file__, "--sweep-child", str(n), "--blocks", str(blocks)]
        cmd += ["--seed", str(seed), "--reps", str(calls)]
        if TABLES is not None:
            cmd += ["--backend", "python"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("SWEEP ")), None)
        if line is None:
            raise RuntimeError(f"sweep child {n} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        rows.append(json.loads(line[len("SWEEP ") :]))
    base = rows[0]
    header = [
        "instances",
        "match 512, 1 holder: p50 / p99 us",
        "vs first",
        "cold prompt: p50 / p99 us",
        "B per distinct block (RSS / self-reported)",
        "heartbeat: consumer + columns (32 per refresh), us",
        "share of a core at 2 heartbeats/s each",
        "liveness sweep: ms, next in s (heard just now; heartbeats every 0.5 s: ~4.5 s)",
    ]
    table = []
    for r in rows:
        hb = r["heartbeat_us"] + r["refresh_us"]
        table.append(
            [
                f"{r['instances']:,}",
                f"{r['match_p50_us']:.1f} / {r['match_p99_us']:.1f}",
                f"x{r['match_p50_us'] / base['match_p50_us']:.2f}",
                f"{r['cold_p50_us']:.1f} / {r['cold_p99_us']:.1f}",
                f"{r['rss_per_block']:.1f} / {r['nbytes_per_block']:.1f}",
                f"{r['heartbeat_us']:.1f} + {r['refresh_us']:.1f}",
                f"{hb * 2 * r['instances'] / 1e4:.1f} %",
                f"{r['sweep_ms']:.2f}, {r['sweep_every_s']:.1f}",
            ]
        )
    render_table(
        f"fleet-size sweep: {rows[0]['distinct']:,} distinct blocks, {rows[0]['entries']:,} entries; "
        f"{calls} matches each, in process",
        header,
        table,
    )
    print(markdown_table(header, table))
    for r in rows[1:]:
        ratio = r["match_p50_us"] / base["match_p50_us"]
        hb_share = (r["heartbeat_us"] + r["refresh_us"]) * 2 * r["instances"] / 1e6
        print(
            f"- match at {r['instances']:,} vs {base['instances']}: x{ratio:.2f} "
            f"(target <= x2: {'met' if ratio <= 2 else 'MISSED'}); heartbeat ingest "
            f"{hb_share * 100:.1f} % of a core (target < 10 %: {'met' if hb_share < 0.1 else 'MISSED'})"
        )
    return rows


def table_rows(res: Results) -> list[list[str]]:
    rows = []
    for r in res.rows:
        ratio = r.ratio
        rows.append(
            [
                r.name + (f" ({r.note})" if r.note else ""),
                r.unit,
                fmt(r.ours, r.unit),
                fmt(r.dynamo, r.unit),
                "-" if ratio is None else f"{ratio:.2f}x",
                r.target,
                r.met if r.target != "-" else "",
            ]
        )
    return rows


def write_readme(res: Results, command: str, dyn_version: str | None, elapsed: float) -> None:
    """Replace only this benchmark's generated block inside its section of benchmarks/README.md."""
    block = [
        RESULTS_START,
        f"Command: `{command}` (from the repo root, after `make install-bench`; took {elapsed:.0f} s)",
        "",
        f"Machine: {machine_info()}; peer: "
        + (f"ai-dynamo-runtime {dyn_version}" if dyn_version else "Dynamo not installed (ours alone)"),
        "",
        markdown_table(HEADER, table_rows(res)),
        "",
        "Ratio is ours/Dynamo for throughput and Dynamo/ours for latency and memory (> 1x: ours is better).",
        "",
        *[f"- {f}" for f in res.facts],
        *[f"- MISMATCH {m}" for m in res.mismatches],
        RESULTS_END,
    ]
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    generated = "\n".join(block)
    if RESULTS_START in text and RESULTS_END in text:
        pattern = re.escape(RESULTS_START) + r".*?" + re.escape(RESULTS_END)
        text = re.sub(pattern, lambda _m: generated, text, count=1, flags=re.S)
    elif SECTION in text:
        head, _, rest = text.partition(SECTION)
        text = f"{head}{SECTION}\n\n{generated}\n{rest}"
    else:
        text = f"{text.rstrip()}\n\n{SECTION}\n\n{generated}\n"
    README.write_text(text)


def backend_name() -> str:
    return "native" if getattr(new_index(), "native", False) else "pure-Python"


def code_version() -> str:
    """The kvindex commit measured, flagged when kvindex/ has uncommitted changes."""
    root = HERE.parent

    def git(*cmd: str) -> str:
        out = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, check=False)
        return out.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "kvindex")
    return f"kvindex {commit}" + (" + uncommitted changes in kvindex/" if dirty else "")


def dynamo_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sizes (< 60 s)")
    ap.add_argument("--reps", type=int, help="repetitions per measurement (default 7, quick 3)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ours-only", action="store_true", help="skip Dynamo even when installed")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument(
        "--backend",
        choices=("default", "python"),
        default="default",
        help="our index's tables: its default (native when built) or the pure-Python twin",
    )
    ap.add_argument(
        "--no-pin", action="store_true", help="do not pin the process to one CPU (see pin_to_one_cpu)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile our ingest and match paths, then exit")
    ap.add_argument("--write-readme", action="store_true", help=f"update the results block in {README}")
    ap.add_argument(
        "--sweep",
        default="",
        help="fleet sizes, e.g. 64,1024,8192: match, memory and heartbeat cost per size, then exit",
    )
    ap.add_argument("--sweep-blocks", type=int, default=1_000_000, help="distinct blocks in the sweep")
    ap.add_argument("--sweep-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.backend == "python":
        global TABLES
        from kvindex.index import _pytable

        TABLES = _pytable
    if args.sweep_child:
        child = sweep_child(args.sweep_child, args.blocks, args.seed, args.reps or 2000)
        print("SWEEP " + json.dumps(child), flush=True)
        return
    if args.sweep:
        quiet_logs()
        pinned = None if args.no_pin else pin_to_one_cpu()
        print(f"code: {code_version()}, {backend_name()} tables; pinned to CPU {pinned}")
        print(f"load average {os.getloadavg()[0]:.2f}")
        sizes_ = [int(x) for x in args.sweep.split(",") if x]
        fleet_sweep(sizes_, args.sweep_blocks, args.seed, args.reps or 2000)
        print(f"load average {os.getloadavg()[0]:.2f}")
        return
    if args.memory_child:
        print("MEMORY " + json.dumps(memory_child(args.memory_child, args.blocks, args.seed)), flush=True)
        return
    quiet_logs()
    # Before any RadixTree exists: its thread inherits the affinity of the thread that creates it.
    pinned = None if args.no_pin else pin_to_one_cpu()
    sizes = QUICK if args.quick else FULL
    if args.reps:
        sizes = Sizes(**{**sizes.__dict__, "reps": args.reps})
    if args.profile:
        profile_ours(sizes, args.seed)
        return
    dyn = RadixTree is not None and not args.ours_only
    version = dynamo_version() if dyn else None
    if not dyn:
        why = "--ours-only" if args.ours_only else "ai-dynamo-runtime is not installed (make install-bench)"
        print(f"Dynamo RadixTree not used: {why}. Running ours alone.")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    res = Results()
    steps: list[tuple[str, Callable[[Sizes, int, Results, bool], None]]] = [
        ("ingest, 4-block events", bench_ingest_small),
        ("ingest, 512-block events", bench_ingest_large),
        ("prefix match", bench_match),
    ]
    if not args.skip_memory:
        steps.append(("memory", bench_memory))
    for label, step in steps:
        t0 = time.perf_counter()
        step(sizes, args.seed, res, dyn)
        print(f"[{label}: {time.perf_counter() - t0:.1f} s]", flush=True)
    elapsed = time.perf_counter() - started
    # Other work on the machine skews throughput; say how busy it was.
    res.facts.append(
        f"code: {code_version()}, {backend_name()} tables; "
        + ("not pinned" if pinned is None else f"process pinned to CPU {pinned}")
        + f"; 1-min load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    )
    render_table(
        f"kvindex InvertedIndex vs Dynamo RadixTree ({'quick' if args.quick else 'full'}, "
        f"median of {sizes.reps})",
        HEADER,
        table_rows(res),
    )
    for f in res.facts:
        print(f"- {f}")
    for m in res.mismatches:
        print(f"- MISMATCH {m}")
    print(f"Machine: {machine_info()}; Dynamo: {version or 'not used'}; total {elapsed:.0f} s")
    if args.write_readme:
        command = ".venv/bin/python benchmarks/bench_index.py " + " ".join(sys.argv[1:])
        write_readme(res, command.strip(), version, elapsed)
        print(f"results written to {README}")


if __name__ == "__main__":
    main()
