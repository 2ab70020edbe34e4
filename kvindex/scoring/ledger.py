"""Routing state kept on behalf of routers: the in-flight ledger and speculative keys.

A heartbeat reports an instance's queue at most once per interval; requests routed since then are
invisible to it, and a burst would pile onto one instance. The ledger remembers what was routed
(committed) and is released by the router when the request's prefill is done and when it finishes;
entries that are never released expire.

Speculative keys: a committed prompt's blocks will exist on its instance once its prefill runs, but
the real stored events arrive only after that. Until then (or until a TTL), later requests sharing
the prefix see those blocks as if stored, so concurrent siblings of a cold prefix follow the first
one instead of each starting a copy elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, ItemsView, Iterable, KeysView, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvindex.instance import InstanceKey

if TYPE_CHECKING:
    from kvindex.scoring.outcomes import Prediction

PREFILL = "prefill"
FINISHED = "finished"


@dataclass(slots=True)
class LedgerEntry:
    request_id: str
    instance: InstanceKey
    model: str
    prompt_tokens: int
    miss_tokens: int
    committed_at: float
    expires_at: float
    prefill_done: bool = False
    # What the index predicted at commit (kvindex/scoring/outcomes.py); None for entries learnt
    # from another replica. ``reported``: an outcome report was compared already.
    prediction: Prediction | None = None
    reported: bool = False
    # The prompt's block keys when they were added to the speculative keys: its release settles
    # them (SpeculativeKeys.settle).
    keys: list[int] | None = None
    # The engine time its prefill was estimated to take at commit (prefill + fetch, ms): the
    # ledger's work left on the instance (busy_until).
    work_ms: float = 0.0


class Ledger:
    """Requests routed per instance, not yet released."""

    def __init__(
        self,
        clock: Callable[[], float],
        ttl: float = 300.0,
        max_entries: int = 1_000_000,
        released_memory: int = 65_536,
    ) -> None:
        self.clock = clock
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()  # oldest first, for expiry
        # The last finished request ids (bounded): a late report for one is told apart from a
        # report for a request never committed.
        self.released_memory = released_memory
        self._released: OrderedDict[str, None] = OrderedDict()
        self._by_instance: dict[InstanceKey, dict[str, LedgerEntry]] = {}
        # Per instance with entries: when its last prefill finished (a release of phase prefill).
        self._done_at: dict[InstanceKey, float] = {}
        self.expired = 0
        self._watchers: tuple[set[InstanceKey], ...] = ()

    def watch(self) -> set[InstanceKey]:
        """A set that receives every instance whose entries change from now on (the caller drains
        it): rankers keep per-instance aggregates of ``pending`` without a walk per request."""
        changed: set[InstanceKey] = set(self._by_instance)
        self._watchers = (*self._watchers, changed)
        return changed

    def _changed(self, instance: InstanceKey) -> None:
        for changed in self._watchers:
            changed.add(instance)

    def __len__(self) -> int:
        return len(self._entries)

    def commit(
        self,
        request_id: str,
        instance: InstanceKey,
        model: str,
        prompt_tokens: int,
        miss_tokens: int,
        work_ms: float = 0.0,
    ) -> LedgerEntry:
        self.expire()
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._by_instance.get(old.instance, {}).pop(request_id, None)
            self._changed(old.instance)
        now = self.clock()
        entry = LedgerEntry(request_id, instance, model, prompt_tokens, miss_tokens, now, now + self.ttl)
        entry.work_ms = work_ms if work_ms > 0 else 0.0
        self._entries[request_id] = entry
        self._by_instance.setdefault(instance, {})[request_id] = entry
        self._changed(instance)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self.expired += 1
        return entry

    def get(self, request_id: str) -> LedgerEntry | None:
        return self._entries.get(request_id)

    def was_released(self, request_id: str) -> bool:
        """Finished (or expired) recently: among the last ``released_memory`` ids let go."""
        return request_id in self._released

    def release(self, request_id: str, phase: str) -> LedgerEntry | None:
        """``prefill``: its prefill is done (it now only decodes); ``finished``: forget it."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        if phase == PREFILL:
            if not entry.prefill_done:
                entry.prefill_done = True
                self._done_at[entry.instance] = self.clock()
            self._changed(entry.instance)
        else:
            self._drop(request_id)
        return entry

    def _drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id)
        if self.released_memory > 0:
            released = self._released
            released[request_id] = None
            released.move_to_end(request_id)
            if len(released) > self.released_memory:
                released.popitem(last=False)
        self._changed(entry.instance)
        per = self._by_instance.get(entry.instance)
        if per is not None:
            per.pop(request_id, None)
            if not per:
                del self._by_instance[entry.instance]
                self._done_at.pop(entry.instance, None)

    def expire(self) -> None:
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires_at > now:
                break
            self._drop(first.request_id)
            self.expired += 1

    @property
    def busy(self) -> Mapping[InstanceKey, object]:
        """The instances with requests in flight (a read-only view; test membership only)."""
        return self._by_instance

    def of(self, instance: InstanceKey) -> Iterable[LedgerEntry]:
        return self._by_instance.get(instance, {}).values()

    def pending(self, instance: InstanceKey, since: float | None) -> tuple[int, int, int]:
        """(requests, prefill tokens not yet computed, requests in flight at all) committed to
        ``instance``; the first two count only commits after ``since`` (the last heartbeat, which
        already reported the older ones in its queue)."""
        n = tokens = total = 0
        for e in self.of(instance):
            total += 1
            if e.prefill_done or (since is not None and e.committed_at <= since):
                continue
            n += 1
            tokens += e.miss_tokens
        return n, tokens, total

    def busy_until(self, instance: InstanceKey) -> float:
        """When the prefill work routed to ``instance`` ends, by the ledger (costs.ledger_ms): its
        entries whose prefill is not done, in commit order, each starting when committed or when
        the one before ends (from the instance's last finished prefill), for its ``work_ms``. An
        engine batches concurrent prefills into shared steps, which ends the batch at the same time
        as running them in turn would. 0.0 without such work."""
        t = self._done_at.get(instance, 0.0)
        busy = False
        for e in self.of(instance):
            if e.prefill_done or not e.work_ms:
                continue
            busy = True
            start = e.committed_at if e.committed_at > t else t
            t = start + e.work_ms / 1000.0
        return t if busy else 0.0


