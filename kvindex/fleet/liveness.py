"""Which instances went quiet: no heartbeat for ``stale_after`` -> stale (not ranked); for
``forget_after`` -> forgotten (blocks dropped). Pure, so the sweep is easy to test."""

from __future__ import annotations

from collections.abc import Iterable

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import InstanceKey


def sweep(
    states: Iterable[InstanceState], now: float, stale_after: float, forget_after: float
) -> tuple[list[InstanceState], list[InstanceKey]]:
    """(instances that just became stale, instances to forget)."""
    newly_stale: list[InstanceState] = []
    forget: list[InstanceKey] = []
    for state in states:
        if state.static:
            continue  # registered by the operator, not by heartbeats: nothing to age
        # An instance never heard in a heartbeat ages from when it was first seen.
        last = state.last_status_at if state.last_status_at is not None else state.first_seen
        silent = now - last
        if silent > forget_after:
            forget.append(state.key)
        elif silent > stale_after and not state.stale:
            newly_stale.append(state)
    return newly_stale, forget
