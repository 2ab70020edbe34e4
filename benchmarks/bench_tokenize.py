"""Tokenizing an 8K-token chat prompt: cold (empty cache), warm (the same chat again) and grown (the chat
plus one new turn, its earlier turns cached), against the tokenizers library alone, in the same run.

    .venv/bin/python benchmarks/bench_tokenize.py [--tokens 8192] [--repeat 30]

The tokenizer is the test suite's Llama-3-style fixture (kvindex/testing/tokenizer_fixtures.py: byte-level
BPE with Llama 3's pre-tokenizer regex and chat template), trained here with a 1024-token vocabulary: a
real 128K vocabulary makes fewer, longer tokens from the same text, so per token the fixture costs about
what a real one does on more text. Medians of ``--repeat`` runs, in milliseconds; ratios against cold.
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

from kvindex.testing.tokenizer_fixtures import corpus, make_tokenizer_dir
from kvindex.tokenize import ChatOptions, Tokenizers


def median_ms(fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def build_chat(toks: Tokenizers, model: str, target: int, rng: random.Random) -> list[dict[str, str]]:
    """A system prompt of about a tenth of the target, then user/assistant turns up to ``target`` tokens."""
    lines = corpus(4000, seed=7)
    system = " ".join(lines[:20])
    chat = [{"role": "system", "content": system}]
    i = 20
    while len(toks.encode_chat(model, chat)) < target:
        role = "user" if chat[-1]["role"] != "user" else "assistant"
        n = rng.randint(2, 8)
        chat.append({"role": role, "content": " ".join(lines[i : i + n])})
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

    figures: dict[str, float] = {}
    # Baselines: the tokenizers library encoding the rendered text once (no cache, no rendering), and
    # rendering the template alone.
    figures["tokenizers_encode"] = median_ms(lambda: raw.encode(text, add_special_tokens=False), r)
    figures["render_only"] = median_ms(lambda: toks.render_chat(model, chat, opts), r)
    figures["chat_cold"] = median_ms(lambda: toks.encode_chat(model, chat), r, before=toks.cache.clear)
    toks.encode_chat(model, chat)
    figures["chat_warm"] = median_ms(lambda: toks.encode_chat(model, chat), r)

    # Grown: each sample is the cached chat plus its own new question (a user sending the next turn).
    def grown_sample() -> None:
        question = " ".join(rng.choices(corpus(200, seed=rng.randrange(1 << 30)), k=3))
        toks.encode_chat(model, [*chat, {"role": "user", "content": question}])

    toks.cache.clear()
    toks.encode_chat(model, chat)
    figures["chat_grown"] = median_ms(grown_sample, r)
    figures["prompt_cold"] = median_ms(lambda: toks.encode_prompt(model, prompt), r, before=toks.cache.clear)
    toks.encode_prompt(model, prompt)
    figures["prompt_warm"] = median_ms(lambda: toks.encode_prompt(model, prompt), r)

    rows = [
        ("tokenizers library: encode the rendered chat", "tokenizers_encode", "chat_cold"),
        ("render the template only (jinja2)", "render_only", "chat_cold"),
        ("chat, cold (empty cache)", "chat_cold", "chat_cold"),
        ("chat, warm (the same chat again)", "chat_warm", "chat_cold"),
        ("chat grown by one new user turn", "chat_grown", "chat_cold"),
        ("completions prompt, cold", "prompt_cold", "prompt_cold"),
        ("completions prompt, warm (the same text)", "prompt_warm", "prompt_cold"),
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
