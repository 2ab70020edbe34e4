"""Why a message from the wire was rejected; each reason is a metric label."""

from __future__ import annotations

from typing import Final

MALFORMED: Final = "malformed_msgpack"
NOT_A_MAP: Final = "not_a_map"
MISSING_FIELD: Final = "missing_field"
BAD_TYPE: Final = "bad_type"
BAD_VALUE: Final = "bad_value"
UNSUPPORTED_VERSION: Final = "unsupported_version"
SUBJECT_MISMATCH: Final = "subject_mismatch"
BAD_SUBJECT: Final = "bad_subject"
OVERSIZE: Final = "oversize"
# Containers nested deeper than the decoder follows (msgspec recurses per level, up to Python's limit).
TOO_DEEP: Final = "too_deep"
BLOCK_SIZE_MISMATCH: Final = "block_size_mismatch"
MODEL_MISMATCH: Final = "model_mismatch"
# Not a rejection of the message: a heartbeat whose ``endpoint`` is malformed is applied without it.
BAD_ENDPOINT: Final = "bad_endpoint"
# Likewise: a heartbeat whose ``role`` or ``group`` is malformed is applied as role ``both``, no group.
BAD_ROLE: Final = "bad_role"
# Likewise: a heartbeat whose ``groups`` (KV-cache layout, docs/wire.md §8) is malformed is applied
# without them (the instance is approximate until a valid layout comes).
BAD_GROUPS: Final = "bad_groups"
# A layout other than the model's (its first announced): the instance's batches are refused.
GROUP_LAYOUT_MISMATCH: Final = "group_layout_mismatch"

REASONS: Final = (
    MALFORMED,
    NOT_A_MAP,
    MISSING_FIELD,
    BAD_TYPE,
    BAD_VALUE,
    UNSUPPORTED_VERSION,
    SUBJECT_MISMATCH,
    BAD_SUBJECT,
    OVERSIZE,
    TOO_DEEP,
    BLOCK_SIZE_MISMATCH,
    MODEL_MISMATCH,
    BAD_ENDPOINT,
    BAD_ROLE,
    BAD_GROUPS,
    GROUP_LAYOUT_MISMATCH,
)


class WireError(ValueError):
    """A message that breaks the wire contract. ``reason`` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"
