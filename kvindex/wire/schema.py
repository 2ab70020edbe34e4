"""Decoded forms of the wire messages (see docs/wire.md), kept small because the hot path builds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, NamedTuple

WIRE_VERSION: Final = 1

# Tier order is also preference order: a block present on several tiers of one instance is loaded
# from the fastest (lowest index).
GPU: Final = 0
CPU: Final = 1
DISK: Final = 2
SHARED: Final = 3
TIER_NAMES: Final = ("gpu", "cpu", "disk", "shared")
TIER_BY_NAME: Final = {name: i for i, name in enumerate(TIER_NAMES)}
LOCAL_TIERS: Final = (GPU, CPU, DISK)

# Event operations.
STORED: Final = 0
REMOVED: Final = 1
CLEARED: Final = 2
OP_NAMES: Final = ("stored", "removed", "cleared")
OP_BY_NAME: Final = {name: i for i, name in enumerate(OP_NAMES)}

U64_MAX: Final = (1 << 64) - 1


class Event(NamedTuple):
    """One event of a batch. ``tier`` is None only for a ``cleared`` of every tier."""

    op: int
    tier: int | None
    keys: list[int]
    parent: int | None = None


@dataclass(slots=True)
class EventBatch:
    worker: str
    model: str
    epoch: int
    seq: int
    ts: float
    block_size: int
    dp_rank: int
    events: list[Event]

    @property
    def instance(self) -> tuple[str, int]:
        return (self.worker, self.dp_rank)


@dataclass(slots=True)
class Load:
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    kv_usage: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class StatusReport:
    worker: str
    model: str
    epoch: int
    seq: int
    ts: float
    block_size: int
    dp_rank: int
    load: Load
    capacity: dict[int, int]
    # tier -> (count, xor of keys) over the worker's blocks after batch ``seq``.
    digest: dict[int, tuple[int, int]]

    @property
    def instance(self) -> tuple[str, int]:
        return (self.worker, self.dp_rank)
