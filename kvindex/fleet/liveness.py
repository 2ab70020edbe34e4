"""Which instances went quiet: no heartbeat for ``stale_after`` -> stale (not ranked); for
``forget_after`` -> forgotten (blocks dropped). Pure, so the sweep is easy to test."""

from __future__ import annotations

from collections.abc import Iterable

from kvindex.fleet.registry import InstanceState
from kvindex.instance import InstanceKey


def sweep(
    states: Iterable[InstanceState], now: float, stale_after: float, forget_after: float
) -> tuple[list[InstanceState], list[InstanceKey]]:
    """(instances that just became stale, instances to forget)."""
    newly_stale, forget, _ = sweep_next(states, now, stale_after, forget_after)
    return newly_stale, forget


def sweep_next(
    states: Iterable[InstanceState], now: float, stale_after: float, forget_after: float
) -> tuple[list[InstanceState], list[InstanceKey], float]:
    """``sweep``, plus the earliest time another sweep can find anything: heartbeats only move an
    instance's deadline later, and one that joins later has its deadline after this one, so a
    service sweeps again only then (in a healthy fleet every few seconds, not 4 times a second
    over every instance)."""
    newly_stale: list[InstanceState] = []
    forget: list[InstanceKey] = []
    next_due = now + stale_after  # an instance that joins right after this sweep
    for state in states:
        if state.static:
            continue  # registered by the operator, not by heartbeats: nothing to age
        # An instance never heard in a heartbeat ages from when it was first seen.
        last = state.last_status_at if state.last_status_at is not None else state.first_seen
        silent = now - last
        if silent > forget_after:
            forget.append(state.key)
            continue
        if state.stale or silent > stale_after:
            if not state.stale:
                newly_stale.append(state)
            due = last + forget_after
        else:
            due = last + min(stale_after, forget_after)
        if due < next_due:
            next_due = due
    return newly_stale, forget, next_due
