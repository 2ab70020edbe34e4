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


# A Llama-3-like chat template in the model directory (tokenizer_config.json), so that chat requests
# are rendered by the engine and by kvindex's tokenizer the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' </s> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]


def tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ROLES)}
    vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=8192
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def model(out: Path, seed: int, size: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        max_position_embeddings=8192,
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
    # The default is the tiny model of make e2e-vllm; make e2e-routing asks for one whose 2K-token
    # prefill takes ~0.5-1 s on one CPU core, so that queueing and cache hits show in TTFT.
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=VOCAB)
    args = p.parse_args()
    size = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "vocab")}
    out: Path = args.out
    marker = out / "kvindex-e2e.json"
    if marker.exists():
        print(f"{out}: already there")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    model(out, args.seed, size)
    tokenizer(out, args.vocab)
    marker.write_text(json.dumps({**size, "seed": args.seed}) + "\n")
    print(f"{out}: random Llama {size}, float32, word-level tokenizer with a chat template")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
