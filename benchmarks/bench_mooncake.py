"""NVIDIA Dynamo's Mooncake indexer benchmark (``mooncake_bench``), reproduced on kvindex.

    .venv/bin/python benchmarks/bench_mooncake.py                       # 1000 workers x d7, 30 s window
    .venv/bin/python benchmarks/bench_mooncake.py --sweep               # + the peak sweep
    .venv/bin/python benchmarks/bench_mooncake.py --trace-duplication-factor 4   # 28,000 workers
    .venv/bin/python benchmarks/bench_mooncake.py --quick               # smoke run, a few seconds
    .venv/bin/python benchmarks/bench_mooncake.py --preregister --hybrid gemma3   # a hybrid-attention model

The workload is Dynamo's (benchmarks/README.md, "Dynamo's Mooncake indexer benchmark", lists every
difference): the Mooncake FAST25 conversation trace (kvtools/data), its requests partitioned at random
over ``--workers`` unique workers (seed 42), each a mock engine with an LRU cache of ``--gpu-blocks``
blocks that stores a prompt's uncached blocks and one block per ``--block-size`` generated tokens and
reports evictions; every worker's timeline squeezed to ``--trace-seconds`` (first request at 0, last at
the end), then stretched so that its last operation lands at the end of a ``--window-seconds`` window;
``-d`` identical copies of every worker (their own ids); ``--trace-duplication-factor`` copies of the
trace in disjoint hash spaces, each on its own workers (``--duplication-workers shared`` puts them on the
same workers, as Dynamo's code does). One hash id is one block, as in Dynamo's runs.

Operations (KV events and one match per request) are replayed open loop, in one thread pinned to one
CPU, at their scheduled times: an operation that is late runs at once, and a match's latency is
reported both as service time and from its scheduled time (queueing behind earlier operations
counts). Events go through the real consumer (``Consumer.on_events`` on wire batches, one event per
batch); matches through one of three paths:

- ``score``: ``Ranker.score(top_k=3)``, what the Score RPC runs (its pruned ranking over
  ``InvertedIndex.match_groups``), without protobuf;
- ``match``: ``InvertedIndex.match_groups``, the index query the ranking makes;
- ``lookup``: ``KvIndexServicer.Lookup`` in process (every instance with its match, as the protobuf
  bytes gRPC sends), no socket.

A sample of the answers is checked afterwards against a plain set model of every worker (of a sample
of workers beyond ``--check-workers``), replaying the same operations in the same order.

``--hybrid LAYOUT`` (a preset of workers_shim/sim/hybrid.py: ``gemma3``, ``qwen3-next``, ...): the same
trace, partition, duplication and window, but the model is hybrid. Each mock engine keeps per KV-cache
group what vLLM 0.32 keeps (``HybridLruEngine``, with the simulated engine's rules), its groups' events
of one step travel in one wire batch naming their groups (docs/wire.md §8), every worker announces the
layout in its heartbeats (so ``--preregister`` is required), the index applies vLLM's rule, and the set
model holds one set per group and computes the engine's hit by that rule.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import gc
import heapq
import io
import json
import math
import os
import pstats
import re
import resource
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from resource import RUSAGE_SELF
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script, or imported as benchmarks.bench_mooncake by a test
    sys.path.insert(0, str(HERE))

from _common import machine_info, markdown_table, quiet_logs, render_table, rss_bytes  # noqa: E402
from bench_index import code_version, pin_to_one_cpu, settle  # noqa: E402

from kvindex.api.servicer import KvIndexServicer  # noqa: E402
from kvindex.config.args import positive, positive_number  # noqa: E402
from kvindex.core import Core, CoreConfig, build_core  # noqa: E402
from kvindex.index.hybrid import GroupLayout, hit_limit, hit_tokens  # noqa: E402
from kvindex.ingest.limits import IngestLimits  # noqa: E402
from kvindex.keys import keys_from_le_bytes, model_seed  # noqa: E402
from kvindex.scoring.base import RouteRequest  # noqa: E402
from kvindex.tokenize.registry import Tokenizers  # noqa: E402
from kvindex.v1 import kvindex_pb2 as pb  # noqa: E402
from kvindex.wire.codec import encode_batch, event_to_wire  # noqa: E402
from kvindex.wire.schema import REMOVED, STORED  # noqa: E402
from kvtools.data import mooncake_trace  # noqa: E402
from workers_shim.publisher import WorkerLog  # noqa: E402
from workers_shim.sim.hybrid import (  # noqa: E402
    KV_GROUP_PRESETS,
    engine_lookup,
    kept_blocks,
    kept_span,
    parse_kv_groups,
    referenced_from,
)
from workers_shim.sim.trace import mooncake_rows  # noqa: E402

MODEL = "mooncake"
README = HERE / "README.md"
SECTION = "## Dynamo's Mooncake indexer benchmark (`bench_mooncake.py`)"
PATHS = ("score", "match", "lookup")
TOP_K = 3  # what `kvindex route` asks for (--top-k default)
STEADY_EDGE = 0.05  # matches scheduled in the first and last 5 % of the window: the bursts

MATCH, EVENT = 0, 1


@dataclass
class Config:
    workers: int = 1000  # --num-unique-inference-workers
    dup: int = 7  # -d: copies of each worker
    trace_dup: int = 1  # --trace-duplication-factor
    dup_workers: str = "own"  # trace copies on their own workers, or on the same ("shared", Dynamo's code)
    trace_seconds: float = 10.0  # --trace-simulation-duration-ms / 1000
    window_seconds: float = 30.0  # --benchmark-duration-ms / 1000
    gpu_blocks: int = 16384  # --num-gpu-blocks
    block_size: int = 128  # tokens per block (Dynamo's default); one block per trace hash id
    length_factor: int = 1  # --trace-length-factor: each hash id becomes this many blocks
    decode_ms_per_token: float = 1.0  # engine time per generated token, in the squeezed trace's time
    seed: int = 42
    limit: int | None = None  # first rows of the trace only
    check_samples: int = 400  # matches whose answer is checked against the set model
    check_workers: int = 8000  # workers modelled by the check (all of them up to this many)
    preregister: bool = False  # every worker registered before timing
    max_seconds: float = 300.0  # a replay that falls behind stops after this long
    final_samples: int = 2000  # matches timed one after the other on the final state
    final_also: tuple[str, ...] = ()  # paths also timed on each replay's final state
    hybrid: str | None = None  # a hybrid-attention model's KV-cache groups (KV_GROUP_PRESETS name)

    @property
    def tag(self) -> str:
        parts = [f"w{self.workers}", f"d{self.dup}", f"x{self.trace_dup}"]
        if self.trace_dup > 1:
            parts.append(self.dup_workers)
        if self.length_factor != 1:
            parts.append(f"f{self.length_factor}")
        if self.limit is not None:
            parts.append(f"rows{self.limit}")
        if self.window_seconds != 30.0:
            parts.append(f"{self.window_seconds:g}s")
        if self.preregister:
            parts.append("prereg")
        if self.hybrid:
            parts.append(f"hybrid-{self.hybrid}")
        return "-".join(parts)

    def layout(self) -> GroupLayout | None:
        """The hybrid model's KV-cache groups at this block size (None: full attention only)."""
        if self.hybrid is None:
            return None
        return GroupLayout(parse_kv_groups(self.hybrid, self.block_size), self.block_size)


QUICK = dict(
    workers=24,
    dup=2,
    trace_seconds=0.5,
    window_seconds=1.0,
    limit=600,
    check_samples=200,
)


# -- workload -------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Everything the replay needs, built before any timing."""

    config: Config
    n_requests: int  # requests of the duplicated trace (each matched once per copy -d)
    unique_workers: int
    req_keys: list[list[int]]  # per request, its blocks' keys
    req_tokens: list[int]  # per request, its prompt tokens (blocks x block size)
    sched: list[float]  # per operation, its scheduled time in the window (s), in replay order
    ops: list[Any]  # per operation: a request index (a match) or (subject, payload) (an event)
    op_worker: np.ndarray  # per operation, the actual worker (unique * dup + copy)
    op_event: np.ndarray  # per operation, the unique batch of events (-1 for a match)
    batches: list[list[int]]  # per unique batch, its unique events (several: a hybrid model's groups)
    ev_kind: list[int]  # per unique event, STORED or REMOVED
    ev_keys: list[list[int]]  # per unique event, its keys
    ev_group: list[int]  # per unique event, its KV-cache group (0 unless hybrid)
    worker_names: list[str]  # per actual worker
    final_entries: int  # (block, worker) entries the index holds after the whole replay
    facts: dict[str, Any] = field(default_factory=dict)
    layout: GroupLayout | None = None  # a hybrid model's KV-cache groups (engines and index)

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_matches(self) -> int:
        return self.n_requests * self.config.dup


