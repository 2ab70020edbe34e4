"""Engine block hashes -> the project's block keys, per (worker, dp_rank), with per-tier refcounts.

The translator keeps, for every block the engine holds, ``engine hash -> Entry(key, parent key,
depth, refcount per tier)``:

- ``BlockStored`` with tokens: keys are computed from ``token_ids`` (+ extra keys), continuing the chain
  from the parent's key (the parent hash translated through the map) or, at the start of a sequence,
  from the seed of (model, LoRA name, cache salt). Blocks whose hash is already mapped keep their key.
- ``BlockStored`` without tokens (CPU offload placeholders: ``token_ids=[]``, ``block_size=0``)
  translate through the map: the block's key is known from its GPU store.
- A store increments the (hash, tier) refcount, a remove decrements it (offload connectors emit
  duplicates; vLLM keeps duplicate physical blocks of one hash). Keys are counted again per tier over
  hashes, so the sink sees ``stored`` only when a key appears on a tier and ``removed`` only when its
  last holder there goes.
- An entry held on no tier leaves the map but stays in a bounded "retired" memory: engine hashes are
  functions of the prefix, so an old translation is still right when a later store names it as parent.

When a store cannot be keyed because its parent (or a token-less block) is unknown, :meth:`apply`
returns ``False`` if ``recover`` is set, leaving the event unapplied so the bridge can rebuild the map
from the engine's replay buffer; otherwise the event is skipped, counted, and its hashes remembered as
unkeyable so that their descendants are skipped quietly instead of asking for recovery again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Protocol

from kvindex.keys import keys_from_le_bytes_extra, model_seed, tokens_to_le_bytes
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


class Sink(Protocol):
    """What the translator drives: :class:`workers_shim.publisher.Publisher` fits."""

    def stored(self, keys: Iterable[int], tier: str = "gpu", parent: int | None = None) -> int: ...

    def removed(self, keys: Iterable[int], tier: str = "gpu") -> int: ...

    def cleared(self, tier: str | None = None) -> int: ...


class NullSink:
    """Publishes nothing: used while rebuilding a map from the engine's history."""

    def stored(self, keys: Iterable[int], tier: str = "gpu", parent: int | None = None) -> int:
        return 0

    def removed(self, keys: Iterable[int], tier: str = "gpu") -> int:
        return 0

    def cleared(self, tier: str | None = None) -> int:
        return 0


class Entry:
    __slots__ = ("depth", "key", "parent", "refs")

    def __init__(self, key: int, parent: int | None, depth: int) -> None:
        self.key = key
        self.parent = parent  # key of the block before, None at the start of a sequence or unknown
        self.depth = depth  # position in its sequence (best effort; orders re-published chains)
        self.refs = [0, 0, 0, 0]


