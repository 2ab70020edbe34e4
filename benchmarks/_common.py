"""Shared helpers for the benchmarks: workload generation, wire encoding, stats and output.

The workload is generated from token ids, the way a worker shim sees it, so that both structures
under comparison get the same logical stream:

- our index gets the chained block keys of kvindex.keys (each key names its whole prefix);
- Dynamo's RadixTree gets ``tokens_hash`` = a per-block local hash (xxh3 of the block's tokens, seed
  1337, as Dynamo computes it) and ``block_hash`` = our chained key (its sequence hash).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import structlog
import xxhash

from kvindex.keys import keys_from_le_bytes, model_seed
from kvindex.wire.codec import encode_batch

MODEL = "bench-model"
BLOCK_SIZE = 16  # tokens per block (vLLM's default)
VOCAB = 128_000
DYNAMO_LOCAL_SEED = 1337  # the seed Dynamo uses for its per-block token hash
# A publisher seals a batch at 4096 keys (workers_shim.publisher.Publisher.max_batch_keys).
PUBLISHER_MAX_BATCH_KEYS = 4096

_xxh3 = xxhash.xxh3_64_intdigest
_BLOCK_BYTES = BLOCK_SIZE * 4


def quiet_logs() -> None:
    """Drop info logs (e.g. one 'instance_joined' per worker) as the service does at level=warning."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# -- block chains ---------------------------------------------------------------------------------


class Chain(NamedTuple):
    """Consecutive blocks of one sequence: our chained keys and Dynamo's local (token) hashes."""

    keys: list[int]
    local: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def slice(self, start: int, stop: int) -> Chain:
        return Chain(self.keys[start:stop], self.local[start:stop])

    def __add__(self, other: object) -> Chain:  # type: ignore[override]
        assert isinstance(other, Chain)
        return Chain(self.keys + other.keys, self.local + other.local)


