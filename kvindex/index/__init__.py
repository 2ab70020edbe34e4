"""blockKey -> instances per tier: the interface (base) and the default backend (inverted)."""

from kvindex.index.base import NO_MATCH, IndexStats, InstanceMatch, KvBlockIndex
from kvindex.index.inverted import NATIVE, InvertedIndex

__all__ = [
    "NATIVE",
    "NO_MATCH",
    "IndexStats",
    "InstanceMatch",
    "InvertedIndex",
    "KvBlockIndex",
]
