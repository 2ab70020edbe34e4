"""Block keys: the one definition shared by worker shims, the index and clients.

The index never trusts engine block hashes (they depend on the engine's hash algorithm, its seed and
version). Every party recomputes the same chained key from token ids instead:

    seed    = xxh3_64(utf8(model) + b"\\0" + utf8(lora or "") + b"\\0" + utf8(salt or ""))
    key[i]  = xxh3_64(tokens of block i as little-endian uint32, seed = key[i-1]),  key[-1] = seed

Only full blocks get keys. Because each key folds in its predecessor, equal keys imply equal prefixes,
so the index can look blocks up independently and still match prefixes exactly.

Blocks that carry extra keys (multimodal inputs, prompt embeddings) append them, encoded, to the block's
token bytes (:func:`block_keys_extra`); a block without extra keys keeps exactly the plain key.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

try:  # one C loop over the blocks (kvindex/_keys_native.pyx); same results as _keys_python
    from kvindex._keys_native import chain_keys as _chain_keys
except ImportError:  # no compiler at install time
    _chain_keys = None
_TOKEN_MAX = 0xFFFFFFFF


def model_seed(model: str, lora: str | None = None, salt: str | None = None) -> int:
    """Seed of the key chain for one (model, LoRA adapter, cache salt) namespace."""
    raw = b"\0".join((model.encode(), (lora or "").encode(), (salt or "").encode()))
    return _xxh3(raw)


def tokens_to_le_bytes(tokens: Any) -> bytes:
    """Token ids as little-endian uint32 bytes.

    Accepts a sequence of ints, a numpy array, an object exposing ``__array__`` (protobuf repeated
    fields do; that path avoids creating a Python int per token), or bytes that already hold LE uint32.
    Raises ValueError for ids outside [0, 2**32).
    """
    if isinstance(tokens, bytes | bytearray | memoryview):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError(f"token bytes length {len(raw)} is not a multiple of 4")
        return raw
    if isinstance(tokens, list | tuple | array):
        try:
            arr = array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        if sys.byteorder != "little":
            arr.byteswap()
        return arr.tobytes()
    np_arr = np.asarray(tokens)
    if np_arr.size == 0:
        return b""
    if np_arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {np_arr.dtype}")
    if np_arr.dtype not in (np.uint32, np.dtype("<u4")) and (
        int(np_arr.min()) < 0 or int(np_arr.max()) > _TOKEN_MAX
    ):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return np_arr.astype("<u4", copy=False).tobytes()


def keys_from_le_bytes(raw: bytes, block_size: int, seed: int) -> list[int]:
    """Chained keys of the full blocks in ``raw`` (LE uint32 tokens), continuing from ``seed``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if _chain_keys is not None:
        return _chain_keys(raw, block_size, seed)
    return _keys_python(raw, block_size, seed)


def _keys_python(raw: bytes, block_size: int, seed: int) -> list[int]:
    step = block_size * 4
    full = len(raw) - len(raw) % step
    mv = memoryview(raw)
    keys: list[int] = []
    append = keys.append
    key = seed
    for off in range(0, full, step):
        key = _xxh3(mv[off : off + step], key)
        append(key)
    return keys


def block_keys(
    tokens: Any,
    block_size: int,
    model: str,
    lora: str | None = None,
    salt: str | None = None,
    *,
    parent: int | None = None,
) -> list[int]:
    """Keys of the full blocks of ``tokens``.

    ``parent`` continues a chain: pass the key of the block just before ``tokens[0]`` (when a shim
    sees only the newly stored blocks of a sequence). Without it the chain starts at the model seed.
    """
    seed = model_seed(model, lora, salt) if parent is None else parent
    return keys_from_le_bytes(tokens_to_le_bytes(tokens), block_size, seed)


