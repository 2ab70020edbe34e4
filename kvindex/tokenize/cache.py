"""The tokenization cache: encoded text pieces, and the prompts encoded last (for prompts that grow).

``PieceCache``: (model, piece text) -> token ids, an LRU sized by bytes. ``PrefixMemo``: the last
prompts' texts with their ids and piece boundaries, so that a prompt extending one of them (a
conversation grown by a turn) reuses its ids up to the last boundary they share and cuts, looks up and
encodes only the rest.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

ENTRY_OVERHEAD = 160  # dict slot, key tuple, ndarray header: measured roughly, it only has to bound


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # pieces found (in the piece cache or inside a remembered prefix)
    misses: int = 0  # pieces encoded
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0
    uncached: int = 0  # pieces encoded but not kept: too large, or beyond the call's budget
    prefix_hits: int = 0  # calls that reused a remembered prompt's prefix
    prefix_tokens: int = 0  # tokens taken from remembered prefixes


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
        return self.get_many(key[0], [key[1]])[0]

    def get_many(self, model: int, pieces: list[str]) -> list[np.ndarray | None]:
        """Each piece's ids or None; one lock for all (a 256 K-token chat has thousands of pieces)."""
        out: list[np.ndarray | None] = []
        found = 0
        tokens = 0
        entries = self._entries
        with self._lock:
            for piece in pieces:
                key = (model, piece)
                ids = entries.get(key)
                if ids is not None:
                    entries.move_to_end(key)
                    found += 1
                    tokens += len(ids)
                out.append(ids)
            self.stats.hits += found
            self.stats.hit_tokens += tokens
        return out

    def put(self, key: tuple[int, str], ids: np.ndarray, room: int | None = None) -> int:
        """Count ``ids`` as encoded and keep them if they fit: at most a quarter of the cache, and at
        most ``room`` bytes (what the call may still add). Returns the bytes kept (0: not kept)."""
        cost = self.cost(key, ids)
        with self._lock:
            self.stats.misses += 1
            self.stats.miss_tokens += len(ids)
            if cost > self.max_bytes // 4 or (room is not None and cost > room):
                self.stats.uncached += 1  # one huge document, or one huge call, must not flush the rest
                return 0
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= self.cost(key, old)
            self._entries[key] = ids
            self.bytes += cost
            while self.bytes > self.max_bytes and self._entries:
                k, v = self._entries.popitem(last=False)
                self.bytes -= self.cost(k, v)
                self.stats.evictions += 1
        return cost

    def count_reused(self, pieces: int, tokens: int) -> None:
        """Pieces served from a remembered prefix count as hits (they were not encoded)."""
        with self._lock:
            self.stats.hits += pieces
            self.stats.hit_tokens += tokens
            self.stats.prefix_hits += 1
            self.stats.prefix_tokens += tokens

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


# -- remembered prompts ----------------------------------------------------------------------------

WINDOW = 1024  # characters hashed to find a remembered prompt; texts shorter than this are not kept


@dataclass(slots=True, eq=False)
class Remembered:
    model: int
    text: str
    ids: np.ndarray  # the text's ids (without the post-processor's additions), read-only
    ends: np.ndarray  # int64: where each piece ends in text (characters)
    tokens: np.ndarray  # int64: ids up to the end of each piece
    keys: tuple[tuple[int, int, int], ...] = ()  # the index entries pointing here
    cost: int = 0


