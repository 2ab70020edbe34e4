"""Which instances went quiet: no heartbeat for ``stale_after`` -> stale (not ranked); for
``forget_after`` -> forgotten (blocks dropped). Pure, so the sweep is easy to test; the service runs
it (kvindex/service/app.py), an offline replay runs it on log time (kvindex/capture/replay.py), and
the consumer carries out what it finds (``Consumer.mark_stale`` / ``forget``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvindex.fleet.registry import InstanceState
from kvindex.instance import InstanceKey


@dataclass
class LivenessConfig:
    stale_after: float = 5.0  # no heartbeat this long: not ranked (s)
    forget_after: float = 120.0  # no heartbeat this long: blocks dropped (s)
    tick: float = 0.25  # how often the service looks whether a sweep is due (s)


def sweep(
    states: Iterable[InstanceState], now: float, stale_after: float, forget_after: float
) -> tuple[list[InstanceState], list[InstanceKey]]:
    """(instances that just became stale, instances to forget)."""
    newly_stale, forget, _ = sweep_next(states, now, stale_after, forget_after)
    return newly_stale, forget


def sweep_next(
    states: Iterable[InstanceState],
    now: float,
    stale_after: float,
    forget_after: float,
    heard_since: float = float("-inf"),
) -> tuple[list[InstanceState], list[InstanceKey], float]:
    """``sweep``, plus the earliest time another sweep can find anything: heartbeats only move an
    instance's deadline later, and one that joins later has its deadline after this one, so a
    service sweeps again only then (in a healthy fleet every few seconds, not 4 times a second
    over every instance).

    ``heard_since``: since when the index could hear heartbeats at all (its NATS connection's last
    return): silence before it was the index's, not the instances', so no instance ages from
    earlier than that."""
    newly_stale: list[InstanceState] = []
    forget: list[InstanceKey] = []
    next_due = now + stale_after  # an instance that joins right after this sweep
    for state in states:
        if state.static:
            continue  # registered by the operator, not by heartbeats: nothing to age
        # An instance never heard in a heartbeat ages from when it was first seen.
        last = state.last_heartbeat_at if state.last_heartbeat_at is not None else state.first_seen
        if last < heard_since:
            last = heard_since
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
