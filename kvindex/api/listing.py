"""ListInstances: its pages, its views, and the rows it sends.

A full listing of a large fleet is large: ~134 bytes and ~26 us of the index's event loop an
instance (its load, blocks per tier, prefill fit, outcome counts), so 4 MB, other gRPC clients'
default receive limit, near 30,000 instances, and ~6 s of the loop at 224,000. Routers list the
fleet every few seconds for their fallback (kvindex/client/fallback.py). So:

- **pages**: ``page_size`` instances at most, in (model, worker, dp_rank) order, and a
  ``next_page_token`` naming the last one sent. Each model's keys are kept sorted
  (``sortedcontainers.SortedList``) and follows the registry's journal of joins and leaves, so a
  page costs what it sends plus a bisection, not a sort or a comparison of the fleet.
- **views**: ``brief`` sends what routing without the index needs (identity, block size, endpoint,
  pool, stale, role, PD group): ~1/10 of the bytes and of the time of ``full``.

A token is the last key sent, not a position: instances that join or leave between pages move no
other instance (one joining before the page reached is missed until the next listing).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from typing import Any

from sortedcontainers import SortedList

from kvindex.api.errors import BadRequest
from kvindex.fleet.registry import InstanceState, Registry
from kvindex.instance import InstanceKey
from kvindex.v1 import kvindex_pb2 as pb

FULL, BRIEF = "full", "brief"
VIEWS = ("", FULL, BRIEF)

Position = tuple[str, InstanceKey]  # (model, instance key): where a page ends


def check_view(view: str) -> str:
    if view not in VIEWS:
        raise BadRequest(f"view must be {FULL!r} (or empty) or {BRIEF!r}, not {view[:40]!r}")
    return view or FULL


def encode_token(position: Position) -> str:
    model, (worker, rank) = position
    raw = json.dumps([model, worker, rank], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, model: str) -> Position | None:
    """The position a page_token names (None for ""); BadRequest for one this index did not give,
    or one given for another model's listing."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError):
        value = None
    if not (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], str)
        and isinstance(value[1], str)
        and type(value[2]) is int
    ):
        raise BadRequest(f"page_token {token[:40]!r} is not a next_page_token this index gave") from None
    if model and value[0] != model:
        raise BadRequest(f"page_token belongs to a listing of model {value[0]!r}, not {model!r}")
    return value[0], (value[1], value[2])


class _SortedKeys:
    """One model's instance keys, sorted, as of a per-model membership count."""

    __slots__ = ("keys", "known", "membership")

    def __init__(self) -> None:
        self.keys: SortedList = SortedList()
        self.known: set[InstanceKey] = set()
        self.membership = -1

    def update(self, registry: Registry, model: str) -> None:
        membership = registry.model_membership(model)
        if membership == self.membership:
            return
        keys, known = self.keys, self.known
        changes = registry.model_changes(model, self.membership) if self.membership >= 0 else None
        if changes is not None:  # the joins and leaves since, from the registry's journal
            for key, joined in changes:
                if joined and key not in known:
                    keys.add(key)
                    known.add(key)
                elif not joined and key in known:
                    keys.remove(key)
                    known.discard(key)
        else:  # first use, or too many changes since: rebuilt (~25 ms at 224,000 instances)
            members = registry.members(model)
            self.keys, self.known = SortedList(members), set(members)
        self.membership = membership


class InstanceListing:
    """Pages of a registry's instances, in (model, key) order."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._sorted: dict[str, _SortedKeys] = {}

    def _keys(self, model: str) -> SortedList:
        registry = self.registry
        entry = self._sorted.get(model)
        if entry is None:
            entry = self._sorted[model] = _SortedKeys()
        entry.update(registry, model)
        return entry.keys

    def page(
        self, model: str, after: Position | None, size: int
    ) -> tuple[list[InstanceState], Position | None]:
        """Up to ``size`` instances (0: all) of ``model`` ("" for every model) after ``after``, and
        the position to pass for the next page (None: this was the last)."""
        for gone in [m for m in self._sorted if not self.registry.count(m)]:
            del self._sorted[gone]
        models = [model] if model else sorted(self.registry.models())
        limit = size or None
        out: list[InstanceState] = []
        last: Position | None = None
        for m in models:
            if after is not None and m < after[0]:
                continue
            keys = self._keys(m)
            start = keys.bisect_right(after[1]) if after is not None and m == after[0] else 0
            members = self.registry.members(m)
            want = None if limit is None else limit - len(out)
            stop = len(keys) if want is None else min(len(keys), start + want)
            out.extend(members[k] for k in keys.islice(start, stop))
            if stop > start:
                last = (m, keys[stop - 1])
            if limit is not None and len(out) >= limit:
                more = stop < len(keys) or any(self.registry.count(x) for x in models if x > m)
                return out, last if more else None
        return out, None


def brief_info(state: InstanceState) -> pb.InstanceInfo:
    """The fields a router routes by without the index (kvindex/client/fallback.py)."""
    return pb.InstanceInfo(
        instance_id=state.instance_id,
        worker=state.worker,
        dp_rank=state.dp_rank,
        model=state.model,
        block_size=state.block_size,
        endpoint=state.endpoint or "",
        pool=state.is_pool,
        stale=state.stale,
        role=state.role,
        pd_group=state.pd_group or "",
    )


def add_rows(
    response: pb.ListInstancesResponse,
    states: Sequence[InstanceState],
    view: str,
    full_row: Callable[[pb.ListInstancesResponse, InstanceState], Any],
) -> None:
    if view == BRIEF:
        response.instances.extend([brief_info(s) for s in states])
    else:
        for state in states:
            full_row(response, state)
