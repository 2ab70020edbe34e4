"""Tokenizing chat prompts of 8 K to 256 K tokens: cold (empty cache), warm (the same chat again) and
grown (the chat plus one new turn), against the tokenizers library alone, in the same run; the memory a
call takes (tracemalloc peak, and the process's peak RSS, which sees the tokenizers library's Rust
side); what a growing conversation costs with the remembered prompts and with the piece cache alone.

    .venv/bin/python benchmarks/bench_tokenize.py [--tokens 8192[,65536,262144]] [--repeat 30]

The tokenizer is the test suite's Llama-3-style fixture (kvtools/testing/tokenizer_fixtures.py: byte-level
BPE with Llama 3's pre-tokenizer regex and chat template), trained here with a 1024-token vocabulary: a
real 128K vocabulary makes fewer, longer tokens from the same text, so per token the fixture costs about
what a real one does on more text. Every variant runs once per round, rounds interleaved (the load of a
shared machine drifts); medians of ``--repeat`` rounds in milliseconds, and ratios against cold.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvindex.keys import keys_from_le_bytes, model_seed
from kvindex.tokenize import ChatOptions, Tokenizers, bounded_json
from kvindex.tokenize.cache import PrefixMemo
from kvindex.tokenize.segments import split
from kvtools.testing.tokenizer_fixtures import corpus, make_tokenizer_dir

BLOCK_SIZE = 16
KINDS = (
    "tokenizers_encode",
    "render_only",
    "messages_json",
    "chat_cold",
    "chat_warm",
    "chat_grown",
    "chat_grown_pieces",
    "keys_grown",
    "prompt_cold",
    "prompt_warm",
    "prompt_grown",
    "prompt_grown_pieces",
)
ROWS = (
    ("tokenizers library alone: encode the rendered chat", "tokenizers_encode", "chat_cold"),
    ("render the template only (jinja2)", "render_only", "chat_cold"),
    ("parse the messages JSON (as the servicer does)", "messages_json", "chat_cold"),
    ("chat, cold (empty cache)", "chat_cold", "chat_cold"),
    ("chat, warm (the same chat again)", "chat_warm", "chat_cold"),
    ("chat grown by one new user turn", "chat_grown", "chat_cold"),
    ("  the same, piece cache only (no remembered prompt)", "chat_grown_pieces", "chat_cold"),
    ("block keys of the grown chat (xxh3 chain, native)", "keys_grown", "chat_cold"),
    ("completions prompt, cold", "prompt_cold", "prompt_cold"),
    ("completions prompt, warm (the same text)", "prompt_warm", "prompt_cold"),
    ("completions prompt + a new question line", "prompt_grown", "prompt_cold"),
    ("  the same, piece cache only (no remembered prompt)", "prompt_grown_pieces", "prompt_cold"),
)


def build_chat(toks: Tokenizers, model: str, target: int, rng: random.Random) -> list[dict[str, str]]:
    """A system prompt of about a tenth of the target, then user/assistant turns up to ``target`` tokens."""
    lines = corpus(4000, seed=7)
    system = " ".join(lines[:20])
    chat = [{"role": "system", "content": system}]
    i = 20
    while (have := len(toks.encode_chat(model, chat))) < target:
        # Far from the target, add several turns before measuring again (each measure renders and
        # encodes the whole chat: one turn at a time is quadratic, hours at 256 K tokens); about 80 %
        # of what is missing, so the chat is still the first one of the sequence to reach the target.
        missing = target - have
        turns = max(1, int(0.8 * missing * (len(chat) / have))) if missing > 4096 else 1
        for _ in range(turns):
            role = "user" if chat[-1]["role"] != "user" else "assistant"
            n = rng.randint(2, 8)
            chat.append({"role": role, "content": " ".join(lines[i % len(lines) : i % len(lines) + n])})
            i += n
    return chat


def peak_rss_reset() -> int:
    """Reset the process's peak RSS (Linux: clear_refs 5) and return the current RSS in bytes."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") << 10


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_in_child(directory: Path, chat: list[dict[str, str]]) -> dict[str, int]:
    """Peak RSS growth of a cold chat call (and of the tokenizers library's own encode of its text) in a
    fresh process: in this one, memory freed by earlier calls is reused and hides a call's peak."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.json"
        path.write_text(json.dumps({"dir": str(directory), "chat": chat}))
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(path)],
            check=True,
            capture_output=True,
            text=True,
            env=os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 17)},  # no dynamic threshold
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_child(path: Path) -> int:
    spec = json.loads(path.read_text())
    toks = Tokenizers.from_dirs({"m": spec["dir"]})
    raw = Tokenizer.from_file(str(Path(spec["dir"]) / "tokenizer.json"))
    text = toks.render_chat("m", spec["chat"])
    out = {}
    for name, fn in (
        ("chat_cold", lambda: toks.encode_chat("m", spec["chat"])),
        ("tokenizers_encode", lambda: raw.encode(text, add_special_tokens=False).ids),
    ):
        gc.collect()
        base = peak_rss_reset()
        fn()
        out[name] = max(0, (_status_kb("VmHWM") << 10) - base)
    print(json.dumps(out))
    return 0


def memory(fn: Callable[[], Any]) -> tuple[int, int]:
    """(tracemalloc peak, peak RSS growth) of one call, in bytes. tracemalloc sees Python objects and
    numpy arrays; the RSS also sees the tokenizers library's Rust allocations."""
    gc.collect()
    base = peak_rss_reset()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, max(0, (_status_kb("VmHWM") << 10) - base)


