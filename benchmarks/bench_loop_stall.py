"""How long a Score of a long, new chat holds the index's event loop: tokenized on the loop (as before)
against in a worker thread first (``KvIndexServicer.pretokenize``), in the same run.

    .venv/bin/python benchmarks/bench_loop_stall.py --tokens 262144
    .venv/bin/python benchmarks/bench_loop_stall.py --quick

In process: the servicer with the test suite's Llama-3-style tokenizer and 64 instances; a chat of
about ``--tokens`` tokens (benchmarks/bench_tokenize.py's), each round a new one with the
tokenizer's caches emptied (a long new conversation: nothing of it cached). While its ``Score``
runs as a task, the loop runs a 1 ms ticker and a ``Score`` of 1,024 token ids every 2 ms;
reported: the longest gap between ticks (the stall) and the short Scores' p50 / max latency.
Rounds alternate between the two modes; medians of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_listings import join
from bench_tokenize import build_chat

from kvindex.api import servicer as servicer_module
from kvindex.api.inprocess import InProcessContext
from kvindex.api.servicer import KvIndexServicer
from kvindex.core import build_core
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir

MODEL = "bench"


def make_servicer(toks: Tokenizers) -> KvIndexServicer:
    core = build_core()
    for w in range(64):
        join(core, f"w{w:02d}", "", MODEL)
    return KvIndexServicer(core.index, core.registry, core.counters, None, core.ranker, toks)


async def one_round(servicer: KvIndexServicer, chat: list[dict[str, str]]) -> dict[str, float]:
    request = pb.ScoreRequest(model=MODEL, messages=json.dumps(chat))
    short = pb.ScoreRequest(model=MODEL, token_ids=list(range(1024)))
    ctx: Any = InProcessContext()
    t0 = time.perf_counter()
    task = asyncio.ensure_future(servicer.Score(request, ctx))
    gaps, shorts, last = [], [], time.perf_counter()
    while not task.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if len(gaps) % 2 == 0:
            t = time.perf_counter()
            await servicer.Score(short, ctx)
            shorts.append(time.perf_counter() - t)
            last = time.perf_counter()
    reply = await task
    return {
        "total": time.perf_counter() - t0,
        "stall": max(gaps, default=0.0),
        "short_p50": statistics.median(shorts) if shorts else float("nan"),
        "short_max": max(shorts, default=float("nan")),
        "tokens": reply.prompt_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = 32768, 1
    tmp = tempfile.TemporaryDirectory()
    directory = make_tokenizer_dir(Path(tmp.name) / "llama3", "llama3")
    toks = Tokenizers.from_dirs({MODEL: str(directory)})
    servicer = make_servicer(toks)
    base = build_chat(toks, MODEL, args.tokens, random.Random(5))
    offload = servicer_module.OFFLOAD_CHARS
    results: dict[str, list[dict[str, float]]] = {"on the loop": [], "worker thread first": []}
    print(
        f"load average {os.getloadavg()[0]:.2f}; chat of ~{args.tokens:,} tokens, {args.rounds} rounds a mode"
    )
    for r in range(args.rounds):
        for mode in results:
            chat = [{"role": "system", "content": f"Round {r} {mode}. " + base[0]["content"]}, *base[1:]]
            servicer_module.OFFLOAD_CHARS = offload if mode == "worker thread first" else 1 << 62
            toks.clear_cache()  # cold: nothing of the chat tokenized before (build_chat tokenized it)
            results[mode].append(asyncio.run(one_round(servicer, chat)))
    servicer_module.OFFLOAD_CHARS = offload
    print(
        "\n| tokenized | Score of the new chat, ms | longest loop stall, ms "
        "| short Scores meanwhile p50 / max, ms |"
    )
    print("|---|---|---|---|")
    for mode, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(
            f"| {mode} | {med['total'] * 1e3:,.0f} | {med['stall'] * 1e3:,.1f} "
            f"| {med['short_p50'] * 1e3:.2f} / {med['short_max'] * 1e3:.1f} |"
        )
    print(f"\n({int(rows[0]['tokens']):,} tokens; load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
