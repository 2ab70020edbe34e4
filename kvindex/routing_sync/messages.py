"""The routing-sync message on ``{prefix}.routing.{replica_id}`` (docs/wire.md §7): schema, encoding
and strict decoding.

One msgpack map per NATS message carries a replica's routing decisions in the order it made them:
``commit`` (a request placed on an instance) and ``release`` (its prefill done, or finished).
Decoding validates everything the receiving replica relies on, inside msgspec's typed decoder, and
raises WireError with a reason (a metric label, as for event batches): a message is applied whole or
not at all. Unknown fields are ignored, so newer replicas can add some.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta, Struct

from kvindex.wire.codec import decode_error, too_deep
from kvindex.wire.errors import (
    SUBJECT_MISMATCH,
    UNSUPPORTED_VERSION,
    WireError,
)
from kvindex.wire.schema import U64, BlockSize, DpRank, ModelName, WorkerId

SYNC_VERSION: Final = 1
MAX_OPS: Final = 4096  # per message
MAX_KEYS: Final = 16_384  # per commit: a longer prompt's keys are cut to this prefix by the sender
MAX_REQUEST_ID: Final = 1024  # characters; longer ids are not shared (counted by the sender)
MAX_SPEC_TTL: Final = 3600.0

ReplicaId = WorkerId  # same rule: it is the last token of the subject
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID)]
PolicyName = Annotated[str, Meta(max_length=64)]


class CommitOp(Struct, tag_field="op", tag="commit", gc=False, omit_defaults=True):
    """Request ``id`` was sent to instance ``worker/dp_rank``, as ``policy`` decided."""

    id: RequestId  # "" when the router gave none: nothing to release later, no ledger entry
    model: ModelName
    worker: WorkerId
    dp_rank: DpRank
    block_size: BlockSize
    prompt_tokens: U64
    miss_tokens: U64  # prefill work the deciding replica expected there
    policy: PolicyName
    role: Literal["prefill", "decode"] = "prefill"
    spec_ttl: Annotated[float, Meta(ge=0.0, le=MAX_SPEC_TTL)] = 0.0  # speculative keys' lifetime (s)
    keys: Annotated[list[U64], Meta(max_length=MAX_KEYS)] = []  # the prompt's block keys


class ReleaseOp(Struct, tag_field="op", tag="release", gc=False):
    id: Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID)]
    phase: Literal["prefill", "finished"]


Op = CommitOp | ReleaseOp


class Header(Struct, gc=False):
    v: int
    replica: ReplicaId
    epoch: U64


class RoutingMessage(Struct, gc=False):
    v: int
    replica: ReplicaId  # must equal the subject's last token
    epoch: U64  # chosen at replica start: tells a restart, or two replicas given the same id, apart
    seq: Annotated[int, Meta(ge=1)]  # 1, 2, 3, ... per epoch: a hole is a lost message
    ts: float  # sender wall time (s) of the message's oldest decision: the delay is measured from it
    ops: Annotated[list[Op], Meta(max_length=MAX_OPS)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RoutingMessage)
_header_decoder = msgspec.msgpack.Decoder(Header)


def encode(message: RoutingMessage) -> bytes:
    return _encoder.encode(message)


def op_size(op: Op) -> int:
    """Upper bound of an op's encoded size in bytes (to keep messages under the server's limit)."""
    if isinstance(op, ReleaseOp):
        return 40 + len(op.id) * 4
    return 200 + (len(op.id) + len(op.model) + len(op.worker)) * 4 + 9 * len(op.keys)


def _error(exc: msgspec.MsgspecError, payload: bytes) -> WireError:
    return decode_error(
        exc,
        payload,
        SYNC_VERSION,
        lambda v: WireError(UNSUPPORTED_VERSION, f"routing message version {v!r} is not {SYNC_VERSION}"),
    )


def header(payload: bytes) -> Header:
    """Only the sender's identity (cheap: the ops are skipped, not built). Raises WireError."""
    try:
        return _header_decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise _error(exc, payload) from None
    except RecursionError:
        raise too_deep() from None


def decode(payload: bytes, subject_replica: str | None = None) -> RoutingMessage:
    """Decode and validate one routing message. Raises WireError."""
    try:
        msg = _decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise _error(exc, payload) from None
    except RecursionError:
        raise too_deep() from None
    if msg.v != SYNC_VERSION:
        raise WireError(UNSUPPORTED_VERSION, f"routing message version {msg.v!r} is not {SYNC_VERSION}")
    if subject_replica is not None and msg.replica != subject_replica:
        raise WireError(
            SUBJECT_MISMATCH,
            f"envelope replica {msg.replica!r} differs from subject replica {subject_replica!r}",
        )
    return msg
