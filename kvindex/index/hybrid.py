"""KV-cache groups of hybrid-attention models, and vLLM's rule for the prefix they can reuse.

A hybrid model (Gemma 3, gpt-oss, Llama 4, Qwen3-Next, Nemotron-H, Jamba, ...) keeps one KV cache per
attention type: a *group*. vLLM reuses a prefix only where every group can serve it
(``vllm/v1/core/kv_cache_coordinator.py``, ``HybridKVCacheCoordinator.find_longest_cache_hit``): the
candidate length starts at the prompt's last token and each group lowers it to what it can serve,
until none does. What a group can serve depends on its kind
(``vllm/v1/core/single_type_kv_cache_manager.py``, each manager's ``find_longest_cache_hit``):

- full attention needs every block from the start;
- sliding window needs the blocks of the window before the next token, ``ceil((window - 1) / B)``
  consecutive blocks ending at the candidate length (or the blocks from the start, if fewer);
- chunked local attention needs the blocks from the start of the chunk holding the candidate length;
- Mamba / linear attention needs the state block at the candidate length.

This module holds the layout (``GroupLayout``: which group follows which rule, and how the index
walks them) and the rule itself written plainly over a ``held(group, block)`` predicate
(``hit_tokens``): the reference the index's native kernels are tested against, and what the
simulated engines use. Groups of one kind and parameters are looked up together, as vLLM's
``SpecGroup`` does: a block counts for them only if every one of them holds it.

The index stores a block of group ``g`` under its *group key* (``kvindex.keys.group_key``), so the
groups live in the same tables as before and digests and snapshots need no new shape
(docs/wire.md §8).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.keys import MAX_GROUPS, group_mask
from kvindex.wire.groups import (
    CHUNKED,
    FULL,
    FULL_ATTENTION,
    KIND_RULES,
    MAMBA,
    RULE_NAMES,
    SLIDING,
    UNKNOWN,
    GroupSpec,
    LayoutError,
    describe,
    parse_groups,
)

__all__ = [
    "CHUNKED",
    "FULL",
    "KIND_RULES",
    "MAMBA",
    "SLIDING",
    "UNKNOWN",
    "GroupLayout",
    "GroupSpec",
    "LayoutError",
    "RuleGroup",
    "held_from_sets",
    "hit_limit",
    "hit_tokens",
    "rule_hit",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class RuleGroup:
    """Groups looked up together (one kind and parameters): ``param`` is the consecutive blocks a
    sliding window needs, or a chunk's tokens; ``masks`` the members' ``G(g)`` (their group keys are
    ``key ^ mask``)."""

    rule: int
    param: int
    members: tuple[int, ...]
    masks: tuple[int, ...]


class GroupLayout:
    """A model's KV-cache groups and how the index answers a prefix query over them.

    ``primary`` is the full-attention group whose keys the index walks from the start, as for any
    model (its answer bounds every other group's); None when the model has no full attention, and
    then the walk starts from the whole prompt. ``rules`` are the other lookups, each lowering the
    candidate length (the primary group's fellow members first: they are full attention too).
    ``understood`` is False when a kind is unknown or the groups' block sizes differ: the answer then
    uses the groups it understands, and the instances say they are approximate.
    """

    __slots__ = (
        "block_size",
        "groups",
        "hybrid",
        "primary",
        "primary_mask",
        "rule_tuples",
        "rules",
        "understood",
        "why",
    )

    def __init__(self, groups: Sequence[GroupSpec], block_size: int) -> None:
        if not groups:
            raise LayoutError("a layout needs at least one group")
        if len(groups) > MAX_GROUPS:
            raise LayoutError(f"{len(groups)} groups; at most {MAX_GROUPS}")
        self.groups = tuple(groups)
        self.block_size = block_size
        why: list[str] = []
        for g, spec in enumerate(self.groups):
            spec.check(g)
            if spec.rule == UNKNOWN:
                why.append(f"group {g}: kind {spec.kind!r} not understood")
            elif spec.rule == CHUNKED and spec.chunk < 1:
                # vLLM publishes no chunk size (it is in the model's config.json): kvshim
                # --attention-chunk tells it.
                why.append(f"group {g}: chunked local attention of unknown chunk size")
            elif spec.block_size != block_size:
                why.append(f"group {g}: block size {spec.block_size}, the model's is {block_size}")
        self.understood = not why
        self.why = "; ".join(why)
        # Only groups of the model's block size and a known kind take part: the rest is what makes
        # the answer approximate.
        usable = [
            g
            for g, s in enumerate(self.groups)
            if s.rule != UNKNOWN and s.block_size == block_size and (s.rule != CHUNKED or s.chunk > 0)
        ]
        full = [g for g in usable if self.groups[g].rule == FULL]
        self.primary: int | None = full[0] if full else None
        self.primary_mask = group_mask(self.primary) if self.primary is not None else 0
        # One lookup per distinct spec (vLLM's SpecGroup), full attention first.
        by_spec: dict[GroupSpec, list[int]] = {}
        for g in usable:
            if g != self.primary:
                by_spec.setdefault(self.groups[g], []).append(g)
        rules: list[RuleGroup] = []
        for spec, members in sorted(by_spec.items(), key=lambda item: item[0].rule != FULL):
            if spec.rule == SLIDING:
                param = _cdiv(spec.window - 1, spec.block_size)
            elif spec.rule == CHUNKED:
                param = spec.chunk
            else:
                param = 0
            rules.append(RuleGroup(spec.rule, param, tuple(members), tuple(group_mask(g) for g in members)))
        self.rules = tuple(rules)
        # The rules as the index's native loops take them.
        self.rule_tuples = [(r.rule, r.param, r.masks) for r in rules]
        # Not hybrid: one full-attention group 0, answered by the plain prefix walk as always.
        self.hybrid = not (len(self.groups) == 1 and self.primary == 0)

    @classmethod
    def single(cls, block_size: int) -> GroupLayout:
        """What a worker without groups has: one full-attention group."""
        return cls((GroupSpec(FULL_ATTENTION, block_size),), block_size)

    @classmethod
    def from_wire(cls, raw: Any, block_size: int) -> GroupLayout:
        """A heartbeat's ``groups`` (a list of maps); LayoutError says what is wrong."""
        return cls(parse_groups(raw, block_size), block_size)

    def to_wire(self) -> list[dict[str, Any]]:
        return [spec.to_wire() for spec in self.groups]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, GroupLayout)
            and self.groups == other.groups
            and self.block_size == other.block_size
        )

    def __hash__(self) -> int:
        return hash((self.groups, self.block_size))

    def __repr__(self) -> str:
        kinds = ", ".join(
            f"{s.kind}" + (f"/{s.window}" if s.window else "") + (f"/{s.chunk}" if s.chunk else "")
            for s in self.groups
        )
        return f"GroupLayout([{kinds}], block_size={self.block_size})"

    def describe(self) -> str:
        """One line for logs and ListInstances (wire.groups.describe)."""
        return describe(self.groups)


