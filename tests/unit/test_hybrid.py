"""Hybrid-attention models: the group layout, vLLM's hit rule (kvindex/index/hybrid.py) and the index's
answers under it (native and pure-Python tables) against the rule written plainly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.index import _pytable
from kvindex.index.base import InstanceMatch
from kvindex.index.hybrid import (
    CHUNKED,
    FULL,
    MAMBA,
    SLIDING,
    GroupLayout,
    GroupSpec,
    LayoutError,
    held_from_sets,
    hit_tokens,
)
from kvindex.index.inverted import NATIVE, InvertedIndex
from kvindex.keys import block_keys
from kvindex.wire.schema import Removed, Stored

IMPLS = [pytest.param(None, id="native")] if NATIVE else []
IMPLS.append(pytest.param(_pytable, id="pytable"))

BS = 32


def gemma(window: int = 64, sliding: int = 3) -> GroupLayout:
    """The issue's tiny Gemma 3: sliding-window groups first, one full-attention group last."""
    specs = [GroupSpec("sliding_window", BS, window=window)] * sliding + [GroupSpec("full_attention", BS)]
    return GroupLayout(specs, BS)


def test_layout_rules_and_primary() -> None:
    layout = gemma()
    assert layout.hybrid and layout.understood and layout.primary == 3
    # The three sliding-window groups share one spec: one lookup needing ceil(63 / 32) = 2 blocks.
    assert [(r.rule, r.param, r.members) for r in layout.rules] == [(SLIDING, 2, (0, 1, 2))]
    assert layout.describe() == "3x sliding_window(64) + full_attention"
    single = GroupLayout.single(16)
    assert not single.hybrid and single.primary == 0 and single.rules == ()
    # Two full-attention groups: one is walked, the other checked as a rule.
    two = GroupLayout([GroupSpec("full_attention", 16), GroupSpec("mla_attention", 16)], 16)
    assert two.primary == 0 and [(r.rule, r.members) for r in two.rules] == [(FULL, (1,))]
    mixed = GroupLayout(
        [GroupSpec("mamba", 16), GroupSpec("chunked_local_attention", 16, chunk=64), GroupSpec("mamba", 16)],
        16,
    )
    assert mixed.primary is None and sorted((r.rule, r.members) for r in mixed.rules) == [
        (CHUNKED, (1,)),
        (MAMBA, (0, 2)),
    ]


