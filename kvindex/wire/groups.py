"""KV-cache groups as workers announce them (docs/wire.md §8): the vocabulary of hybrid-attention
models. What the index does with them (vLLM's hit rule) is kvindex/index/hybrid.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvindex.keys import MAX_GROUPS

# Rules, by what a group needs to serve a prefix.
FULL: Final = 0
SLIDING: Final = 1
CHUNKED: Final = 2
MAMBA: Final = 3
UNKNOWN: Final = 4
RULE_NAMES: Final = ("full", "sliding_window", "chunked_local", "mamba", "unknown")

# vLLM 0.32's ``KVCacheSpecKind`` values (vllm/v1/kv_cache_interface.py) by the manager that looks
# them up: MLA and attention-sink groups use FullAttentionManager's rule, sliding-window MLA the
# sliding window's.
KIND_RULES: Final[Mapping[str, int]] = {
    "full_attention": FULL,
    "mla_attention": FULL,
    "sink_full_attention": FULL,
    "sliding_window": SLIDING,
    "sliding_window_mla": SLIDING,
    "chunked_local_attention": CHUNKED,
    "mamba": MAMBA,
}
FULL_ATTENTION: Final = "full_attention"


class LayoutError(ValueError):
    """A group layout that cannot be right (the message says which group and why)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group as a worker announces it (docs/wire.md §8 ``groups``)."""

    kind: str
    block_size: int
    window: int = 0  # sliding-window kinds: tokens
    chunk: int = 0  # chunked local attention: tokens

    @property
    def rule(self) -> int:
        return KIND_RULES.get(self.kind, UNKNOWN)

    def check(self, group: int) -> None:
        """LayoutError when the spec cannot be right (as group ``group``)."""
        if self.block_size < 1:
            raise LayoutError(f"group {group}: block_size {self.block_size} is not positive")
        if self.rule == SLIDING and self.window < 1:
            raise LayoutError(f"group {group} ({self.kind}) has no window")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "block_size": self.block_size}
        if self.window:
            out["window"] = self.window
        if self.chunk:
            out["chunk"] = self.chunk
        return out


def describe(specs: tuple[GroupSpec, ...]) -> str:
    """One line for logs and ListInstances: kinds (window or chunk) with their group counts, in order
    of first appearance, e.g. "3x sliding_window(64) + full_attention"."""
    counts: dict[str, int] = {}
    for s in specs:
        name = s.kind + (f"({s.window})" if s.window else "") + (f"({s.chunk})" if s.chunk else "")
        counts[name] = counts.get(name, 0) + 1
    return " + ".join(f"{n}x {k}" if n > 1 else k for k, n in counts.items())


def parse_groups(raw: Any, block_size: int) -> tuple[GroupSpec, ...]:
    """A heartbeat's ``groups`` (a list of maps, one per group); LayoutError says what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise LayoutError("groups must be a non-empty list of maps")
    if len(raw) > MAX_GROUPS:
        raise LayoutError(f"{len(raw)} groups; at most {MAX_GROUPS}")
    specs = []
    for g, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise LayoutError(f"group {g} is not a map")
        kind = entry.get("kind")
        if not isinstance(kind, str) or not 1 <= len(kind) <= 64:
            raise LayoutError(f"group {g} has no kind")
        fields = {}
        for name in ("block_size", "window", "chunk"):
            value = entry.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1 << 30:
                raise LayoutError(f"group {g}: {name} {value!r} is not an integer in 0..2^30")
            fields[name] = value
        spec = GroupSpec(
            kind, fields.get("block_size") or block_size, fields.get("window", 0), fields.get("chunk", 0)
        )
        spec.check(g)
        specs.append(spec)
    return tuple(specs)
