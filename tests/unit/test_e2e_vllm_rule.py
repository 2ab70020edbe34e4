"""The prediction rule of the real-engine run (e2e/run_vllm.py, docs/e2e-vllm.md): vLLM never reuses
the last prompt token, and reuses whole blocks only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "e2e_run_vllm", Path(__file__).resolve().parents[2] / "e2e" / "run_vllm.py"
)
assert _SPEC is not None and _SPEC.loader is not None
run_vllm = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = run_vllm  # dataclasses resolve annotations through it
_SPEC.loader.exec_module(run_vllm)


@pytest.mark.parametrize(
    ("matched", "prompt_len", "cached"),
    [
        (0, 104, 0),
        (1, 32, 0),  # the only block is the one holding the last token: recomputed
        (1, 33, 32),
        (3, 96, 64),  # every block cached, the last one recomputed all the same
        (3, 104, 96),
        (2, 104, 64),  # fewer blocks held than the prompt has: the index's answer stands
        (7, 256, 224),
        (7, 257, 224),
    ],
)
def test_predicted_cached_tokens(matched: int, prompt_len: int, cached: int) -> None:
    assert run_vllm.predict_cached(matched, prompt_len, 32) == cached


def test_event_mirror_follows_chains_duplicates_and_clears() -> None:
    mirror = run_vllm.EventMirror()
    tokens = list(range(100, 196))  # three blocks of 32
    mirror.apply({"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                  "token_ids": tokens[:64], "block_size": 32, "medium": "GPU"})  # fmt: skip
    mirror.apply({"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2,
                  "token_ids": tokens[64:], "block_size": 32, "medium": "GPU"})  # fmt: skip
    assert mirror.matched(tokens) == 3
    mirror.apply({"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1,
                  "token_ids": tokens[32:64], "block_size": 32, "medium": None})  # fmt: skip
    mirror.apply({"type": "BlockRemoved", "block_hashes": [2]})
    assert mirror.matched(tokens) == 3  # one of two copies evicted
    mirror.apply({"type": "BlockRemoved", "block_hashes": [2]})
    assert mirror.matched(tokens) == 1
    mirror.apply({"type": "AllBlocksCleared"})
    assert mirror.matched(tokens) == 0
    assert mirror.anomalies == []
