"""Decoded forms of the wire messages (see docs/wire.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Final, Literal

from msgspec import Meta, Struct

from kvindex.wire.groups import GroupSpec

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


# Decoded event batches are msgspec Structs: msgspec validates types and ranges in C while decoding,
# about 3.5x faster than decoding to dicts and checking them in Python.
TierName = Literal["gpu", "cpu", "disk", "shared"]
# msgpack cannot carry an int above 2**64-1, so only the lower bound needs checking.
U64 = Annotated[int, Meta(ge=0)]


# A KV-cache group of a hybrid-attention model (docs/wire.md §8); 0 for models with one cache.
Group = Annotated[int, Meta(ge=0, le=1023)]


class Stored(Struct, tag_field="type", tag="stored", gc=False):
    """The worker now holds ``keys`` (a chain, in order) on ``tier`` in KV-cache ``group``;
    ``parent`` precedes keys[0]."""

    tier: TierName
    keys: list[U64]
    parent: U64 | None = None
    group: Group = 0
    op: ClassVar[int] = STORED


class Removed(Struct, tag_field="type", tag="removed", gc=False):
    tier: TierName
    keys: list[U64]
    group: Group = 0
    op: ClassVar[int] = REMOVED
    parent: ClassVar[None] = None


class Cleared(Struct, tag_field="type", tag="cleared", gc=False):
    """Every block on ``tier`` is gone (every tier when None), in every KV-cache group."""

    tier: TierName | None = None
    op: ClassVar[int] = CLEARED
    keys: ClassVar[tuple[int, ...]] = ()
    parent: ClassVar[None] = None
    group: ClassVar[int] = 0


Event = Stored | Removed | Cleared


MAX_MODEL_LEN: Final = 512
WorkerId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
ModelName = Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_LEN)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
DpRank = Annotated[int, Meta(ge=0, le=1 << 16)]


class EventBatch(Struct, gc=False):
    v: int
    # A WorkerId: its pattern is checked by kvindex.wire.codec.decode_batch once per distinct worker
    # (a regex per batch was 0.45 us, half the decoding), not by the type.
    worker: str
    model: ModelName
    epoch: U64
    seq: Annotated[int, Meta(ge=1)]
    ts: float
    block_size: BlockSize
    events: list[Event]
    dp_rank: DpRank = 0

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
class HeartbeatReport:
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
    # (prompt tokens, cached tokens, measured prefill ms) since the previous heartbeat.
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    # Where routers send this instance's requests (``host:port``); None when not announced or
    # malformed, and then ``endpoint_error`` says what was wrong with it.
    endpoint: str | None = None
    endpoint_error: str | None = None
    # False: a worker without KV events (heartbeats only): its cache is predicted, not reported.
    events: bool = True
    # Prefill/decode disaggregation (kvindex/wire/role.py): "prefill", "decode" or "both" (absent or
    # malformed), and the KV-transfer group (None: none). ``role_error`` says what was malformed.
    role: str = "both"
    pd_group: str | None = None
    role_error: str | None = None
    # KV-cache groups (docs/wire.md §8): None when not announced (one full-attention group) or
    # malformed, and then ``groups_error`` says what was wrong with them.
    groups: tuple[GroupSpec, ...] | None = None
    groups_error: str | None = None

    @property
    def instance(self) -> tuple[str, int]:
        return (self.worker, self.dp_rank)
