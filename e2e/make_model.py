"""A tiny randomly initialised Llama and a trivial tokenizer, saved locally for the real-engine run.

Runs in the vLLM venv (it needs ``transformers`` and ``torch``); nothing is downloaded. The weights are
random (seeded), so generations are gibberish, but the engine's KV cache, prefix caching and KV events
behave exactly as with a real model: they depend on token ids and block sizes, not on what is said.

    .venv-vllm/bin/python e2e/make_model.py --out e2e/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


def tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    fast.save_pretrained(out)


def model(out: Path, seed: int) -> None:
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
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
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
    model(out, args.seed)
    tokenizer(out)
    marker.write_text(json.dumps({"vocab": VOCAB, "seed": args.seed}) + "\n")
    print(f"{out}: tiny Llama (hidden 128, 2 layers, 4 heads, vocab {VOCAB}, float32) and tokenizer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
