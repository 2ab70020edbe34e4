"""msgpack encoding and strict decoding of event batches and heartbeats.

Decoding validates everything the index relies on and raises WireError (with a reason used as a
metric label) instead of letting a bad message reach the index: a message is accepted whole or not
at all. Validation happens inside msgspec's typed decoder (in C); its messages name the offending
path, e.g. ``Expected `int` >= 0 - at `$.events[0].keys[1]```. Unknown fields are ignored so that
newer publishers keep working with older indexes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec
from msgspec import Meta, Raw, Struct

from kvindex.wire.endpoint import BadEndpoint, parse_endpoint
from kvindex.wire.errors import (
    BAD_TYPE,
    BAD_VALUE,
    MALFORMED,
    MISSING_FIELD,
    NOT_A_MAP,
    OVERSIZE,
    SUBJECT_MISMATCH,
    TOO_DEEP,
    UNSUPPORTED_VERSION,
    WireError,
)
from kvindex.wire.groups import GroupSpec, LayoutError, parse_groups
from kvindex.wire.role import BOTH, BadRole, check_group, check_role
from kvindex.wire.schema import (
    CLEARED,
    OP_NAMES,
    STORED,
    TIER_BY_NAME,
    TIER_NAMES,
    U64,
    WIRE_VERSION,
    BlockSize,
    DpRank,
    EventBatch,
    HeartbeatReport,
    Load,
    ModelName,
    TierName,
    WorkerId,
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a single batch must respect; larger batches are rejected as ``oversize``."""

    max_events: int = 16_384
    max_keys: int = 131_072


DEFAULT_LIMITS = Limits()
MAX_PREFILL_SAMPLES = 1024


_NOT_SENT = Raw(b"")


class _HeartbeatMsg(Struct, gc=False):
    v: int
    worker: WorkerId
    model: ModelName
    epoch: U64
    seq: U64
    ts: float
    block_size: BlockSize
    dp_rank: DpRank = 0
    load: dict[str, int | float] = {}
    capacity: dict[TierName, U64] = {}
    digest: dict[TierName, tuple[U64, U64]] = {}
    # Prefills measured since the last heartbeat: [prompt tokens, cached tokens, ms].
    prefill: Annotated[list[tuple[U64, U64, float]], Meta(max_length=MAX_PREFILL_SAMPLES)] = []
    # Optional and checked after decoding (any type gets through here): a malformed endpoint must
    # not cost the heartbeat's load and digest, so it is dropped alone (see _endpoint).
    endpoint: Any = None
    # False: the worker publishes no KV events (heartbeats only); the index predicts its cache from
    # its own routing decisions (kvindex/scoring/approximate.py).
    events: bool = True
    # Prefill/decode disaggregation: checked after decoding like the endpoint (see _role).
    role: Any = None
    pd_group: Any = None
    # KV-cache groups (docs/wire.md §8): bytes, parsed once per distinct layout (see _groups).
    groups: Raw = _NOT_SENT


class HeartbeatPeek(Struct, gc=False):
    """A heartbeat with its maps left undecoded (``Raw``: their bytes, absent -> ``_NOT_SENT``).

    A worker's heartbeats mostly repeat the previous one's capacity, digest and endpoint; comparing
    those as bytes (``decode_heartbeat_into``) spares building them again at every heartbeat. Only for
    that comparison: worker, model, block size and rank are not validated here (the worker's
    pattern alone costs more than the rest of the decoding), so a peek may be used only where they
    equal those of a heartbeat decode_heartbeat accepted; the other fields are typed as in _HeartbeatMsg.
    """

    v: int
    worker: str
    model: str
    epoch: U64
    seq: U64
    ts: float
    block_size: int
    dp_rank: int = 0
    load: Raw = _NOT_SENT
    capacity: Raw = _NOT_SENT
    digest: Raw = _NOT_SENT
    prefill: Annotated[list[tuple[U64, U64, float]], Meta(max_length=MAX_PREFILL_SAMPLES)] = []
    endpoint: Any = None
    events: bool = True
    role: Any = None
    pd_group: Any = None
    groups: Raw = _NOT_SENT


