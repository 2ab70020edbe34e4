"""A bounded LRU of encoded text pieces: (model, piece text) -> token ids, sized by bytes."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

ENTRY_OVERHEAD = 160  # dict slot, key tuple, ndarray header: measured roughly, it only has to bound


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # pieces found
    misses: int = 0  # pieces encoded
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0
    uncached: int = 0  # pieces too large to keep


class PieceCache:
    """Thread-safe (routers may call the registry from threads); encoding happens outside the lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def cost(key: tuple[int, str], ids: np.ndarray) -> int:
        return sys.getsizeof(key[1]) + ids.nbytes + ENTRY_OVERHEAD

    def get(self, key: tuple[int, str]) -> np.ndarray | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_tokens += len(ids)
            return ids

    def put(self, key: tuple[int, str], ids: np.ndarray) -> None:
        cost = self.cost(key, ids)
        with self._lock:
            self.stats.misses += 1
            self.stats.miss_tokens += len(ids)
            if cost > self.max_bytes // 4:
                self.stats.uncached += 1  # one huge document must not flush everything else
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= self.cost(key, old)
            self._entries[key] = ids
            self.bytes += cost
            while self.bytes > self.max_bytes and self._entries:
                k, v = self._entries.popitem(last=False)
                self.bytes -= self.cost(k, v)
                self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