class SpeculativeKeys:
    """Block keys expected on an instance soon (committed prompts), each until a TTL."""

    def __init__(self, clock: Callable[[], float], ttl: float = 10.0, max_keys: int = 4_000_000) -> None:
        self.clock = clock
        self.ttl = ttl
        self.max_keys = max_keys
        self._keys: dict[InstanceKey, dict[int, float]] = {}  # instance -> key -> expiry
        # Hybrid-attention models (kvindex/index/hybrid.py): a committed prompt's cache serves later
        # prompts only up to where its sliding-window and Mamba groups keep state, the block before
        # its last token; marked by that block's key alone (which names the whole prefix).
        self._marks: dict[InstanceKey, dict[int, float]] = {}
        # ... while its full-attention group holds every block of it: the reach (``reach``).
        self._full: dict[InstanceKey, dict[int, float]] = {}
        self._count = 0

    def add(
        self,
        instance: InstanceKey,
        keys: Sequence[int],
        ttl: float | None = None,
        boundary: int | None = None,
        junction: int = 0,
    ) -> None:
        """``keys`` are expected on ``instance`` for ``ttl``; ``boundary``: a hybrid model's, only the
        prefix of ``boundary`` blocks as a whole (``boundary_of``), and ``junction`` blocks too when
        the instance's full-attention group held that much of the prompt but no window ended there
        (``Candidate.reach``): vLLM keeps the window at that junction after this request."""
        if self._count > self.max_keys:
            self.expire()
        expiry = self.clock() + (self.ttl if ttl is None else ttl)
        if boundary is not None:
            marks = self._marks.setdefault(instance, {})
            for depth in (boundary, junction) if 0 < junction < boundary else (boundary,):
                if 0 < depth <= len(keys):
                    self._count += keys[depth - 1] not in marks
                    marks[keys[depth - 1]] = expiry
            if not marks:
                del self._marks[instance]
            full = self._full.setdefault(instance, {})
            before = len(full)
            for key in keys:
                full[key] = expiry
            self._count += len(full) - before
            return
        held = self._keys.setdefault(instance, {})
        before = len(held)
        for key in keys:
            held[key] = expiry
        self._count += len(held) - before

    def extend(self, instance: InstanceKey, keys: list[int], start: int) -> int:
        """How far past ``start`` the consecutive request ``keys`` are expected on ``instance``."""
        held = self._keys.get(instance)
        now = self.clock()
        i = start
        n = len(keys)
        if held:
            while i < n:
                expiry = held.get(keys[i])
                if expiry is None or expiry <= now:
                    break
                i += 1
        marks = self._marks.get(instance)
        if marks:
            # The longest marked prefix of the request (a key names its whole prefix).
            for j in range(n, i, -1):
                expiry = marks.get(keys[j - 1])
                if expiry is not None and expiry > now:
                    return j
        return i

    def reach(self, instance: InstanceKey, keys: list[int], start: int) -> int:
        """How far past ``start`` a hybrid model's committed prompts on ``instance`` are expected in
        its full-attention group (``add`` with a boundary): the reach they give (Candidate.reach)."""
        full = self._full.get(instance)
        if not full:
            return start
        now = self.clock()
        i = start
        n = len(keys)
        while i < n:
            expiry = full.get(keys[i])
            if expiry is None or expiry <= now:
                break
            i += 1
        return i

    def settle(self, instance: InstanceKey, keys: Iterable[int], until: float) -> None:
        """The request that added ``keys`` has prefilled (or ended): its blocks are in the engine's
        cache now and its KV events vouch for them, evictions included. Speculative credit for them
        ends at ``until`` (a grace for the events in flight) instead of the TTL: kept for the TTL, a
        prefix the engine evicted after storing it would still be promised (an ``over`` outcome)."""
        for store in (self._keys.get(instance), self._marks.get(instance), self._full.get(instance)):
            if not store:
                continue
            for key in keys:
                expiry = store.get(key)
                if expiry is not None and expiry > until:
                    store[key] = until

    def instances(self) -> Set[InstanceKey]:
        """The instances with expected keys (some may have expired: see ``extend``), a live view."""
        return self._keys.keys() | self._marks.keys() if self._marks else self._keys.keys()

    def marked(self) -> KeysView[InstanceKey]:
        """The instances with marked prefixes of hybrid-attention prompts (see ``add``), a live view."""
        return self._marks.keys()

    def by_instance(self) -> ItemsView[InstanceKey, Mapping[int, float]]:
        """(instance, its expected keys -> expiry) for every instance with some, a live read-only
        view: a pruned ranking walks it once per Score to find the instances a prompt continues on."""
        return self._keys.items()

    def expire(self) -> None:
        now = self.clock()
        for store in (self._keys, self._marks, self._full):
            for instance in list(store):
                held = store[instance]
                for key in [k for k, t in held.items() if t <= now]:
                    del held[key]
                if not held:
                    del store[instance]
        self._count = sum(len(h) for store in (self._keys, self._marks, self._full) for h in store.values())

    def forget(self, instance: InstanceKey) -> None:
        for store in (self._keys, self._marks, self._full):
            held = store.pop(instance, None)
            if held:
                self._count -= len(held)

    def __len__(self) -> int:
        return self._count