class Translator:
    def __init__(
        self,
        model: str,
        block_size: int,
        sink: Sink,
        stats: BridgeStats,
        *,
        kv_group: int = 0,
        set_tiers: Iterable[str] = (),
        memory: int = 1 << 16,
        context: Mapping[str, object] | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.sink = sink
        self.stats = stats
        self.kv_group = kv_group
        # Tiers where a repeated store of a held hash is a re-announcement, not another copy.
        self.set_tiers = {TIER_INDEX[t] for t in set_tiers}
        self.memory = memory
        self.context = dict(context or {})
        self.entries: dict[Hash, Entry] = {}
        self.retired: OrderedDict[Hash, tuple[int, int | None, int]] = OrderedDict()
        self.unkeyable: OrderedDict[Hash, None] = OrderedDict()
        self.key_refs: list[dict[int, int]] = [{}, {}, {}, {}]
        self._seeds: dict[tuple[str | None, str | None], int] = {}

    # -- lookups --------------------------------------------------------------------------------

    def _known(self, h: Hash) -> tuple[int, int | None, int] | None:
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

    def _remember(self, store: OrderedDict[Hash, object], h: Hash, value: object) -> None:
        store[h] = value
        store.move_to_end(h)
        if len(store) > self.memory:
            store.popitem(last=False)

    def _poison(self, hashes: Iterable[Hash]) -> None:
        for h in hashes:
            if h not in self.entries:
                self._remember(self.unkeyable, h, None)  # type: ignore[arg-type]

    # -- applying events ------------------------------------------------------------------------

    def apply(self, ev: NativeEvent, recover: bool = False) -> bool:
        """Apply one decoded event. ``False``: not applied, the map needs rebuilding first."""
        if isinstance(ev, NativeStored):
            self.stats.add("events", "stored")
            if ev.synthetic_lora:
                self.stats.throttled(
                    "lora_without_name", "warning", "kv_lora_without_name", lora=ev.lora_name, **self.context
                )
            return self._stored(ev, recover)
        if isinstance(ev, NativeRemoved):
            self.stats.add("events", "removed")
            self._removed(ev)
        elif isinstance(ev, NativeCleared):
            self.stats.add("events", "cleared")
            self._cleared(ev)
        elif isinstance(ev, Ignored):
            self.stats.add("events", "ignored")
        elif isinstance(ev, EventError):
            self.stats.skip(ev.reason, detail=ev.detail, **self.context)
        return True

    def _stored(self, ev: NativeStored, recover: bool) -> bool:
        n = len(ev.hashes)
        if n == 0:
            self.stats.skip("empty_event", 0, level="debug", **self.context)
            return True
        if ev.group is not None and ev.group != self.kv_group:
            self.stats.skip("other_kv_group", n, level="debug", group=ev.group, **self.context)
            return True
        tier = TIER_INDEX[ev.tier]
        if not ev.tokens:
            return self._stored_tokenless(ev, tier, recover)

        B = self.block_size
        announced = ev.block_size
        if announced == 0 and len(ev.tokens) % n == 0:
            announced = len(ev.tokens) // n  # block_size left out: implied by the tokens
        if announced != B:
            if 0 < announced < B and n == 1 and len(ev.tokens) == announced:
                reason, level = "partial_block", "debug"
            else:
                reason, level = "block_size_mismatch", "error"
            self.stats.skip(reason, n, level=level, event_block_size=announced, block_size=B, **self.context)
            self._poison(ev.hashes)
            return True
        if len(ev.tokens) != n * B:
            # (skip() reports ``blocks=n`` itself: passing it again raised TypeError, found by fuzzing)
            self.stats.skip("token_count_mismatch", n, tokens=len(ev.tokens), **self.context)
            self._poison(ev.hashes)
            return True

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
                    self.stats.skip("parent_unkeyable", n, level="debug", **self.context)
                    self._poison(ev.hashes)
                    return True
                if recover:
                    return False
                self.stats.skip("unknown_parent", n, **self.context)
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
                self.stats.skip("bad_tokens", n, detail=str(exc), **self.context)
                self._poison(ev.hashes)
                return True
            keys += keys_from_le_bytes_extra(raw, B, seed, ev.extras[first:] if ev.extras else None)

        new: list[tuple[int, int | None]] = []  # (key, parent key) newly held on the tier, in order
        # The seed is not a block: a chain starting at the root has no parent key.
        parent_key = None if ev.parent is None else prev_key
        depth = prev_depth
        for h, key in zip(ev.hashes, keys, strict=True):
            depth += 1
            e = self.entries.get(h)
            if e is None:
                old = self.retired.pop(h, None)
                e = self.entries[h] = Entry(key, parent_key if old is None else old[1], depth)
                self.unkeyable.pop(h, None)
            if self._hold(e, tier):
                new.append((e.key, e.parent))
            parent_key = e.key
            depth = e.depth
        self._publish_stored(new, ev.tier)
        return True

    def _stored_tokenless(self, ev: NativeStored, tier: int, recover: bool) -> bool:
        known = []
        for h in ev.hashes:
            k = self._known(h)
            if k is None:
                if h in self.unkeyable:
                    self.stats.skip("unkeyable_block", 1, level="debug", **self.context)
                    continue
                if recover:
                    return False
                self.stats.skip("unknown_tokenless_block", 1, **self.context)
                self._poison([h])
                continue
            known.append((h, k))
        new: list[tuple[int, int | None]] = []
        for h, (key, parent, depth) in known:
            e = self.entries.get(h)
            if e is None:
                self.retired.pop(h, None)
                e = self.entries[h] = Entry(key, parent, depth)
            if self._hold(e, tier):
                new.append((e.key, e.parent))
        self._publish_stored(new, ev.tier)
        return True

    def _hold(self, e: Entry, tier: int) -> bool:
        """One more holder of ``e`` on ``tier``; True when its key newly appears on the tier."""
        if e.refs[tier] and tier in self.set_tiers:
            return False
        e.refs[tier] += 1
        if e.refs[tier] != 1:
            return False
        refs = self.key_refs[tier]
        count = refs.get(e.key, 0) + 1
        refs[e.key] = count
        return count == 1

    def _release(self, h: Hash, e: Entry, tier: int) -> int | None:
        """One holder of ``e`` on ``tier`` fewer; returns its key when the key leaves the tier."""
        e.refs[tier] -= 1
        gone = None
        if e.refs[tier] == 0:
            refs = self.key_refs[tier]
            count = refs.get(e.key, 0) - 1
            if count <= 0:
                refs.pop(e.key, None)
                gone = e.key
            else:
                refs[e.key] = count
            if not any(e.refs):
                del self.entries[h]
                self._remember(self.retired, h, (e.key, e.parent, e.depth))
        return gone

    def _removed(self, ev: NativeRemoved) -> None:
        if ev.group is not None and ev.group != self.kv_group:
            self.stats.skip("other_kv_group", len(ev.hashes), level="debug", group=ev.group, **self.context)
            return
        tier = TIER_INDEX[ev.tier]
        gone: list[int] = []
        for h in ev.hashes:
            e = self.entries.get(h)
            if e is None:
                reason = "unkeyable_block" if h in self.unkeyable else "unknown_block_removed"
                self.stats.skip(reason, 1, level="debug", tier=ev.tier, **self.context)
                continue
            if e.refs[tier] == 0:
                self.stats.skip("removed_not_held", 1, level="debug", tier=ev.tier, **self.context)
                continue
            key = self._release(h, e, tier)
            if key is not None:
                gone.append(key)
        if gone:
            self.stats.add("keys", "removed", len(gone))
            self.sink.removed(gone, ev.tier)

    def _cleared(self, ev: NativeCleared) -> None:
        tiers = LOCAL_TIERS if ev.tier is None else (TIER_INDEX[ev.tier],)
        for tier in tiers:
            for h, e in list(self.entries.items()):
                if e.refs[tier]:
                    e.refs[tier] = 0
                    if not any(e.refs):
                        del self.entries[h]
                        self._remember(self.retired, h, (e.key, e.parent, e.depth))
            self.key_refs[tier].clear()
            self.sink.cleared(TIERS[tier])

    def _publish_stored(self, new: list[tuple[int, int | None]], tier: str) -> None:
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
                self.sink.stored(run, tier, parent=run_parent)
            run, run_parent = [key], parent
        self.sink.stored(run, tier, parent=run_parent)

    # -- learning from the engine's history -----------------------------------------------------

    def learn_from(self, other: Translator) -> int:
        """Learn the hash -> key translations ``other`` (built from the engine's replay buffer) has and
        this map lacks; returns how many. Only translations: what this map holds is driven by the
        events it applies itself, so nothing is counted twice."""
        learned = 0
        known: list[tuple[Hash, tuple[int, int | None, int]]] = [
            (h, (e.key, e.parent, e.depth)) for h, e in other.entries.items()
        ]
        known.extend(other.retired.items())
        for h, value in known:
            if h in self.entries or h in self.retired:
                continue
            self._remember(self.retired, h, value)
            self.unkeyable.pop(h, None)
            learned += 1
        return learned
