"""The wire contract: subjects, message schema and codec (docs/wire.md is the normative text)."""

from kvindex.wire.codec import (
    DEFAULT_LIMITS,
    Limits,
    decode_batch,
    decode_status,
    encode_batch,
    encode_status,
    event_to_wire,
)
from kvindex.wire.errors import WireError
from kvindex.wire.schema import (
    CLEARED,
    CPU,
    DISK,
    GPU,
    LOCAL_TIERS,
    REMOVED,
    SHARED,
    STORED,
    TIER_BY_NAME,
    TIER_NAMES,
    Event,
    EventBatch,
    Load,
    StatusReport,
)
from kvindex.wire.subjects import Subjects, valid_worker_id

__all__ = [
    "CLEARED",
    "CPU",
    "DEFAULT_LIMITS",
    "DISK",
    "GPU",
    "LOCAL_TIERS",
    "REMOVED",
    "SHARED",
    "STORED",
    "TIER_BY_NAME",
    "TIER_NAMES",
    "Event",
    "EventBatch",
    "Limits",
    "Load",
    "StatusReport",
    "Subjects",
    "WireError",
    "decode_batch",
    "decode_status",
    "encode_batch",
    "encode_status",
    "event_to_wire",
    "valid_worker_id",
]
