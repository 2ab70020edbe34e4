"""The index interface. Backends implement KvBlockIndex; the service depends only on this. A backend
that can also answer grouped matches (GroupedIndex) lets pruned rankings treat many equal matches
as one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvindex.index.hybrid import GroupLayout
from kvindex.instance import InstanceKey


class InstanceMatch(NamedTuple):
    """How much of a request's block chain one instance holds.

    ``length`` is the number of consecutive request blocks from the start that the instance can
    use (on any of its tiers or in the model's shared pool); ``tiers`` splits them by the fastest
    tier holding each block, indexed by kvindex.wire.schema tier numbers (gpu, cpu, disk, shared).
    """

    length: int
    tiers: tuple[int, int, int, int]


NO_MATCH = InstanceMatch(0, (0, 0, 0, 0))


class Differ(Protocol):
    """A resumable diff: ``step(budget)`` until it says it is done, then ``missing`` / ``extra``."""

    missing: list[int]
    extra: list[int]

    def step(self, budget: int = ...) -> bool: ...


class MatchGroup(NamedTuple):
    """Many instances with one answer (InvertedIndex.match_groups): ``count`` instances, named by
    ``masks``, one little-endian u64 per 64-slot bank (bit s of bank b: slot b * 64 + s; owners
    from ``slot_layout``)."""

    match: InstanceMatch
    count: int  # type: ignore[assignment]  # (shadows tuple.count: a field by that name reads best)
    masks: bytes


class Applied(NamedTuple):
    """What applying one batch's events did (see KvBlockIndex.apply)."""

    stored: int  # blocks newly held
    removed: int  # blocks no longer held
    cleared: int  # blocks dropped by cleared events
    stored_events: int
    removed_events: int
    cleared_events: int
    local_stored: bool  # some stored event was on a local tier (gpu, cpu, disk), not the shared pool
    top_group: int = 0  # the highest KV-cache group an event named (docs/wire.md §8)


@dataclass(frozen=True, slots=True)
class IndexStats:
    models: int
    instances: int
    distinct_blocks: tuple[int, int, int, int]  # distinct keys per tier
    entries: tuple[int, int, int, int]  # (key, instance) pairs per tier
    nbytes: int = 0  # memory held by native tables and key logs (0 for the pure-Python fallback)


class KvBlockIndex(Protocol):
    """blockKey -> instances, per tier. Keys are the wire's u64 block keys (kvindex.keys)."""

    def add_instance(self, instance: InstanceKey, model: str) -> None:
        """Register an instance serving ``model``; a no-op when already registered for it."""

    def drop_instance(self, instance: InstanceKey) -> int:
        """Forget an instance and all its blocks; returns how many (key, tier) entries went away."""

    def has_instance(self, instance: InstanceKey) -> bool: ...

    def model_of(self, instance: InstanceKey) -> str | None: ...

    def store(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        """Record that the instance holds ``keys`` on ``tier``; returns how many were new."""

    def remove(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        """Record that the instance no longer holds ``keys`` on ``tier``; returns how many it had."""

    def clear(self, instance: InstanceKey, tier: int | None = None) -> int:
        """Drop every block of the instance on ``tier`` (all tiers when None); returns how many."""

    def apply(self, instance: InstanceKey, events: Sequence[Any]) -> Applied:
        """Apply a batch's decoded events in order (kvindex.wire.schema Stored / Removed / Cleared:
        ``op``, ``tier`` name, ``keys``): the same as store / remove / clear per event, in one call."""

    def apply_within(
        self, instance: InstanceKey, events: Sequence[Any], bound: int, limits: Sequence[int]
    ) -> Applied | None:
        """``apply``, when ``bound`` more blocks on every tier would leave the instance within
        ``limits`` (per tier); None, and nothing applied, when they might not. The ingest's fast check
        and its apply in one call (kvindex/ingest/applier.py)."""

    def match(
        self,
        model: str,
        keys: list[int],
        instances: Iterable[InstanceKey] | None = None,
        limit: int | None = None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> dict[InstanceKey, InstanceMatch]:
        """Per instance of ``model`` (all, or those given), the prefix of ``keys`` it can serve: the
        consecutive blocks it holds, or for a hybrid-attention model the prefix every KV-cache group
        can serve by vLLM's rule (kvindex/index/hybrid.py, ``set_layout``). ``limit``: the longest hit
        in tokens (a prompt's length less one, ``hybrid.hit_limit``); None: all of ``keys``.
        ``reach``: for a hybrid model, filled with ``instance -> blocks`` of the prefix its
        full-attention group holds (up to ``limit``) wherever that is longer than the answer — the
        junction where vLLM keeps a window once a request diverges there (docs/scoring.md, "Reach").

        Only instances that matched at least one block appear; look others up with NO_MATCH as the
        default.
        """

    def set_layout(self, model: str, layout: GroupLayout) -> None:
        """``model``'s KV-cache groups (a model with instances; kept while it has some)."""

    def layout_of(self, model: str) -> GroupLayout | None:
        """The layout set for ``model``; None: never set (one full-attention group)."""

    def block_counts(self, instance: InstanceKey) -> tuple[int, int, int, int]:
        """Blocks the instance holds per tier."""

    def digest(self, instance: InstanceKey, tier: int) -> tuple[int, int]:
        """(count, xor of keys) of the instance's blocks on ``tier``: comparable to a heartbeat's digest."""

    def digest_version(self, instance: InstanceKey) -> int:
        """A number that changes whenever the instance's digests may have (any change of its blocks,
        its registration): equal twice, its digests are the same (0: an unknown instance)."""

    def digest_equals(self, instance: InstanceKey, counts: list[int], xors: list[int]) -> bool:
        """Whether ``digest(instance, tier) == (counts[tier], xors[tier])`` on all four tiers (one
        call per heartbeat instead of four)."""

    def diff(self, instance: InstanceKey, tier: int, keys: list[int]) -> tuple[list[int], list[int]]:
        """(keys missing from the instance's tier, keys it holds there that are not in ``keys``)."""

    def differ(self, instance: InstanceKey, tier: int, keys: list[int]) -> Differ:
        """``diff`` a step at a time (the repairer compares a snapshot over several loop turns)."""

    def keys_of(self, instance: InstanceKey, tier: int) -> Iterator[int]:
        """The keys the instance holds on ``tier``, each once."""

    def stats(self) -> IndexStats: ...


@runtime_checkable
class GroupedIndex(KvBlockIndex, Protocol):
    """An index that answers a match grouped by answer (InvertedIndex does): the router's pruned
    rankings then price a large group (a prompt the whole fleet holds the start of) once, not per
    instance. The router checks for it once, when it is built."""

    def match_groups(
        self,
        model: str,
        keys: list[int],
        instances: Iterable[InstanceKey] | None = None,
        listed: int = 16,
        limit: int | None = None,
        reach: dict[InstanceKey, int] | None = None,
    ) -> tuple[dict[InstanceKey, InstanceMatch], list[MatchGroup]]:
        """``match``'s answer, except that answers shared by more than ``listed`` instances come as
        ``MatchGroup`` slot masks instead of an entry per instance (a hybrid model's answers are all
        listed: they depend on each instance's other groups)."""
        ...

    def slot_layout(self, model: str, known: int = -1) -> tuple[int, list[InstanceKey | None]]:
        """(a number that changes whenever a slot of ``model`` changes owner, the owner of each
        slot, None where free): what a ``MatchGroup``'s mask bits name; the list is empty when the
        number is ``known``."""
        ...
