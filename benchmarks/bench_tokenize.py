"""Tokenizing an 8K-token chat prompt: cold (empty cache), warm (the same chat again) and grown (the chat
plus one new turn, its earlier turns cached), against the tokenizers library alone, in the same run.

    .venv/bin/python benchmarks/bench_tokenize.py [--tokens 8192] [--repeat 30]

The tokenizer is the test suite's Llama-3-style fixture (kvtools/testing/tokenizer_fixtures.py: byte-level
BPE with Llama 3's pre-tokenizer regex and chat template), trained here with a 1024-token vocabulary: a
real 128K vocabulary makes fewer, longer tokens from the same text, so per token the fixture costs about
what a real one does on more text. Every variant runs once per round, rounds interleaved (the load of a
shared machine drifts); medians of ``--repeat`` rounds in milliseconds, and ratios against cold.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvindex.tokenize import ChatOptions, Tokenizers
from kvtools.testing.tokenizer_fixtures import corpus, make_tokenizer_dir

KINDS = (
    "tokenizers_encode",
    "render_only",
    "chat_cold",
    "chat_warm",
    "chat_grown",
    "prompt_cold",
    "prompt_warm",
    "prompt_grown",
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    rng = random.Random(0)
    model = "bench"
    with tempfile.TemporaryDirectory() as tmp:
        directory = make_tokenizer_dir(Path(tmp) / "llama3", "llama3")
        toks = Tokenizers.from_dirs({model: str(directory)})
        raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    chat = build_chat(toks, model, args.tokens, rng)
    text = toks.render_chat(model, chat)
    n_tokens = len(toks.encode_chat(model, chat))
    prompt = text.replace("<|", "< |")  # a completions prompt of about the same length, no special tokens
    n_prompt = len(toks.encode_prompt(model, prompt))
    opts = ChatOptions()
    r = args.repeat

    # Every variant once per round, rounds repeated: on a shared machine the load drifts, and
    # interleaving gives each variant the same conditions. Medians per variant.
    questions = [" ".join(rng.choices(corpus(200, seed=k), k=3)) for k in range(r)]
    grown = [[*chat, {"role": "user", "content": q}] for q in questions]
    samples: dict[str, list[float]] = {k: [] for k in KINDS}

    def timed(kind: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        fn()
        samples[kind].append((time.perf_counter() - t0) * 1e3)

    for k in range(r):
        timed("tokenizers_encode", lambda: raw.encode(text, add_special_tokens=False).ids)
        timed("render_only", lambda: toks.render_chat(model, chat, opts))
        toks.cache.clear()
        timed("chat_cold", lambda: toks.encode_chat(model, chat))
        timed("chat_warm", lambda: toks.encode_chat(model, chat))
        timed("chat_grown", lambda k=k: toks.encode_chat(model, grown[k]))  # earlier turns cached
        toks.cache.clear()
        timed("prompt_cold", lambda: toks.encode_prompt(model, prompt))
        timed("prompt_warm", lambda: toks.encode_prompt(model, prompt))
        asked = f"{prompt}\nQuestion: {questions[k]}"  # the same document, a new question after it
        timed("prompt_grown", lambda asked=asked: toks.encode_prompt(model, asked))
    figures = {kind: statistics.median(v) for kind, v in samples.items()}

    rows = [
        ("tokenizers library alone: encode the rendered chat", "tokenizers_encode", "chat_cold"),
        ("render the template only (jinja2)", "render_only", "chat_cold"),
        ("chat, cold (empty cache)", "chat_cold", "chat_cold"),
        ("chat, warm (the same chat again)", "chat_warm", "chat_cold"),
        ("chat grown by one new user turn", "chat_grown", "chat_cold"),
        ("completions prompt, cold", "prompt_cold", "prompt_cold"),
        ("completions prompt, warm (the same text)", "prompt_warm", "prompt_cold"),
        ("completions prompt + a new question line", "prompt_grown", "prompt_cold"),
    ]
    print(
        f"chat: {len(chat)} messages, {len(text)} characters rendered, {n_tokens} tokens; "
        f"prompt: {len(prompt)} characters, {n_prompt} tokens; median of {r}; {platform.python_version()}"
    )
    print(f"{'':46} {'ms':>8} {'/ cold':>8}")
    for label, key, base in rows:
        print(f"{label:46} {figures[key]:8.3f} {figures[key] / figures[base]:8.3f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"tokens": n_tokens, "chars": len(text), "messages": len(chat), "ms": figures}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
