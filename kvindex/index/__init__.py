"""blockKey -> instances per tier: the interface (base) and the default backend (inverted)."""

from kvindex.index.base import NO_MATCH, IndexStats, InstanceKey, InstanceMatch, KvBlockIndex
from kvindex.index.inverted import KEY_MASK, InvertedIndex, index_key

__all__ = [
    "KEY_MASK",
    "NO_MATCH",
    "IndexStats",
    "InstanceKey",
    "InstanceMatch",
    "InvertedIndex",
    "KvBlockIndex",
    "index_key",
]
