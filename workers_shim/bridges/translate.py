"""Engine block hashes -> the project's block keys, per (worker, dp_rank), with refcounts per KV-cache
group and tier.

The translator keeps, for every block the engine holds, ``engine hash -> Entry(key, parent key,
depth, refcount per (group, tier))``:

- ``BlockStored`` with tokens: keys are computed from ``token_ids`` (+ extra keys), continuing the chain
  from the parent's key (the parent hash translated through the map) or, at the start of a sequence,
  from the seed of (model, LoRA name, cache salt). Blocks whose hash is already mapped keep their key.
- ``BlockStored`` without tokens (CPU offload placeholders: ``token_ids=[]``, ``block_size=0``)
  translate through the map: the block's key is known from its GPU store.
- A store increments the (hash, group, tier) refcount, a remove decrements it (offload connectors emit
  duplicates; vLLM keeps duplicate physical blocks of one hash). Keys are counted again per (group,
  tier) over hashes, so the sink sees ``stored`` only when a key appears on a tier of a group and
  ``removed`` only when its last holder there goes.
- An entry held nowhere leaves the map but stays in a bounded "retired" memory: engine hashes are
  functions of the prefix, so an old translation is still right when a later store names it as parent.

**KV-cache groups** (hybrid-attention models, docs/wire.md §8). vLLM >= 0.32 names each store's group,
its kind and sliding window; TensorRT-LLM's pull API names the attention window of the cache (one per
window size). Every group is indexed and published with its group number (``--kv-group N`` indexes
group N alone, published as group 0: the old, approximate behaviour). The layout (kind, window, block
size per group, the chunk of chunked local attention from the operator) is learned from the stores and
handed to the sink (``sink.groups``: the publisher announces it in heartbeats) once the groups seen are
contiguous from 0.

**Sparse groups.** vLLM's sliding-window and Mamba groups keep only some blocks of what a request
computed: a store's ``token_ids`` cover the whole new range from ``parent_block_hash`` but its
``block_hashes`` list only the blocks the group keeps, so their positions are not in the event. The same
block has the same engine hash in every group, so each listed hash is placed by

1. its translation, learned from a group that stores every block (full attention, chunked local) in an
   earlier batch or earlier in the same one (:meth:`Translator.prepare` learns a batch's complete stores
   before its events apply: vLLM stores the groups of one step in group order, sparse ones first for
   Gemma 3), checked against the chain keys of the store's range computed from its parent's key;
2. else, for engines with no such group (a pure Mamba model), vLLM's default block hash (sha256 over
   pickle, chained from ``NONE_HASH``) recomputed over the range: a listed hash it reproduces is placed
   at that block; every block's hash so computed is remembered, so the next store's parent resolves.
   Another hash algorithm simply reproduces nothing;
3. else it is not published (``unplaced_block``, counted and logged): a block is never published at a
   guessed position.

When a store cannot be keyed because its parent (or a token-less block) is unknown, :meth:`apply`
returns ``False`` if ``recover`` is set, leaving the event unapplied so the bridge can rebuild the map
from the engine's replay buffer; otherwise the event is skipped, counted, and its hashes remembered as
unkeyable so that their descendants are skipped quietly instead of asking for recovery again.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvindex.keys import (
    MAX_GROUPS,
    keys_from_le_bytes,
    keys_from_le_bytes_extra,
    model_seed,
    tokens_to_le_bytes,
)
from kvindex.wire.groups import CHUNKED, FULL, FULL_ATTENTION, KIND_RULES, MAMBA, SLIDING
from workers_shim.bridges.native import (
    EventError,
    Hash,
    Ignored,
    NativeCleared,
    NativeEvent,
    NativeRemoved,
    NativeStored,
)
from workers_shim.bridges.stats import BridgeStats

TIERS = ("gpu", "cpu", "disk", "shared")
TIER_INDEX = {name: i for i, name in enumerate(TIERS)}
LOCAL_TIERS = (0, 1, 2)
# Kinds whose groups store every block of what a request computed (vLLM's reachable_block_mask is
# None for them): their stores give every block's position, and so translate the sparse groups'.
DENSE_RULES = frozenset({FULL, CHUNKED})
SPARSE_RULES = frozenset({SLIDING, MAMBA})
# TensorRT-LLM's window size of its linear-attention (Mamba / SSM state) block manager.
TRT_RECURRENT_STATES = -1
# vLLM's first parent for sha256 block hashes (vllm/v1/core/kv_cache_utils.py: init_none_hash with the
# fixed seed used when PYTHONHASHSEED is unset).
VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
# Stores whose listed hashes vLLM's hash never reproduced before the bridge stops computing it.
_HASH_TRIALS = 16
_U64 = (1 << 64) - 1


def vllm_block_digests(parent: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """vLLM's sha256 block hashes (``hash_block_tokens`` with extra keys None) of the full blocks of
    ``tokens``, chained from ``parent`` (:data:`VLLM_NONE_HASH` at the start of a sequence)."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


