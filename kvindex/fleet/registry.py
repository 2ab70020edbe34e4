"""What the index knows about each instance besides its blocks: model, ordering, load, health."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from kvindex.instance import InstanceKey
from kvindex.wire.schema import CPU, DISK, GPU, SHARED, Load


def instance_id(instance: InstanceKey) -> str:
    """The id the API reports: ``worker/dp_rank`` ('/' never occurs in a worker id)."""
    return f"{instance[0]}/{instance[1]}"


# The fields a ranking depends on (load, heartbeat time, health, capacity). Setting one tells the
# registry's watchers which instance changed, so that rankers can keep per-instance state up to date
# at heartbeats instead of re-reading every instance on every request (kvindex/scoring/fleet_table.py).
# Assigning a new Load (as heartbeats do) is seen; mutating one in place is not. (local_blocks_seen
# is not watched: the consumer sets it on every batch with local blocks, and it only matters while no
# capacity is reported; rankers re-read it for those few instances.)


def _watching(slot: str) -> property:
    """The property of a watched field kept in ``slot``: reads stay in C (attrgetter: candidates read
    load and last_heartbeat_at of every instance), a write tells the registry's watchers."""

    def set_(self: InstanceState, value: object) -> None:
        object.__setattr__(self, slot, value)
        for changed in self._watchers:
            changed.add(self.key)

    return property(attrgetter(slot), set_)


@dataclass(slots=True)
class RepairStatus:
    """The repair machine's account of an instance (kvindex/repair/machine.py writes it)."""

    sync: str = "synced"  # synced | replay | snapshot | queued: what the index is doing to stay exact
    cause: str = ""  # why that repair began (gap, drift, start, periodic, degraded, ...)
    # A repair failed (a replay or snapshot that timed out, holes accepted): the index may miss
    # blocks until a snapshot succeeds (kvindex/scoring/outcomes.py: the instance is degraded).
    failed: bool = False


@dataclass(slots=True)
class HeartbeatStatus:
    """What the instance's heartbeats said besides its load (kvindex/ingest/heartbeats.py writes it)."""

    ts: float = 0.0  # the worker's own timestamp in the last heartbeat
    digest: dict[int, tuple[int, int]] = field(default_factory=dict)  # (count, xor) per tier
    seq: int = 0  # the last batch it published, as of that heartbeat
    # The memory of the last accepted heartbeat (kvindex.ingest.heartbeats._HeartbeatMemo): the next
    # one reuses its decoded maps when their bytes are the same.
    memo: Any = None


