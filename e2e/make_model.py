"""A tiny randomly initialised Llama and a small trained tokenizer with a chat template, saved locally for
the real-engine run.

Runs in the vLLM venv (it needs ``transformers`` and ``torch``); nothing is downloaded. The weights are
random (seeded), so generations are gibberish, but the engine's KV cache, prefix caching and KV events
behave exactly as with a real model: they depend on token ids and block sizes, not on what is said.

    .venv-vllm/bin/python e2e/make_model.py --out e2e/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 1024


def tokenizer(out: Path) -> dict[str, int]:
    """The test suite's Llama-3-style fixture: a byte-level BPE trained here (vocab 1024), a post-processor
    adding <|begin_of_text|>, and a chat template in tokenizer_config.json (kvindex/testing). Returns
    the ids of its BOS and EOS for the model config."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: only tokenizers is imported
    from tokenizers import Tokenizer

    from kvindex.testing.tokenizer_fixtures import make_tokenizer_dir

    make_tokenizer_dir(out, "llama3", vocab_size=VOCAB)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return {"bos": tok.token_to_id("<|begin_of_text|>"), "eos": tok.token_to_id("<|eot_id|>")}


def model(out: Path, seed: int, special: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out: Path = args.out
    marker = out / "kvindex-e2e.json"
    if marker.exists():
        print(f"{out}: already there")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    special = tokenizer(out)
    model(out, args.seed, special)
    marker.write_text(json.dumps({"vocab": VOCAB, "seed": args.seed}) + "\n")
    print(f"{out}: tiny Llama (hidden 128, 2 layers, 4 heads, vocab {VOCAB}, float32), tokenizer, template")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
