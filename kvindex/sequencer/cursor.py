"""Per-instance ordering of event batches: epoch + seq admission decisions, and the repair buffer.

Each (worker, dp_rank) publishes batches numbered 1, 2, 3... within an epoch chosen at worker start.
``decide`` says what an arriving batch means for the index; the consumer acts on it (apply, drop,
buffer while a repair runs). Keeping the decision pure makes it testable and reusable by offline
replay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from sortedcontainers import SortedDict

from kvindex.instance import InstanceKey

# Epochs a worker has left behind; a late batch from one of them is stale, not a new restart.
_RETIRED_EPOCHS_KEPT = 8

# The most batches a hole may miss. A seq further ahead than this of what the instance is known to
# have published is a jump, not a hole: a restart that kept its epoch, or a lie (seq 1, then
# 2**64 - 1). No replay can fill a hole that wide (a kvshim worker keeps its last 1,024 batches for
# replays, the index holds at most --max-held-batches, 4,096, while repairing), so the instance is
# resynchronised from a snapshot instead, and the width is not counted as missing batches (summed
# over instances it made counters pass u64 and Stats fail).
MAX_GAP: Final = 1 << 16


class Verdict(Enum):
    APPLY = "apply"  # next in order
    FIRST = "first"  # first batch ever seen from this instance
    NEW_EPOCH = "new_epoch"  # worker restarted: its earlier blocks are gone
    GAP = "gap"  # batches are missing before this one
    BUFFER = "buffer"  # a repair is running: hold the batch until it is done
    DUPLICATE = "duplicate"  # already applied (redelivery, replay overlap)
    STALE_EPOCH = "stale_epoch"  # late batch from an epoch the worker already left
    JUMP = "jump"  # more than MAX_GAP batches ahead of what is known: refuse it, resync by snapshot


@dataclass(slots=True)
class Cursor:
    epoch: int
    applied: int = 0  # last seq applied to the index (or covered by a snapshot)
    # Why batches are being held back, or None when the instance is in sync.
    repairing: str | None = None
    repair_started: float = 0.0
    rounds: int = 0  # repair requests since the instance was last in sync
    cause: str = ""  # what started the current repair
    target: int = 0  # highest seq the worker is known to have published (from heartbeats)
    behind: int = 0  # a heartbeat's seq not yet applied, awaiting confirmation (unordered sources)
    buffer: SortedDict = field(default_factory=SortedDict)  # seq -> decoded batch
    held_keys: int = 0  # block keys in ``buffer`` (bounded by the consumer's limits)
    retired: deque[int] = field(default_factory=lambda: deque(maxlen=_RETIRED_EPOCHS_KEPT))
    closed: bool = False  # replaced by a new cursor or forgotten (whoever kept it can tell)

    def known(self) -> int:
        """The highest seq the instance is known to have published: applied, held or announced."""
        held = self.buffer.keys()[-1] if self.buffer else 0
        return max(self.applied, self.target, held)

    def hole(self) -> tuple[int, int] | None:
        """The seqs missing between what is applied and the first buffered batch, if any."""
        if not self.buffer:
            return None
        first = self.buffer.keys()[0]
        return (self.applied + 1, first - 1) if first > self.applied + 1 else None


def decide(cursor: Cursor | None, epoch: int, seq: int) -> Verdict:
    """What batch (epoch, seq) means given the instance's cursor. Pure."""
    if cursor is None:
        return Verdict.FIRST
    if epoch != cursor.epoch:
        return Verdict.STALE_EPOCH if epoch in cursor.retired else Verdict.NEW_EPOCH
    if seq <= cursor.applied or seq in cursor.buffer:
        return Verdict.DUPLICATE
    if seq - cursor.applied > MAX_GAP + 1 and seq - cursor.known() > MAX_GAP + 1:  # (first test: cheap)
        return Verdict.JUMP
    if cursor.repairing is not None:
        return Verdict.BUFFER
    return Verdict.APPLY if seq == cursor.applied + 1 else Verdict.GAP


class Sequencer:
    """The cursors of all instances."""

    def __init__(self) -> None:
        self._cursors: dict[InstanceKey, Cursor] = {}
        # Instances opened since the periodic reconciliation last looked (``take_opened``), so that
        # it schedules new instances without walking every cursor each tick.
        self._opened: dict[InstanceKey, None] = {}
        # Instances whose cursor is being repaired: the repair limit is checked at every repair
        # start, and counting over every cursor made that O(instances).
        self._repairing: set[InstanceKey] = set()

    def cursor(self, instance: InstanceKey) -> Cursor | None:
        return self._cursors.get(instance)

    def cursors(self) -> dict[InstanceKey, Cursor]:
        return self._cursors

    def forget(self, instance: InstanceKey) -> None:
        old = self._cursors.pop(instance, None)
        if old is not None:
            old.closed = True
        self._opened.pop(instance, None)
        self._repairing.discard(instance)

    def set_repairing(self, instance: InstanceKey, cursor: Cursor, how: str | None) -> None:
        """``cursor.repairing = how``, counted (``repairs``)."""
        cursor.repairing = how
        if how is None:
            self._repairing.discard(instance)
        elif self._cursors.get(instance) is cursor:
            self._repairing.add(instance)

    def repairs(self) -> int:
        """Instances being repaired now."""
        return len(self._repairing)

    def repairing(self) -> AbstractSet[InstanceKey]:
        """The instances being repaired now (a view: not to be changed)."""
        return self._repairing

    def take_opened(self) -> list[InstanceKey]:
        """The instances opened (first or again) since the last call, oldest first."""
        opened, self._opened = list(self._opened), {}
        return opened

    def open(self, instance: InstanceKey, epoch: int, applied: int = 0) -> Cursor:
        """Start (or restart, retiring the old epoch) the cursor of an instance at ``epoch``."""
        old = self._cursors.get(instance)
        cursor = Cursor(epoch, applied)
        if old is not None:
            old.closed = True
            cursor.retired = old.retired
            if old.epoch != epoch:
                cursor.retired.append(old.epoch)
        self._cursors[instance] = cursor
        self._opened[instance] = None
        self._repairing.discard(instance)  # a new cursor starts in sync
        return cursor
