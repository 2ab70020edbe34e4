"""Per-instance ordering of event batches: epoch + seq admission decisions.

Each (worker, dp_rank) publishes batches numbered 1, 2, 3... within an epoch chosen at worker start.
The sequencer decides, for each arriving batch, whether the index may apply it. It only decides; the
consumer acts (apply, drop, clear on restart, and - in the repair layer - buffer and fetch missing
ranges). Keeping the decision pure makes it testable and reusable by offline replay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kvindex.index.base import InstanceKey

# Epochs a worker has left behind; a late batch from one of them is stale, not a new restart.
_RETIRED_EPOCHS_KEPT = 8


class Verdict(Enum):
    APPLY = "apply"  # next in order
    FIRST = "first"  # first batch ever seen from this instance
    NEW_EPOCH = "new_epoch"  # worker restarted: its earlier blocks are gone
    GAP = "gap"  # batches are missing before this one
    DUPLICATE = "duplicate"  # already applied (redelivery, replay overlap)
    STALE_EPOCH = "stale_epoch"  # late batch from an epoch the worker already left


@dataclass(frozen=True, slots=True)
class Admission:
    verdict: Verdict
    # Inclusive range of seqs known to be missing before this batch, if any.
    missing: tuple[int, int] | None = None

    @property
    def applies(self) -> bool:
        return self.verdict not in (Verdict.DUPLICATE, Verdict.STALE_EPOCH)


@dataclass(slots=True)
class Cursor:
    epoch: int
    last_seq: int
    retired: deque[int] = field(default_factory=lambda: deque(maxlen=_RETIRED_EPOCHS_KEPT))


_APPLY = Admission(Verdict.APPLY)
_DUPLICATE = Admission(Verdict.DUPLICATE)
_STALE = Admission(Verdict.STALE_EPOCH)


class Sequencer:
    def __init__(self) -> None:
        self._cursors: dict[InstanceKey, Cursor] = {}

    def cursor(self, instance: InstanceKey) -> Cursor | None:
        return self._cursors.get(instance)

    def forget(self, instance: InstanceKey) -> None:
        self._cursors.pop(instance, None)

    def restart(self, instance: InstanceKey, epoch: int, seq: int) -> None:
        """Move the cursor to a new epoch learnt out of band (a status heartbeat)."""
        cur = self._cursors.get(instance)
        if cur is None:
            self._cursors[instance] = Cursor(epoch, seq)
        elif cur.epoch != epoch:
            cur.retired.append(cur.epoch)
            cur.epoch, cur.last_seq = epoch, seq

    def skip_to(self, instance: InstanceKey, seq: int) -> tuple[int, int] | None:
        """Advance past batches known lost (heartbeat says seq was published); returns the range."""
        cur = self._cursors.get(instance)
        if cur is None or seq <= cur.last_seq:
            return None
        missing = (cur.last_seq + 1, seq)
        cur.last_seq = seq
        return missing

    def admit(self, instance: InstanceKey, epoch: int, seq: int) -> Admission:
        """Decide about batch (epoch, seq) and, when it applies, advance the cursor past it."""
        cur = self._cursors.get(instance)
        if cur is None:
            self._cursors[instance] = Cursor(epoch, seq)
            return Admission(Verdict.FIRST, (1, seq - 1) if seq > 1 else None)
        if epoch != cur.epoch:
            if epoch in cur.retired:
                return _STALE
            cur.retired.append(cur.epoch)
            cur.epoch = epoch
            cur.last_seq = seq
            return Admission(Verdict.NEW_EPOCH, (1, seq - 1) if seq > 1 else None)
        last = cur.last_seq
        if seq == last + 1:
            cur.last_seq = seq
            return _APPLY
        if seq <= last:
            return _DUPLICATE
        cur.last_seq = seq
        return Admission(Verdict.GAP, (last + 1, seq - 1))
