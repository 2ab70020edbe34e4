"""A tiny randomly initialised Llama and a small trained tokenizer with a chat template, saved locally for
the real-engine run.

Runs in the vLLM venv (it needs ``transformers`` and ``torch``); nothing is downloaded. The weights are
random (seeded), so generations are gibberish, but the engine's KV cache, prefix caching and KV events
behave exactly as with a real model: they depend on token ids and block sizes, not on what is said.

    .venv-vllm/bin/python e2e/make_model.py --out e2e/tiny-llama
    .venv-vllm/bin/python e2e/make_model.py --out e2e/routing-llama --hidden 512 --intermediate 1536 \
        --layers 6 --heads 8 --vocab 4096      # make e2e-routing's: a 2K-token prefill ~0.56 s on a core
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 1024


def tokenizer(out: Path, vocab_size: int = VOCAB) -> dict[str, int]:
    """The test suite's Llama-3-style fixture: a byte-level BPE trained here, a post-processor adding
    <|begin_of_text|>, and a chat template in tokenizer_config.json (kvtools/testing). Returns the ids
    of its BOS and EOS and its vocabulary size for the model config."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: only tokenizers is imported
    from tokenizers import Tokenizer

    from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir

    make_tokenizer_dir(out, "llama3", vocab_size=vocab_size)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return {
        "bos": tok.token_to_id("<|begin_of_text|>"),
        "eos": tok.token_to_id("<|eot_id|>"),
        "vocab": tok.get_vocab_size(with_added_tokens=True),
    }


def model(out: Path, seed: int, special: dict[str, int], size: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=special["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        max_position_embeddings=8192,
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
    # The default is the tiny model of make e2e-vllm; make e2e-routing asks for one whose 2K-token
    # prefill takes ~0.5 s on one CPU core, so that queueing and cache hits show in TTFT.
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=VOCAB, help="the tokenizer's target vocabulary")
    args = p.parse_args()
    size = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads")}
    out: Path = args.out
    marker = out / "kvindex-e2e.json"
    if marker.exists():
        print(f"{out}: already there")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    special = tokenizer(out, args.vocab)
    model(out, args.seed, special, size)
    marker.write_text(json.dumps({**size, "vocab": special["vocab"], "seed": args.seed}) + "\n")
    print(f"{out}: random Llama {size}, vocab {special['vocab']}, float32, BPE tokenizer and chat template")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