# -- the rule, written plainly ------------------------------------------------------------------


def hit_limit(prompt_tokens: int) -> int:
    """The longest prefix (tokens) vLLM reuses of a prompt: it always computes the last token, whose
    logits give the first output token (``kv_cache_manager.get_computed_blocks``)."""
    return max(prompt_tokens - 1, 0)


def rule_hit(rule: RuleGroup, held: Callable[[int], bool], limit: int, block_size: int) -> int:
    """Tokens ``rule``'s groups can serve of a candidate of ``limit`` tokens; ``held(j)``: whether
    every member holds block j. As vLLM's managers compute it (non-EAGLE, block-aligned hits)."""
    blocks = limit // block_size
    if rule.rule == FULL:
        j = 0
        while j < blocks and held(j):
            j += 1
        return j * block_size
    if rule.rule == SLIDING:
        # Right to left, stopping at the first run of ``param`` held blocks; none: the run from 0.
        run = 0
        for j in range(blocks - 1, -1, -1):
            if held(j):
                run += 1
                if run >= rule.param:
                    return (j + run) * block_size
            else:
                run = 0
        return run * block_size
    if rule.rule == CHUNKED:
        start = limit // rule.param * rule.param if limit > 0 else 0
        j = start // block_size
        while j < blocks and held(j):
            j += 1
        return j * block_size
    if rule.rule == MAMBA:
        for j in range(blocks - 1, -1, -1):
            if held(j):
                return (j + 1) * block_size
        return 0
    raise ValueError(f"no rule for {RULE_NAMES[rule.rule]}")


def hit_tokens(layout: GroupLayout, held: Callable[[int, int], bool], limit: int) -> int:
    """The prefix (tokens) the engine would reuse: ``held(group, block)`` says what each group holds,
    ``limit`` is the longest hit allowed (a prompt's length less one: the last token is always
    computed). The fixed point of HybridKVCacheCoordinator.find_longest_cache_hit."""
    bs = layout.block_size
    length = limit
    if layout.primary is not None:
        primary = RuleGroup(FULL, 0, (layout.primary,), (layout.primary_mask,))
        length = rule_hit(primary, lambda j: held(layout.primary, j), length, bs)  # type: ignore[arg-type]
    while True:
        before = length
        for rule in layout.rules:
            length = rule_hit(rule, lambda j, r=rule: all(held(g, j) for g in r.members), length, bs)  # type: ignore[misc]
        if length >= before:
            return length


def held_from_sets(sets: Mapping[int, Iterable[int]], keys: Sequence[int]) -> Callable[[int, int], bool]:
    """A ``held(group, block)`` over per-group sets of plain block keys (tests, simulators)."""
    frozen = {g: set(s) for g, s in sets.items()}
    empty: set[int] = set()
    return lambda g, j: keys[j] in frozen.get(g, empty)