def measure(
    toks: Tokenizers,
    pieces_only: Tokenizers,
    raw: Tokenizer,
    directory: Path,
    model: str,
    target: int,
    repeat: int,
) -> dict[str, Any]:
    rng = random.Random(0)
    chat = build_chat(toks, model, target, rng)
    text = toks.render_chat(model, chat)
    n_tokens = len(toks.encode_chat(model, chat))
    prompt = text.replace("<|", "< |")  # a completions prompt of about the same length, no special tokens
    n_prompt = len(toks.encode_prompt(model, prompt))
    messages = json.dumps(chat)
    opts = ChatOptions()
    seed = model_seed(model)
    n_pieces = len(split(text, toks._models[model].pattern))

    # Every variant once per round, rounds repeated: on a shared machine the load drifts, and
    # interleaving gives each variant the same conditions. Medians per variant.
    questions = [" ".join(rng.choices(corpus(200, seed=k), k=3)) for k in range(repeat)]
    grown = [[*chat, {"role": "user", "content": q}] for q in questions]
    samples: dict[str, list[float]] = {k: [] for k in KINDS}

    def timed(kind: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        samples[kind].append((time.perf_counter() - t0) * 1e3)
        return out

    for k in range(repeat):
        timed("tokenizers_encode", lambda: raw.encode(text, add_special_tokens=False).ids)
        timed("render_only", lambda: toks.render_chat(model, chat, opts))
        timed("messages_json", lambda: bounded_json.loads(messages, "messages"))
        for t in (toks, pieces_only):
            t.clear_cache()
        timed("chat_cold", lambda: toks.encode_chat(model, chat))
        timed("chat_warm", lambda: toks.encode_chat(model, chat))
        ids = timed("chat_grown", lambda k=k: toks.encode_chat(model, grown[k]))  # earlier turns cached
        pieces_only.encode_chat(model, chat)
        timed("chat_grown_pieces", lambda k=k: pieces_only.encode_chat(model, grown[k]))
        raw_ids = ids.tobytes()
        timed("keys_grown", lambda raw_ids=raw_ids: keys_from_le_bytes(raw_ids, BLOCK_SIZE, seed))
        for t in (toks, pieces_only):
            t.clear_cache()
        timed("prompt_cold", lambda: toks.encode_prompt(model, prompt))
        timed("prompt_warm", lambda: toks.encode_prompt(model, prompt))
        asked = f"{prompt}\nQuestion: {questions[k]}"  # the same document, a new question after it
        timed("prompt_grown", lambda asked=asked: toks.encode_prompt(model, asked))
        pieces_only.encode_prompt(model, prompt)
        timed("prompt_grown_pieces", lambda asked=asked: pieces_only.encode_prompt(model, asked))
    figures = {kind: statistics.median(v) for kind, v in samples.items()}

    toks.clear_cache()
    mem = {"chat_cold": memory(lambda: toks.encode_chat(model, chat))}
    added = toks.cache.bytes + toks.memo.bytes
    mem["chat_warm"] = memory(lambda: toks.encode_chat(model, chat))
    mem["chat_grown"] = memory(lambda: toks.encode_chat(model, grown[0]))
    toks.clear_cache()
    mem["tokenizers_encode"] = memory(lambda: raw.encode(text, add_special_tokens=False).ids)
    return {
        "rss_cold_fresh_process": rss_in_child(directory, chat),
        "tokens": n_tokens,
        "prompt_tokens": n_prompt,
        "chars": len(text),
        "messages": len(chat),
        "pieces": n_pieces,
        "ms": figures,
        "memory": mem,
        "cache_bytes_added_cold": added,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="8192", help="comma-separated chat sizes in tokens")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--memory-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child is not None:
        return memory_child(args.memory_child)
    sizes = [int(t) for t in args.tokens.split(",") if t]
    model = "bench"
    tmp = tempfile.TemporaryDirectory()  # for the whole run: the memory child loads it again
    directory = make_tokenizer_dir(Path(tmp.name) / "llama3", "llama3")
    toks = Tokenizers.from_dirs({model: str(directory)})
    pieces_only = Tokenizers.from_dirs({model: str(directory)})
    pieces_only.memo = PrefixMemo(0)  # nothing remembered: the piece cache alone (before 9123266)
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    print(
        f"load average {os.getloadavg()[0]:.2f}; median of {args.repeat} rounds; "
        f"Python {platform.python_version()}; cache {toks.cache.max_bytes + toks.memo.max_bytes >> 20} MiB "
        f"(pieces {toks.cache.max_bytes >> 20}, prompts {toks.memo.max_bytes >> 20}), "
        f"at most {toks.call_bytes >> 20} MiB added per call"
    )
    results = {}
    for target in sizes:
        r = measure(toks, pieces_only, raw, directory, model, target, args.repeat)
        results[target] = r
        f = r["ms"]
        print(
            f"\nchat: {r['messages']} messages, {r['chars']} characters rendered, {r['tokens']} tokens, "
            f"{r['pieces']} pieces; prompt: {r['prompt_tokens']} tokens"
        )
        print(f"{'':54} {'ms':>9} {'/ cold':>8}")
        for label, key, base in ROWS:
            print(f"{label:54} {f[key]:9.3f} {f[key] / f[base]:8.3f}")
        for kind, (peak, _rss) in r["memory"].items():
            print(f"memory, {kind:18}: tracemalloc peak {peak / 2**20:7.1f} MiB")
        for kind, rss in r["rss_cold_fresh_process"].items():
            print(f"memory, {kind:18}: peak RSS growth in a fresh process {rss / 2**20:7.1f} MiB")
        print(f"cache bytes added by the cold chat: {r['cache_bytes_added_cold'] / 2**20:.1f} MiB")
    print(f"\nload average now {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