@dataclass(slots=True)
class InstanceState:
    """One instance as the index knows it. The registry's fields (identity, announcement, the watched
    ranking view); the batch path's (the consumer's sequence position and counts, kvindex/ingest);
    and a record per other writer: ``repair`` (the repair machine's), ``heartbeat`` (the heartbeats')."""

    key: InstanceKey
    model: str
    block_size: int
    # The batch path (the consumer, and its repair machine on a restart or a repair's end).
    epoch: int = 0
    last_seq: int = 0
    last_event_ts: float = 0.0
    first_seen: float = 0.0
    _last_heartbeat_at: float | None = None  # local monotonic time of the last heartbeat
    _load: Load = field(default_factory=Load)
    _capacity: dict[int, int] = field(default_factory=dict)
    batches: int = 0
    gaps: int = 0
    missing_batches: int = 0
    restarts: int = 0
    local_blocks_seen: bool = False
    removals: int = 0  # blocks removed or cleared by its events (outcomes: an eviction since a decision)
    repair: RepairStatus = field(default_factory=RepairStatus)
    heartbeat: HeartbeatStatus = field(default_factory=HeartbeatStatus)
    # Where routers send this instance's requests ("host:port", from its heartbeats); None: unknown.
    endpoint: str | None = None
    # No KV events from this instance (heartbeat-only worker, or a static --instance): its blocks in
    # the index are predicted from routing decisions (kvindex/scoring/approximate.py).
    approximate: bool = False
    # Prefill/decode disaggregation (kvindex/wire/role.py): "prefill", "decode" or "both" (default:
    # serves whole requests), and the KV-transfer group routers may keep a request's two halves in.
    role: str = "both"
    pd_group: str | None = None
    # KV-cache groups of a hybrid-attention model (docs/wire.md §8, kvindex/ingest/layouts.py): what
    # its heartbeats last announced (() before the first; None: no groups), whether that contradicts
    # the model's layout (its batches are then refused), the highest group its events named, and why
    # its answers are not the engine's rule ("" when they are; else it is approximate).
    groups_announced: Any = ()
    layout_conflict: bool = False
    top_group: int = 0
    groups_inexact: str = ""
    static: bool = False  # registered from the command line: never stale, never forgotten
    _stale: bool = False  # no heartbeat for a while: excluded from rankings
    # Sets the registry's watchers drain (Registry.watch); each gets the key of a changed instance.
    _watchers: tuple[set[InstanceKey], ...] = ()

    # Most blocks the index keeps per tier for this instance (kvindex/ingest/limits.py), and the
    # tiers (bit 1 << tier) where stores were refused: the index holds a subset of the worker's
    # blocks there, so the digest check skips them until the worker reports fitting again.
    # None until the consumer first needs it (instances registered elsewhere, e.g. static ones).
    block_limits: tuple[int, int, int, int] | None = None
    capped: int = 0
    # No longer the registry's entry for its key (removed, or replaced by a new one): whoever kept
    # it (the consumer's repeated-heartbeat path) learns so without a lookup.
    removed: bool = False

    # The watched fields (above): written by the heartbeats and the liveness sweep, read by rankings.
    if TYPE_CHECKING:  # (as typed)

        @property
        def load(self) -> Load: ...
        @load.setter
        def load(self, value: Load) -> None: ...
        @property
        def last_heartbeat_at(self) -> float | None: ...
        @last_heartbeat_at.setter
        def last_heartbeat_at(self, value: float | None) -> None: ...
        @property
        def capacity(self) -> dict[int, int]: ...
        @capacity.setter
        def capacity(self, value: dict[int, int]) -> None: ...
        @property
        def stale(self) -> bool: ...
        @stale.setter
        def stale(self, value: bool) -> None: ...
    else:
        load = _watching("_load")
        last_heartbeat_at = _watching("_last_heartbeat_at")
        capacity = _watching("_capacity")
        stale = _watching("_stale")

    @property
    def instance_id(self) -> str:
        return instance_id(self.key)

    @property
    def worker(self) -> str:
        return self.key[0]

    @property
    def dp_rank(self) -> int:
        return self.key[1]

    @property
    def is_pool(self) -> bool:
        """A shared-pool publisher (e.g. a bridge in front of Mooncake Store): not routable."""
        capacity = self.capacity
        if capacity:
            get = capacity.get  # (no generator: rankers ask this per instance)
            return SHARED in capacity and not (get(GPU) or get(CPU) or get(DISK))
        return not self.local_blocks_seen and self.batches > 0

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.last_heartbeat_at is None else max(0.0, now - self.last_heartbeat_at)


JOURNAL = 4096  # joins and leaves remembered per model (Registry.model_changes)


