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


# A Gemma-3-style layout as vLLM 0.32 publishes it: group 0 sliding window (64 tokens = 2 blocks of
# 32), group 1 full attention. Hashes are arbitrary ints; what matters is that a block has the same
# hash in every group.
A = list(range(1000, 1240))  # 240 tokens: 7 full blocks, the last-token limit is 239
HASHES = [11, 12, 13, 14, 15, 16, 17]  # blocks ending at 32, 64, ..., 224


def stored(group: int, hashes: list[int], tokens: list[int], parent: int | None = None) -> dict:
    kind = "sliding_window" if group == 0 else "full_attention"
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 32, "medium": "GPU", "group_idx": group, "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": 64 if group == 0 else None}  # fmt: skip


def gemma_mirror() -> object:
    """A 240-token prompt as vLLM stores it: the sliding-window group keeps only the window ending at
    the replay boundary (blocks ending at 192 and 224) but its event covers the whole range; the
    full-attention group keeps every block. Groups in order: the sliding store comes first."""
    mirror = run_vllm.EventMirror(32)
    mirror.apply_batch([stored(0, HASHES[5:], A[:224]), stored(1, HASHES, A[:224])])
    return mirror


def test_mirror_places_a_sparse_groups_hashes_and_applies_vllms_rule() -> None:
    mirror = gemma_mirror()
    assert mirror.anomalies == []
    assert mirror.held() == 2 + 7  # (block, group) pairs, as the index counts them
    again = mirror.predict(A)
    assert (again.cached, again.full_only) == (224, 224)
    assert again.held == {0: [192, 224], 1: [32, 64, 96, 128, 160, 192, 224]}
    # A sibling diverging after 192 tokens: the full-attention group holds its 6 blocks, but no window
    # ends at 192 (only the block ending there is kept, not the one before): a cold prefill.
    sibling = mirror.predict(A[:192] + list(range(5000, 5048)))
    assert (sibling.cached, sibling.full_blocks, sibling.full_only) == (0, 6, 192)
    # A prefix shorter than one window is served by the blocks from the start, which were not kept.
    assert mirror.predict(A[:40] + list(range(6000, 6200))).cached == 0


def test_mirror_needs_the_complete_store_of_the_batch_to_place_a_sparse_one() -> None:
    # Applied one by one, the sliding-window store comes before anything tells where its hashes are.
    mirror = run_vllm.EventMirror(32)
    mirror.apply(stored(0, HASHES[5:], A[:224]))
    assert len(mirror.anomalies) == 2 and "not placed" in mirror.anomalies[0]


def test_mirror_removes_per_group_and_clears_every_group() -> None:
    mirror = gemma_mirror()
    # vLLM evicts per group: the sliding-window group loses the window's last block, the full group
    # still holds it; the window ending at 224 is gone, and the one ending at 192 is incomplete.
    mirror.apply_batch([{"type": "BlockRemoved", "block_hashes": [17], "group_idx": 0, "medium": "GPU"}])
    p = mirror.predict(A)
    assert (p.cached, p.full_only, p.held[0]) == (0, 224, [192])
    mirror.apply_batch([{"type": "AllBlocksCleared"}])
    assert mirror.held() == 0 and mirror.predict(A).cached == 0
    assert mirror.anomalies == []


def test_an_empty_mirror_predicts_nothing() -> None:
    p = run_vllm.EventMirror(32).predict(A)
    assert (p.cached, p.full_blocks, p.full_only, p.held) == (0, 0, 0, {})


def test_parse_stream_reads_text_ids_usage_and_the_end() -> None:
    chunks = [
        {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "c", "token_ids": [7], "finish_reason": "length"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3}},
    ]
    raw = "".join(f"data: {run_vllm.json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
    out = run_vllm.parse_stream(raw)
    assert (out.text, out.token_ids, out.finish_reason, out.done, out.problems) == (
        "abc",
        [5, 6, 7],
        "length",
        True,
        [],
    )
    assert out.usage == {"prompt_tokens": 40, "completion_tokens": 3}
    cut = run_vllm.parse_stream(raw.rsplit(b"data: [DONE]", 1)[0] + b"data: {oops\n\n")
    assert not cut.done and cut.problems == ["not JSON: '{oops'", "no data: [DONE] at the end"]
