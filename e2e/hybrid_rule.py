"""vLLM 0.32's prefix-cache hit rule for hybrid-attention models, from block residency alone.

The e2e drivers' own reference (``capture_hybrid.py``, ``run_vllm.py``), written from vLLM's source
(``vllm/v1/core/kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``) and checked against the
engine on every ``r5_hybrid_*`` capture (docs/hybrid-vllm-findings.md). Deliberately independent of the
project's code: kvindex's own rule (``kvindex/index/hybrid.py``) is what these drivers test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One KV-cache group as its events describe it (``chunk`` is not in the events: from the model)."""

    kind: str  # kv_cache_spec_kind: full_attention, sliding_window, chunked_local_attention, mamba, ...
    block_size: int
    window: int | None = None  # kv_cache_spec_sliding_window
    chunk: int | None = None  # attention_chunk_size of a chunked_local_attention group


FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


def partial_hits(groups: Sequence[Group], hash_block: int) -> bool:
    """kv_cache_utils.partial_hash_hits_enabled: hits at hash-block (not scheduler-block) boundaries when
    a Mamba group's block is larger than the hash block and every other group can look up at that
    granularity (full attention and Mamba can; sliding window and chunked local only at their block)."""
    return any(g.kind == "mamba" and g.block_size > hash_block for g in groups) and all(
        g.kind in FULL_KINDS or g.kind == "mamba" or g.block_size == hash_block for g in groups
    )


def hybrid_hit(groups: Sequence[Group], held: Sequence[set[int]], prompt_len: int, hash_block: int) -> int:
    """The prompt tokens vLLM 0.32 reports as cached (``cached_tokens``); no EAGLE, no KV connector.

    ``held[g]``: the prefix lengths ``p`` (multiples of ``hash_block``) for which group ``g`` holds the
    block whose hash chains the prompt's first ``p`` tokens; a full block ``i`` of a group with block size
    ``bs`` is ``p = (i + 1) * bs``, a partial (sub-block) entry any other multiple of ``hash_block``.

    kv_cache_manager.py ``get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``.
    kv_cache_coordinator.py ``HybridKVCacheCoordinator.find_longest_cache_hit``: groups with equal specs
    are looked up jointly (a block counts only if every member holds it), full attention first, then a
    fixed point: each spec group accepts or lowers the candidate length until none lowers it (one pass
    when there are exactly two spec groups and the first is full attention). Hits are aligned to the
    scheduler block size (LCM of the group block sizes), or to the hash block with partial hits.
    One group alone: ``UnitaryKVCacheCoordinator`` (alignment = its block size).
    """
    max_len = prompt_len - 1
    specs: dict[Group, set[int]] = {}
    for g, h in zip(groups, held, strict=True):
        specs[g] = specs[g] & h if g in specs else set(h)
    if len(specs) == 1:
        ((g, h),) = specs.items()
        return FINDERS[g.kind](g, h, max_len, g.block_size)
    alignment = hash_block if partial_hits(groups, hash_block) else math.lcm(*(g.block_size for g in groups))
    order = sorted(specs, key=lambda g: g.kind not in FULL_KINDS)  # stable: full attention first
    simple = len(order) == 2 and order[0].kind in FULL_KINDS
    hit = max_len
    full_hit: dict[Group, int] = {}
    while True:
        curr = hit
        for g in order:
            if g in full_hit:  # full attention is downward-closed: looked up once, then only trimmed
                curr = min(curr, full_hit[g])
                continue
            curr = FINDERS[g.kind](g, specs[g], curr, alignment)
            if g.kind in FULL_KINDS:
                full_hit[g] = curr
        if curr >= hit:
            return hit
        hit = curr
        if simple:
            return hit


def find_full(g: Group, held: set[int], max_len: int, alignment: int) -> int:
    """FullAttentionManager.find_longest_cache_hit: the leading run of held blocks; with partial hits
    (alignment < block size) then the longest held hash boundary inside the next block; aligned down."""
    bs = g.block_size
    n = 0
    while n < max_len // bs and (n + 1) * bs in held:
        n += 1
    hit = n * bs
    if alignment < bs and bs % alignment == 0:
        top = min(hit + bs - alignment, max_len // alignment * alignment)
        for p in range(top, hit, -alignment):
            if p in held:
                hit = p
                break
    return hit - hit % alignment


def find_sliding(g: Group, held: set[int], max_len: int, alignment: int) -> int:
    """SlidingWindowManager.find_longest_cache_hit: right to left, the first run of
    cdiv(window - 1, block_size) held blocks whose right edge is aligned; else the run from block 0."""
    assert g.window is not None
    bs = g.block_size
    need = -(-(g.window - 1) // bs)
    run = 0
    for i in range(max_len // bs - 1, -1, -1):
        if (i + 1) * bs in held:
            if run == 0 and bs != alignment and ((i + 1) * bs) % alignment != 0:
                continue
            run += 1
            if run >= need:
                return (i + run) * bs
        else:
            run = 0
    n = run  # the run reaching block 0 is a hit even when shorter than the window
    while bs != alignment and n * bs % alignment != 0:
        n -= 1
    return n * bs


def find_chunked(g: Group, held: set[int], max_len: int, alignment: int) -> int:
    """ChunkedLocalAttentionManager.find_longest_cache_hit: the blocks before the chunk holding max_len
    count without a lookup; held blocks from the chunk start on extend the hit."""
    assert g.chunk is not None
    bs = g.block_size
    n = (max_len // g.chunk * g.chunk) // bs if max_len > 0 else 0
    while n < max_len // bs and (n + 1) * bs in held:
        n += 1
    return n * bs


def find_mamba(g: Group, held: set[int], max_len: int, alignment: int) -> int:
    """MambaManager.find_longest_cache_hit: the right-most held state at or below max_len (no contiguity),
    at an aligned block end; with partial hits at any held hash boundary."""
    bs = g.block_size
    if alignment < bs and bs % alignment == 0:
        return max((p for p in held if p <= max_len and p % alignment == 0), default=0)
    for i in range(max_len // bs - 1, -1, -1):
        if (i + 1) * bs in held and (bs == alignment or ((i + 1) * bs) % alignment == 0):
            return (i + 1) * bs
    return 0


# kv_cache_spec_kind -> the manager's hit finder (KVCacheSpecRegistry in single_type_kv_cache_manager.py:
# MLA and sink-full specs subclass FullAttentionSpec, sliding-window MLA subclasses SlidingWindowSpec).
FINDERS: dict[str, Callable[[Group, set[int], int, int], int]] = {
    **dict.fromkeys(FULL_KINDS, find_full),
    **dict.fromkeys(SLIDING_KINDS, find_sliding),
    "chunked_local_attention": find_chunked,
    "mamba": find_mamba,
}