def test_layout_not_understood_says_why() -> None:
    odd = GroupLayout([GroupSpec("full_attention", 16), GroupSpec("hisparse_hot", 16)], 16)
    assert not odd.understood and "'hisparse_hot' not understood" in odd.why
    sizes = GroupLayout([GroupSpec("full_attention", 16), GroupSpec("mamba", 64)], 16)
    assert not sizes.understood and "block size 64" in sizes.why
    # What is understood still answers: the full-attention group alone here.
    assert sizes.primary == 0 and sizes.rules == ()
    chunked = GroupLayout([GroupSpec("chunked_local_attention", 16), GroupSpec("full_attention", 16)], 16)
    assert not chunked.understood and "unknown chunk size" in chunked.why and chunked.rules == ()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "non-empty list"),
        ([{"block_size": 16}], "group 0 has no kind"),
        ([{"kind": "sliding_window"}], "group 0 (sliding_window) has no window"),
        ([{"kind": "full_attention", "block_size": -1}], "block_size -1"),
        ([{"kind": "full_attention"}, 7], "group 1 is not a map"),
        ([{"kind": "full_attention"}] * 1025, "at most 1024"),
    ],
)
def test_bad_wire_layouts(raw: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GroupLayout.from_wire(raw, 16)


def test_wire_round_trip() -> None:
    layout = gemma()
    assert GroupLayout.from_wire(layout.to_wire(), BS) == layout
    assert GroupLayout.from_wire([{"kind": "full_attention"}], 16) == GroupLayout.single(16)


def test_the_issues_scenario_by_the_rule() -> None:
    """Issue 33's session with the tiny Gemma 3 (window 64, blocks of 32): vLLM retains the window
    before each prompt's last token, so a prompt sharing 192 tokens of a 240-token one is cold in the
    sliding-window groups, though the full-attention group holds all 192."""
    layout = gemma()
    first = list(range(240))
    keys = block_keys(first, BS, "m")
    full = set(keys)  # blocks 0..6
    window = {keys[5], keys[6]}  # the window ending at block 7 (token 224 <= 239)
    held = {0: window, 1: window, 2: window, 3: full}
    assert hit_tokens(layout, held_from_sets(held, keys), len(first) - 1) == 224
    third = first[:192] + [1000 + t for t in range(48)]
    tkeys = block_keys(third, BS, "m")
    assert hit_tokens(layout, held_from_sets(held, tkeys), len(third) - 1) == 0
    # A full-attention index alone would promise 192 cached tokens.
    assert hit_tokens(GroupLayout.single(BS), held_from_sets({0: full}, tkeys), len(third) - 1) == 192
    # The engine then keeps the window at the divergence point (blocks 4 and 5).
    for g in (0, 1, 2):
        held[g] = window | {tkeys[4], tkeys[5]}
    fourth = first[:192] + [2000 + t for t in range(40)]
    assert hit_tokens(layout, held_from_sets(held, block_keys(fourth, BS, "m")), len(fourth) - 1) == 192


def test_rules_one_by_one() -> None:
    keys = list(range(1, 11))  # 10 blocks of 4 tokens

    def hit(spec: GroupSpec, held_blocks: set[int], limit: int = 40) -> int:
        layout = GroupLayout([spec], 4)
        return hit_tokens(layout, lambda g, j: j in held_blocks, limit)

    # Sliding window of 8 tokens: ceil(7 / 4) = 2 consecutive blocks ending at the candidate.
    assert hit(GroupSpec("sliding_window", 4, window=8), {3, 4, 8}) == 20
    assert hit(GroupSpec("sliding_window", 4, window=8), {3, 4, 8, 9}) == 40
    assert hit(GroupSpec("sliding_window", 4, window=8), {3, 4, 8, 9}, limit=39) == 20  # block 9 is out
    assert hit(GroupSpec("sliding_window", 4, window=8), {0, 5}) == 4  # only the run from the start
    # Mamba: the rightmost state at or before the candidate.
    assert hit(GroupSpec("mamba", 4), {2, 6}) == 28
    assert hit(GroupSpec("mamba", 4), {2, 6}, limit=27) == 12
    # Chunked local attention (chunk 16): blocks from the candidate's chunk start, consecutively.
    assert hit(GroupSpec("chunked_local_attention", 4, chunk=16), {8}) == 36  # chunk starts at 32
    assert hit(GroupSpec("chunked_local_attention", 4, chunk=16), {8, 9}, limit=39) == 36
    assert hit(GroupSpec("chunked_local_attention", 4, chunk=16), set(), limit=33) == 32
    assert len(keys) == 10


def _build(
    impl: object, layout: GroupLayout, held: dict[tuple[str, int], dict[int, set[int]]], keys: list[int]
) -> InvertedIndex:
    """An index whose instances hold, per (instance, group), blocks (positions of ``keys``) on tiers:
    ``held[(name, group)] = {tier: {positions}}``, stored through batch events as the consumer does."""
    index = InvertedIndex(impl)
    names = sorted({name for name, _g in held})
    for name in names:
        index.add_instance((name, 0), "m")
    index.set_layout("m", layout)
    tier_names = ("gpu", "cpu", "disk")
    for (name, group), tiers in sorted(held.items()):
        events = [
            Stored(tier=tier_names[t], keys=[keys[j] for j in sorted(pos)], group=group)
            for t, pos in sorted(tiers.items())
            if pos
        ]
        index.apply((name, 0), events)
    return index


@pytest.mark.parametrize("impl", IMPLS)
def test_index_answers_the_issues_scenario(impl: object) -> None:
    layout = gemma()
    first = list(range(240))
    keys = block_keys(first, BS, "m")
    window = {5, 6}
    held = {("a", g): {0: window} for g in (0, 1, 2)} | {("a", 3): {0: set(range(7))}}
    index = _build(impl, layout, held, keys)
    assert index.match("m", keys, limit=239) == {("a", 0): InstanceMatch(7, (7, 0, 0, 0))}
    third = block_keys(first[:192] + [1000 + t for t in range(48)], BS, "m")
    assert index.match("m", third, limit=239) == {}
    # The same index asked without the rule's layout answers like a full-attention index.
    index.set_layout("m", GroupLayout.single(BS))
    assert index.match("m", third, limit=239) == {}  # group 3's keys are not the plain keys
    index.set_layout("m", layout)
    # What the walk found anyway: the full-attention group's 6 blocks, where no window ends.
    reach: dict = {}
    assert index.match("m", third, limit=239, reach=reach) == {}
    assert reach == {("a", 0): 6}
    reach.clear()
    index.match("m", keys, limit=239, reach=reach)
    assert reach == {}  # the answer is the whole prefix: nothing beyond it
    index.apply(("a", 0), [Removed(tier="gpu", keys=[keys[6]], group=1)])
    assert index.match("m", keys, limit=239) == {}  # group 1 lost block 6: no window at 224, none below


layouts = st.builds(
    lambda specs, bs: GroupLayout(
        [GroupSpec(k, bs, window=w * bs - d, chunk=c * bs) for k, w, d, c in specs], bs
    ),
    st.lists(
        st.tuples(
            st.sampled_from(["full_attention", "sliding_window", "mamba", "chunked_local_attention"]),
            st.integers(1, 4),
            st.integers(0, 1),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([2, 4]),
)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=150, deadline=None)
@given(
    layout=layouts,
    data=st.data(),
)
def test_index_agrees_with_the_rule(impl: object, layout: GroupLayout, data: st.DataObject) -> None:
    n_blocks = data.draw(st.integers(1, 14))
    keys = list(range(101, 101 + n_blocks))
    names = ["a", "b", "c"]
    held: dict[tuple[str, int], dict[int, set[int]]] = {}
    for name in names:
        for g in range(len(layout.groups)):
            blocks = data.draw(st.sets(st.integers(0, n_blocks - 1)))
            tiers: dict[int, set[int]] = {0: set(), 1: set()}
            for j in blocks:
                tiers[data.draw(st.sampled_from([0, 0, 1]))].add(j)
            held[(name, g)] = tiers
    limit = data.draw(st.integers(0, n_blocks * layout.block_size))
    index = _build(impl, layout, held, keys)
    reach: dict = {}
    got = index.match("m", keys, limit=limit, reach=reach)
    for name in names:

        def held_any(g: int, j: int, name: str = name) -> bool:
            return any(j in pos for pos in held[(name, g)].values())

        want = hit_tokens(layout, held_any, limit) // layout.block_size
        m = got.get((name, 0))
        assert (m.length if m else 0) == want, (name, want, m)
        if m is not None:
            assert sum(m.tiers) == m.length
        # The reach: the full-attention group's own prefix (up to the limit), where it is longer.
        far = 0
        if layout.primary is not None and layout.hybrid:
            while far < min(n_blocks, limit // layout.block_size) and held_any(layout.primary, far):
                far += 1
        assert reach.get((name, 0), 0) == (far if far > want else 0), (name, far, want)
