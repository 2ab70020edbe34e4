"""Admission decisions of the sequencer."""

from __future__ import annotations

from kvindex.sequencer import Sequencer, Verdict

W = ("w", 0)


def test_in_order_duplicates_and_gaps() -> None:
    s = Sequencer()
    assert s.admit(W, 10, 1).verdict is Verdict.FIRST
    assert s.admit(W, 10, 2).verdict is Verdict.APPLY
    assert s.admit(W, 10, 2).verdict is Verdict.DUPLICATE
    assert s.admit(W, 10, 1).verdict is Verdict.DUPLICATE
    gap = s.admit(W, 10, 6)
    assert gap.verdict is Verdict.GAP and gap.missing == (3, 5) and gap.applies
    assert s.admit(W, 10, 7).verdict is Verdict.APPLY
    assert s.admit(W, 10, 4).verdict is Verdict.DUPLICATE  # too late: the cursor moved on


def test_first_contact_mid_stream_reports_unknown_history() -> None:
    s = Sequencer()
    first = s.admit(W, 3, 42)
    assert first.verdict is Verdict.FIRST and first.missing == (1, 41)


def test_restart_and_late_batches_from_old_epoch() -> None:
    s = Sequencer()
    s.admit(W, 1, 1)
    s.admit(W, 1, 2)
    restart = s.admit(W, 2, 1)
    assert restart.verdict is Verdict.NEW_EPOCH and restart.missing is None
    late = s.admit(W, 1, 3)
    assert late.verdict is Verdict.STALE_EPOCH and not late.applies
    assert s.admit(W, 2, 2).verdict is Verdict.APPLY
    # Restart seen mid-stream of the new epoch: the start of that epoch is missing.
    assert s.admit(W, 3, 4).missing == (1, 3)


def test_heartbeat_driven_moves() -> None:
    s = Sequencer()
    s.restart(W, 7, 3)  # first contact via heartbeat
    assert s.admit(W, 7, 4).verdict is Verdict.APPLY
    assert s.skip_to(W, 6) == (5, 6)
    assert s.skip_to(W, 6) is None
    assert s.admit(W, 7, 7).verdict is Verdict.APPLY
    s.restart(W, 8, 0)
    assert s.admit(W, 7, 8).verdict is Verdict.STALE_EPOCH
    assert s.admit(W, 8, 1).verdict is Verdict.APPLY
    s.forget(W)
    assert s.cursor(W) is None