class _CheckedBatch(EventBatch, gc=False):
    """An EventBatch whose worker id is checked by the type, as every other field is: decodes the
    batches of a worker id not seen valid yet, and names the first error of a malformed batch."""

    worker: WorkerId


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_checked_decoder = msgspec.msgpack.Decoder(_CheckedBatch)
# Worker ids a batch of which the checked type accepted. Whether an id matches the pattern depends on
# the string alone, so one check per distinct id is enough; the set is emptied when full (a fleet
# larger than this only checks some ids again), which bounds it to ~20 MB of typical ids.
_valid_workers: set[str] = set()
VALID_WORKERS_MAX = 1 << 18
_heartbeat_decoder = msgspec.msgpack.Decoder(_HeartbeatMsg)
peek_decoder = msgspec.msgpack.Decoder(HeartbeatPeek)  # (peek_heartbeat without the checks; the consumer's)
_load_decoder = msgspec.msgpack.Decoder(dict[str, int | float])


def _subject_mismatch(worker: str, subject_worker: str) -> WireError:
    return WireError(
        SUBJECT_MISMATCH, f"envelope worker {worker!r} differs from subject worker {subject_worker!r}"
    )


def _unsupported(version: Any) -> WireError:
    return WireError(UNSUPPORTED_VERSION, f"wire version {version!r} is not supported (want {WIRE_VERSION})")


def too_deep() -> WireError:
    """The rejection of a message nested deeper than the decoder follows.

    msgspec's decoders recurse once per container level, unknown fields included (they are skipped
    by recursion too), and raise RecursionError at Python's recursion limit (1,000, less the stack in
    use; kvindex never raises it): that is the depth limit of every wire message, whose own
    structure nests 4 deep. Every decoder of worker bytes turns that RecursionError into this.
    """
    return WireError(
        TOO_DEEP, "containers nested deeper than the decoder follows (about 1,000 levels; a message needs 4)"
    )


def _decode_error(exc: msgspec.MsgspecError, payload: bytes) -> WireError:
    """Map a msgspec error to a rejection reason (keeping msgspec's message, which names the path)."""
    return decode_error(exc, payload, WIRE_VERSION, _unsupported)


def decode_error(
    exc: msgspec.MsgspecError,
    payload: bytes,
    version_expected: int,
    unsupported: Callable[[Any], WireError],
) -> WireError:
    """A typed msgspec decode failure as a rejection reason, for any message with a ``v`` field:
    garbage, another version (``unsupported``), a missing field, not a map, a bad type or value."""
    text = str(exc)
    # Typed decoding stops at the first value of the wrong type; look at the whole payload to tell
    # garbage from a well-formed message of the wrong shape, or of another wire version.
    try:
        generic = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as inner:
        return WireError(MALFORMED, f"payload is not valid msgpack ({inner})")
    except RecursionError:  # the typed decoder stopped before the deep part; this one reached it
        return too_deep()
    version = generic.get("v", version_expected) if isinstance(generic, dict) else version_expected
    if version != version_expected:
        return unsupported(version)
    if "missing required field" in text:
        reason = MISSING_FIELD
    elif text.startswith("Expected `object`, got"):
        reason = NOT_A_MAP
    elif ", got `" in text:
        reason = BAD_TYPE
    else:  # out of range, bad pattern or length, unknown tier or event type
        reason = BAD_VALUE
    return WireError(reason, text)