class Sink(Protocol):
    """What the translator drives: :class:`workers_shim.publisher.Publisher` fits."""

    groups: list[dict[str, Any]] | None

    def stored(
        self, keys: Iterable[int], tier: str = "gpu", parent: int | None = None, group: int = 0
    ) -> int: ...

    def removed(self, keys: Iterable[int], tier: str = "gpu", group: int = 0) -> int: ...

    def cleared(self, tier: str | None = None) -> int: ...


class NullSink:
    """Publishes nothing: used while rebuilding a map from the engine's history."""

    def __init__(self) -> None:
        self.groups: list[dict[str, Any]] | None = None

    def stored(
        self, keys: Iterable[int], tier: str = "gpu", parent: int | None = None, group: int = 0
    ) -> int:
        return 0

    def removed(self, keys: Iterable[int], tier: str = "gpu", group: int = 0) -> int:
        return 0

    def cleared(self, tier: str | None = None) -> int:
        return 0


class Entry:
    __slots__ = ("depth", "key", "parent", "refs")

    def __init__(self, key: int, parent: int | None, depth: int) -> None:
        self.key = key
        self.parent = parent  # key of the block before, None at the start of a sequence or unknown
        self.depth = depth  # position in its sequence (best effort; orders re-published chains)
        self.refs: dict[int, list[int]] = {}  # group -> holders per tier

    def held(self) -> bool:
        return any(any(tiers) for tiers in self.refs.values())


@dataclass(slots=True)
class GroupInfo:
    """One KV-cache group as the engine's stores describe it."""

    kind: str
    window: int = 0  # sliding-window kinds: tokens
    sizes: set[int] = field(default_factory=set)  # block sizes its stores announced

    def block_size(self, keyed: int) -> int:
        """The group's block size: the bridge's (``keyed``) when its stores announce it; else the
        largest they announce (a partial entry announces less, an odd store is skipped anyway)."""
        if keyed in self.sizes or not self.sizes:
            return keyed
        return max(self.sizes)


Known = tuple[int, int | None, int]  # (key, parent key, depth)


