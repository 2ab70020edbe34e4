"""msgpack encoding and strict decoding of event batches and status heartbeats.

Decoding validates everything the index relies on and raises WireError (with a reason used as a
metric label) instead of letting a bad message reach the index: a batch is applied whole or not at
all. Unknown fields are ignored so that newer publishers keep working with older indexes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvindex.wire.errors import (
    BAD_TYPE,
    BAD_VALUE,
    MALFORMED,
    MISSING_FIELD,
    NOT_A_MAP,
    OVERSIZE,
    SUBJECT_MISMATCH,
    UNSUPPORTED_VERSION,
    WireError,
)
from kvindex.wire.schema import (
    CLEARED,
    OP_BY_NAME,
    OP_NAMES,
    STORED,
    TIER_BY_NAME,
    TIER_NAMES,
    U64_MAX,
    WIRE_VERSION,
    Event,
    EventBatch,
    Load,
    StatusReport,
)
from kvindex.wire.subjects import valid_worker_id

MAX_MODEL_LEN = 512
MAX_BLOCK_SIZE = 1 << 20
MAX_DP_RANK = 1 << 16


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a single batch must respect; larger batches are rejected as ``oversize``."""

    max_events: int = 16_384
    max_keys: int = 131_072


DEFAULT_LIMITS = Limits()

_unpackb = msgpack.unpackb
_INT = int


def _unpack(payload: bytes) -> Any:
    try:
        return _unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise WireError(MALFORMED, f"payload is not valid msgpack ({type(exc).__name__}: {exc})") from None


def _field(msg: Mapping[str, Any], name: str) -> Any:
    try:
        return msg[name]
    except KeyError:
        raise WireError(MISSING_FIELD, f"missing field {name!r}") from None