def decode_batch(
    payload: bytes, subject_worker: str | None = None, limits: Limits = DEFAULT_LIMITS
) -> EventBatch:
    """Decode and validate one event batch. Raises WireError.

    Accepts and rejects exactly what decoding with the checked type alone would (with its error):
    the batch is decoded without the worker id's pattern, which is checked by decoding with the
    checked type when the id was not seen valid before, or when anything is wrong."""
    try:
        batch = _batch_decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise _batch_rejection(payload, exc) from None
    if batch.worker not in _valid_workers:
        try:
            _checked_decoder.decode(payload)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise _batch_rejection(payload, exc) from None
        if len(_valid_workers) >= VALID_WORKERS_MAX:
            _valid_workers.clear()
        _valid_workers.add(batch.worker)
    if batch.v != WIRE_VERSION:
        raise _unsupported(batch.v)
    if subject_worker is not None and batch.worker != subject_worker:
        raise _subject_mismatch(batch.worker, subject_worker)
    events = batch.events
    if len(events) > limits.max_events:
        raise WireError(OVERSIZE, f"batch has {len(events)} events, limit is {limits.max_events}")
    # Every key takes at least one byte, so only a payload longer than the limit needs counting.
    if len(payload) > limits.max_keys:
        total_keys = sum([len(ev.keys) for ev in events])
        if total_keys > limits.max_keys:
            raise WireError(OVERSIZE, f"batch has {total_keys} keys, limit is {limits.max_keys}")
    return batch


def batch_fast_path() -> tuple[Callable[[bytes], EventBatch], set[str]]:
    """For a caller that inlines decode_batch's common case (kvindex/ingest/consumer.py): the
    decoder without the worker id's pattern and the ids seen valid (read only). A batch it decodes
    whose worker is in the set, of version WIRE_VERSION, equal to the subject's and within the
    limits without counting keys (events <= max_events, payload <= max_keys bytes) is what
    decode_batch returns; anything else must go through decode_batch."""
    return _batch_decoder.decode, _valid_workers


def _batch_rejection(payload: bytes, exc: BaseException) -> WireError:
    """Why a batch is rejected: the first error in the payload as the checked type finds it (a bad
    worker id may come before the error the unchecked type stopped at)."""
    try:
        _checked_decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as checked:
        exc = checked
    if isinstance(exc, RecursionError):
        return too_deep()
    assert isinstance(exc, msgspec.MsgspecError)
    return _decode_error(exc, payload)


_LOAD_INTS = ("running", "waiting", "waiting_prefill_tokens")


def _load(raw: dict[str, int | float]) -> Load:
    load = Load()
    for name, value in raw.items():
        if name in _LOAD_INTS:
            if type(value) is not int:
                raise WireError(BAD_TYPE, f"Expected `int`, got `float` - at `$.load.{name}`")
            if value < 0:
                raise WireError(BAD_VALUE, f"Expected `int` >= 0 - at `$.load.{name}`")
            setattr(load, name, value)
        elif name == "kv_usage":
            if not 0.0 <= value <= 1.0:
                raise WireError(BAD_VALUE, f"Expected a number in [0, 1], got {value} - at `$.load.kv_usage`")
            load.kv_usage = float(value)
        else:
            load.extra[name] = float(value)
    return load


def decode_heartbeat(payload: bytes, subject_worker: str | None = None) -> HeartbeatReport:
    """Decode and validate one heartbeat. Raises WireError."""
    try:
        msg = _heartbeat_decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise _decode_error(exc, payload) from None
    except RecursionError:
        raise too_deep() from None
    if msg.v != WIRE_VERSION:
        raise _unsupported(msg.v)
    if subject_worker is not None and msg.worker != subject_worker:
        raise _subject_mismatch(msg.worker, subject_worker)
    return HeartbeatReport(
        msg.worker,
        msg.model,
        msg.epoch,
        msg.seq,
        msg.ts,
        msg.block_size,
        msg.dp_rank,
        _load(msg.load),
        {TIER_BY_NAME[t]: n for t, n in msg.capacity.items()},
        {TIER_BY_NAME[t]: (c, x) for t, (c, x) in msg.digest.items()},
        msg.prefill,
        *_endpoint(msg.endpoint),
        msg.events,
        *_role(msg.role, msg.pd_group),  # type: ignore[arg-type]  # (mypy does not align star args)
        *_groups(msg.groups, msg.block_size),
    )