# -- extra keys (multimodal inputs, prompt embeddings, …): docs/wire.md §1 "Extra keys" ----------
#
# Some blocks are not determined by their token ids alone: an image's placeholder tokens are the same
# for every image, prompt embeddings have no token ids at all. Engines fold such per-block "extra
# keys" into their block hashes; the project's key appends them, encoded as below, to the block's
# token bytes. A block without extra keys has an empty suffix, so its key is exactly the plain one.

EXTRA_MM = 0x01
EXTRA_EMBEDS = 0x02
EXTRA_OTHER = 0x03


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def mm_extra(identifier: str | bytes, offset: int) -> bytes:
    """One multimodal input in a block: the engine's identifier (its mm hash) and the input's start
    relative to the block's first token (negative when the input began in an earlier block)."""
    ident = _as_bytes(identifier)
    return (
        bytes((EXTRA_MM,)) + int(offset).to_bytes(8, "little", signed=True) + len(ident).to_bytes(4, "little")
    ) + ident


def embeds_extra(digest: bytes) -> bytes:
    """A digest of the block's prompt embeddings (vLLM: SHA-256 of the block's embedding tensor)."""
    return bytes((EXTRA_EMBEDS,)) + len(digest).to_bytes(4, "little") + bytes(digest)


def other_extra(encoded: bytes) -> bytes:
    """Any other extra key, given as its msgpack encoding (maps with sorted keys)."""
    return bytes((EXTRA_OTHER,)) + len(encoded).to_bytes(4, "little") + bytes(encoded)


def keys_from_le_bytes_extra(
    raw: bytes, block_size: int, seed: int, extras: Sequence[bytes | None] | None
) -> list[int]:
    """Like :func:`keys_from_le_bytes`, with ``extras[i]`` (encoded items, or empty/None) appended to
    block ``i``'s token bytes. Blocks beyond ``len(extras)`` have no extra keys."""
    if not extras or not any(extras):
        return keys_from_le_bytes(raw, block_size, seed)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    step = block_size * 4
    full = len(raw) - len(raw) % step
    keys: list[int] = []
    key = seed
    n_extras = len(extras)
    for i, off in enumerate(range(0, full, step)):
        extra = extras[i] if i < n_extras else None
        data = raw[off : off + step] + extra if extra else raw[off : off + step]
        key = _xxh3(data, key)
        keys.append(key)
    return keys


def block_keys_extra(
    tokens: Any,
    block_size: int,
    model: str,
    lora: str | None = None,
    salt: str | None = None,
    *,
    extras: Sequence[bytes | None] | None = None,
    parent: int | None = None,
) -> list[int]:
    """:func:`block_keys` for blocks with extra keys: ``extras[i]`` is block ``i``'s encoded extra
    keys (a concatenation of :func:`mm_extra`, :func:`embeds_extra`, :func:`other_extra` items)."""
    seed = model_seed(model, lora, salt) if parent is None else parent
    return keys_from_le_bytes_extra(tokens_to_le_bytes(tokens), block_size, seed, extras)


MAX_GROUPS = 1024  # KV-cache groups of one engine (docs/wire.md §8)


def group_mask(group: int) -> int:
    """``G(group)``: what a block key of KV-cache ``group`` is XORed with to make its group key
    (docs/wire.md §8). Group 0 is the plain key, so workers without groups are unchanged; the others
    are XXH3-64 of the group number (little-endian uint32): random-looking, one bijection per group."""
    if not 0 <= group < MAX_GROUPS:
        raise ValueError(f"KV-cache group {group} is outside 0..{MAX_GROUPS - 1}")
    return 0 if group == 0 else _xxh3(group.to_bytes(4, "little"))


def group_key(key: int, group: int) -> int:
    """The key the index stores for block ``key`` held in KV-cache ``group``."""
    return key ^ group_mask(group)


# Every group's mask, for the index's native loops (computed once: 1,024 short hashes).
GROUP_MASKS: tuple[int, ...] = tuple(group_mask(g) for g in range(MAX_GROUPS))