class Translator:
    def __init__(
        self,
        model: str,
        block_size: int,
        sink: Sink,
        stats: BridgeStats,
        *,
        kv_group: int | None = None,
        attention_chunk: int | None = None,
        set_tiers: Iterable[str] = (),
        memory: int = 1 << 16,
        context: Mapping[str, object] | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.sink = sink
        self.stats = stats
        # None: every group, each published as itself; N: group N alone, published as group 0.
        self.kv_group = kv_group
        # Tokens per chunk of chunked local attention (in no event: from the operator).
        self.attention_chunk = attention_chunk
        # Tiers where a repeated store of a held hash is a re-announcement, not another copy.
        self.set_tiers = {TIER_INDEX[t] for t in set_tiers}
        self.memory = memory
        self.context = dict(context or {})
        self.entries: dict[Hash, Entry] = {}
        self.retired: OrderedDict[Hash, Known] = OrderedDict()
        self.unkeyable: OrderedDict[Hash, None] = OrderedDict()
        self.key_refs: dict[int, list[dict[int, int]]] = {}  # group -> per tier: key -> holders
        self._seeds: dict[tuple[str | None, str | None], int] = {}
        # What the engine said about its groups.
        self.groups: dict[int, GroupInfo] = {}
        self.kinds_seen = False  # the engine names its groups' kinds (vLLM >= 0.32)
        self.dense_seen = False  # a group that stores every block exists
        self.windows: dict[int, int] = {}  # TensorRT-LLM attention window -> group
        self.layout: list[dict[str, Any]] | None = None  # what the sink announces
        self._chunk_warned = False
        # vLLM block hash -> its sha256 digest (int hashes are the digest's low 64 bits): the parent
        # of the next store, for engines whose sparse groups are placed by recomputing the hash.
        self.digests: OrderedDict[Hash, bytes] = OrderedDict()
        self._vllm_hash: bool | None = None  # reproduced (True), never in _HASH_TRIALS tries (False)
        self._hash_misses = 0
        self._range: tuple[int, list[Any], list[int]] | None = None  # last range's (seed, tokens, keys)

    # -- lookups --------------------------------------------------------------------------------

    def _known(self, h: Hash) -> Known | None:
        e = self.entries.get(h)
        if e is not None:
            return (e.key, e.parent, e.depth)
        return self.retired.get(h)

    def _seed(self, lora: str | None, salt: str | None) -> int:
        k = (lora or None, salt or None)
        seed = self._seeds.get(k)
        if seed is None:
            seed = self._seeds[k] = model_seed(self.model, lora, salt)
        return seed

    def _remember(self, store: OrderedDict[Hash, Any], h: Hash, value: Any) -> None:
        store[h] = value
        store.move_to_end(h)
        if len(store) > self.memory:
            store.popitem(last=False)

    def _learn(self, h: Hash, value: Known) -> None:
        """A translation (not a holder): remembered unless the map already knows ``h``."""
        if h not in self.entries and h not in self.retired:
            self._remember(self.retired, h, value)
            self.unkeyable.pop(h, None)

    def _poison(self, hashes: Iterable[Hash]) -> None:
        for h in hashes:
            if h not in self.entries:
                self._remember(self.unkeyable, h, None)

    def _parent(self, ev: NativeStored) -> tuple[int, int] | None:
        """Key and depth of the block before ``ev``'s range (the seed at the start of a sequence);
        None when its parent hash is unknown."""
        if ev.parent is None:
            return self._seed(ev.lora_name, ev.salt), -1
        known = self._known(ev.parent)
        return None if known is None else (known[0], known[2])

    def _range_keys(self, seed: int, tokens: list[Any]) -> list[int]:
        """Chain keys of every full block of ``tokens`` from ``seed`` (no extra keys); the last range is
        kept, since a hybrid model's groups store the same range one after the other."""
        cached = self._range
        if cached is not None and cached[0] == seed and cached[1] == tokens:
            return cached[2]
        keys = keys_from_le_bytes(tokens_to_le_bytes(tokens), self.block_size, seed)
        self._range = (seed, tokens, keys)
        return keys

    # -- groups ---------------------------------------------------------------------------------

    def _skip(self, reason: str, n: int, level: str = "warning", **kw: Any) -> None:
        self.stats.skip(reason, n, level=level, **kw, **self.context)

    def _store_group(self, ev: NativeStored) -> int | None:
        """The group ``ev`` is published in, learning what it says about its group; None: skipped."""
        n = len(ev.hashes)
        if ev.attention_window is not None:
            g = self._window_group(ev.attention_window, ev.block_size)
        elif ev.group is None:
            g = 0  # an engine without groups
        else:
            g = ev.group
            if not 0 <= g < MAX_GROUPS:
                self._skip("bad_group", n, group=g, detail=f"group_idx outside 0..{MAX_GROUPS - 1}")
                return None
            if not self._learn_group(ev, g):
                return None
        return self._published(g, n)

    def _published(self, g: int, n: int) -> int | None:
        if self.kv_group is None:
            return g
        if g != self.kv_group:
            self._skip("other_kv_group", n, level="debug", group=g)
            return None
        return 0

    def _learn_group(self, ev: NativeStored, g: int) -> bool:
        """Learn (or check) group ``g``'s kind, window and block size from one of its stores; False:
        the store contradicts or lacks what the group needs (skipped, counted)."""
        n = len(ev.hashes)
        info = self.groups.get(g)
        kind = ev.kind
        if kind is None:
            if info is not None:
                return True  # named once is enough
            if g == 0 and not self.kinds_seen:
                return True  # an engine that numbers groups but names no kinds: group 0, as before
            self._skip("group_without_kind", n, group=g)
            return False
        window = ev.sliding_window or 0
        rule = KIND_RULES.get(kind)
        if not 1 <= len(kind) <= 64 or window < 0 or (rule == SLIDING and window < 1):
            self._skip("bad_group", n, group=g, kind=kind[:64], window=window, detail="unusable kind/window")
            return False
        self.kinds_seen = True
        if rule in DENSE_RULES:
            self.dense_seen = True
        size = ev.block_size if ev.block_size > 0 else 0
        if info is None:
            self.groups[g] = GroupInfo(kind, window, {size} if size else set())
            self._layout_changed()
            return True
        if info.kind != kind or info.window != window:
            self._skip(
                "group_spec_mismatch",
                n,
                group=g,
                kind=kind,
                window=window,
                known_kind=info.kind,
                known_window=info.window,
            )
            return False
        if size and size not in info.sizes:
            info.sizes.add(size)
            self._layout_changed()
        return True

    def _window_group(self, window: int, block_size: int = 0) -> int:
        """TensorRT-LLM: the group of an attention window (numbered as the engine first names them; it
        iterates its windows in ascending order, so in practice ascending)."""
        g = self.windows.get(window)
        if g is None:
            g = self.windows[window] = len(self.windows)
            self._layout_changed()
        return g

    def _layout_changed(self) -> None:
        layout = self._compute_layout()
        if layout == self.layout:
            return
        self.layout = layout
        self.sink.groups = layout
        if layout is not None:
            self.stats.log.info("kv_groups_learned", groups=layout, **self.context)

    def _compute_layout(self) -> list[dict[str, Any]] | None:
        """The groups as docs/wire.md §8 announces them, in group order; None while not known (or
        with ``--kv-group``: one group, read as before)."""
        if self.kv_group is not None:
            return None
        if self.windows:
            return self._window_layout()
        if not self.groups:
            return None
        top = max(self.groups)
        if len(self.groups) != top + 1:
            return None  # a group between the ones seen not yet named: vLLM names all in one step
        out = []
        for g in range(top + 1):
            info = self.groups[g]
            entry: dict[str, Any] = {"kind": info.kind, "block_size": info.block_size(self.block_size)}
            if info.window:
                entry["window"] = info.window
            if KIND_RULES.get(info.kind) == CHUNKED:
                if self.attention_chunk:
                    entry["chunk"] = self.attention_chunk
                elif not self._chunk_warned:
                    self._chunk_warned = True
                    self.stats.log.warning(
                        "kv_group_chunk_unknown",
                        group=g,
                        detail="chunked local attention's chunk size is in no event: give "
                        "--attention-chunk or --model-config; until then the index says this worker "
                        "is approximate",
                        **self.context,
                    )
            out.append(entry)
        if len(out) == 1 and out[0] == {"kind": FULL_ATTENTION, "block_size": self.block_size}:
            return None  # one full-attention cache: what an absent layout means (docs/wire.md §8)
        return out

    def _window_layout(self) -> list[dict[str, Any]]:
        """TensorRT-LLM's windows: the largest is full attention (max_attention_window), the others
        sliding windows, window -1 the linear-attention state."""
        largest = max((w for w in self.windows if w > 0), default=None)
        out: list[dict[str, Any]] = []
        for window, _g in sorted(self.windows.items(), key=lambda item: item[1]):
            if window == TRT_RECURRENT_STATES:
                out.append({"kind": "mamba", "block_size": self.block_size})
            elif window == largest:
                out.append({"kind": FULL_ATTENTION, "block_size": self.block_size})
            else:
                out.append({"kind": "sliding_window", "block_size": self.block_size, "window": window})
        return None if len(out) == 1 and out[0]["kind"] == FULL_ATTENTION else out

    def inherit(self, old: Translator) -> None:
        """Keep what ``old`` (this engine life's previous map) learned about the groups: a resync
        starts a new wire epoch, not a new engine."""
        self.groups = {g: GroupInfo(i.kind, i.window, set(i.sizes)) for g, i in old.groups.items()}
        self.kinds_seen, self.dense_seen = old.kinds_seen, old.dense_seen
        self.windows = dict(old.windows)
        self._layout_changed()

    # -- applying events ------------------------------------------------------------------------

    def prepare(self, events: Iterable[NativeEvent]) -> None:
        """Before a batch applies: learn the translations of its complete stores when it also holds a
        sparse one, which may come first (vLLM caches a step's groups in group order)."""
        B = self.block_size
        complete: list[NativeStored] = []
        sparse = False
        for ev in events:
            if not isinstance(ev, NativeStored) or not ev.tokens or ev.block_size != B:
                continue
            if ev.kind is not None and KIND_RULES.get(ev.kind) in DENSE_RULES:
                self.dense_seen = True
            n = len(ev.hashes)
            if n and len(ev.tokens) == n * B:
                complete.append(ev)
            elif len(ev.tokens) > n * B:
                sparse = True
        if not sparse:
            return
        for ev in complete:
            if all(self._known(h) is not None for h in ev.hashes):
                continue
            parent = self._parent(ev)
            if parent is None:
                continue
            seed, depth = parent
            try:
                raw = tokens_to_le_bytes(ev.tokens)
            except ValueError:
                continue
            keys = keys_from_le_bytes_extra(raw, B, seed, ev.extras)
            prev = None if ev.parent is None else seed
            for h, key in zip(ev.hashes, keys, strict=False):
                depth += 1
                self._learn(h, (key, prev, depth))
                prev = key

    def apply(self, ev: NativeEvent, recover: bool = False) -> bool:
        """Apply one decoded event. ``False``: not applied, the map needs rebuilding first."""
        if isinstance(ev, NativeStored):
            self.stats.add("events", "stored")
            if ev.synthetic_lora:
                self.stats.throttled(
                    "lora_without_name", "warning", "kv_lora_without_name", lora=ev.lora_name, **self.context
                )
            group = self._store_group(ev)
            if group is None:
                return True
            return self._stored(ev, group, recover)
        if isinstance(ev, NativeRemoved):
            self.stats.add("events", "removed")
            self._removed(ev)
        elif isinstance(ev, NativeCleared):
            self.stats.add("events", "cleared")
            self._cleared(ev)
        elif isinstance(ev, Ignored):
            self.stats.add("events", "ignored")
            if ev.attention_window is not None:
                self._window_group(ev.attention_window)  # TensorRT-LLM names its windows at start
        elif isinstance(ev, EventError):
            self.stats.skip(ev.reason, detail=ev.detail, **self.context)
        return True

    def _sparse_kind(self, ev: NativeStored) -> bool:
        return ev.kind is not None and KIND_RULES.get(ev.kind) in SPARSE_RULES

    def _stored(self, ev: NativeStored, group: int, recover: bool) -> bool:
        n = len(ev.hashes)
        tier = TIER_INDEX[ev.tier]
        if not ev.tokens:
            if n == 0:
                self._skip("empty_event", 0, level="debug")
                return True
            return self._stored_tokenless(ev, group, tier, recover)

        B = self.block_size
        announced = ev.block_size
        if announced == 0 and n and len(ev.tokens) % n == 0:
            announced = len(ev.tokens) // n  # block_size left out: implied by the tokens
        if n == 0:
            # A sparse group that keeps none of the range (vLLM decode blocks of a sliding-window or
            # Mamba group): nothing held, but a pure Mamba model's next store chains from it.
            if announced == B and not self.dense_seen and self._sparse_kind(ev):
                self._learn_vllm_hashes(ev)
            return True
        if announced != B:
            if 0 < announced < B and n == 1 and len(ev.tokens) == announced:
                reason, level = "partial_block", "debug"
            else:
                reason, level = "block_size_mismatch", "error"
            self._skip(reason, n, level=level, event_block_size=announced, block_size=B)
            self._poison(ev.hashes)
            return True
        if len(ev.tokens) % B or len(ev.tokens) < n * B:
            # (skip() reports ``blocks=n`` itself: passing it again raised TypeError, found by fuzzing)
            self._skip("token_count_mismatch", n, tokens=len(ev.tokens))
            self._poison(ev.hashes)
            return True
        tried = self._sparse_kind(ev) and not self.dense_seen
        if tried:
            self._learn_vllm_hashes(ev)  # no group stores every block: vLLM's hash places them
        if len(ev.tokens) > n * B:
            return self._stored_sparse(ev, group, tier, recover, tried)
        return self._stored_dense(ev, group, tier, recover)

    def _stored_dense(self, ev: NativeStored, group: int, tier: int, recover: bool) -> bool:
        """Every block of the range is listed, in order."""
        B = self.block_size
        n = len(ev.hashes)
        known = [self._known(h) for h in ev.hashes]
        first = next((i for i, k in enumerate(known) if k is None), None)
        # Key and depth of the block before the event's first block.
        if ev.parent is None:
            prev_key: int | None = self._seed(ev.lora_name, ev.salt)
            prev_depth = -1
        else:
            parent = self._known(ev.parent)
            if parent is None and first == 0:
                if ev.parent in self.unkeyable:
                    self._skip("parent_unkeyable", n, level="debug")
                    self._poison(ev.hashes)
                    return True
                if recover:
                    return False
                self._skip("unknown_parent", n)
                self._poison(ev.hashes)
                return True
            prev_key, _, prev_depth = parent if parent is not None else (None, None, -1)

        keys: list[int] = [k[0] for k in known[:first]] if first is not None else [k[0] for k in known]  # type: ignore[index]
        if first is not None:
            seed = prev_key if first == 0 else keys[first - 1]
            assert seed is not None
            try:
                raw = tokens_to_le_bytes(ev.tokens[first * B :])
            except ValueError as exc:
                self._skip("bad_tokens", n, detail=str(exc))
                self._poison(ev.hashes)
                return True
            keys += keys_from_le_bytes_extra(raw, B, seed, ev.extras[first:] if ev.extras else None)

        new: list[tuple[int, int | None]] = []  # (key, parent key) newly held on the tier, in order
        # The seed is not a block: a chain starting at the root has no parent key.
        parent_key = None if ev.parent is None else prev_key
        depth = prev_depth
        for h, key in zip(ev.hashes, keys, strict=True):
            depth += 1
            e = self._entry(h, key, parent_key, depth)
            if self._hold(e, group, tier):
                new.append((e.key, e.parent))
            parent_key = e.key
            depth = e.depth
        self._publish_stored(new, ev.tier, group)
        return True

    def _stored_sparse(self, ev: NativeStored, group: int, tier: int, recover: bool, tried: bool) -> bool:
        """The range's tokens, the hashes of some of its blocks: each placed by its translation (checked
        against the range's chain keys) or vLLM's recomputed hash, else not published."""
        n = len(ev.hashes)
        known = [self._known(h) for h in ev.hashes]
        parent = self._parent(ev)
        if None in known and parent is not None and not tried:
            self._learn_vllm_hashes(ev)  # the last resort (a no-op when it cannot apply)
            known = [self._known(h) for h in ev.hashes]
        if None in known and parent is None:
            if ev.parent in self.unkeyable:
                self._skip("parent_unkeyable", n, level="debug")
                return True
            if recover:
                return False
            self._skip("unknown_parent", n)
            return True
        # The chain keys of the whole range check each translation's position; with extra keys (a
        # salt, multimodal inputs) the unlisted blocks' are unknown, and the translations stand alone.
        range_keys: list[int] | None = None
        if parent is not None and not ev.extras and not ev.salt:
            try:
                range_keys = self._range_keys(parent[0], ev.tokens)
            except ValueError as exc:
                self._skip("bad_tokens", n, detail=str(exc))
                return True
        positions = {k: i for i, k in enumerate(range_keys)} if range_keys is not None else {}
        new: list[tuple[int, int | None]] = []
        unplaced: list[Hash] = []
        last = -1
        for h, k in zip(ev.hashes, known, strict=True):
            if k is None:
                unplaced.append(h)
                continue
            key, parent_key, depth = k
            if range_keys is not None and parent is not None:
                pos = positions.get(key)
                if pos is None or pos <= last:
                    unplaced.append(h)  # a translation that is not a block of this range
                    continue
                last = pos
                parent_key = range_keys[pos - 1] if pos else (None if ev.parent is None else parent[0])
                depth = parent[1] + 1 + pos
            e = self._entry(h, key, parent_key, depth)
            if self._hold(e, group, tier):
                new.append((e.key, e.parent))
        if unplaced:
            self._skip("unplaced_block", len(unplaced), group=group, tokens=len(ev.tokens))
        self._publish_stored(new, ev.tier, group)
        return True

    def _learn_vllm_hashes(self, ev: NativeStored) -> None:
        """Recompute vLLM's default block hashes (sha256 over pickle) over ``ev``'s range and remember
        each block's translation and digest. Only what an engine names afterwards is ever used, and
        an engine names a hash only if it is its own, so a computed hash is verified by being named."""
        if self._vllm_hash is False or ev.extras or ev.salt or ev.lora_name:
            return  # vLLM hashes extra keys too; the bridge recomputes only plain blocks
        if ev.parent is None:
            parent_digest: bytes | None = VLLM_NONE_HASH
        elif isinstance(ev.parent, bytes):
            parent_digest = ev.parent if len(ev.parent) == 32 else None
        else:
            parent_digest = self.digests.get(ev.parent)
        parent = self._parent(ev)
        if parent_digest is None or parent is None:
            return
        try:
            keys = self._range_keys(parent[0], ev.tokens)
            digests = vllm_block_digests(parent_digest, ev.tokens, self.block_size)
        except (ValueError, TypeError, pickle.PicklingError):
            return
        as_bytes = bool(ev.hashes) and isinstance(ev.hashes[0], bytes)
        computed: set[Hash] = set()
        prev = None if ev.parent is None else parent[0]
        depth = parent[1]
        for key, digest in zip(keys, digests, strict=False):
            h: Hash = digest if as_bytes else int.from_bytes(digest, "big") & _U64
            if not as_bytes:
                self._remember(self.digests, h, digest)
            depth += 1
            self._learn(h, (key, prev, depth))
            computed.add(h)
            prev = key
        if not ev.hashes or self._vllm_hash:
            return
        if any(h in computed for h in ev.hashes):
            self._vllm_hash = True
            return
        self._hash_misses += 1
        if self._hash_misses >= _HASH_TRIALS:
            self._vllm_hash = False
            self.stats.log.warning(
                "kv_engine_hash_not_reproduced",
                detail="the engine's block hashes are not vLLM's default sha256: stores of sliding-window "
                "or Mamba groups without a full-attention group cannot be placed",
                **self.context,
            )

    def _entry(self, h: Hash, key: int, parent: int | None, depth: int) -> Entry:
        e = self.entries.get(h)
        if e is None:
            old = self.retired.pop(h, None)
            e = self.entries[h] = Entry(key, parent if old is None else old[1], depth)
            self.unkeyable.pop(h, None)
        return e

    def _stored_tokenless(self, ev: NativeStored, group: int, tier: int, recover: bool) -> bool:
        known = []
        for h in ev.hashes:
            k = self._known(h)
            if k is None:
                if h in self.unkeyable:
                    self._skip("unkeyable_block", 1, level="debug")
                    continue
                if recover:
                    return False
                self._skip("unknown_tokenless_block", 1)
                self._poison([h])
                continue
            known.append((h, k))
        new: list[tuple[int, int | None]] = []
        for h, (key, parent, depth) in known:
            e = self._entry(h, key, parent, depth)
            if self._hold(e, group, tier):
                new.append((e.key, e.parent))
        self._publish_stored(new, ev.tier, group)
        return True

    def _tier_refs(self, group: int) -> list[dict[int, int]]:
        refs = self.key_refs.get(group)
        if refs is None:
            refs = self.key_refs[group] = [{}, {}, {}, {}]
        return refs

    def _hold(self, e: Entry, group: int, tier: int) -> bool:
        """One more holder of ``e`` on ``tier`` of ``group``; True when its key newly appears there."""
        counts = e.refs.get(group)
        if counts is None:
            counts = e.refs[group] = [0, 0, 0, 0]
        if counts[tier] and tier in self.set_tiers:
            return False
        counts[tier] += 1
        if counts[tier] != 1:
            return False
        refs = self._tier_refs(group)[tier]
        count = refs.get(e.key, 0) + 1
        refs[e.key] = count
        return count == 1

    def _release(self, h: Hash, e: Entry, group: int, tier: int) -> int | None:
        """One holder of ``e`` on ``tier`` of ``group`` fewer; its key when the key leaves there."""
        counts = e.refs[group]
        counts[tier] -= 1
        gone = None
        if counts[tier] == 0:
            refs = self._tier_refs(group)[tier]
            count = refs.get(e.key, 0) - 1
            if count <= 0:
                refs.pop(e.key, None)
                gone = e.key
            else:
                refs[e.key] = count
            if not any(counts):
                del e.refs[group]
            if not e.refs:
                del self.entries[h]
                self._remember(self.retired, h, (e.key, e.parent, e.depth))
        return gone

    def _remove_group(self, ev: NativeRemoved) -> int | None:
        n = len(ev.hashes)
        if ev.attention_window is not None:
            g = self._window_group(ev.attention_window)
        elif ev.group is None:
            g = 0
        else:
            g = ev.group
            if not 0 <= g < MAX_GROUPS:
                self._skip("bad_group", n, group=g, detail=f"group_idx outside 0..{MAX_GROUPS - 1}")
                return None
            if g not in self.groups and not (g == 0 and not self.kinds_seen) and g not in self.key_refs:
                self._skip("unknown_group_removed", n, group=g)
                return None
        return self._published(g, n)

    def _removed(self, ev: NativeRemoved) -> None:
        group = self._remove_group(ev)
        if group is None:
            return
        tier = TIER_INDEX[ev.tier]
        gone: list[int] = []
        for h in ev.hashes:
            e = self.entries.get(h)
            if e is None:
                reason = "unkeyable_block" if h in self.unkeyable else "unknown_block_removed"
                self._skip(reason, 1, level="debug", tier=ev.tier, group=group)
                continue
            counts = e.refs.get(group)
            if counts is None or counts[tier] == 0:
                self._skip("removed_not_held", 1, level="debug", tier=ev.tier, group=group)
                continue
            key = self._release(h, e, group, tier)
            if key is not None:
                gone.append(key)
        if gone:
            self.stats.add("keys", "removed", len(gone))
            self.sink.removed(gone, ev.tier, group=group)

    def _cleared(self, ev: NativeCleared) -> None:
        tiers = LOCAL_TIERS if ev.tier is None else (TIER_INDEX[ev.tier],)
        for tier in tiers:
            for h, e in list(self.entries.items()):
                for group, counts in list(e.refs.items()):
                    counts[tier] = 0
                    if not any(counts):
                        del e.refs[group]
                if not e.refs:
                    del self.entries[h]
                    self._remember(self.retired, h, (e.key, e.parent, e.depth))
            for refs in self.key_refs.values():
                refs[tier].clear()
            self.sink.cleared(TIERS[tier])

    def _publish_stored(self, new: list[tuple[int, int | None]], tier: str, group: int) -> None:
        """Publish newly held keys as chains: a run continues while each key's parent is the previous."""
        if not new:
            return
        self.stats.add("keys", "stored", len(new))
        run: list[int] = []
        run_parent: int | None = None
        for key, parent in new:
            if run and parent == run[-1]:
                run.append(key)
                continue
            if run:
                self.sink.stored(run, tier, parent=run_parent, group=group)
            run, run_parent = [key], parent
        self.sink.stored(run, tier, parent=run_parent, group=group)

    # -- learning from the engine's history -----------------------------------------------------

    def learn_from(self, other: Translator) -> int:
        """Learn the hash -> key translations ``other`` (built from the engine's replay buffer) has and
        this map lacks; returns how many. Only translations: what this map holds is driven by the
        events it applies itself, so nothing is counted twice."""
        learned = 0
        known: list[tuple[Hash, Known]] = [(h, (e.key, e.parent, e.depth)) for h, e in other.entries.items()]
        known.extend(other.retired.items())
        for h, value in known:
            if h in self.entries or h in self.retired:
                continue
            self._remember(self.retired, h, value)
            self.unkeyable.pop(h, None)
            learned += 1
        for h, digest in other.digests.items():
            if h not in self.digests:
                self._remember(self.digests, h, digest)
        return learned
