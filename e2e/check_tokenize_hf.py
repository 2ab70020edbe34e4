"""kvindex's tokenization against transformers' own, on the test suite's fixture tokenizers.

Runs in the vLLM venv (it has ``transformers``, the library vLLM tokenizes with; kvindex is imported from
this checkout). For each fixture style (Llama-3, ChatML with ``chat_template.jinja``, Metaspace with
``add_bos_token`` in its config) and many random texts: completions ids with and without special
tokens (``tokenizer(text, add_special_tokens=...)``), and for random chats the rendered text
(``apply_chat_template(tokenize=False)``) and its ids, with and without a generation prompt. Prints the
count of comparisons and of differences; exit status 1 on any difference.

    .venv-vllm/bin/python e2e/check_tokenize_hf.py [--texts 300]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "structlog" not in sys.modules:
    try:
        import structlog  # noqa: F401
    except ImportError:  # the vLLM venv has none; kvindex only logs through it
        stub = types.ModuleType("structlog")
        stub.get_logger = logging.getLogger  # type: ignore[attr-defined]
        sys.modules["structlog"] = stub

from kvindex.tokenize import ChatOptions, TokenizeError, Tokenizers
from kvtools.testing.tokenizer_fixtures import STYLES, make_tokenizer_dir

WORDS = [
    "hello",
    "world",
    "the",
    "cache",
    "",
    "東京",
    "café",
    "🙂",
    "\n\n",
    "x",
    "",
    "<|eot_id|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "[INST]",
    "12",
    "345",
    "'s",
    "ok\t",
]


def main() -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=300, help="random texts (and chats) per style")
    args = p.parse_args()
    rng = random.Random(1)

    def text() -> str:
        return "".join(
            rng.choice(WORDS) + rng.choice(["", " ", "\n", "  "]) for _ in range(rng.randint(0, 30))
        )

    checks = differences = 0
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {style: str(make_tokenizer_dir(Path(tmp) / style, style)) for style in STYLES}
        ours = Tokenizers.from_dirs(dirs)
        for style, directory in dirs.items():
            hf = AutoTokenizer.from_pretrained(directory)
            roles = (
                ["user", "assistant"] if style == "sentencepiece" else ["system", "user", "assistant", "user"]
            )
            for _ in range(args.texts):
                t = text()
                for special in (True, False):
                    checks += 1
                    a = ours.encode_prompt(style, t, special).tolist()
                    b = hf(t, add_special_tokens=special)["input_ids"]
                    if a != b:
                        differences += 1
                        print(f"prompt {style} special={special} {t!r}: ours {a[:12]} transformers {b[:12]}")
                msgs = [{"role": roles[j], "content": text()} for j in range(rng.randint(1, len(roles)))]
                for agp in (True, False):
                    try:
                        b_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
                    except Exception:  # the template refusing (e.g. roles must alternate)
                        b_text = None
                    try:
                        a_text = ours.render_chat(style, msgs, ChatOptions(add_generation_prompt=agp))
                    except TokenizeError:
                        a_text = None
                    checks += 1
                    if a_text != b_text:
                        differences += 1
                        print(f"render {style}: ours {a_text!r:.120} transformers {b_text!r:.120}")
                        continue
                    if b_text is None:
                        continue
                    checks += 1
                    a = ours.encode_chat(style, msgs, add_generation_prompt=agp).tolist()
                    b = hf(b_text, add_special_tokens=False)["input_ids"]
                    if a != b:
                        differences += 1
                        print(f"chat {style}: ours {a[:12]} transformers {b[:12]}")
    print(f"kvindex vs transformers: {checks} comparisons, {differences} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