# Layouts by their bytes: every worker of a model sends the same one every second, parsed once.
_layouts: dict[tuple[bytes, int], tuple[tuple[GroupSpec, ...] | None, str | None]] = {}
_MAX_LAYOUTS = 256


def _groups(raw: Raw, block_size: int) -> tuple[tuple[GroupSpec, ...] | None, str | None]:
    """(groups, None) when valid or absent (None), (None, why) when malformed: the heartbeat is
    applied without them (docs/wire.md §8)."""
    if not raw:
        return None, None
    key = (bytes(raw), block_size)
    known = _layouts.get(key)
    if known is None:
        try:
            known = (parse_groups(msgspec.msgpack.decode(key[0]), block_size), None)
        except (msgspec.MsgspecError, RecursionError):
            known = (None, "groups is not valid msgpack")
        except LayoutError as exc:
            known = (None, str(exc))
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.clear()
        _layouts[key] = known
    return known


def peek_heartbeat(payload: bytes) -> HeartbeatPeek | None:
    """The heartbeat with its maps undecoded; None when it does not decode so (decode_heartbeat then
    says why) or when ``payload`` is not ``bytes`` (a ``Raw`` would point into a buffer its owner
    may reuse, and then compare equal to its own next message)."""
    if type(payload) is not bytes:
        return None
    try:
        return peek_decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError):
        return None


# Never the first byte of a msgpack value: marks an absent map in HeartbeatMemory.maps, so that no
# concatenation of present ones can equal it (msgpack values delimit themselves).
_ABSENT = b"\xc1"


def _maps_of(peek: HeartbeatPeek) -> bytes:
    """The load, capacity, digest and groups' bytes, one after the other (absent: _ABSENT)."""
    return b"".join(
        (peek.load or _ABSENT, peek.capacity or _ABSENT, peek.digest or _ABSENT, peek.groups or _ABSENT)
    )


class HeartbeatMemory:
    """What a heartbeat decode_heartbeat accepted leaves for the next one of its instance: the bytes of
    its maps (a copy: a peek's would hold its whole payload), where the load's bytes end in them,
    and its report, which ``decode_heartbeat_into`` updates in place."""

    __slots__ = ("endpoint", "maps", "report", "role", "split")

    def __init__(self, peek: HeartbeatPeek, report: HeartbeatReport) -> None:
        self.renew(peek, report)

    def renew(self, peek: HeartbeatPeek, report: HeartbeatReport) -> None:
        """``report`` is decode_heartbeat's result for the heartbeat ``peek`` was taken from."""
        self.report = report
        self.maps = _maps_of(peek)
        self.split = len(peek.load) or 1
        self.endpoint = peek.endpoint
        self.role = (peek.role, peek.pd_group)


class _KnownLoad(Struct, forbid_unknown_fields=True, gc=False):
    """A load of the four known fields, as _load accepts them (other names: _load itself)."""

    running: U64 = 0
    waiting: U64 = 0
    waiting_prefill_tokens: U64 = 0
    kv_usage: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


_known_load_decoder = msgspec.msgpack.Decoder(_KnownLoad)


def load_of(raw: bytes) -> Load | None:
    """The Load of a heartbeat's load map, as decode_heartbeat makes it; None if it rejects it."""
    try:
        k = _known_load_decoder.decode(raw)  # typed in C: a third of _load's cost
    except (msgspec.MsgspecError, RecursionError):
        try:
            return _load(_load_decoder.decode(raw))
        except (msgspec.MsgspecError, WireError, RecursionError):
            return None
    return Load(k.running, k.waiting, k.waiting_prefill_tokens, k.kv_usage)