def _u64(value: Any, name: str, minimum: int = 0, maximum: int = U64_MAX) -> int:
    if type(value) is not _INT:
        raise WireError(BAD_TYPE, f"field {name!r} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise WireError(BAD_VALUE, f"field {name!r}={value} is outside [{minimum}, {maximum}]")
    return value


def _number(value: Any, name: str) -> float:
    if type(value) is float or type(value) is _INT:
        return float(value)
    raise WireError(BAD_TYPE, f"field {name!r} must be a number, got {type(value).__name__}")


def _str(value: Any, name: str, max_len: int = MAX_MODEL_LEN) -> str:
    if type(value) is not str:
        raise WireError(BAD_TYPE, f"field {name!r} must be a string, got {type(value).__name__}")
    if not 0 < len(value) <= max_len:
        raise WireError(BAD_VALUE, f"field {name!r} must have 1..{max_len} characters")
    return value


def _key_list(value: Any, where: str) -> list[int]:
    if type(value) is not list:
        raise WireError(BAD_TYPE, f"{where}: 'keys' must be a list, got {type(value).__name__}")
    if value:
        # C-speed checks: every element an int (bool excluded) and none negative. msgpack cannot
        # carry an int above 2**64-1, so no upper-bound check is needed.
        if set(map(type, value)) != {_INT}:
            raise WireError(BAD_TYPE, f"{where}: every key must be an unsigned 64-bit integer")
        if min(value) < 0:
            raise WireError(BAD_VALUE, f"{where}: keys must be unsigned 64-bit integers")
    return value


def _tier(value: Any, where: str) -> int:
    tier = TIER_BY_NAME.get(value) if type(value) is str else None
    if tier is None:
        raise WireError(BAD_VALUE, f"{where}: 'tier' must be one of {list(TIER_NAMES)}, got {value!r}")
    return tier


def _envelope(msg: Any, subject_worker: str | None, kind: str) -> tuple[str, str, int, int]:
    if type(msg) is not dict:
        raise WireError(NOT_A_MAP, f"{kind} must be a msgpack map, got {type(msg).__name__}")
    version = _field(msg, "v")
    if version != WIRE_VERSION or type(version) is not _INT:
        raise WireError(
            UNSUPPORTED_VERSION, f"wire version {version!r} is not supported (want {WIRE_VERSION})"
        )
    worker = _field(msg, "worker")
    if not valid_worker_id(worker):
        raise WireError(BAD_VALUE, f"field 'worker'={worker!r} must match [A-Za-z0-9_-]{{1,128}}")
    if subject_worker is not None and worker != subject_worker:
        raise WireError(
            SUBJECT_MISMATCH, f"envelope worker {worker!r} differs from subject worker {subject_worker!r}"
        )
    model = _str(_field(msg, "model"), "model")
    epoch = _u64(_field(msg, "epoch"), "epoch")
    return worker, model, epoch, _u64(msg.get("dp_rank", 0), "dp_rank", 0, MAX_DP_RANK)


def decode_batch(
    payload: bytes, subject_worker: str | None = None, limits: Limits = DEFAULT_LIMITS
) -> EventBatch:
    """Decode and validate one event batch. Raises WireError."""
    msg = _unpack(payload)
    worker, model, epoch, dp_rank = _envelope(msg, subject_worker, "event batch")
    seq = _u64(_field(msg, "seq"), "seq", 1)
    ts = _number(_field(msg, "ts"), "ts")
    block_size = _u64(_field(msg, "block_size"), "block_size", 1, MAX_BLOCK_SIZE)
    raw_events = _field(msg, "events")
    if type(raw_events) is not list:
        raise WireError(BAD_TYPE, f"field 'events' must be a list, got {type(raw_events).__name__}")
    if len(raw_events) > limits.max_events:
        raise WireError(OVERSIZE, f"batch has {len(raw_events)} events, limit is {limits.max_events}")
    events: list[Event] = []
    total_keys = 0
    for i, ev in enumerate(raw_events):
        if type(ev) is not dict:
            raise WireError(NOT_A_MAP, f"events[{i}] must be a map, got {type(ev).__name__}")
        op = OP_BY_NAME.get(ev.get("type")) if type(ev.get("type")) is str else None
        if op is None:
            raise WireError(
                BAD_VALUE, f"events[{i}]: 'type' must be one of {list(OP_NAMES)}, got {ev.get('type')!r}"
            )
        where = f"events[{i}] ({OP_NAMES[op]})"
        if op == CLEARED:
            raw_tier = ev.get("tier")
            events.append(Event(CLEARED, None if raw_tier is None else _tier(raw_tier, where), []))
            continue
        tier = _tier(_field(ev, "tier"), where)
        keys = _key_list(_field(ev, "keys"), where)
        total_keys += len(keys)
        parent = None
        if op == STORED:
            parent = ev.get("parent")
            if parent is not None:
                parent = _u64(parent, f"{where}.parent")
        events.append(Event(op, tier, keys, parent))
    if total_keys > limits.max_keys:
        raise WireError(OVERSIZE, f"batch has {total_keys} keys, limit is {limits.max_keys}")
    return EventBatch(worker, model, epoch, seq, ts, block_size, dp_rank, events)


_LOAD_INTS = ("running", "waiting", "waiting_prefill_tokens")


def _load(raw: Any) -> Load:
    if raw is None:
        return Load()
    if type(raw) is not dict:
        raise WireError(BAD_TYPE, f"field 'load' must be a map, got {type(raw).__name__}")
    load = Load()
    for name in _LOAD_INTS:
        if name in raw:
            setattr(load, name, _u64(raw[name], f"load.{name}", 0, 1 << 62))
    if "kv_usage" in raw:
        usage = _number(raw["kv_usage"], "load.kv_usage")
        if not 0.0 <= usage <= 1.0:
            raise WireError(BAD_VALUE, f"field 'load.kv_usage'={usage} is outside [0, 1]")
        load.kv_usage = usage
    for name, value in raw.items():
        known = name in _LOAD_INTS or name == "kv_usage"
        if not known and type(name) is str and (type(value) is float or type(value) is _INT):
            load.extra[name] = float(value)
    return load


def _tier_map(raw: Any, name: str) -> dict[int, Any]:
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise WireError(BAD_TYPE, f"field {name!r} must be a map of tier -> value")
    return {_tier(tier, name): value for tier, value in raw.items()}


def decode_status(payload: bytes, subject_worker: str | None = None) -> StatusReport:
    """Decode and validate one status heartbeat. Raises WireError."""
    msg = _unpack(payload)
    worker, model, epoch, dp_rank = _envelope(msg, subject_worker, "status")
    seq = _u64(_field(msg, "seq"), "seq")
    ts = _number(_field(msg, "ts"), "ts")
    block_size = _u64(_field(msg, "block_size"), "block_size", 1, MAX_BLOCK_SIZE)
    capacity = {
        tier: _u64(value, f"capacity.{TIER_NAMES[tier]}")
        for tier, value in _tier_map(msg.get("capacity"), "capacity").items()
    }
    digest: dict[int, tuple[int, int]] = {}
    for tier, value in _tier_map(msg.get("digest"), "digest").items():
        tname = TIER_NAMES[tier]
        if type(value) not in (list, tuple) or len(value) != 2:
            raise WireError(BAD_TYPE, f"field 'digest.{tname}' must be [count, xor]")
        digest[tier] = (_u64(value[0], f"digest.{tname}.count"), _u64(value[1], f"digest.{tname}.xor"))
    return StatusReport(
        worker, model, epoch, seq, ts, block_size, dp_rank, _load(msg.get("load")), capacity, digest
    )


# --- encoding (publishers, tests, tools) -------------------------------------------------------


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def event_to_wire(op: int, tier: int | None, keys: Iterable[int] = (), parent: int | None = None) -> dict:
    if op == CLEARED:
        return {"type": "cleared", "tier": None if tier is None else TIER_NAMES[tier]}
    out: dict[str, Any] = {"type": OP_NAMES[op], "tier": TIER_NAMES[tier], "keys": list(keys)}  # type: ignore[index]
    if op == STORED:
        out["parent"] = parent
    return out


def encode_batch(
    *,
    worker: str,
    model: str,
    epoch: int,
    seq: int,
    ts: float,
    block_size: int,
    events: list[dict],
    dp_rank: int = 0,
) -> bytes:
    """Encode a batch whose events are already in wire form (see event_to_wire)."""
    return _packb(
        {
            "v": WIRE_VERSION,
            "worker": worker,
            "model": model,
            "epoch": epoch,
            "seq": seq,
            "ts": ts,
            "block_size": block_size,
            "dp_rank": dp_rank,
            "events": events,
        }
    )


def encode_status(
    *,
    worker: str,
    model: str,
    epoch: int,
    seq: int,
    ts: float,
    block_size: int,
    load: Mapping[str, float],
    capacity: Mapping[str, int],
    digest: Mapping[str, tuple[int, int]],
    dp_rank: int = 0,
    **extra: Any,
) -> bytes:
    msg: dict[str, Any] = {
        "v": WIRE_VERSION,
        "worker": worker,
        "model": model,
        "epoch": epoch,
        "seq": seq,
        "ts": ts,
        "block_size": block_size,
        "dp_rank": dp_rank,
        "load": dict(load),
        "capacity": dict(capacity),
        "digest": {tier: [count, xor] for tier, (count, xor) in digest.items()},
    }
    msg.update(extra)
    return _packb(msg)