class Registry:
    """Instances by key and by model, and each model's block size (announced by its workers)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[InstanceKey, InstanceState] = {}
        self._by_model: dict[str, dict[InstanceKey, InstanceState]] = {}
        # endpoint -> instances announcing it (the ranks of one data-parallel engine share its server)
        self._by_endpoint: dict[str, dict[InstanceKey, InstanceState]] = {}
        self._watchers: tuple[set[InstanceKey], ...] = ()
        # Bumped whenever an instance is added or removed: views of the membership (the pick's
        # fleet ages) recompute only when it moved. Per model too (ListInstances' sorted keys).
        self.membership = 0
        self._model_membership: dict[str, int] = {}
        # Per model, the last joins and leaves (count after, key, joined): a sorted view follows
        # them instead of comparing the whole membership (kvindex/api/listing.py).
        self._journal: dict[str, deque[tuple[int, InstanceKey, bool]]] = {}

    def watch(self) -> set[InstanceKey]:
        """A set that receives the key of every instance added, removed or assigned a watched field
        (load, heartbeat time, staleness, capacity) from now on; the caller drains it."""
        changed: set[InstanceKey] = set(self._states)
        self._watchers = (*self._watchers, changed)
        for state in self._states.values():
            state._watchers = self._watchers
        return changed

    def __len__(self) -> int:
        return len(self._states)

    def get(self, instance: InstanceKey) -> InstanceState | None:
        return self._states.get(instance)

    def getter(self) -> Callable[[InstanceKey], InstanceState | None]:
        """``get`` without a call in between: the registry's own dict's (for the ingest's hot path)."""
        return self._states.get

    def all(self) -> list[InstanceState]:
        return list(self._states.values())

    def models(self) -> list[str]:
        return list(self._by_model)

    def block_size(self, model: str) -> int | None:
        members = self._by_model.get(model)
        if not members:
            return None
        return next(iter(members.values())).block_size

    def add(self, instance: InstanceKey, model: str, block_size: int) -> InstanceState:
        state = InstanceState(instance, model, block_size, first_seen=self.clock())
        self.membership += 1
        self._bump(model, instance, True)
        state._watchers = self._watchers
        old = self._states.get(instance)
        if old is not None:
            old.removed = True
        self._states[instance] = state
        for changed in self._watchers:
            changed.add(instance)
        self._by_model.setdefault(model, {})[instance] = state
        return state

    def remove(self, instance: InstanceKey) -> InstanceState | None:
        state = self._states.pop(instance, None)
        if state is not None:
            self.membership += 1
            self._bump(state.model, instance, False)
            state.removed = True
            self.set_endpoint(state, None)
            for changed in self._watchers:
                changed.add(instance)
            state._watchers = ()
            members = self._by_model[state.model]
            del members[instance]
            if not members:
                del self._by_model[state.model]
        return state

    def _bump(self, model: str, instance: InstanceKey, joined: bool) -> None:
        # Never reset (a model that empties and comes back must not repeat a count a view saw).
        count = self._model_membership[model] = self._model_membership.get(model, 0) + 1
        journal = self._journal.get(model)
        if journal is None:
            journal = self._journal[model] = deque(maxlen=JOURNAL)
        journal.append((count, instance, joined))

    def model_membership(self, model: str) -> int:
        """A count that moves whenever an instance of ``model`` is added or removed."""
        return self._model_membership.get(model, 0)

    def model_changes(self, model: str, since: int) -> list[tuple[InstanceKey, bool]] | None:
        """The joins (True) and leaves of ``model``'s instances after count ``since``, oldest
        first; None when the journal no longer reaches back that far."""
        journal = self._journal.get(model)
        if not journal or journal[0][0] > since + 1:
            return None if self.model_membership(model) != since else []
        return [(key, joined) for count, key, joined in journal if count > since]

    def members(self, model: str) -> dict[InstanceKey, InstanceState]:
        """The model's instances by key (a live view: do not modify)."""
        return self._by_model.get(model, {})

    def count(self, model: str) -> int:
        """Instances of ``model``."""
        return len(self._by_model.get(model, ()))

    def of_model(self, model: str) -> list[InstanceState]:
        return list(self._by_model.get(model, {}).values())

    def routable(self, model: str, candidates: Iterable[str] | None = None) -> list[InstanceState]:
        """Instances of ``model`` a request may go to, optionally limited to ``candidates``.

        A candidate is an instance id (``worker/rank``) or a bare worker id (all of its ranks).
        """
        members = self._by_model.get(model)
        if not members:
            return []
        states = [s for s in members.values() if not s.is_pool and not s.stale]
        if candidates is None:
            return states
        wanted = set(candidates)
        return [s for s in states if s.worker in wanted or s.instance_id in wanted]

    # -- endpoints (for in-process routers: the route proxy and the ext_proc picker) -------------

    def set_endpoint(self, state: InstanceState, endpoint: str | None) -> None:
        """Record where ``state`` serves (validated by the caller; None: not announced)."""
        old = state.endpoint
        if old == endpoint:
            return
        if old is not None:
            holders = self._by_endpoint.get(old)
            if holders is not None:
                holders.pop(state.key, None)
                if not holders:
                    del self._by_endpoint[old]
        state.endpoint = endpoint
        if endpoint is not None and state.key in self._states:
            self._by_endpoint.setdefault(endpoint, {})[state.key] = state

    def set_role(self, state: InstanceState, role: str, group: str | None) -> None:
        """Record what ``state`` does under disaggregation (validated by the caller)."""
        state.role, state.pd_group = role, group

    def endpoint(self, instance: InstanceKey | str) -> str | None:
        """Where an instance (key or "worker/dp_rank" id) serves; None if unknown or not announced."""
        if isinstance(instance, str):
            worker, _, rank = instance.partition("/")
            if not (rank.isdigit() and rank.isascii()):
                return None
            instance = (worker, int(rank))
        state = self._states.get(instance)
        return None if state is None else state.endpoint

    def at_endpoint(self, endpoint: str) -> list[InstanceState]:
        """The instances announcing ``endpoint`` (an engine serving several dp ranks has one)."""
        return list(self._by_endpoint.get(endpoint, {}).values())