def decode_heartbeat_into(peek: HeartbeatPeek, memory: HeartbeatMemory) -> bool:
    """Make ``memory.report`` what decode_heartbeat returns for the heartbeat ``peek`` was taken from:
    True then; False, and the memory untouched, when that needs the full decoder (capacity or
    digest changed: rare; or a load that does not decode, which decode_heartbeat then names).
    Capacity and digest stay the same objects, and the load too when its bytes are the same: a
    steady heartbeat builds nothing that outlives it.

    The caller checks that ``peek`` has decode_heartbeat's ``v``, worker (the subject's), model, block
    size and rank: those of the report's heartbeat.
    """
    maps = _maps_of(peek)
    report = memory.report
    if maps == memory.maps:  # one comparison for the three maps: the steady state
        load = report.load
    else:
        split = len(peek.load) or 1
        if maps[split:] != memory.maps[memory.split :]:
            return False  # capacity, digest or groups
        fresh = load_of(maps[:split]) if peek.load else Load()  # (not sent: the defaults)
        if fresh is None:
            return False
        load = fresh
        memory.maps, memory.split = maps, split
    endpoint = peek.endpoint
    # parse_endpoint depends on the string alone: the same string needs no second look.
    if endpoint is None or type(endpoint) is not str or endpoint != memory.endpoint:
        report.endpoint, report.endpoint_error = _endpoint(endpoint)
        memory.endpoint = endpoint
    role = (peek.role, peek.pd_group)
    if role != memory.role:  # (both absent, or the same strings: nothing to check again)
        report.role, report.pd_group, report.role_error = _role(*role)
        memory.role = role
    report.epoch = peek.epoch
    report.seq = peek.seq
    report.ts = peek.ts
    report.load = load
    report.prefill = peek.prefill
    report.events = peek.events
    return True


def _endpoint(raw: Any) -> tuple[str | None, str | None]:
    """(endpoint, None) when valid or absent, (None, why) when malformed."""
    if raw is None:
        return None, None
    try:
        parse_endpoint(raw)
    except BadEndpoint as exc:
        return None, str(exc)
    return raw, None


def _role(role: Any, group: Any) -> tuple[str, str | None, str | None]:
    """(role, group, None) when valid or absent; (both, None, why) when either is malformed: an
    instance whose role cannot be read serves whole requests, as one that announces none."""
    try:
        checked = BOTH if role is None else check_role(role)
        return checked, (None if group is None else check_group(group)), None
    except BadRole as exc:
        return BOTH, None, str(exc)


# --- encoding (publishers, tests, tools) -------------------------------------------------------


def _packb(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def event_to_wire(
    op: int, tier: int | None, keys: Iterable[int] = (), parent: int | None = None, group: int = 0
) -> dict[str, Any]:
    if op == CLEARED:
        return {"type": "cleared", "tier": None if tier is None else TIER_NAMES[tier]}
    out: dict[str, Any] = {"type": OP_NAMES[op], "tier": TIER_NAMES[tier], "keys": list(keys)}  # type: ignore[index]
    if op == STORED:
        out["parent"] = parent
    if group:
        out["group"] = group
    return out


def encode_batch(
    *,
    worker: str,
    model: str,
    epoch: int,
    seq: int,
    ts: float,
    block_size: int,
    events: list[dict[str, Any]],
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


def encode_heartbeat(
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
        "block_size": block_size,
        "dp_rank": dp_rank,
        "capacity": dict(capacity),
        "digest": {tier: [count, xor] for tier, (count, xor) in digest.items()},
    }
    msg.update(extra)
    # ts and load last (any order is valid): what changes between two heartbeats of a steady worker
    # is then the payload's tail, which the index compares and decodes alone (consumer._Repeat).
    msg.pop("ts", None)
    msg.pop("load", None)
    msg["ts"] = ts
    msg["load"] = dict(load)
    return _packb(msg)