class ChainGen:
    """Makes block chains from random token ids (deterministic for a seed)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.root = model_seed(MODEL)

    def extend(self, parent: int | None, n: int) -> Chain:
        """``n`` new blocks continuing after the block whose key is ``parent`` (None: a new sequence)."""
        if n <= 0:
            return Chain([], [])
        raw = self.rng.integers(0, VOCAB, n * BLOCK_SIZE, dtype=np.uint32).astype("<u4").tobytes()
        keys = keys_from_le_bytes(raw, BLOCK_SIZE, self.root if parent is None else parent)
        mv = memoryview(raw)
        local = [_xxh3(mv[o : o + _BLOCK_BYTES], DYNAMO_LOCAL_SEED) for o in range(0, len(raw), _BLOCK_BYTES)]
        return Chain(keys, local)


class Event(NamedTuple):
    """One 'stored' event of one worker: blocks continuing after ``parent`` (a key, or None)."""

    worker: int
    parent: int | None
    keys: list[int]
    local: list[int]


def split_events(worker: int, parent: int | None, chain: Chain, per_event: int) -> list[Event]:
    """A newly stored run of blocks as events of at most ``per_event`` blocks, parent-linked."""
    out = []
    for start in range(0, len(chain), per_event):
        keys = chain.keys[start : start + per_event]
        out.append(Event(worker, parent, keys, chain.local[start : start + per_event]))
        parent = keys[-1]
    return out


def interleave(per_worker: Sequence[Sequence[Any]]) -> list[Any]:
    """Round-robin over workers (the order a fleet's engine steps reach the index), order kept per worker."""
    out: list[Any] = []
    longest = max((len(items) for items in per_worker), default=0)
    for i in range(longest):
        for items in per_worker:
            if i < len(items):
                out.append(items[i])
    return out


def fleet_stream(
    gen: ChainGen,
    rng: np.random.Generator,
    *,
    workers: int,
    target_blocks: int,
    per_event: int,
    groups: int,
    prefix_blocks: tuple[int, int],
    tail_blocks: tuple[int, int],
    granule: int = 1,
) -> tuple[list[Event], int]:
    """Requests spread over ``workers``: a shared system prefix of one of ``groups`` + a unique tail.

    A worker stores a group's prefix only the first time it serves that group (later requests hit its
    prefix cache and store just their tail, parented on the prefix), as engines report it. Groups are
    Zipf-skewed; block counts are multiples of ``granule`` (= ``per_event`` makes every event exactly
    ``per_event`` blocks). Stops once ``target_blocks`` distinct blocks exist.
    Returns the events in fleet order and the number of distinct blocks.
    """
    lo, hi = prefix_blocks
    prefixes = [
        gen.extend(None, int(n)) for n in rng.integers(lo // granule, hi // granule + 1, groups) * granule
    ]
    weights = 1.0 / np.arange(1, groups + 1)
    weights /= weights.sum()
    held: list[set[int]] = [set() for _ in range(workers)]
    events: list[list[Event]] = [[] for _ in range(workers)]
    used_groups: set[int] = set()
    distinct = 0
    w = 0
    while distinct < target_blocks:
        g = int(rng.choice(groups, p=weights))
        prefix = prefixes[g]
        tail_n = int(rng.integers(tail_blocks[0] // granule, tail_blocks[1] // granule + 1)) * granule
        parent = prefix.keys[-1] if len(prefix) else None
        tail = gen.extend(parent, tail_n)
        if g in held[w]:
            new, new_parent = tail, parent
        else:
            held[w].add(g)
            new, new_parent = prefix + tail, None
            if g not in used_groups:
                used_groups.add(g)
                distinct += len(prefix)
        distinct += len(tail)
        events[w].extend(split_events(w, new_parent, new, per_event))
        w = (w + 1) % workers
    return interleave(events), distinct


# -- encoding -------------------------------------------------------------------------------------


def worker_name(worker: int) -> str:
    return f"w{worker:02d}"


def encode_ours(events: Sequence[Event], per_batch: int, epoch: int = 1) -> list[tuple[str, bytes]]:
    """Wire batches as the publisher seals them: per worker, consecutive events, at most ``per_batch``
    events and PUBLISHER_MAX_BATCH_KEYS keys per batch; batches of different workers interleaved."""
    by_worker: dict[int, list[list[dict[str, Any]]]] = {}
    keys_in_open: dict[int, int] = {}
    for ev in events:
        batches = by_worker.setdefault(ev.worker, [[]])
        open_keys = keys_in_open.get(ev.worker, 0)
        if batches[-1] and (
            len(batches[-1]) >= per_batch or open_keys + len(ev.keys) > PUBLISHER_MAX_BATCH_KEYS
        ):
            batches.append([])
            open_keys = 0
        batches[-1].append({"type": "stored", "tier": "gpu", "keys": ev.keys, "parent": ev.parent})
        keys_in_open[ev.worker] = open_keys + len(ev.keys)
    per_worker: list[list[tuple[str, bytes]]] = []
    for worker, batches in by_worker.items():
        name = worker_name(worker)
        subject = f"kvindex.events.{name}"
        per_worker.append(
            [
                (
                    subject,
                    encode_batch(
                        worker=name,
                        model=MODEL,
                        epoch=epoch,
                        seq=seq,
                        ts=0.0,
                        block_size=BLOCK_SIZE,
                        events=batch,
                    ),
                )
                for seq, batch in enumerate(batches, start=1)
            ]
        )
    return interleave(per_worker)


def encode_dynamo(events: Sequence[Event]) -> list[tuple[int, bytes]]:
    """One JSON KvCacheEvent per event (Dynamo's Python API takes one event per call)."""
    next_id: dict[int, int] = {}
    out = []
    for ev in events:
        event_id = next_id.get(ev.worker, 0)
        next_id[ev.worker] = event_id + 1
        blocks = [{"block_hash": k, "tokens_hash": h} for k, h in zip(ev.keys, ev.local, strict=True)]
        body = {"event_id": event_id, "data": {"stored": {"parent_hash": ev.parent, "blocks": blocks}}}
        out.append((ev.worker, json.dumps(body).encode()))
    return out


# -- measurement ----------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print with rich when installed, as aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        print(f"\n{title}")
        for r in [header, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    console = Console()
    if not console.is_terminal:  # piped into a log: do not wrap at the default 80 columns
        console = Console(width=160)
    console.print(table)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
