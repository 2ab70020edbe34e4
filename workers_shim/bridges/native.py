"""Decode engines' native KV-event payloads (msgpack) into one normalized form.

Shapes accepted (the engines' source and published event formats):

- outer batch as an array ``[ts, events, dp_rank?]`` (vLLM ``data_parallel_rank``, SGLang
  ``attn_dp_rank``, TRT-LLM) or as a map with ``ts``/``events`` and one of those rank names;
- inner events as tagged arrays (older vLLM, SGLang: ``["BlockStored", hashes, parent, tokens,
  block_size, lora_id, medium?, ...]``) or as maps with ``type`` (newer vLLM, TRT-LLM), trailing or
  default fields omitted, unknown fields ignored;
- TensorRT-LLM's pull-API dicts ``{event_id, data: {type: stored|removed|updated|created, ...},
  attention_dp_rank}``;
- hashes as unsigned 64-bit ints, signed 64-bit ints (SGLang, TRT-LLM: normalized to unsigned) or
  bytes (16/32-byte digests). Hashes are only ever compared with each other, never trusted as keys;
- medium strings mapped to tiers by the engine profile's table (``GPU``, ``CPU``, ``CPU_PINNED``,
  ``DISK``, ``STORAGE``, ``EXTERNAL``, …; absent = ``GPU``).

A batch that is not msgpack or not batch-shaped raises :class:`DecodeError`; a bad event inside a good
batch becomes an :class:`EventError` in place, so the rest of the batch still applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from workers_shim.bridges import extras as ex

Hash = int | bytes
_U64 = (1 << 64) - 1
_STORED = {"blockstored", "stored"}
_REMOVED = {"blockremoved", "removed"}
_CLEARED = {"allblockscleared", "cleared", "allcleared"}
_IGNORED = {"created", "updated"}
_LEVELS = {0: "gpu", 1: "cpu", 2: "disk"}  # TRT-LLM cache_level: primary, secondary (host), …


class DecodeError(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class NativeStored:
    """Blocks an engine stored, as it published them: engine hashes, not block keys. The translator
    keys them and the publisher sends them as the wire's ``stored`` event (``kvindex.wire.schema.Stored``)."""

    hashes: list[Hash]
    parent: Hash | None
    tokens: list[Any]  # token ids; empty for token-less placeholders (CPU offload)
    block_size: int  # as announced by the event; 0 when absent
    tier: str
    lora_name: str | None = None
    salt: str | None = None
    extras: list[bytes] | None = None  # encoded extra keys per block (docs/wire.md §1)
    group: int | None = None
    dp_rank: int | None = None
    synthetic_lora: bool = False  # lora_id without a name: keyed under "lora-id:N"
    # The group's kind and sliding window as vLLM >= 0.32 names them (kv_cache_spec_kind,
    # kv_cache_spec_sliding_window); TensorRT-LLM's pull API names the attention window instead.
    kind: str | None = None
    sliding_window: int | None = None
    attention_window: int | None = None


@dataclass(slots=True)
class NativeRemoved:
    """Blocks an engine no longer holds on a tier, by engine hash (on the wire: ``removed``)."""

    hashes: list[Hash]
    tier: str
    group: int | None = None
    dp_rank: int | None = None
    attention_window: int | None = None


@dataclass(slots=True)
class NativeCleared:
    """An engine dropped every block of a tier, or of every local tier (on the wire: ``cleared``)."""

    tier: str | None  # None: every local tier (gpu, cpu, disk)
    dp_rank: int | None = None


@dataclass(slots=True)
class Ignored:
    kind: str
    dp_rank: int | None = None
    attention_window: int | None = None  # TensorRT-LLM ``created``: one per attention window


@dataclass(slots=True)
class EventError:
    reason: str
    detail: str = ""
    dp_rank: int | None = None


NativeEvent = NativeStored | NativeRemoved | NativeCleared | Ignored | EventError


@dataclass(slots=True)
class Batch:
    ts: float
    dp_rank: int | None
    events: list[NativeEvent]


