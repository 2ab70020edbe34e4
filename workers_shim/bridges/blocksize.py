"""The engine's block size, learned from its own events (or checked against ``--block-size``).

Keys are computed per block of ``B`` tokens, so a bridge keying with another ``B`` than the engine's
would publish keys no router ever computes. Every engine announces its block size in each
``BlockStored`` (``block_size``; when absent, ``len(token_ids) / len(block_hashes)`` tells), so:

- without ``--block-size`` the bridge publishes nothing keyed (not even a heartbeat, which announces
  ``B``) until the first keyed store, or the engine's ``/metrics`` (vLLM ``cache_config_info``),
  has said what ``B`` is;
- with ``--block-size`` (or once learned), the first keyed store of each engine life is checked, and
  a disagreement is a :class:`BlockSizeConflict`: the bridge stops and ``kvshim`` exits non-zero
  naming both sizes, instead of skipping every event.

SGLang's last partial page arrives as a single short block whose ``block_size`` is its own length,
and so does vLLM's partial (sub-block) entry with ``--prefix-match-unit`` (it announces the hash
block), so for engines with partial blocks a lone one-block store shorter than the known size is not
evidence of a conflict, and the size learned from a batch is the largest it announces.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers_shim.bridges.native import NativeEvent, NativeStored


class BlockSizeConflict(RuntimeError):
    """The engine's events announce another block size than the one the bridge keys with."""

    def __init__(self, engine_size: int, size: int, source: str) -> None:
        super().__init__(
            f"block size conflict: the engine's KV events announce {engine_size} tokens per block, "
            f"but {source} says {size}. Start kvshim with --block-size {engine_size} (or without "
            "--block-size, to take it from the engine), matching the engine's --block-size"
        )
        self.engine_size = engine_size
        self.size = size
        self.source = source


def announced(ev: NativeStored) -> int | None:
    """Tokens per block a keyed store announces; None for token-less or inconsistent ones."""
    n = len(ev.hashes)
    if not ev.tokens:
        return None
    if not n:
        # A hybrid model's sparse group keeping none of a range (vLLM names the size): a pure Mamba
        # model's first stores are all like this, and the next ones chain from them.
        size = ev.block_size
        return size if size > 0 and len(ev.tokens) % size == 0 else None
    size = ev.block_size
    if size == 0 and len(ev.tokens) % n == 0:
        size = len(ev.tokens) // n  # the field left out: implied by the tokens
    return size if size > 0 else None


def maybe_partial(ev: NativeStored, size: int) -> bool:
    """A single block whose announced size is just its token count: possibly a short last page."""
    return len(ev.hashes) <= 1 and len(ev.tokens) == size


def evidence(events: Iterable[NativeEvent], kv_group: int | None = None) -> list[tuple[int, bool]]:
    """(announced size, maybe partial) of each keyed store of the indexed KV groups (every group when
    ``kv_group`` is None), in order."""
    out = []
    for ev in events:
        if isinstance(ev, NativeStored) and (kv_group is None or ev.group is None or ev.group == kv_group):
            size = announced(ev)
            if size is not None:
                out.append((size, maybe_partial(ev, size)))
    return out


def learn(seen: list[tuple[int, bool]], partial_blocks: bool) -> int | None:
    """The block size a batch's stores tell (None: they tell nothing)."""
    if not seen:
        return None
    if not partial_blocks:
        return seen[0][0]
    whole = [size for size, partial in seen if not partial]
    return max(whole or [size for size, _ in seen])


def conflict(seen: list[tuple[int, bool]], size: int, partial_blocks: bool) -> int | None:
    """The first size in ``seen`` that contradicts ``size`` (None: they agree or tell nothing)."""
    for announced_size, partial in seen:
        if announced_size == size:
            continue
        if partial_blocks and partial and announced_size < size:
            continue  # a short last page, not another block size
        return announced_size
    return None


def confirms(seen: list[tuple[int, bool]], size: int) -> bool:
    """True when ``seen`` holds a store that shows ``size`` for certain."""
    return any(s == size for s, _ in seen)