@dataclass(slots=True)
class Reuse:
    """What a new text can take from a remembered one: ``ids`` up to character ``start`` (a piece
    boundary of both), the boundaries up to there, or the whole text (``whole``)."""

    ids: np.ndarray
    start: int
    ends: np.ndarray
    tokens: np.ndarray
    whole: bool
    source: int = -1  # the remembered entry it came from


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, comparing slices in C (a character loop in Python costs
    ~50 ns per character: 30 ms for a 256 K-token prompt)."""
    n = min(len(a), len(b))
    if b.startswith(a) if len(a) <= len(b) else a.startswith(b):  # the usual case, no copies
        return n
    step = 1 << 15
    lo = 0
    while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
        lo += step
    hi = min(lo + step, n)
    # a[:lo] == b[:lo]; find the first difference in [lo, hi) by bisection.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _levels(length: int) -> list[int]:
    """Prefix lengths a text is found by: WINDOW, 2 x WINDOW, 4 x ..., up to ``length``."""
    out = []
    level = WINDOW
    while level <= length:
        out.append(level)
        level *= 2
    return out


class PrefixMemo:
    """The prompts encoded last, by bytes (LRU), found again by the text they start with.

    A text is filed under a hash of the WINDOW characters before each of its levels (1 K, 2 K, 4 K ...
    characters): a conversation grown by a turn shares its predecessor's deepest level below the old
    length, so one hash and one comparison of the shared prefix (memcmp) find it, whatever the number of
    conversations remembered. A hash only proposes a candidate: the common prefix is always compared,
    and reuse stops at the last piece boundary strictly inside it (a line-start cut looks at the next
    character, which must be shared too).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats_kept = 0
        self.stats_too_large = 0
        self._ids = itertools.count()
        self._entries: OrderedDict[int, Remembered] = OrderedDict()
        self._index: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, model: int, text: str) -> Reuse | None:
        for level in reversed(_levels(len(text))):
            key = (model, level, hash(text[level - WINDOW : level]))
            with self._lock:
                eid = self._index.get(key)
                entry = self._entries.get(eid) if eid is not None else None
                if entry is not None:
                    self._entries.move_to_end(eid)  # type: ignore[arg-type]
            if entry is None:
                continue
            shared = common_prefix(entry.text, text)
            if shared == len(entry.text) == len(text):
                return Reuse(entry.ids, shared, entry.ends, entry.tokens, True, eid)  # type: ignore[arg-type]
            k = int(np.searchsorted(entry.ends, shared, side="left"))  # pieces ending before `shared`
            if k == 0:
                continue
            start = int(entry.ends[k - 1])
            n = int(entry.tokens[k - 1])
            return Reuse(entry.ids[:n], start, entry.ends[:k], entry.tokens[:k], False, eid)  # type: ignore[arg-type]
        return None

    def remember(
        self,
        model: int,
        text: str,
        ids: np.ndarray,
        ends: np.ndarray,
        tokens: np.ndarray,
        room: int,
        reused: Reuse | None = None,
    ) -> bool:
        """Keep ``text`` if it is long enough to be found and costs at most ``room`` bytes and half of
        the memo (one prompt must not flush every other conversation). The text it ``reused`` is
        forgotten when the new one takes all of it but the last WINDOW characters (a conversation's
        previous turn, whose tail was the generation prompt): a conversation keeps one entry, not one
        per turn."""
        levels = _levels(len(text))
        if not levels:
            return False
        cost = sys.getsizeof(text) + ids.nbytes + ends.nbytes + tokens.nbytes + ENTRY_OVERHEAD * len(levels)
        if cost > min(room, self.max_bytes // 2):
            self.stats_too_large += 1
            return False
        keys = tuple((model, level, hash(text[level - WINDOW : level])) for level in levels)
        entry = Remembered(model, text, ids, ends, tokens, keys, cost)
        with self._lock:
            if reused is not None:
                old = self._entries.get(reused.source)
                if old is not None and reused.start >= len(old.text) - WINDOW:
                    self._drop(reused.source)
            eid = next(self._ids)
            self._entries[eid] = entry
            for key in keys:
                self._index[key] = eid  # the newest text wins a level it shares with older ones
            self.bytes += cost
            self.stats_kept += 1
            while self.bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
        return True

    def _drop(self, eid: int) -> None:
        old = self._entries.pop(eid)
        self.bytes -= old.cost
        for key in old.keys:
            if self._index.get(key) == eid:
                del self._index[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self.bytes = 0
