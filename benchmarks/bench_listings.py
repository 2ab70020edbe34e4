"""What answers that list the fleet cost the index at large fleet sizes: ListInstances (one answer,
pages of 4,096, full and brief views) and Lookup (every instance, or max_instances).

    .venv/bin/python benchmarks/bench_listings.py --sizes 7000,28000,224000
    .venv/bin/python benchmarks/bench_listings.py --quick

In process (the servicer's handlers, no socket: the index's event-loop time is what is measured),
N instances of one model registered by real heartbeats (each with an endpoint and a load) and a
24-block prompt held by every tenth instance. Per configuration the best of 3 walks: the whole
listing's time and bytes (the answers serialized, as gRPC sends them), per instance, and the
longest single call (how long the index's loop is held at once). Then the first page after one
instance joined (the sorted view follows the registry's journal) and after 5,000 joined (the
journal overflowed: rebuilt).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from kvindex.api.servicer import KvIndexServicer
from kvindex.core import Core, build_core
from kvindex.keys import block_keys
from kvindex.tokenize.registry import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.codec import encode_batch, encode_heartbeat

MODEL = "m"
BS = 16


def join(core: Core, name: str, endpoint: str, model: str = MODEL) -> None:
    """``name`` joins ``model`` by a heartbeat (a load, a 16,384-block GPU, ``endpoint``)."""
    beat = encode_heartbeat(
        worker=name,
        model=model,
        epoch=1,
        seq=0,
        ts=time.time(),
        block_size=BS,
        load={"running": 3, "waiting": 1},
        capacity={"gpu": 16384},
        digest={},
        endpoint=endpoint,
    )
    core.consumer.on_heartbeat(f"kvindex.status.{name}", beat)


def fleet(n: int, keys: list[int]) -> Core:
    core = build_core()
    for w in range(n):
        name = f"worker-{w:06d}"
        join(core, name, f"10.{w >> 16}.{(w >> 8) & 255}.{w & 255}:8000")
        if w % 10 == 0:
            batch = encode_batch(
                worker=name,
                model=MODEL,
                epoch=1,
                seq=1,
                ts=time.time(),
                block_size=BS,
                events=[{"type": "stored", "tier": "gpu", "keys": keys[: 1 + w % 24], "parent": None}],
            )
            core.consumer.on_events(f"kvindex.events.{name}", batch)
    return core


def caller(servicer: KvIndexServicer, name: str) -> Callable[[Any], Any]:
    method = getattr(servicer, name)

    def call(request: Any) -> Any:
        coro = method(request, None)
        try:
            coro.send(None)  # no await on the success path
        except StopIteration as done:
            return done.value
        raise RuntimeError(f"{name} awaited something")

    return call


def walk(list_instances: Callable[[Any], Any], view: str, size: int) -> tuple[float, int, float, int, int]:
    """(seconds, bytes, longest call, pages, instances) of one whole listing."""
    t0 = time.perf_counter()
    token, count, nbytes, worst, pages = "", 0, 0, 0.0, 0
    while True:
        t = time.perf_counter()
        reply = list_instances(
            pb.ListInstancesRequest(model=MODEL, view=view, page_size=size, page_token=token)
        )
        nbytes += len(reply.SerializeToString())
        worst = max(worst, time.perf_counter() - t)
        count += len(reply.instances)
        pages += 1
        token = reply.next_page_token
        if not token:
            return time.perf_counter() - t0, nbytes, worst, pages, count


def lookup_row(lookup: Callable[[Any], Any], keys: list[int], limit: int) -> tuple[float, int]:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        reply = lookup(pb.LookupRequest(model=MODEL, block_keys=keys, max_instances=limit))
        best = min(best, time.perf_counter() - t)
    return best, len(reply) if isinstance(reply, bytes) else reply.ByteSize()


def run(n: int) -> None:
    keys = block_keys(list(range(24 * BS)), BS, MODEL)
    t = time.perf_counter()
    core = fleet(n, keys)
    built = time.perf_counter() - t
    servicer = KvIndexServicer(core.index, core.registry, core.counters, None, core.ranker, Tokenizers())
    list_instances = caller(servicer, "ListInstances")
    print(f"\n{n:,} instances (registered in {built:.1f} s)\n")
    print("| answer | whole listing, ms | us per instance | MB | B per instance | calls | longest call, ms |")
    print("|---|---|---|---|---|---|---|")
    for view, size in (("full", 0), ("full", 4096), ("brief", 0), ("brief", 4096)):
        secs, nbytes, worst, pages, count = min(
            (walk(list_instances, view, size) for _ in range(3)), key=lambda r: r[0]
        )
        label = f"ListInstances {view}, " + ("one answer" if size == 0 else f"pages of {size:,}")
        print(
            f"| {label} | {secs * 1e3:,.1f} | {secs / count * 1e6:.1f} | {nbytes / 1e6:.2f} "
            f"| {nbytes / count:.0f} | {pages} | {worst * 1e3:.1f} |"
        )
    lookup = caller(servicer, "Lookup")
    for limit in (0, 100):
        secs, nbytes = lookup_row(lookup, keys, limit)
        label = "Lookup, every instance" if limit == 0 else f"Lookup, max_instances {limit}"
        print(
            f"| {label} | {secs * 1e3:,.2f} | {secs / n * 1e6:.2f} | {nbytes / 1e6:.2f} "
            f"| {nbytes / (min(limit, n) if limit else n):.0f} | 1 | - |"
        )
    first = pb.ListInstancesRequest(model=MODEL, view="brief", page_size=4096)
    join(core, "joined-1", "10.255.0.1:8000")
    t = time.perf_counter()
    list_instances(first)
    one = time.perf_counter() - t
    for i in range(5000):
        join(core, f"joined-many-{i}", "10.255.1.1:8000")
    t = time.perf_counter()
    list_instances(first)
    many = time.perf_counter() - t
    print(
        f"\n- first brief page of 4,096 after one join: {one * 1e3:.1f} ms; "
        f"after 5,000 joins: {many * 1e3:.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7000,28000,224000", help="fleet sizes, comma-separated")
    ap.add_argument("--quick", action="store_true", help="one small fleet (a smoke run)")
    args = ap.parse_args()
    sizes = [2000] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    print(f"load average {os.getloadavg()[0]:.2f}")
    for n in sizes:
        run(n)
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