def _int(value: Any, what: str, *, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise DecodeError("bad_field", f"{what} must be an integer, got {type(value).__name__}")


def _str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise DecodeError("bad_field", f"{what} must be a string, got {type(value).__name__}")


def normalize_hash(value: Any) -> Hash:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64
    if isinstance(value, bytes | bytearray) and value:
        return bytes(value)
    raise DecodeError("bad_hash", f"block hash must be an integer or bytes, got {type(value).__name__}")


def _hashes(value: Any) -> list[Hash]:
    if not isinstance(value, list | tuple):
        raise DecodeError("bad_field", "block_hashes must be a list")
    return [normalize_hash(v) for v in value]


def _list(value: Any, what: str) -> list[Any] | tuple[Any, ...]:
    """An optional list field (None: empty); anything else is a bad field, not a TypeError later
    (a TRT-LLM block with ``tokens: 3`` escaped as TypeError: found by fuzzing)."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise DecodeError("bad_field", f"{what} must be a list, got {type(value).__name__}")
    return value


def _tokens(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise DecodeError("bad_field", "token_ids must be a list")
    if value and isinstance(value[0], list | tuple):
        # SGLang bigram pages (EAGLE): (token, next_token) pairs; the block holds the first of each.
        # Each pair must be a list: a map in its place raised KeyError here (found by fuzzing).
        if not all(isinstance(pair, list | tuple) and pair for pair in value):
            raise DecodeError("bad_field", "token pairs must be [token, next_token]")
        return [pair[0] for pair in value]
    return list(value)


class Decoder:
    """Stateless decoder; ``media`` maps upper-case medium strings to tiers."""

    def __init__(self, media: Mapping[str, str]) -> None:
        self.media = {k.upper(): v for k, v in media.items()}

    def tier(self, medium: Any) -> str:
        if medium is None:
            return "gpu"
        name = _str(medium, "medium")
        assert name is not None
        tier = self.media.get(name.upper())
        if tier is None:
            raise DecodeError("unknown_medium", name)
        return tier

    # -- batch ----------------------------------------------------------------------------------

    def decode(self, payload: bytes) -> Batch:
        try:
            obj = msgspec.msgpack.decode(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            raise DecodeError("malformed_msgpack", str(exc)) from None
        if isinstance(obj, list):
            if len(obj) < 2:
                raise DecodeError("bad_batch", f"batch array has {len(obj)} elements")
            ts, events = obj[0], obj[1]
            rank = obj[2] if len(obj) > 2 else None
        elif isinstance(obj, dict):
            ts, events = obj.get("ts", 0.0), obj.get("events")
            rank = None
            for name in ("data_parallel_rank", "attn_dp_rank", "dp_rank", "attention_dp_rank"):
                if obj.get(name) is not None:
                    rank = obj[name]
                    break
        else:
            raise DecodeError("bad_batch", f"batch is a {type(obj).__name__}")
        if not isinstance(events, list):
            raise DecodeError("bad_batch", "events is not a list")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise DecodeError("bad_batch", f"bad dp rank {rank!r}")
        if not isinstance(ts, int | float) or isinstance(ts, bool):
            ts = 0.0
        out: list[NativeEvent] = []
        for raw in events:
            try:
                out.extend(self.event(raw))
            except DecodeError as exc:
                out.append(EventError(exc.reason, exc.detail))
        return Batch(float(ts), rank, out)

    # -- events ---------------------------------------------------------------------------------

    def event(self, raw: Any) -> list[NativeEvent]:
        if isinstance(raw, list | tuple):
            if not raw:
                raise DecodeError("bad_event", "empty event array")
            tag = _str(raw[0], "event tag")
            kind = (tag or "").replace("_", "").lower()
            if kind in _STORED:
                return [self._stored_array(raw)]
            if kind in _REMOVED:
                if len(raw) < 2:
                    raise DecodeError("missing_field", "BlockRemoved without block_hashes")
                medium = raw[2] if len(raw) > 2 and not isinstance(raw[2], int) else None
                group = raw[3] if len(raw) > 3 else None
                return [NativeRemoved(_hashes(raw[1]), self.tier(medium), _int(group, "group_idx"))]
            if kind in _CLEARED:
                medium = raw[1] if len(raw) > 1 and isinstance(raw[1], str | bytes) else None
                return [NativeCleared(self.tier(medium) if medium is not None else None)]
            raise DecodeError("unknown_event_type", str(tag))
        if isinstance(raw, dict):
            tag = raw.get("type")
            if tag is None and isinstance(raw.get("data"), dict):
                return self._pull_api(raw)
            kind = (_str(tag, "type") or "").replace("_", "").lower()
            if kind in _STORED:
                return [self._stored_map(raw)]
            if kind in _REMOVED:
                if "block_hashes" not in raw:
                    raise DecodeError("missing_field", "BlockRemoved without block_hashes")
                group = _int(raw.get("group_idx"), "group_idx")
                return [NativeRemoved(_hashes(raw["block_hashes"]), self.tier(raw.get("medium")), group)]
            if kind in _CLEARED:
                medium = raw.get("medium")
                return [NativeCleared(self.tier(medium) if medium is not None else None)]
            if kind in _IGNORED:
                return [Ignored(kind)]
            raise DecodeError("unknown_event_type", str(tag))
        raise DecodeError("bad_event", f"event is a {type(raw).__name__}")

    def _stored_array(self, raw: list[Any] | tuple[Any, ...]) -> NativeStored:
        if len(raw) < 5:
            raise DecodeError("missing_field", f"BlockStored array has {len(raw)} fields")
        lora_id = _int(raw[5], "lora_id") if len(raw) > 5 else None
        medium = raw[6] if len(raw) > 6 else None
        lora_name = salt = None
        extra_keys = None
        group = None
        # Position 7 onwards: vLLM lora_name, extra_keys, group_idx, kv_cache_spec_kind, …;
        # SGLang's BlockStoredWithMetadata appends a map {cache_salt}. Told apart by type.
        for pos in range(7, len(raw)):
            value = raw[pos]
            if isinstance(value, dict):
                salt = _str(value.get("cache_salt"), "cache_salt") or salt
                lora_name = _str(value.get("lora_name"), "lora_name") or lora_name
            elif pos == 7 and isinstance(value, str | bytes):
                lora_name = _str(value, "lora_name")
            elif pos == 8 and isinstance(value, list | tuple):
                extra_keys = value
            elif pos == 9 and isinstance(value, int) and not isinstance(value, bool):
                group = value
        ev = self._stored(
            raw[1], raw[2], raw[3], raw[4], lora_id, medium, lora_name, salt, extra_keys, group, None, None
        )
        # vLLM >= 0.32 arrays go on with kv_cache_spec_kind, kv_cache_spec_sliding_window.
        if len(raw) > 10:
            ev.kind = _str(raw[10], "kv_cache_spec_kind")
        if len(raw) > 11:
            ev.sliding_window = _int(raw[11], "kv_cache_spec_sliding_window")
        return ev

    def _stored_map(self, raw: dict[str, Any]) -> NativeStored:
        if "block_hashes" not in raw:
            raise DecodeError("missing_field", "BlockStored without block_hashes")
        metadata = raw.get("metadata")
        salt = raw.get("cache_salt")
        if salt is None and isinstance(metadata, dict):
            salt = metadata.get("cache_salt")
        ev = self._stored(
            raw["block_hashes"],
            raw.get("parent_block_hash", raw.get("parent_hash")),
            raw.get("token_ids"),
            raw.get("block_size", 0),
            _int(raw.get("lora_id"), "lora_id"),
            raw.get("medium"),
            _str(raw.get("lora_name"), "lora_name"),
            _str(salt, "cache_salt"),
            raw.get("extra_keys"),
            _int(raw.get("group_idx"), "group_idx"),
            raw.get("mm_keys"),
            raw.get("block_mm_infos"),
        )
        ev.kind = _str(raw.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        ev.sliding_window = _int(raw.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window")
        return ev

    def _stored(
        self,
        hashes_raw: Any,
        parent_raw: Any,
        tokens_raw: Any,
        block_size: Any,
        lora_id: int | None,
        medium: Any,
        lora_name: str | None,
        salt: str | None,
        extra_keys: Any,
        group: int | None,
        mm_keys: Any,
        block_infos: Any,
    ) -> NativeStored:
        hashes = _hashes(hashes_raw)
        parent = None if parent_raw is None else normalize_hash(parent_raw)
        bs = _int(block_size, "block_size") or 0
        n = len(hashes)
        info = ex.from_vllm(extra_keys, n, lora_name, lora_id, parent is None)
        lora = lora_name or info.lora_name
        synthetic = False
        if lora is None and lora_id is not None:
            # Adapter ids are per process; without a name the blocks still must not pass for the base
            # model's, so they get a namespace of their own (routers cannot ask for it by name).
            lora, synthetic = f"lora-id:{lora_id}", True
        extras = ex.merge(info.extras, ex.from_mm_keys(mm_keys, n))
        extras = ex.merge(extras, ex.from_block_infos(block_infos, n))
        return NativeStored(
            hashes=hashes,
            parent=parent,
            tokens=_tokens(tokens_raw),
            block_size=bs,
            tier=self.tier(medium),
            lora_name=lora,
            salt=salt or info.salt,
            extras=extras,
            group=group,
            synthetic_lora=synthetic,
        )

    def _pull_api(self, raw: dict[str, Any]) -> list[NativeEvent]:
        """TensorRT-LLM ``LLM.get_kv_cache_events()`` serialized dicts."""
        data = raw["data"]
        rank = _int(raw.get("attention_dp_rank"), "attention_dp_rank")
        # The attention window of the cache the event is about: TensorRT-LLM keeps one block manager
        # per window size (variable sliding window attention) and says which on every event.
        window = _int(raw.get("window_size"), "window_size")
        kind = _str(data.get("type"), "type") or ""
        if kind == "stored":
            out = self._pull_stored(data, rank)
            for ev in out:
                assert isinstance(ev, NativeStored)
                ev.attention_window = window
            return out
        if kind == "removed":
            return [NativeRemoved(_hashes(data.get("block_hashes")), "gpu", None, rank, window)]
        if kind == "updated":
            level = data.get("cache_level")
            if isinstance(level, dict) and "old_value" in level and "new_value" in level:
                h = normalize_hash(data.get("block_hash"))
                old, new = self._level(level["old_value"]), self._level(level["new_value"])
                if old != new:  # a block moved between cache levels: drop it on one, hold it on the other
                    return [
                        NativeRemoved([h], old, None, rank, window),
                        NativeStored([h], None, [], 0, new, dp_rank=rank, attention_window=window),
                    ]
            return [Ignored("updated", rank)]
        if kind == "created":
            return [Ignored("created", rank, window)]
        raise DecodeError("unknown_event_type", kind)

    def _level(self, level: Any) -> str:
        lvl = _int(level, "cache_level")
        tier = _LEVELS.get(lvl or 0)
        if tier is None:
            raise DecodeError("unknown_medium", f"cache_level {level}")
        return tier

    def _pull_stored(self, data: dict[str, Any], rank: int | None) -> list[NativeEvent]:
        blocks = data.get("blocks")
        if not isinstance(blocks, list):
            raise DecodeError("missing_field", "stored without blocks")
        parent = None if data.get("parent_hash") is None else normalize_hash(data["parent_hash"])
        out: list[NativeEvent] = []
        run: NativeStored | None = None
        for block in blocks:
            if not isinstance(block, dict):
                raise DecodeError("bad_event", "block is not a map")
            h = normalize_hash(block.get("block_hash"))
            tier = self._level(block.get("cache_level", 0))
            tokens: list[Any] = []
            extra_ids: list[Any] = []
            for tok in _list(block.get("tokens"), "tokens"):
                if isinstance(tok, dict):
                    tokens.append(tok.get("token_id"))
                    extra_ids.append(tok.get("token_extra_id", 0))
                else:
                    tokens.append(tok)
            parts = [ex._mm_item(e) for e in _list(block.get("mm_keys"), "mm_keys")]
            if any(extra_ids):
                parts.append(ex.encode_other(extra_ids))
            salt = _str(block.get("cache_salt"), "cache_salt")
            lora_id = _int(block.get("lora_id"), "lora_id")
            if run is None or run.tier != tier or run.salt != salt:
                run = NativeStored(
                    [], parent if run is None else run.hashes[-1], [], len(tokens), tier, dp_rank=rank
                )
                run.salt = salt
                if lora_id is not None:
                    run.lora_name, run.synthetic_lora = f"lora-id:{lora_id}", True
                run.extras = []
                out.append(run)
            run.hashes.append(h)
            run.tokens.extend(tokens)
            assert run.extras is not None
            run.extras.append(b"".join(parts))
            if len(tokens) != run.block_size:
                run.block_size = -1  # blocks of different sizes: reported as a block-size mismatch
        for ev in out:
            assert isinstance(ev, NativeStored)
            if not any(ev.extras or ()):
                ev.extras = None
        return out
