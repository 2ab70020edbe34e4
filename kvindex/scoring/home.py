"""Stable homes for prefixes: rendezvous (highest-random-weight) hashing over instance ids.

Every index replica computes the same order for the same prefix and instance set, with no shared
state; adding or removing an instance moves only the prefixes whose top choice it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import xxhash

T = TypeVar("T")
_xxh3 = xxhash.xxh3_64_intdigest


def rendezvous_order(items: Sequence[T], ids: Sequence[str], key: int) -> list[T]:
    """``items`` ordered by rendezvous weight of their ``ids`` for ``key`` (highest first)."""
    seed = key & 0xFFFFFFFFFFFFFFFF
    weights = [_xxh3(i.encode(), seed) for i in ids]
    order = sorted(range(len(items)), key=lambda j: (-weights[j], ids[j]))
    return [items[j] for j in order]


def home_block(n_blocks: int, block_size: int, home_tokens: int) -> int:
    """Index of the block whose key names a prompt's home prefix (its first ``home_tokens``)."""
    return min(n_blocks, max(1, home_tokens // block_size)) - 1
