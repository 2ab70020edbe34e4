"""Admission decisions of the sequencer (pure) and cursor bookkeeping."""

from __future__ import annotations

from kvindex.sequencer import Cursor, Sequencer, Verdict, decide
from kvindex.sequencer.cursor import MAX_GAP

W = ("w", 0)


def test_decisions_in_sync() -> None:
    assert decide(None, 10, 1) is Verdict.FIRST
    cur = Cursor(epoch=10, applied=3)
    assert decide(cur, 10, 4) is Verdict.APPLY
    assert decide(cur, 10, 3) is Verdict.DUPLICATE
    assert decide(cur, 10, 1) is Verdict.DUPLICATE
    assert decide(cur, 10, 7) is Verdict.GAP
    assert decide(cur, 11, 1) is Verdict.NEW_EPOCH
    cur.retired.append(9)
    assert decide(cur, 9, 50) is Verdict.STALE_EPOCH


def test_decisions_while_repairing() -> None:
    cur = Cursor(epoch=1, applied=3, repairing="replay")
    assert decide(cur, 1, 4) is Verdict.BUFFER  # even the next in order waits for the repair
    assert decide(cur, 1, 9) is Verdict.BUFFER
    cur.buffer[9] = object()
    assert decide(cur, 1, 9) is Verdict.DUPLICATE  # already held
    assert decide(cur, 1, 2) is Verdict.DUPLICATE
    assert cur.hole() == (4, 8)
    cur.applied = 8
    assert cur.hole() is None


def test_open_retires_the_old_epoch() -> None:
    s = Sequencer()
    first = s.open(W, 5)
    first.applied = 40
    second = s.open(W, 6)
    assert second.applied == 0 and 5 in second.retired
    assert decide(second, 5, 41) is Verdict.STALE_EPOCH
    s.forget(W)
    assert s.cursor(W) is None


def test_a_seq_beyond_the_widest_hole_is_a_jump() -> None:
    cur = Cursor(epoch=1, applied=3)
    assert decide(cur, 1, 3 + MAX_GAP + 1) is Verdict.GAP  # MAX_GAP batches missing: a hole
    assert decide(cur, 1, 3 + MAX_GAP + 2) is Verdict.JUMP
    assert decide(cur, 1, (1 << 64) - 1) is Verdict.JUMP
    cur.repairing = "snapshot"
    assert decide(cur, 1, (1 << 64) - 1) is Verdict.JUMP  # never held, even while repairing
    # What the instance is known to have published counts as much as what is applied: joining a
    # worker at seq 10**6 (its heartbeat said so, or its first batch is held) holds what follows.
    cur.target = 10**6
    assert cur.known() == 10**6 and decide(cur, 1, 10**6 + 1) is Verdict.BUFFER
    cur.target = 0
    cur.buffer[10**6] = object()
    assert decide(cur, 1, 10**6 + 1) is Verdict.BUFFER
    assert decide(cur, 1, 10**6 + MAX_GAP + 2) is Verdict.JUMP
