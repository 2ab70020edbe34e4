"""Engines' per-block extra keys -> the project's encoded extra-key suffixes (docs/wire.md §1).

vLLM sends ``extra_keys``: one entry per block, ``None`` or a tuple built in this order
(vllm/v1/core/kv_cache_utils.py ``generate_block_hash_extra_keys``):

    (lora_name?, (mm_identifier, mm_offset_in_block)*, cache_salt?, prompt_embeds_sha256?)

- the LoRA name is in every block of a LoRA request (the event also carries ``lora_name``);
- ``cache_salt`` only in the block that starts at token 0 of the request;
- a multimodal input appears in every block it overlaps, with its start relative to the block
  (negative when it began in an earlier block).

LoRA name and salt go into the chain's seed (docs/wire.md §1), so they are dropped from the
per-block suffix; every other item is encoded with :mod:`kvindex.keys`' extra-key helpers.

TensorRT-LLM sends multimodal keys per block as ``mm_keys`` (entries with a hash and a start offset);
Dynamo's TRT-LLM relay sends ``block_mm_infos`` (per block, a map or null). Shapes the bridge does not
know are still folded in (as "other" items): a block with multimodal content must never get the key of
a plain-text block with the same placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvindex.keys import embeds_extra, mm_extra, other_extra

_canonical = msgspec.msgpack.Encoder(order="sorted")


def encode_other(value: Any) -> bytes:
    """An extra key the bridge does not interpret, as an "other" item (canonical msgpack)."""
    try:
        return other_extra(_canonical.encode(value))
    except (TypeError, ValueError, OverflowError):
        return other_extra(repr(value).encode())


def _identifier(value: Any) -> str | bytes | None:
    if isinstance(value, str | bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _offset(value: Any) -> bool:
    """A token offset the key encodes (signed 64-bit); a larger one raised OverflowError out of the
    decoder (found by fuzzing) and is now an "other" item like any value that is not an offset."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63)


def _mm_item(entry: Any) -> bytes:
    """One multimodal entry as [identifier, offset, ...] or a map; anything else as "other"."""
    if isinstance(entry, list | tuple) and len(entry) >= 2:
        ident, offset = _identifier(entry[0]), entry[1]
        if ident is not None and _offset(offset):
            return mm_extra(ident, offset)
    if isinstance(entry, dict):
        ident = None
        for name in ("hash", "mm_hash", "identifier", "id"):
            if name in entry:
                ident = _identifier(entry[name])
                break
        offset = entry.get("start_offset", entry.get("offset", 0))
        if ident is not None and _offset(offset):
            return mm_extra(ident, offset)
    return encode_other(entry)


@dataclass(slots=True)
class ExtraInfo:
    # Encoded suffix per block (b"" for none), or None when no block has one.
    extras: list[bytes] | None = None
    # Cache salt found in the extra keys of the block at token 0.
    salt: str | None = None
    # LoRA name found in the extra keys when the event carried only a numeric lora_id.
    lora_name: str | None = None


def from_vllm(
    extra_keys: Any, n_blocks: int, lora_name: str | None, lora_id: int | None, is_root: bool
) -> ExtraInfo:
    """Interpret vLLM's ``extra_keys`` (see the module docstring)."""
    info = ExtraInfo()
    if not isinstance(extra_keys, list | tuple) or not extra_keys:
        return info
    if lora_name is None and lora_id is not None:
        # Older events: no lora_name field, but the adapter name leads every block's extra keys.
        # Only string firsts can name an adapter (a list among them raised TypeError: found by fuzzing).
        firsts = [items[0] for items in extra_keys if isinstance(items, list | tuple) and items]
        if firsts and all(isinstance(f, str) and f == firsts[0] for f in firsts):
            info.lora_name = lora_name = firsts[0]
    out: list[bytes] = []
    for i in range(n_blocks):
        items = extra_keys[i] if i < len(extra_keys) else None
        if items is None:
            out.append(b"")
            continue
        if not isinstance(items, list | tuple):
            items = [items]
        parts: list[bytes] = []
        lora_seen = False
        for item in items:
            if isinstance(item, str):
                if lora_name is not None and item == lora_name and not lora_seen:
                    lora_seen = True
                elif i == 0 and is_root and info.salt is None:
                    info.salt = item
                else:
                    parts.append(encode_other(item))
            elif isinstance(item, bytes):
                parts.append(embeds_extra(item))
            else:
                parts.append(_mm_item(item))
        out.append(b"".join(parts))
    if any(out):
        info.extras = out
    return info


def from_mm_keys(mm_keys: Any, n_blocks: int) -> list[bytes] | None:
    """TensorRT-LLM ``mm_keys``: per block, a list of multimodal entries."""
    if not isinstance(mm_keys, list | tuple) or not mm_keys:
        return None
    if len(mm_keys) == n_blocks and all(e is None or isinstance(e, list | tuple) for e in mm_keys):
        out = [b"".join(_mm_item(e) for e in entries) if entries else b"" for entries in mm_keys]
    else:
        # Not per block: fold the whole value into every block (distinct from plain text, never shared).
        out = [encode_other(mm_keys)] * n_blocks
    return out if any(out) else None


def from_block_infos(infos: Any, n_blocks: int) -> list[bytes] | None:
    """Dynamo's TRT-LLM relay ``block_mm_infos``: per block a map (multimodal objects) or null."""
    if not isinstance(infos, list | tuple) or not any(i is not None for i in infos):
        return None
    out = [
        encode_other(infos[i]) if i < len(infos) and infos[i] is not None else b"" for i in range(n_blocks)
    ]
    return out if any(out) else None


def merge(a: Sequence[bytes] | None, b: Sequence[bytes] | None) -> list[bytes] | None:
    if not a:
        return list(b) if b else None
    if not b:
        return list(a)
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else b"") + (b[i] if i < len(b) else b"") for i in range(n)]