def read_trace(limit: int | None) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    ts, ids, out = [], [], []
    for row in mooncake_rows(mooncake_trace(), limit):
        ts.append(float(row["timestamp"]))
        ids.append(row["hash_ids"])
        out.append(int(row["output_length"]))
    return np.array(ts), ids, np.array(out, dtype=np.int64)


# An engine's KV events: (STORED or REMOVED, group, blocks, parent block or -1).
Events = list[tuple[int, int, list[int], int]]


class LruEngine:
    """A worker's KV cache: ``capacity`` blocks, least recently used evicted first. A request's hit is
    the longest resident prefix of its blocks; its other blocks are stored (one event), evicting what
    they need (one event before it); each generated block is stored when complete (one event each).
    Blocks are touched tail first, so a prefix is always more recent than its continuations and is
    evicted after them (vLLM frees a request's blocks in that order)."""

    __slots__ = ("capacity", "lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.lru)

    def _evict(self, n: int) -> list[int]:
        lru = self.lru
        return [lru.popitem(last=False)[0] for _ in range(min(n, len(lru)))]

    def request(self, blocks: list[int]) -> Events:
        """The events of a prompt of ``blocks``: evictions, then its new blocks parented on its hit."""
        lru = self.lru
        hit = 0
        for b in blocks:
            if b not in lru:
                break
            hit += 1
        for b in reversed(blocks[:hit]):
            lru.move_to_end(b)
        rest = blocks[hit:]
        new = [b for b in rest if b not in lru]
        for b in reversed(rest):
            if b in lru:
                lru.move_to_end(b)
        if len(new) > self.capacity:
            raise ValueError(f"a prompt of {len(blocks)} blocks does not fit in {self.capacity}")
        evicted = self._evict(len(lru) + len(new) - self.capacity)
        for b in reversed(new):
            lru[b] = None
        events: Events = []
        if evicted:
            events.append((REMOVED, 0, evicted, -1))
        if new:
            events.append((STORED, 0, new, blocks[hit - 1] if hit else -1))
        return events

    def store(self, block: int, parent: int) -> Events:
        """The events of a generated block, complete."""
        evicted = self._evict(len(self.lru) + 1 - self.capacity)
        self.lru[block] = None
        return ([(REMOVED, 0, evicted, -1)] if evicted else []) + [(STORED, 0, [block], parent)]


class HybridLruEngine:
    """A hybrid-attention model's worker (``--hybrid``): ``capacity`` (block, group) pairs, least
    recently used evicted first, keeping per KV-cache group what vLLM 0.32 keeps (retention interval
    0; workers_shim/sim/hybrid.py has the rules, with the source references):

    - a request's hit is the engine's (``engine_lookup``: vLLM's rule over every group); of it each
      group references what its lookup returned (``referenced_from``: full attention every block, a
      sliding window its window, a Mamba group the state block);
    - its new blocks are cached in full-attention (and chunked-local) groups all of them, in a
      sliding-window or Mamba group only the ``kept_span`` blocks ending at the replay boundary (the
      prompt's last token, floored to a block) and at the shared-prefix junction (when full
      attention alone hit further than all groups together); a block a group already holds beyond
      the hit is computed again, an uncached duplicate;
    - a generated block is cached by the groups that cache every block (full attention): vLLM's
      sliding-window and Mamba groups store none of a request's decode blocks;
    - stores and evictions are announced per group (parent: the request's previous block, whatever
      the group holds, as vLLM does); a request's pairs are touched in group order, each tail first
      (the order vLLM frees them in), so group 0 loses its blocks first under pressure.
    """

    __slots__ = ("capacity", "everyblock", "layout", "lru", "spans")

    def __init__(self, capacity: int, layout: GroupLayout) -> None:
        self.capacity = capacity
        self.layout = layout
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.spans = [kept_span(spec, layout.block_size) for spec in layout.groups]
        self.everyblock = [g for g, span in enumerate(self.spans) if span is None]

    def __len__(self) -> int:
        return len(self.lru)

    def _evict(self, n: int) -> Events:
        """The ``n`` least recently used pairs, announced per group in eviction order."""
        lru = self.lru
        events: Events = []
        for _ in range(min(n, len(lru))):
            g, b = lru.popitem(last=False)[0]
            if events and events[-1][1] == g:
                events[-1][2].append(b)
            else:
                events.append((REMOVED, g, [b], -1))
        return events

    def request(self, blocks: list[int]) -> Events:
        layout = self.layout
        B = layout.block_size
        lru = self.lru
        n = len(blocks)
        hit, first = engine_lookup(layout, lambda g, j: (g, blocks[j]) in lru, hit_limit(n * B))
        replay = (n * B - 1) // B
        bounds = (replay, first) if first > hit and first != replay else (replay,)
        mine: list[list[int]] = []  # per group, the blocks the request holds (referenced or stored)
        stores: Events = []
        for g, (spec, span) in enumerate(zip(layout.groups, self.spans, strict=True)):
            held = list(range(referenced_from(spec, B, hit), hit))
            keep = None if span is None else kept_blocks(span, bounds, hit, n)
            run: list[int] = []
            parent = blocks[hit - 1] if hit else -1
            for j in range(hit, n):
                b = blocks[j]
                if (keep is not None and j not in keep) or (g, b) in lru:
                    if run:
                        stores.append((STORED, g, run, parent))
                        run = []
                    parent = b
                    continue
                held.append(j)
                run.append(b)
            if run:
                stores.append((STORED, g, run, parent))
            mine.append(held)
        referenced = sum(hit - referenced_from(spec, B, hit) for spec in layout.groups)
        new = sum(len(js) for js in mine) - referenced
        if new + referenced > self.capacity:
            raise ValueError(f"a prompt of {n} blocks does not fit in {self.capacity} (block, group) pairs")
        for g, js in enumerate(mine):  # the hit's pairs are not evicted for the new ones
            for j in js:
                if (g, blocks[j]) in lru:
                    lru.move_to_end((g, blocks[j]))
        events = self._evict(len(lru) + new - self.capacity)
        for g, js in enumerate(mine):  # group order, tail first: vLLM's freeing order
            for j in reversed(js):
                lru[(g, blocks[j])] = None
                lru.move_to_end((g, blocks[j]))
        return events + stores

    def store(self, block: int, parent: int) -> Events:
        lru = self.lru
        events = self._evict(len(lru) + len(self.everyblock) - self.capacity)
        for g in self.everyblock:
            lru[(g, block)] = None
            events.append((STORED, g, [block], parent))
        return events


class FleetSim:
    """The mock engines of every unique worker, one after the other; collects their events."""

    def __init__(self, cfg: Config, first_decode_block: int) -> None:
        self.cfg = cfg
        self.layout = cfg.layout()
        self.tpot = cfg.decode_ms_per_token / 1000.0
        self.next_block = first_decode_block  # generated blocks get ids from here
        self.parents: dict[int, int] = {}  # generated block -> its parent block
        self.ev_kind: list[int] = []
        self.ev_blocks: list[list[int]] = []
        self.ev_parent: list[int] = []  # -1: none
        self.ev_group: list[int] = []
        self.batches: list[list[int]] = []  # per batch (one operation), its events
        self.stored_events = self.removed_events = self.stored_blocks = self.removed_blocks = 0
        self.final_blocks = 0  # blocks (hybrid: (block, group) pairs) the engines hold at the end

    def _events(self, timeline: list[tuple[float, int, int]], t: float, events: Events) -> None:
        """One batch (operation) per kind: a hybrid engine's groups' stores of one step travel
        together, as a bridge publishes an engine's step (one event per batch without groups)."""
        last = -1
        for kind, group, blocks, parent in events:
            if kind != last:
                timeline.append((t, EVENT, len(self.batches)))
                self.batches.append([])
                last = kind
            self.batches[-1].append(len(self.ev_kind))
            self.ev_kind.append(kind)
            self.ev_blocks.append(blocks)
            self.ev_parent.append(parent)
            self.ev_group.append(group)
            if kind == STORED:
                self.stored_events += 1
                self.stored_blocks += len(blocks)
            else:
                self.removed_events += 1
                self.removed_blocks += len(blocks)

    def worker(
        self, requests: list[int], times: list[float], req_ids: list[np.ndarray], req_out: np.ndarray
    ) -> list[tuple[float, int, int]]:
        """One worker's requests (indices, at their squeezed times): its timeline of (time, MATCH,
        request) and (time, EVENT, event), in the order the engine produced them."""
        bs = self.cfg.block_size
        layout = self.layout
        gpu = self.cfg.gpu_blocks
        engine = LruEngine(gpu) if layout is None else HybridLruEngine(gpu, layout)
        timeline: list[tuple[float, int, int]] = []
        pending: list[tuple[float, int, int, int]] = []  # generated blocks: (done at, seq, block, parent)
        seq = 0

        def complete(until: float) -> None:
            while pending and pending[0][0] < until:
                t, _, block, parent = heapq.heappop(pending)
                self._events(timeline, t, engine.store(block, parent))

        for r, t in zip(requests, times, strict=True):
            complete(t)  # at the same instant the request comes first, as Dynamo merges them
            timeline.append((t, MATCH, r))
            blocks = req_ids[r].tolist()
            self._events(timeline, t, engine.request(blocks))
            prev = blocks[-1]
            for i in range(int(req_out[r]) // bs):
                block = self.next_block
                self.next_block += 1
                self.parents[block] = prev
                heapq.heappush(pending, (t + (i + 1) * bs * self.tpot, seq, block, prev))
                seq += 1
                prev = block
        complete(math.inf)
        self.final_blocks += len(engine)
        return timeline


def build_workload(cfg: Config, log: Callable[[str], None] = print) -> Workload:
    t_build = time.perf_counter()
    ts, raw_ids, output = read_trace(cfg.limit)
    n_rows = len(ts)
    F, C, bs = cfg.length_factor, cfg.trace_dup, cfg.block_size
    if F > 1:  # Dynamo's expand: id h becomes h*F .. h*F+F-1 (shared prefixes stay shared)
        raw_ids = [[h * F + i for h in ids for i in range(F)] for ids in raw_ids]
    max_id = max(max(ids) for ids in raw_ids)
    offset = max_id + 1  # copy c's ids are shifted by c * offset: disjoint hash spaces
    n_trace_ids = offset * C

    # Requests of the duplicated trace, copy-major; each copy is partitioned like the original (own
    # workers), or every request of every copy drawn anew over the same workers (shared).
    rng = np.random.default_rng(cfg.seed)
    if cfg.dup_workers == "own":
        part = rng.integers(0, cfg.workers, n_rows)
        req_worker = np.concatenate([part + c * cfg.workers for c in range(C)])
        unique_workers = cfg.workers * C
    else:
        req_worker = rng.integers(0, cfg.workers, n_rows * C)
        unique_workers = cfg.workers
    n_req = n_rows * C
    base_ids = [np.asarray(ids, dtype=np.int64) for ids in raw_ids]
    # The trace's ids are chained (an id always follows the same prefix): each has one parent, so a
    # key per id is the key of its whole prefix. Checked, since everything below relies on it.
    child = np.concatenate(base_ids)
    prev = np.concatenate([np.concatenate(([-1], ids[:-1])) for ids in base_ids])
    pairs = np.unique(np.stack([child, prev]), axis=1)
    if len(np.unique(pairs[0])) != pairs.shape[1]:
        raise ValueError("the trace's hash ids are not chained: an id follows two different prefixes")
    req_ids = [base_ids[i] + c * offset for c in range(C) for i in range(n_rows)]
    req_ts = np.tile(ts, C)
    req_out = np.tile(output, C)

    # Per unique worker: its requests in trace order, squeezed to trace_seconds (first at 0, last at
    # the end: Dynamo's rescale of each worker's ready span), then its mock engine.
    order = np.lexsort((np.arange(n_req), req_ts, req_worker))
    bounds = np.searchsorted(req_worker[order], np.arange(unique_workers + 1))
    fleet = FleetSim(cfg, n_trace_ids)
    # per unique worker: window times, kinds, refs (request or unique event)
    w_t: list[np.ndarray] = []
    w_kind: list[np.ndarray] = []
    w_ref: list[np.ndarray] = []
    for u in range(unique_workers):
        mine = order[bounds[u] : bounds[u + 1]]
        if not len(mine):
            w_t.append(np.zeros(0))
            w_kind.append(np.zeros(0, np.int8))
            w_ref.append(np.zeros(0, np.int64))
            continue
        t_req = req_ts[mine]
        span = t_req[-1] - t_req[0]
        sim_t = (t_req - t_req[0]) * (cfg.trace_seconds / span) if span > 0 else np.zeros(len(mine))
        timeline = fleet.worker(mine.tolist(), sim_t.tolist(), req_ids, req_out)
        times = np.array([e[0] for e in timeline])
        last = times.max()
        # Dynamo rescales each worker's merged timeline so that its last operation ends the window.
        w_t.append(times * (cfg.window_seconds / last) if last > 0 else np.zeros(len(times)))
        w_kind.append(np.array([e[1] for e in timeline], np.int8))
        w_ref.append(np.array([e[2] for e in timeline], np.int64))
    stored_events, removed_events = fleet.stored_events, fleet.removed_events
    stored_blocks, removed_blocks = fleet.stored_blocks, fleet.removed_blocks
    ev_kind, ev_blocks, ev_parent, parents = fleet.ev_kind, fleet.ev_blocks, fleet.ev_parent, fleet.parents
    ev_group, batches = fleet.ev_group, fleet.batches
    next_decode, final_blocks = fleet.next_block, fleet.final_blocks
    log(
        f"[workload] {n_req:,} requests on {unique_workers:,} unique workers: {stored_events:,} stored "
        f"events ({stored_blocks:,} blocks), {removed_events:,} removed ({removed_blocks:,} blocks); "
        f"{time.perf_counter() - t_build:.1f} s"
    )

    # Keys: chained from the model's seed; block b's tokens are b repeated (Dynamo repeats the hash id).
    n_ids = next_decode
    assert n_ids < 2**32  # a block's token is its id
    keys = np.zeros(n_ids, dtype=np.uint64)
    known = np.zeros(n_ids, dtype=bool)
    root = model_seed(MODEL)

    def chain(blocks: np.ndarray, parent: int | None) -> None:
        tokens = np.repeat(blocks.astype(np.uint32), bs).astype("<u4").tobytes()
        keys[blocks] = keys_from_le_bytes(tokens, bs, root if parent is None else int(keys[parent]))
        known[blocks] = True

    for ids in req_ids:  # a hash id always follows the same prefix, so its key is computed once
        first = int(np.argmin(known[ids])) if not known[ids].all() else len(ids)
        if first < len(ids):
            chain(ids[first:], int(ids[first - 1]) if first else None)
    for block in range(n_trace_ids, n_ids):  # decode blocks, each after its parent (a smaller id)
        chain(np.array([block]), parents[block])
    assert known[np.concatenate(req_ids)].all() and known[n_trace_ids:].all()
    req_keys = [keys[ids].tolist() for ids in req_ids]
    ev_keys = [keys[b].tolist() for b in ev_blocks]
    ev_parent_key = [None if p < 0 else int(keys[p]) for p in ev_parent]
    del ev_blocks

    # The replay order: by time, then copy (-d), then worker, then the worker's own order.
    d = cfg.dup
    lengths = np.array([len(t) for t in w_t])
    u_of = np.repeat(np.arange(unique_workers), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    t_all = np.concatenate(w_t)
    kind_all = np.concatenate(w_kind)
    ref_all = np.concatenate(w_ref)
    n_unique_ops = len(t_all)
    rep = np.repeat(np.arange(d), n_unique_ops)
    t_rep = np.tile(t_all, d)
    u_rep = np.tile(u_of, d)
    order = np.lexsort((np.tile(pos, d), u_rep, rep, t_rep))
    del pos
    sched = t_rep[order]
    op_unique = np.tile(np.arange(n_unique_ops), d)[order]
    op_worker = (u_rep * d + rep)[order]
    del t_rep, u_rep, rep, order
    op_kind = kind_all[op_unique]
    op_ref = ref_all[op_unique]
    op_event = np.where(op_kind == EVENT, op_ref, -1)

    # Wire batches, one event each (Dynamo applies one event per call), seq per actual worker.
    worker_names = [f"w{u:06d}-{r}" for u in range(unique_workers) for r in range(d)]
    subjects = [f"kvindex.events.{name}" for name in worker_names]
    # A hybrid engine's events name their group (docs/wire.md §8), as the bridges publish them.
    wire_events = [
        event_to_wire(kind, 0, k, p, g)
        for kind, k, p, g in zip(ev_kind, ev_keys, ev_parent_key, ev_group, strict=True)
    ]
    next_seq = [1] * len(worker_names)
    ops: list[Any] = []
    append = ops.append
    for kind, ref, w in zip(op_kind.tolist(), op_ref.tolist(), op_worker.tolist(), strict=True):
        if kind == MATCH:
            append(ref)
            continue
        s = next_seq[w]
        next_seq[w] = s + 1
        events = [wire_events[e] for e in batches[ref]]
        payload = encode_batch(
            worker=worker_names[w], model=MODEL, epoch=1, seq=s, ts=0.0, block_size=bs, events=events
        )
        append((subjects[w], payload))
    n_events = int((op_kind == EVENT).sum())
    facts = {
        "trace_rows": n_rows,
        "requests": n_req,
        "unique_workers": unique_workers,
        "workers": unique_workers * d,
        "operations": len(ops),
        "matches": len(ops) - n_events,
        "events": n_events,
        "stored_events": stored_events * d,
        "removed_events": removed_events * d,
        "stored_blocks": stored_blocks * d,
        "removed_blocks": removed_blocks * d,
        "request_blocks": int(sum(len(k) for k in req_keys)) * d,
        "distinct_keys": len(np.unique(keys[np.concatenate(req_ids)])) + (n_ids - n_trace_ids),
        "payload_mb": sum(len(op[1]) for op in ops if op.__class__ is tuple) / 1e6,
        "build_s": time.perf_counter() - t_build,
    }
    log(
        f"[workload] {facts['workers']:,} workers, {len(ops):,} operations ({facts['matches']:,} matches, "
        f"{n_events:,} events); built in {facts['build_s']:.1f} s"
    )
    return Workload(
        config=cfg,
        n_requests=n_req,
        unique_workers=unique_workers,
        req_keys=req_keys,
        req_tokens=[len(k) * bs for k in req_keys],
        sched=sched.tolist(),
        ops=ops,
        op_worker=op_worker,
        op_event=op_event,
        batches=batches,
        ev_kind=ev_kind,
        ev_keys=ev_keys,
        ev_group=ev_group,
        worker_names=worker_names,
        final_entries=final_blocks * d,
        facts=facts,
        layout=fleet.layout,
    )


# -- replay ---------------------------------------------------------------------------------------


@dataclass
class Run:
    path: str
    window: float  # seconds
    offered: float  # ops/s
    achieved: float  # ops/s
    duration: float  # s, from the first scheduled operation to the last one done
    kept_up: bool  # duration <= 1.1 x window (Dynamo's warning threshold)
    service: dict[str, float]  # us: p50, p99, max
    from_schedule: dict[str, float]
    steady_service: dict[str, float]
    steady_from_schedule: dict[str, float]
    match_busy_s: float  # time spent in matches
    event_busy_s: float  # time spent in events
    preregistered: bool = False
    # Matches during which the kernel ran another process on this CPU (shared machine): their
    # service time includes someone else's; service_alone leaves them out.
    service_alone: dict[str, float] = field(default_factory=dict)
    preempted: int = 0
    cpu_wait_s: float = 0.0  # runnable but waiting for the CPU (other processes on it), from schedstat
    match_cpu_s: float = 0.0  # this thread's CPU time in matches (thread_time: preemption left out)
    event_cpu_s: float = 0.0

    @property
    def capacity(self) -> float:
        """Operations per second of CPU spent in them: the rate one core could sustain, the replay
        loop and other processes aside."""
        spent = self.match_cpu_s + self.event_cpu_s
        return self.done / spent if spent else math.nan

    done: int = 0  # operations done (all, unless the replay hit --max-seconds)
    final_state: dict[str, float] = field(default_factory=dict)  # closed loop after the replay
    final_others: dict[str, dict[str, float]] = field(default_factory=dict)  # other paths, same state
    entries: int = 0
    distinct: int = 0
    nbytes: int = 0
    rss_delta: int = 0
    instances: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)


def new_core(limits: IngestLimits) -> Core:
    return build_core(CoreConfig(ingest_limits=limits))


def announced_groups(layout: GroupLayout | None) -> list[dict[str, Any]] | None:
    """What the workers announce in their heartbeats (docs/wire.md §8): the engines' own groups."""
    return None if layout is None else layout.to_wire()


def query_for(path: str, core: Core, wl: Workload) -> Callable[[int], Any]:
    """The match operation of ``path`` for request ``i`` (its arguments built beforehand)."""
    bs = wl.config.block_size
    if path == "score":
        reqs = [RouteRequest(MODEL, k, t, bs) for k, t in zip(wl.req_keys, wl.req_tokens, strict=True)]
        score = core.ranker.score
        return lambda i: score(reqs[i], top_k=TOP_K)
    if path == "match":
        # The ranking's own query (kvindex/scoring/pool.py, ``_matches``): the last-token limit and
        # a reach for a hybrid model's full-attention prefixes (untouched for any other model).
        groups = core.index.match_groups
        listed = core.ranker.config.group_min_instances
        keys = wl.req_keys
        limits = [hit_limit(t) for t in wl.req_tokens]
        return lambda i: groups(MODEL, keys[i], None, listed, limits[i], {})
    if path == "lookup":
        servicer = KvIndexServicer(core.index, core.registry, core.counters, None, core.ranker, Tokenizers())
        lookups = [pb.LookupRequest(model=MODEL, block_keys=k) for k in wl.req_keys]
        lookup = servicer.Lookup

        def call(i: int) -> Any:
            coro = lookup(lookups[i], None)  # type: ignore[arg-type]
            try:
                coro.send(None)  # no await on the success path: it returns at once
            except StopIteration as done:
                return done.value
            raise RuntimeError("Lookup awaited something")

        return call
    raise ValueError(path)


def stats_us(samples: np.ndarray) -> dict[str, float]:
    if not len(samples):
        return {"n": 0, "p50": math.nan, "p99": math.nan, "max": math.nan}
    s = np.sort(samples) * 1e6
    rank = lambda q: s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]  # noqa: E731
    return {"n": len(s), "p50": float(rank(50)), "p99": float(rank(99)), "max": float(s[-1])}


def replay(
    wl: Workload,
    path: str,
    window: float,
    limits: IngestLimits,
    record_every: int = 0,
    profile: cProfile.Profile | None = None,
    preregister: bool = False,
    max_seconds: float = math.inf,
    final_samples: int = 0,
    record_limit: int = 1 << 30,
    final_also: Sequence[str] = (),
    clocks: bool = True,
) -> tuple[Run, Core, dict[int, Any]]:
    """One open-loop replay of the whole schedule into a fresh core, stretched to ``window`` s.
    Returns the run, the core, and the answers of every ``record_every``-th match (by match number)."""
    gc.collect()
    rss0 = rss_bytes()
    core = new_core(limits)
    query = query_for(path, core, wl)
    on_events = core.consumer.on_events
    index = core.index
    scale = window / wl.config.window_seconds
    sched = wl.sched
    ops = wl.ops
    m_sched: list[float] = []
    m_start: list[float] = []
    m_end: list[float] = []
    m_preempted: list[int] = []  # involuntary context switches during the match (another process ran)
    recorded: dict[int, Any] = {}
    if preregister:
        # Every worker known before timing (as Dynamo's later replay does), by the heartbeat a worker
        # sends first (with its capacity), and one match made so that the rankings' per-fleet tables
        # are built: what is timed is then the steady state.
        cfg = wl.config
        groups = announced_groups(wl.layout)
        for name in wl.worker_names:
            log = WorkerLog(
                worker=name, model=MODEL, block_size=cfg.block_size, epoch=1, capacity={"gpu": cfg.gpu_blocks}
            )
            log.groups = groups  # a hybrid model's layout: the index learns it from the heartbeats
            for subject, data in log.heartbeat_messages():
                core.consumer.on_heartbeat(subject, data)
        query(0)
    perf = time.perf_counter
    sleep = time.sleep
    # Per operation, the thread's CPU time and its involuntary context switches: two system calls
    # each (~1-2 us together), left out of the peak sweep (``clocks`` False) so that its achieved
    # rate is the index's, not the measuring's.
    switches = resource.getrusage if clocks else _no_rusage
    cpu = time.thread_time if clocks else float
    settle()
    wait0 = run_delay()
    t0 = perf() + 0.02

    deadline = t0 + max(max_seconds, 1.2 * window)  # a replay that keeps up is never cut

    def drive(lo: int, hi: int, j: int) -> tuple[float, int, int]:
        """Operations lo..hi-1 at their times, until ``deadline``; returns the time spent in events,
        the next match number (``j``: matches before lo) and the operations done."""
        ev_busy = ev_cpu = m_cpu = 0.0
        done = lo
        for t, op in zip(sched[lo:hi], ops[lo:hi], strict=True):
            target = t0 + t * scale
            now = perf()
            if now < target:
                if target - now > 0.0006:
                    sleep(target - now - 0.0004)
                while perf() < target:
                    pass
            elif now > deadline:
                break
            if op.__class__ is tuple:
                c = cpu()
                s = perf()
                on_events(op[0], op[1])
                ev_busy += perf() - s
                ev_cpu += cpu() - c
            else:
                c0 = switches(RUSAGE_SELF).ru_nivcsw
                c = cpu()
                s = perf()
                answer = query(op)
                e = perf()
                m_cpu += cpu() - c
                m_preempted.append(switches(RUSAGE_SELF).ru_nivcsw - c0)
                m_sched.append(target)
                m_start.append(s)
                m_end.append(e)
                if record_every and j % record_every == 0 and len(recorded) < record_limit:
                    # match groups name slots: keep the slot owners of the moment with the answer
                    recorded[j] = (answer, index.slot_layout(MODEL)[1]) if path == "match" else answer
                j += 1
            done += 1
        cpu_s[0] += m_cpu
        cpu_s[1] += ev_cpu
        return ev_busy, j, done - lo

    cpu_s = [0.0, 0.0]  # CPU time of this thread in matches, in events (preemption left out)
    if profile is None:
        ev_busy, _, done = drive(0, len(ops), 0)
    else:  # only the operations scheduled outside the bursts
        lo = bisect.bisect_left(sched, STEADY_EDGE * wl.config.window_seconds)
        hi = bisect.bisect_right(sched, (1 - STEADY_EDGE) * wl.config.window_seconds)
        ev_busy, j, done = drive(0, lo, 0)
        profile.enable()
        busy, j, n = drive(lo, hi, j) if done == lo else (0.0, j, 0)
        profile.disable()
        ev_busy, done = ev_busy + busy, done + n
        busy, j, n = drive(hi, len(ops), j) if done == hi else (0.0, j, 0)
        ev_busy, done = ev_busy + busy, done + n
    t_end = perf()
    cpu_wait = run_delay() - wait0
    final = final_state_latency(query, wl, final_samples) if final_samples else {}
    others = {
        other: final_state_latency(
            query_for(other, core, wl), wl, final_samples // (10 if other == "lookup" else 1)
        )
        for other in final_also
        if other != path and final_samples
    }
    gc.unfreeze()
    sched_a, start_a, end_a = np.array(m_sched), np.array(m_start), np.array(m_end)
    service = end_a - start_a
    alone = np.array(m_preempted) == 0
    waited = end_a - sched_a
    rel = sched_a - t0
    steady = (rel >= STEADY_EDGE * window) & (rel <= (1 - STEADY_EDGE) * window)
    duration = t_end - t0
    c = core.counters
    stats = index.stats()
    run = Run(
        path=path,
        window=window,
        offered=len(ops) / window,
        achieved=done / max(duration, window),
        duration=duration,
        kept_up=done == len(ops) and duration <= 1.1 * window,
        service=stats_us(service),
        from_schedule=stats_us(waited),
        steady_service=stats_us(service[steady]),
        service_alone=stats_us(service[alone]),
        preempted=int((~alone).sum()),
        steady_from_schedule=stats_us(waited[steady]),
        match_busy_s=float(service.sum()),
        event_busy_s=ev_busy,
        preregistered=preregister,
        cpu_wait_s=cpu_wait,
        match_cpu_s=cpu_s[0],
        event_cpu_s=cpu_s[1],
        done=done,
        entries=stats.entries[0],
        distinct=stats.distinct_blocks[0],
        nbytes=stats.nbytes,
        rss_delta=rss_bytes() - rss0,
        instances=stats.instances,
        rejects=dict(c.rejects),
    )
    run.final_state = final
    run.final_others = others
    # Every batch applied, in order, and nothing refused: otherwise the figures mean nothing.
    events_done = sum(1 for op in ops[:done] if op.__class__ is tuple)
    complete = done == len(ops)
    run.check["ingest"] = {
        "batches_applied": c.batches_applied,
        "events": events_done,
        "gaps": c.gaps,
        "rejects": c.rejects_total,
        "entries": stats.entries[0],
        "expected_entries": wl.final_entries if complete else None,
    }
    run.check["ingest_ok"] = (
        c.rejects_total == 0
        and c.gaps == 0
        and c.batches_applied == events_done
        and (not complete or stats.entries[0] == wl.final_entries)
    )
    return run, core, recorded


_NO_SWITCHES = resource.struct_rusage((0.0, 0.0) + (0,) * 14)


def _no_rusage(_who: int) -> resource.struct_rusage:
    return _NO_SWITCHES


def run_delay() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (/proc schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def final_state_latency(query: Callable[[int], Any], wl: Workload, n: int) -> dict[str, float]:
    """Service time of ``n`` matches (requests spread over the trace) one after the other on the
    index as the replay left it: no joins, no bursts, no queue."""
    step = max(1, wl.n_requests // n)
    picks = list(range(0, wl.n_requests, step))[:n]
    perf = time.perf_counter
    samples, alone = [], []
    for i in picks:
        c0 = resource.getrusage(RUSAGE_SELF).ru_nivcsw
        s = perf()
        query(i)
        samples.append(perf() - s)
        alone.append(resource.getrusage(RUSAGE_SELF).ru_nivcsw == c0)
    out = stats_us(np.array(samples))
    kept = np.array(samples)[np.array(alone, dtype=bool)]
    out.update({f"alone_{k}": v for k, v in stats_us(kept).items()})
    return out


# -- correctness: a plain set model ---------------------------------------------------------------


def expected_overlaps(model: dict[int, set[int]], keys: list[int]) -> dict[int, int]:
    out = {}
    for w, held in model.items():
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        if n:
            out[w] = n
    return out


def expected_hits(
    model: dict[int, list[set[int]]], keys: list[int], layout: GroupLayout, tokens: int, seen: list[int]
) -> dict[int, int]:
    """A hybrid model's answer: per worker, the blocks vLLM would reuse of a prompt of ``tokens``
    (the last-token limit) by its rule over the worker's groups (``hit_tokens``, the plain Python
    reference of kvindex/index/hybrid.py, not the index's native walk). ``seen`` counts the workers
    holding a full-attention prefix, those to which an index of that group alone would promise more
    than the rule gives, and those it would promise a hit that is cold (0)."""
    B = layout.block_size
    limit = hit_limit(tokens)
    primary = layout.primary
    out = {}
    for w, held in model.items():
        full = 0
        if primary is not None:
            group = held[primary]
            cap = min(len(keys), limit // B)
            while full < cap and keys[full] in group:
                full += 1
            if not full:
                continue  # no full-attention prefix, no hit: spares the rule most workers
        n = hit_tokens(layout, lambda g, j, held=held: keys[j] in held[g], limit) // B  # type: ignore[misc]
        if n:
            out[w] = n
        if full:
            seen[0] += 1
            seen[1] += full > n
            seen[2] += n == 0
    return out


def answer_overlaps(path: str, answer: Any, names: dict[str, int], audited: set[int]) -> Any:
    """The recorded answer as {worker: blocks} over the audited workers (score: the ranked list)."""
    if path == "match":
        (matches, groups), owners = answer
        out = {names[inst[0]]: m.length for inst, m in matches.items()}
        for g in groups:
            bits = np.unpackbits(np.frombuffer(g.masks, dtype=np.uint8), bitorder="little")
            for slot in np.flatnonzero(bits).tolist():
                out[names[owners[slot][0]]] = g.match.length
        return {w: n for w, n in out.items() if w in audited and n}
    if path == "lookup":
        if isinstance(answer, bytes):  # the servicer answers with the bytes (kvindex/api/lookup.py)
            answer = pb.LookupResponse.FromString(answer)
        return {
            names[m.worker]: m.matched_blocks
            for m in answer.matches
            if m.matched_blocks and names[m.worker] in audited
        }
    return [(names[c.candidate.state.worker], c.candidate.blocks) for c in answer.choices]


def check_answers(wl: Workload, path: str, recorded: dict[int, Any]) -> dict[str, Any]:
    """Replays the schedule's events into one set per audited worker (a hybrid model: one per
    KV-cache group) and compares each recorded answer with the model at that point: the leading run
    of held blocks, or a hybrid model's hit by vLLM's rule (``expected_hits``). score: each ranked
    instance that is audited has the model's answer, and the first has the longest of all audited
    workers (no load anywhere, so the ttft policy ranks by matched blocks)."""
    cfg = wl.config
    n_workers = len(wl.worker_names)
    if n_workers <= cfg.check_workers:
        audited = set(range(n_workers))
    else:
        audited = set(
            np.random.default_rng(cfg.seed + 1).choice(n_workers, cfg.check_workers, replace=False).tolist()
        )
    names = {name: i for i, name in enumerate(wl.worker_names)}
    layout = wl.layout
    n_groups = 1 if layout is None else len(layout.groups)
    model: dict[int, list[set[int]]] = {w: [set() for _ in range(n_groups)] for w in audited}
    ev_kind, ev_keys, ev_group = wl.ev_kind, wl.ev_keys, wl.ev_group
    mismatches: list[str] = []
    checked = 0
    seen = [0, 0, 0]  # hybrid: (worker, answer) pairs with a full-attention prefix, over-promised, cold
    j = 0
    for op, w, ev in zip(wl.ops, wl.op_worker.tolist(), wl.op_event.tolist(), strict=True):
        if ev >= 0:
            groups = model.get(w)
            if groups is not None:
                for e in wl.batches[ev]:
                    held = groups[ev_group[e]]
                    if ev_kind[e] == STORED:
                        held.update(ev_keys[e])
                    else:
                        held.difference_update(ev_keys[e])
            continue
        if j in recorded:
            keys = wl.req_keys[op]
            if layout is None:
                want = expected_overlaps({w: groups[0] for w, groups in model.items()}, keys)
            else:
                want = expected_hits(model, keys, layout, wl.req_tokens[op], seen)
            got = answer_overlaps(path, recorded[j], names, audited)
            checked += 1
            if path == "score":
                best = max(want.values(), default=0)
                ranked_ok = all(n == want.get(x, 0) for x, n in got if x in audited)
                # (no instance known yet, before the first event: an empty ranking)
                top_ok = got[0][1] >= best if got else best == 0
                if not (ranked_ok and top_ok):
                    mismatches.append(f"match {j}: ranked {got}, model best {best}")
            elif got != want:
                diff = {
                    x: (got.get(x), want.get(x)) for x in set(got) | set(want) if got.get(x) != want.get(x)
                }
                mismatches.append(f"match {j}: {len(diff)} workers differ, e.g. {list(diff.items())[:3]}")
        j += 1
    return {
        "checked": checked,
        "audited_workers": len(audited),
        "mismatches": len(mismatches),
        "examples": mismatches[:5],
        "passed": checked > 0 and not mismatches,
        "full_attention_holders": seen[0],
        "full_attention_over": seen[1],
        "full_attention_cold": seen[2],
    }


# -- runs -----------------------------------------------------------------------------------------


def steady_run(
    wl: Workload, path: str, limits: IngestLimits, check: bool, log: Callable[[str], None], preregister: bool
) -> Run:
    cfg = wl.config
    every = max(1, wl.n_matches // max(1, cfg.check_samples)) if check else 0
    keep = cfg.check_samples
    if path == "lookup" and check:
        # Each answer lists every instance: keep fewer, early (a Lookup replay may stop early).
        every, keep = min(every, 10), min(keep, 150)
    run, core, recorded = replay(
        wl,
        path,
        cfg.window_seconds,
        limits,
        every,
        preregister=preregister,
        max_seconds=cfg.max_seconds,
        final_samples=cfg.final_samples // (10 if path == "lookup" else 1),
        final_also=cfg.final_also,
        record_limit=keep,
    )
    log(summary_line(run))
    del core
    if check:
        t = time.perf_counter()
        run.check.update(check_answers(wl, path, recorded))
        log(
            f"[check] {path}: {run.check['checked']} answers vs the set model of "
            f"{run.check['audited_workers']:,} workers: {run.check['mismatches']} mismatches "
            f"({time.perf_counter() - t:.1f} s)"
        )
    del recorded
    gc.collect()
    return run


def sweep_windows(lo: float, hi: float, steps: int) -> list[float]:
    if steps <= 1:
        return [hi]
    return [hi * (lo / hi) ** (i / (steps - 1)) for i in range(steps)]


def sweep(
    wl: Workload,
    path: str,
    windows: list[float],
    limits: IngestLimits,
    log: Callable[[str], None],
    preregister: bool,
) -> list[Run]:
    """Shrinking windows (rising offered rates) until two in a row do not keep up."""
    runs: list[Run] = []
    behind = 0
    for w in windows:
        run, core, _ = replay(
            wl, path, w, limits, preregister=preregister, max_seconds=wl.config.max_seconds, clocks=False
        )
        del core
        gc.collect()
        runs.append(run)
        log(summary_line(run))
        behind = 0 if run.kept_up else behind + 1
        if behind >= 2:
            break
    return runs


def summary_line(r: Run) -> str:
    return (
        f"[{r.path} {r.window:.2f} s] offered {r.offered:,.0f} ops/s, achieved {r.achieved:,.0f}"
        f"{behind(r)}; match service p50/p99/max "
        f"{r.service['p50']:.0f}/{r.service['p99']:.0f}/{r.service['max']:.0f} us (not preempted p99 "
        f"{r.service_alone['p99']:.0f}, {r.preempted:,} preempted); from schedule "
        f"{triple(r.from_schedule, '/')}; without the bursts: service p50/p99 "
        f"{r.steady_service['p50']:.0f}/{r.steady_service['p99']:.0f} us, "
        f"from schedule p99 {fmt_us(r.steady_from_schedule['p99'])}; busy: matches "
        f"{r.match_busy_s:.1f} s, events {r.event_busy_s:.1f} s (CPU {r.match_cpu_s:.1f} + "
        f"{r.event_cpu_s:.1f} s: {r.capacity:,.0f} ops/s per core); waited for the CPU {r.cpu_wait_s:.1f} s"
        + (
            f"; final state one at a time p50/p99 {r.final_state['p50']:.0f}/{r.final_state['p99']:.0f} us "
            f"(not preempted p99 {r.final_state['alone_p99']:.0f})"
            if r.final_state
            else ""
        )
    )


def fmt_us(us: float) -> str:
    if math.isnan(us):
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.1f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} us"


def behind(r: Run) -> str:
    if r.kept_up:
        return ""
    ops = round(r.offered * r.window)
    if r.done < ops:
        return f" (behind; stopped after {r.duration:.0f} s, {r.done / ops:.0%} done)"
    return " (behind)"


def triple(st: dict[str, float], sep: str = " / ") -> str:
    return sep.join(fmt_us(st[q]) for q in ("p50", "p99", "max"))


def peak(runs: list[Run]) -> Run | None:
    """Dynamo's peak: the highest achieved rate of a window that kept up."""
    kept = [r for r in runs if r.kept_up]
    return max(kept, key=lambda r: r.achieved) if kept else None


# -- output ---------------------------------------------------------------------------------------


def steady_rows(runs: list[Run]) -> list[list[str]]:
    """(RSS growth only for the first replay: later ones reuse what the earlier ones freed.)"""
    rows = []
    for i, r in enumerate(runs):
        rows.append(
            [
                r.path,
                f"{r.offered:,.0f}",
                f"{r.achieved:,.0f}" + behind(r),
                f"{r.service['p50']:.0f} / {r.service['p99']:.0f} / {fmt_us(r.service['max'])}",
                f"{r.service_alone['p99']:.0f} ({r.preempted / max(r.service['n'], 1):.1%})",
                triple(r.from_schedule),
                f"{fmt_us(r.steady_service['p50'])} / {fmt_us(r.steady_service['p99'])}",
                triple(r.steady_from_schedule),
                (
                    f"{r.final_state['p50']:.0f} / {r.final_state['p99']:.0f} "
                    f"({r.final_state['alone_p99']:.0f})"
                )
                if r.final_state
                else "-",
                f"{r.match_cpu_s:.1f} + {r.event_cpu_s:.1f} ({r.cpu_wait_s:.1f})",
                f"{r.capacity:,.0f}",
                f"{r.nbytes / max(r.entries, 1):.1f} / "
                + (f"{r.rss_delta / max(r.entries, 1):.1f}" if i == 0 else "-"),
                "passed" if r.check.get("passed") and r.check.get("ingest_ok") else "FAILED",
            ]
        )
    return rows


STEADY_HEADER = [
    "path",
    "offered ops/s",
    "achieved ops/s",
    "match service p50 / p99 / max (us)",
    "service p99, matches not preempted (share preempted)",
    "from schedule p50 / p99 / max",
    "without the bursts: service p50 / p99",
    "without the bursts: from schedule",
    "final state, one at a time: p50 / p99 (not preempted) (us)",
    "CPU s: matches + events (s waiting for the CPU)",
    "ops per CPU second",
    "B per entry: index / RSS (first replay)",
    "check",
]
SWEEP_HEADER = [
    "path",
    "window s",
    "offered ops/s",
    "achieved ops/s",
    "service p99 (us)",
    "from schedule p99",
]


def sweep_rows(runs: list[Run]) -> list[list[str]]:
    return [
        [
            r.path,
            f"{r.window:.2f}",
            f"{r.offered:,.0f}",
            f"{r.achieved:,.0f}" + ("" if r.kept_up else " ⚠"),
            f"{r.service['p99']:.0f}",
            fmt_us(r.from_schedule["p99"]),
        ]
        for r in runs
    ]


def facts_lines(wl: Workload, runs: list[Run], pinned: int | None, load: tuple[float, float]) -> list[str]:
    f = wl.facts
    c = wl.config
    lines = [
        f"workload: {f['trace_rows']:,} trace rows x {c.trace_dup} cop{'y' if c.trace_dup == 1 else 'ies'} "
        f"({c.dup_workers} workers) on {f['unique_workers']:,} unique workers x d{c.dup} = "
        f"{f['workers']:,} workers; {f['operations']:,} operations: {f['matches']:,} matches "
        f"({f['request_blocks'] / max(f['matches'], 1):.1f} blocks each), "
        f"{f['stored_events']:,} stored events "
        f"({f['stored_blocks']:,} blocks), {f['removed_events']:,} removed ({f['removed_blocks']:,} blocks); "
        f"one block per hash id, {c.block_size}-token blocks, {c.gpu_blocks:,}-block LRU engines",
        f"window {c.window_seconds:g} s (trace squeezed to {c.trace_seconds:g} s); bursts: matches scheduled "
        f"in the first and last {STEADY_EDGE * 100:.0f} % of the window",
    ]
    if wl.layout is not None:
        lines.append(
            f"hybrid-attention model `{c.hybrid}`: KV-cache groups {wl.layout.describe()}, announced in "
            "every worker's heartbeat; events per group, a step's groups together in one batch "
            f"({f['events']:,} batches, one operation each); blocks and entries counted per (block, "
            "group) pair, the engines' capacity in pairs; matches by vLLM's rule over the groups"
        )
    if runs:
        r = max(runs, key=lambda run: run.done)  # the most complete replay
        lines.append(
            f"index after the {r.path} replay{'' if r.done == f['operations'] else ' (stopped early)'}: "
            f"{r.instances:,} instances, {r.entries:,} "
            f"({'block, group, worker' if wl.layout is not None else 'block, worker'}) entries on "
            f"{r.distinct:,} distinct blocks; index tables and logs {r.nbytes / 1e6:,.0f} MB "
            f"({r.nbytes / max(r.entries, 1):.1f} B per entry)"
            + (
                f", process RSS grew {r.rss_delta / 1e6:,.0f} MB "
                f"({r.rss_delta / max(r.entries, 1):.1f} B per entry, "
                f"{(r.rss_delta - r.nbytes) / max(r.instances, 1) / 1e3:.1f} kB per instance "
                "besides the tables)"
                if r is runs[0]
                else " (RSS growth: first replay only, in the table)"
            )
        )
        for run in runs:
            for other, st in run.final_others.items():
                lines.append(
                    f"final state of the {run.path} replay, {other} one at a time: p50 / p99 "
                    f"{st['p50']:.0f} / {st['p99']:.0f} us (not preempted p99 {st['alone_p99']:.0f})"
                )
            ck = run.check
            if "checked" in ck:
                lines.append(
                    f"check ({run.path}): {ck['checked']} sampled answers against a set model of "
                    f"{ck['audited_workers']:,} workers"
                    + (" (per KV-cache group, vLLM's rule)" if wl.layout is not None else "")
                    + f": {ck['mismatches']} mismatches; "
                    + (
                        f"an index of the full-attention group alone would have promised more than "
                        f"the rule to {ck['full_attention_over']:,} of the {ck['full_attention_holders']:,} "
                        f"(answer, worker) pairs with a full-attention prefix "
                        f"({ck['full_attention_cold']:,} of them cold); "
                        if wl.layout is not None
                        else ""
                    )
                    + "ingest: "
                    f"{ck['ingest']['batches_applied']:,} batches applied, {ck['ingest']['gaps']} gaps, "
                    f"{ck['ingest']['rejects']} rejects, entries {ck['ingest']['entries']:,} "
                    + (
                        f"(the engines hold {ck['ingest']['expected_entries']:,})"
                        if ck["ingest"]["expected_entries"] is not None
                        else f"(replay stopped after {run.done:,} operations)"
                    )
                )
    lines.append(
        f"code: {code_version()}; "
        + ("not pinned" if pinned is None else f"process pinned to CPU {pinned}")
        + f"; 1-min load average {load[0]:.2f} at start, {load[1]:.2f} at end"
    )
    return lines


def write_readme(block: str, tag: str) -> None:
    start, end = f"<!-- bench_mooncake:{tag}:start -->", f"<!-- bench_mooncake:{tag}:end -->"
    generated = f"{start}\n{block}\n{end}"
    text = README.read_text() if README.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = re.sub(
            re.escape(start) + r".*?" + re.escape(end), lambda _m: generated, text, count=1, flags=re.S
        )
    elif SECTION in text:
        head, _, rest = text.partition(SECTION)
        nxt = rest.find("\n## ")
        body, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        text = f"{head}{SECTION}{body.rstrip()}\n\n{generated}\n{tail}"
    else:
        text = f"{text.rstrip()}\n\n{SECTION}\n\n{generated}\n"
    README.write_text(text)


# -- CLI ------------------------------------------------------------------------------------------


def path_list(text: str) -> list[str]:
    paths = [p for p in text.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise argparse.ArgumentTypeError(
            f"paths are a comma-separated subset of {','.join(PATHS)}, got {text!r}"
        )
    return paths


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=positive, default=1000, help="unique workers the trace is split over")
    ap.add_argument("-d", "--dup", type=positive, default=7, help="copies of each worker (their own ids)")
    ap.add_argument(
        "--trace-duplication-factor",
        type=positive,
        default=1,
        help="copies of the trace, disjoint hash spaces",
    )
    ap.add_argument(
        "--duplication-workers",
        choices=("own", "shared"),
        default="own",
        help="trace copies on their own workers (default) or over the same workers (Dynamo's code)",
    )
    ap.add_argument(
        "--trace-seconds", type=positive_number, default=10.0, help="each worker's trace squeezed to this"
    )
    ap.add_argument("--window-seconds", type=positive_number, default=30.0, help="the replay window")
    ap.add_argument("--gpu-blocks", type=positive, default=16384, help="blocks per mock engine (LRU)")
    ap.add_argument("--block-size", type=positive, default=128, help="tokens per block (generated blocks)")
    ap.add_argument("--trace-length-factor", type=positive, default=1, help="blocks per trace hash id")
    ap.add_argument("--seed", type=int, default=42, help="the worker partition's seed")
    ap.add_argument("--limit", type=positive, help="the first rows of the trace only")
    ap.add_argument("--paths", type=path_list, default=list(PATHS), help="score,match,lookup (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also the peak sweep (shrinking windows)")
    ap.add_argument(
        "--sweep-paths", type=path_list, default=["score", "match"], help="paths swept (default score,match)"
    )
    ap.add_argument("--sweep-min-seconds", type=positive_number, default=1.0)
    ap.add_argument("--sweep-max-seconds", type=positive_number, default=30.0)
    ap.add_argument("--sweep-steps", type=positive, default=8)
    ap.add_argument(
        "--check-samples", type=int, default=400, help="answers checked against the set model (0: none)"
    )
    ap.add_argument(
        "--check-workers", type=positive, default=8000, help="workers the set model follows at most"
    )
    ap.add_argument(
        "--default-limits",
        action="store_true",
        help="keep the default ingest limits (max_instances_per_model 262,144) instead of sizing them",
    )
    ap.add_argument(
        "--max-seconds",
        type=positive_number,
        default=300.0,
        help="stop a replay that falls behind after this",
    )
    ap.add_argument(
        "--final-samples",
        type=int,
        default=2000,
        help="matches timed one after the other on the final state (Lookup: a tenth)",
    )
    ap.add_argument(
        "--final-also",
        type=path_list,
        default=[],
        help="paths also timed one at a time on each replay's final state (e.g. score,lookup)",
    )
    ap.add_argument(
        "--preregister",
        action="store_true",
        help="register every worker before timing (the published runs did not; Dynamo's later replay does)",
    )
    ap.add_argument(
        "--hybrid",
        choices=sorted(KV_GROUP_PRESETS),
        help="a hybrid-attention model with these KV-cache groups (workers_shim/sim/hybrid.py presets): "
        "the engines keep per group what vLLM keeps, the index applies vLLM's rule (needs --preregister)",
    )
    ap.add_argument("--quick", action="store_true", help="a small configuration for a smoke run (seconds)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    ap.add_argument(
        "--profile", help="cProfile the first path's steady run, outside the bursts, into this file (.prof)"
    )
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument(
        "--write-readme", action="store_true", help=f"update this configuration's block in {README.name}"
    )
    ap.add_argument(
        "--readme-label",
        help="appended to the configuration's block label (a block of its own in the README)",
    )
    return ap


def config_from(args: argparse.Namespace) -> Config:
    cfg = Config(
        workers=args.workers,
        dup=args.dup,
        trace_dup=args.trace_duplication_factor,
        dup_workers=args.duplication_workers,
        trace_seconds=args.trace_seconds,
        window_seconds=args.window_seconds,
        gpu_blocks=args.gpu_blocks,
        block_size=args.block_size,
        length_factor=args.trace_length_factor,
        seed=args.seed,
        limit=args.limit,
        check_samples=args.check_samples,
        check_workers=args.check_workers,
        preregister=args.preregister,
        max_seconds=args.max_seconds,
        final_samples=args.final_samples,
        final_also=tuple(args.final_also),
        hybrid=args.hybrid,
    )
    return cfg


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options; --quick changes the defaults (QUICK), options given explicitly still win."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    if args.hybrid and not args.preregister:
        # The index learns a model's KV-cache groups from its workers' heartbeats: workers that join
        # by their first batch would be read as full attention (and marked approximate).
        ap.error("--hybrid needs --preregister (the workers announce their KV-cache groups in heartbeats)")
    if args.readme_label is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.readme_label):
        ap.error(f"--readme-label: letters, digits, '_', '.', '-' only, got {args.readme_label!r}")
    return args


@dataclass
class Results:
    config: Config
    facts: dict[str, Any]
    steady: list[Run]
    sweeps: dict[str, list[Run]]
    lines: list[str]


def run_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> Results:
    cfg = config_from(args)
    quiet_logs()
    pinned = None if args.no_pin else pin_to_one_cpu()
    load0 = os.getloadavg()[0]
    wl = build_workload(cfg, log)
    default = IngestLimits().max_instances_per_model
    limits = (
        IngestLimits()
        if args.default_limits
        else IngestLimits(max_instances_per_model=max(default, len(wl.worker_names)))
    )
    if not args.default_limits and len(wl.worker_names) > default:
        log(
            f"[limits] max_instances_per_model raised from {default:,} to "
            f"{limits.max_instances_per_model:,} for this fleet"
        )
    steady: list[Run] = []
    for i, path in enumerate(args.paths):
        prof = cProfile.Profile() if args.profile and i == 0 else None
        if prof is not None:
            run, core, _ = replay(wl, path, cfg.window_seconds, limits, 0, prof, cfg.preregister)
            del core
            log(summary_line(run))
            prof.dump_stats(args.profile)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
            log(out.getvalue())
        else:
            run = steady_run(wl, path, limits, cfg.check_samples > 0, log, cfg.preregister)
        steady.append(run)
        if run.rejects:
            log(f"[ingest] refused: {run.rejects}")
    sweeps: dict[str, list[Run]] = {}
    if args.sweep:
        windows = sweep_windows(args.sweep_min_seconds, args.sweep_max_seconds, args.sweep_steps)
        if args.quick:
            windows = [cfg.window_seconds, cfg.window_seconds / 4]
        for path in args.sweep_paths:
            sweeps[path] = sweep(wl, path, windows, limits, log, cfg.preregister)
    lines = facts_lines(wl, steady, pinned, (load0, os.getloadavg()[0]))
    return Results(cfg, wl.facts, steady, sweeps, lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    res = run_bench(args)
    elapsed = time.perf_counter() - started
    render_table(
        f"Mooncake trace, {res.facts['workers']:,} workers ({res.config.tag})",
        STEADY_HEADER,
        steady_rows(res.steady),
    )
    for path, runs in res.sweeps.items():
        render_table(f"peak sweep: {path}", SWEEP_HEADER, sweep_rows(runs))
        p = peak(runs)
        print(
            f"peak {path}: "
            + (f"{p.achieved:,.0f} ops/s at p99 {p.service['p99']:.0f} us" if p else "none kept up")
        )
    for line in res.lines:
        print(f"- {line}")
    print(f"Machine: {machine_info()}; total {elapsed:.0f} s")
    ok = all(
        r.check.get("ingest_ok") and (r.check.get("passed") or "checked" not in r.check) for r in res.steady
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "config": asdict(res.config),
                    "facts": res.facts,
                    "steady": [asdict(r) for r in res.steady],
                    "sweeps": {p: [asdict(r) for r in runs] for p, runs in res.sweeps.items()},
                },
                indent=1,
            )
        )
    if args.write_readme:
        command = ".venv/bin/python benchmarks/bench_mooncake.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        parts = [
            f"Command: `{command.strip()}` (took {elapsed:.0f} s)",
            "",
            f"Machine: {machine_info()}",
            "",
            markdown_table(STEADY_HEADER, steady_rows(res.steady)),
        ]
        for path, runs in res.sweeps.items():
            p = peak(runs)
            parts += [
                "",
                f"Peak sweep, {path}: "
                + (
                    f"**{p.achieved:,.0f} ops/s** at service p99 {p.service['p99']:.0f} us"
                    if p
                    else "none kept up"
                )
                + "; ⚠: the window did not keep up (duration > 1.1 x window)",
                "",
                markdown_table(SWEEP_HEADER, sweep_rows(runs)),
            ]
        parts += ["", *[f"- {line}" for line in res.lines]]
        label = res.config.tag + (f"-{args.readme_label}" if args.readme_label else "")
        write_readme("\n".join(parts), label)
        print(f"results written to {README}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
