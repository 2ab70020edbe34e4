"""The liveness sweep (kvindex/fleet/liveness.py): who is stale, who is forgotten, and when the
next sweep can find anything, checked against a brute-force sweep at every instant."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.fleet.liveness import sweep, sweep_next
from kvindex.fleet.registry import Registry


def _fleet(lasts: list[float | None], stale: list[bool]) -> Registry:
    registry = Registry(clock=lambda: 0.0)
    for i, (last, is_stale) in enumerate(zip(lasts, stale, strict=True)):
        state = registry.add((f"w{i}", 0), "m", 16)
        state.first_seen = 0.0
        state.last_heartbeat_at = last
        state.stale = is_stale and last is not None
    return registry


def test_stale_and_forgotten() -> None:
    registry = _fleet([9.0, 4.0, -200.0, None], [False, False, False, False])
    stale, forget, due = sweep_next(registry.all(), 10.0, 5.0, 120.0)
    # w3 never sent a heartbeat: it ages from when it was first seen (0), so it is stale too.
    assert [s.key for s in stale] == [("w1", 0), ("w3", 0)]
    assert forget == [("w2", 0)]
    assert due == 9.0 + 5.0  # w0 goes stale first; the stale ones are forgotten at 120 and 124
    assert sweep(registry.all(), 10.0, 5.0, 120.0) == (stale, forget)


def test_silence_before_the_index_could_hear_does_not_count() -> None:
    """``heard_since``: the index's NATS connection came back at 8; silence before it was the
    index's. w1 (last heard at 4) and w3 (never) age from 8, so nobody is stale or forgotten at 10."""
    registry = _fleet([9.0, 4.0, -200.0, None], [False, False, False, False])
    stale, forget, due = sweep_next(registry.all(), 10.0, 5.0, 120.0, heard_since=8.0)
    assert (stale, forget) == ([], [])
    assert due == 8.0 + 5.0


@settings(max_examples=200, deadline=None)
@given(
    lasts=st.lists(st.one_of(st.none(), st.floats(-300, 100)), min_size=0, max_size=12),
    stale_flags=st.lists(st.booleans(), min_size=12, max_size=12),
    now=st.floats(0, 100),
    stale_after=st.floats(0.5, 30),
    forget_after=st.floats(0.5, 200),
    later=st.floats(0, 300),
)
def test_nothing_changes_before_the_next_due_time(
    lasts: list[float | None],
    stale_flags: list[bool],
    now: float,
    stale_after: float,
    forget_after: float,
    later: float,
) -> None:
    lasts = [None if x is None else min(x, now) for x in lasts]  # heartbeats are in the past
    registry = _fleet(lasts, stale_flags[: len(lasts)])
    stale, forget, due = sweep_next(registry.all(), now, stale_after, forget_after)
    assert now <= due <= now + stale_after
    for state in stale:
        state.stale = True
    for key in forget:
        registry.remove(key)
    # Any instant before ``due`` finds nothing new; at ``due`` something may change.
    t = now + min(later, max(0.0, due - now) * 0.999)
    if t < due:
        assert sweep(registry.all(), t, stale_after, forget_after) == ([], [])
