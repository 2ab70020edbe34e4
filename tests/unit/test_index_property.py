"""The inverted index against a brute-force model: random event sequences, then every query compared."""

from __future__ import annotations

from functools import reduce
from operator import xor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.index import NATIVE, InstanceMatch, InvertedIndex, _pytable
from kvindex.index.base import Applied
from kvindex.index.inverted import bank_shift
from kvindex.wire.schema import CLEARED, STORED, TIER_BY_NAME, Cleared, Removed, Stored

# Small keys (they cluster in a table without mixing), zero, and the top of the u64 range.
POOL = [0, 1, 2, 3, 4, 5, 6, 2**63 + 7, 2**64 - 1, 2**60 + 9, 11, 12]

# Both table implementations must behave identically; the native one must be built here.
BACKENDS = {"native": None, "python": _pytable}


def test_native_extension_is_built() -> None:
    assert NATIVE, "kvindex/index/_native.pyx was not compiled (is a C compiler installed?)"


INSTANCES = [("a", 0), ("a", 1), ("b", 0), ("pool", 0)]
MODEL_OF = {("a", 0): "m1", ("a", 1): "m1", ("b", 0): "m2", ("pool", 0): "m1"}
N_TIERS = 4
SHARED = 3

keys_st = st.lists(st.sampled_from(POOL), max_size=8)
inst_st = st.sampled_from(INSTANCES)
tier_st = st.integers(0, N_TIERS - 1)
op_st = st.one_of(
    st.tuples(st.just("store"), inst_st, tier_st, keys_st),
    st.tuples(st.just("remove"), inst_st, tier_st, keys_st),
    st.tuples(st.just("clear"), inst_st, st.none() | tier_st, st.just([])),
    st.tuples(st.just("drop"), inst_st, st.none(), st.just([])),
)


class Brute:
    def __init__(self) -> None:
        self.held: dict[tuple[str, int], list[set[int]]] = {}

    def ensure(self, inst: tuple[str, int]) -> None:
        self.held.setdefault(inst, [set() for _ in range(N_TIERS)])

    def match(self, model: str, keys: list[int], insts: list[tuple[str, int]]) -> dict:
        shared: set[int] = set()
        for inst, tiers in self.held.items():
            if MODEL_OF[inst] == model:
                shared |= tiers[SHARED]
        out = {}
        for inst in insts:
            if inst not in self.held or MODEL_OF[inst] != model:
                continue
            tiers = self.held[inst]
            counts = [0, 0, 0, 0]
            n = 0
            for k in keys:
                tier = next((t for t in range(3) if k in tiers[t]), None)
                if tier is None and k in shared:
                    tier = SHARED
                if tier is None:
                    break
                counts[tier] += 1
                n += 1
            if n:
                out[inst] = InstanceMatch(n, tuple(counts))
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op_st, max_size=40),
    queries=st.lists(
        st.tuples(st.sampled_from(["m1", "m2"]), keys_st, st.none() | st.lists(inst_st)), max_size=6
    ),
)
def test_index_agrees_with_brute_force(backend: str, ops: list, queries: list) -> None:
    ix = InvertedIndex(BACKENDS[backend])
    ref = Brute()
    for op, inst, tier, keys in ops:
        if op == "drop":
            expected = sum(len(s) for s in ref.held.pop(inst, []))
            assert ix.drop_instance(inst) == expected
            continue
        ix.add_instance(inst, MODEL_OF[inst])
        ref.ensure(inst)
        sets = ref.held[inst]
        if op == "store":
            new = len(set(keys) - sets[tier])
            assert ix.store(inst, tier, keys) == new
            sets[tier] |= set(keys)
        elif op == "remove":
            gone = len(set(keys) & sets[tier])
            assert ix.remove(inst, tier, keys) == gone
            sets[tier] -= set(keys)
        else:
            tiers = range(N_TIERS) if tier is None else [tier]
            assert ix.clear(inst, tier) == sum(len(sets[t]) for t in tiers)
            for t in tiers:
                sets[t] = set()

    for inst in INSTANCES:
        assert ix.has_instance(inst) == (inst in ref.held)
        sets = ref.held.get(inst, [set()] * N_TIERS)
        assert ix.block_counts(inst) == tuple(len(s) for s in sets)
        for t in range(N_TIERS):
            assert sorted(ix.keys_of(inst, t)) == sorted(sets[t])
            assert ix.digest(inst, t) == (len(sets[t]), reduce(xor, sets[t], 0))

    stats = ix.stats()
    for t in range(N_TIERS):
        assert stats.entries[t] == sum(len(s[t]) for s in ref.held.values())
        assert stats.distinct_blocks[t] == len({(MODEL_OF[i], k) for i, s in ref.held.items() for k in s[t]})

    for model, keys, subset in queries:
        insts = INSTANCES if subset is None else subset
        got = ix.match(model, keys, None if subset is None else subset)
        assert got == ref.match(model, keys, insts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clear_costs_only_own_blocks_and_log_compacts(backend: str) -> None:
    ix = InvertedIndex(BACKENDS[backend])
    ix.add_instance(("w", 0), "m")
    ix.add_instance(("x", 0), "m")
    ix.store(("x", 0), 0, range(10_000, 20_000))
    for round_ in range(20):
        ix.store(("w", 0), 0, range(round_ * 1000, round_ * 1000 + 1000))
        ix.remove(("w", 0), 0, range(round_ * 1000, round_ * 1000 + 1000))
    # Churned keys do not pile up: the key log is compacted as removals accumulate.
    assert len(ix._holders[("w", 0)].logs[0]) <= 2 * 0 + 1024 + 1000
    assert ix.clear(("w", 0)) == 0
    assert ix.block_counts(("x", 0)) == (10_000, 0, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_are_reused_and_bits_do_not_leak(backend: str) -> None:
    ix = InvertedIndex(BACKENDS[backend])
    for i in range(5):
        ix.add_instance((f"w{i}", 0), "m")
        ix.store((f"w{i}", 0), 0, [1, 2, 3])
    ix.drop_instance(("w1", 0))
    ix.add_instance(("new", 0), "m")
    # The new instance reuses the freed slot but inherits none of its blocks.
    assert ix.match("m", [1, 2, 3], [("new", 0)]) == {}
    assert ix.match("m", [1, 2, 3], [("w2", 0)])[("w2", 0)].length == 3
    assert ix.match("unknown", [1]) == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_under_heavy_churn(backend: str) -> None:
    """Many keys, clustered and random, stored and removed in waves: growth, shrink, and deletions
    that shift probe runs must never lose or invent a key."""
    import random

    rng = random.Random(7)
    impl = BACKENDS[backend] or __import__("kvindex.index._native", fromlist=["x"])
    table = impl.BlockTable()
    log = impl.KeyLog()
    truth: dict[int, int] = {}
    universe = list(range(20_000)) + [rng.getrandbits(64) for _ in range(20_000)]
    for wave in range(6):
        bit = 1 << (wave % 3)
        add = rng.sample(universe, 15_000)
        n, x = table.add_bit(add, bit, log)
        newly = [k for k in dict.fromkeys(add) if not truth.get(k, 0) & bit]
        assert (n, x) == (len(newly), _xor(newly))
        for k in add:
            truth[k] = truth.get(k, 0) | bit
        gone = rng.sample(universe, 20_000)
        expected = [k for k in dict.fromkeys(gone) if truth.get(k, 0) & bit]
        assert table.remove_bit(gone, bit) == (len(expected), _xor(expected))
        for k in expected:
            truth[k] ^= bit
            if not truth[k]:
                del truth[k]
        assert len(table) == len(truth)
        assert all(table.get_mask(k) == v for k, v in truth.items())
        assert sorted(table.items()) == sorted(truth.items())
    # Clearing bit 1 everywhere through the log, then the table holds only other bits.
    live = table.compact_log(log, 1)
    assert live == sum(1 for v in truth.values() if v & 1)
    assert table.clear_logged(log, 1) == live
    assert all(not v & 1 for _k, v in table.items())


def _xor(keys: list[int]) -> int:
    out = 0
    for k in keys:
        out ^= k
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_instances_span_banks(backend: str) -> None:
    import random

    rng = random.Random(3)
    ix = InvertedIndex(BACKENDS[backend])
    chain = [rng.getrandbits(64) for _ in range(40)]
    want = {}
    for i in range(150):
        inst = (f"w{i}", 0)
        ix.add_instance(inst, "m")
        n = rng.randrange(0, 41)
        ix.store(inst, rng.randrange(0, 3), chain[:n])
        want[inst] = n
    pool = ("pool", 0)
    ix.add_instance(pool, "m")  # slot 150: bank 2
    got = ix.match("m", chain)
    assert {i: m.length for i, m in got.items() if i != pool} == {i: n for i, n in want.items() if n}
    ix.store(pool, 3, chain[:40])
    got = ix.match("m", chain)
    assert all(m.length == 40 for m in got.values())
    assert got[("w0", 0)].tiers[3] == 40 - want[("w0", 0)]
    assert ix.match("m", chain, [("w149", 0)])[("w149", 0)].length == 40


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, deadline=None)
@given(
    held=st.sets(st.sampled_from(POOL)),
    churn=st.lists(st.sampled_from(POOL), max_size=6),
    want=st.sets(st.sampled_from(POOL)),
    budget=st.integers(1, 5),
)
def test_stepwise_diff_agrees_with_sets(backend: str, held: set, churn: list, want: set, budget: int) -> None:
    ix = InvertedIndex(BACKENDS[backend])
    inst, other = ("w", 0), ("x", 0)
    ix.add_instance(inst, "m")
    ix.add_instance(other, "m")
    ix.store(other, 0, list(want))  # another holder of the same keys must not confuse the diff
    ix.store(inst, 0, list(held) + churn)
    ix.remove(inst, 0, churn)  # leaves stale entries in the key log
    truth = held - set(churn)
    differ = ix.differ(inst, 0, list(want))
    while not differ.step(budget):
        pass
    assert sorted(differ.missing) == sorted(want - truth)
    assert sorted(differ.extra) == sorted(truth - want)


TIER_NAMES = ("gpu", "cpu", "disk", "shared")
event_st = st.one_of(
    st.builds(lambda t, k: Stored(TIER_NAMES[t], k), tier_st, keys_st),
    st.builds(lambda t, k: Removed(TIER_NAMES[t], k), tier_st, keys_st),
    st.builds(lambda t: Cleared(None if t is None else TIER_NAMES[t]), st.none() | tier_st),
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.tuples(inst_st, st.lists(event_st, max_size=12)), max_size=12))
def test_batch_apply_agrees_with_brute_force(backend: str, batches: list) -> None:
    """``apply`` (one call per decoded batch, the consumer's path) against sets, event by event."""
    ix = InvertedIndex(BACKENDS[backend])
    ref = Brute()
    for inst, events in batches:
        ix.add_instance(inst, MODEL_OF[inst])
        ref.ensure(inst)
        sets = ref.held[inst]
        want = [0] * 6
        local = False
        for ev in events:
            if ev.op == CLEARED:
                tiers = range(N_TIERS) if ev.tier is None else [TIER_BY_NAME[ev.tier]]
                want[2] += sum(len(sets[t]) for t in tiers)
                want[5] += 1
                for t in tiers:
                    sets[t] = set()
                continue
            t = TIER_BY_NAME[ev.tier]
            if ev.op == STORED:
                want[0] += len(set(ev.keys) - sets[t])
                want[3] += 1
                sets[t] |= set(ev.keys)
                local |= t != SHARED
            else:
                want[1] += len(set(ev.keys) & sets[t])
                want[4] += 1
                sets[t] -= set(ev.keys)
        assert ix.apply(inst, events) == Applied(*want, local)
    for inst, sets in ref.held.items():
        assert ix.block_counts(inst) == tuple(len(s) for s in sets)
        for t in range(N_TIERS):
            assert sorted(ix.keys_of(inst, t)) == sorted(sets[t])
            assert ix.digest(inst, t) == (len(sets[t]), reduce(xor, sets[t], 0))
    for model in ("m1", "m2"):
        assert ix.match(model, POOL) == ref.match(model, POOL, INSTANCES)


_TIER_NAME = {n: name for name, n in TIER_BY_NAME.items()}

# Slots in banks 0, 1, 64 and 65 of one model: with 66 banks a summary bit stands for two banks
# (bit b >> 1), so banks 0 and 1 share one, and 64 and 65 another.
_BANKED = [0, 1, 64, 64 * 64, 65 * 64 + 3]
banked_st = st.sampled_from(range(len(_BANKED)))
banked_op_st = st.one_of(
    st.tuples(st.just("store"), banked_st, tier_st, keys_st),
    st.tuples(st.just("remove"), banked_st, tier_st, keys_st),
    st.tuples(st.just("clear"), banked_st, st.none() | tier_st, st.just([])),
    st.tuples(st.just("apply"), banked_st, tier_st, keys_st),
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(ops=st.lists(banked_op_st, max_size=30), queries=st.lists(keys_st, max_size=5))
def test_bank_summaries_stay_exact(backend: str, ops: list, queries: list) -> None:
    ix = InvertedIndex(BACKENDS[backend])
    n = _BANKED[-1] + 1
    names = [(f"f{s}", 0) for s in range(n)]
    for inst in names:
        ix.add_instance(inst, "m")
    actors = [names[s] for s in _BANKED]
    held = {a: [set() for _ in range(N_TIERS)] for a in actors}
    for op, who, tier, keys in ops:
        inst = actors[who]
        if op == "store":
            ix.store(inst, tier, keys)
            held[inst][tier] |= set(keys)
        elif op == "apply":
            name = _TIER_NAME[tier]
            ix.apply(inst, [Removed(keys=keys[:2], tier=name), Stored(keys=keys, tier=name)])
            held[inst][tier] -= set(keys[:2])
            held[inst][tier] |= set(keys)
        elif op == "remove":
            ix.remove(inst, tier, keys)
            held[inst][tier] -= set(keys)
        else:
            ix.clear(inst, tier)
            for t in range(N_TIERS) if tier is None else [tier]:
                held[inst][t] = set()
    shard = ix._shards["m"]
    assert shard.summaries is not None
    for t in range(N_TIERS):
        want: dict[int, int] = {}
        for b, bank in enumerate(shard.banks):
            for key, _mask in bank.tiers[t].items():
                want[key] = want.get(key, 0) | 1 << (b >> bank_shift(len(shard.banks)))
        assert dict(shard.summaries[t].items()) == want
    # The GPU summary's holder counts (the match's shortcut for blocks every instance holds).
    gpu_holders: dict[int, int] = {}
    for bank in shard.banks:
        for key, mask in bank.tiers[0].items():
            gpu_holders[key] = gpu_holders.get(key, 0) + mask.bit_count()
    assert {k: shard.summaries[0].holders(k) for k, _m in shard.summaries[0].items()} == gpu_holders
    pooled = set().union(*(h[SHARED] for h in held.values()))
    for keys in queries:
        expect = {inst: m for inst, tiers in held.items() if (m := _set_match(tiers, keys, pooled))}
        if keys and keys[0] in pooled:  # every instance of the model matches the pool's blocks
            got = {i: m for i, m in ix.match("m", keys).items() if i in held}
        else:
            got = ix.match("m", keys)
        assert got == expect
        assert _flatten_groups(ix, "m", keys, None) == ix.match("m", keys)
        assert ix.stats().distinct_blocks == tuple(len(s.items()) for s in shard.summaries)


def _flatten_groups(
    ix: InvertedIndex, model: str, keys: list[int], subset: list | None, listed: int = 2
) -> dict:
    """match_groups' answer as match gives it: the listed instances plus every group's members."""
    listed_matches, groups = ix.match_groups(model, keys, subset, listed=listed)
    out = dict(listed_matches)
    _layout, owners = ix.slot_layout(model)
    for group in groups:
        assert group.count > listed
        masks = [int.from_bytes(group.masks[i : i + 8], "little") for i in range(0, len(group.masks), 8)]
        members = [owners[b * 64 + s] for b, m in enumerate(masks) for s in range(64) if m >> s & 1]
        assert len(members) == group.count
        for inst in members:
            assert inst not in out
            out[inst] = group.match
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
    shared=st.integers(0, 12),
    subset=st.booleans(),
    everyone=st.booleans(),
)
def test_fleet_wide_prefix_match_and_groups(
    backend: str, n: int, seed: int, shared: int, subset: bool, everyone: bool
) -> None:
    """Most instances hold one deep prefix on the GPU (a system prompt) and differ in their tails,
    tiers and gaps: the match (which skips the blocks every instance holds, by the GPU summary's
    counts) and the grouped match agree with sets, over one or several banks."""
    import random

    rng = random.Random(seed)
    ix = InvertedIndex(BACKENDS[backend])
    ref = Brute()
    prompt = [rng.getrandbits(64) for _ in range(24)]
    names = [(f"s{i}", 0) for i in range(n)]
    for inst in names:
        MODEL_OF.setdefault(inst, "fleet")
        ix.add_instance(inst, "fleet")
        ref.ensure(inst)
        sets = ref.held[inst]
        kind = rng.random()
        depth = shared if kind < 0.85 else rng.randint(shared if everyone else 0, len(prompt))
        tail = rng.randint(depth, len(prompt)) if rng.random() < 0.1 else depth
        parts = [(0, prompt[:depth])]
        if tail > depth:
            parts.append((rng.choice([0, 0, 1, 2, 3]), prompt[depth:tail]))
        if rng.random() < (0.01 if everyone else 0.05) and depth:
            gap = rng.randrange(depth)  # an evicted middle block
            parts.append((-1, [prompt[gap]]))
        for tier, keys in parts:
            if tier < 0:
                ix.remove(inst, 0, keys)
                sets[0] -= set(keys)
            else:
                ix.store(inst, tier, keys)
                sets[tier] |= set(keys)
    if everyone and n > 64 and shared:
        # Every instance holds the shared prefix but for evicted blocks: the shortcut's case.
        gpu_holders = sum(1 for sets in ref.held.values() if prompt[0] in sets[0])
        # (1 % of instances evict a random block of the prefix: a few may have lost the first one)
        assert gpu_holders >= 0.9 * n
        assert ix._shards["fleet"].summaries[0].holders(prompt[0]) == gpu_holders
    for _ in range(3):
        cut = rng.randint(0, len(prompt))
        keys = prompt[:cut] + ([rng.getrandbits(64)] if rng.random() < 0.3 else [])
        insts = rng.sample(names, rng.randint(1, n)) if subset else None
        want = ref.match("fleet", keys, insts if insts is not None else names)
        assert ix.match("fleet", keys, insts) == want
        assert _flatten_groups(ix, "fleet", keys, insts) == want
    # Instances leave and join: the counts follow (a newcomer holds nothing, so the shortcut stops).
    gone = rng.choice(names)
    ix.drop_instance(gone)
    ref.held.pop(gone)
    ix.add_instance(("late", 0), "fleet")
    MODEL_OF[("late", 0)] = "fleet"
    ref.ensure(("late", 0))
    live = [i for i in names if i != gone] + [("late", 0)]
    want = ref.match("fleet", prompt, live)
    assert ix.match("fleet", prompt) == want
    assert _flatten_groups(ix, "fleet", prompt, None) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_banks_past_the_fleet_wide_prefix(backend: str) -> None:
    """Every instance holds the prompt's first blocks (Mooncake's block 0): only the banks holding
    the next block are walked, the others answer the shared blocks without a walk. Their answers,
    grouped or not, for all instances or some, with a holder of the next block on the CPU, in the
    pool, or none at all, equal the sets'."""
    import random

    rng = random.Random(5)
    ix = InvertedIndex(BACKENDS[backend])
    ref = Brute()
    prompt = [rng.getrandbits(64) for _ in range(8)]
    names = [(f"b{i:03d}", 0) for i in range(300)]  # 5 banks
    for i, inst in enumerate(names):
        MODEL_OF.setdefault(inst, "wide")
        ix.add_instance(inst, "wide")
        ref.ensure(inst)
        depth = 2 + (i % 5 if 128 <= i < 192 else 0)  # bank 2 holds deeper prefixes
        ix.store(inst, 0, prompt[:depth])
        ref.held[inst][0] |= set(prompt[:depth])

    def check() -> None:
        for keys in (prompt, prompt[:2], prompt[:1], [*prompt[:2], 99]):
            for insts in (None, names[::7], names[:3] + names[250:]):
                want = ref.match("wide", keys, insts if insts is not None else names)
                assert ix.match("wide", keys, insts) == want
                assert _flatten_groups(ix, "wide", keys, insts) == want
                assert _flatten_groups(ix, "wide", keys, insts, listed=100) == want

    check()
    ix.store(names[270], 1, prompt[2:4])  # bank 4: the next block on a CPU tier
    ref.held[names[270]][1] |= set(prompt[2:4])
    check()
    ix.add_instance(("pool", 0), "wide")  # a pool holding the next block: every bank is walked
    MODEL_OF[("pool", 0)] = "wide"
    ref.ensure(("pool", 0))
    ix.store(("pool", 0), 0, prompt[:2])  # (on its GPU too: the first blocks stay fleet-wide)
    ref.held[("pool", 0)][0] |= set(prompt[:2])
    ix.store(("pool", 0), 3, prompt[2:3])
    ref.held[("pool", 0)][3] |= set(prompt[2:3])
    names.append(("pool", 0))
    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_within_applies_only_what_fits(backend: str) -> None:
    # The applier's fast check and apply in one call: None and nothing changed where ``bound`` more
    # blocks could pass a tier's limit, else what apply does.
    ix, twin = InvertedIndex(BACKENDS[backend]), InvertedIndex(BACKENDS[backend])
    for index in (ix, twin):
        index.add_instance(("a", 0), "m")
    events = [Stored(tier="gpu", keys=[1, 2, 3]), Removed(tier="gpu", keys=[2])]
    assert ix.apply_within(("a", 0), events, 3, (2, 9, 9, 9)) is None
    assert ix.block_counts(("a", 0)) == (0, 0, 0, 0) and ix.digest_version(("a", 0)) == twin.digest_version(
        ("a", 0)
    )
    assert ix.apply_within(("a", 0), events, 3, (3, 9, 9, 9)) == twin.apply(("a", 0), events)
    assert ix.block_counts(("a", 0)) == twin.block_counts(("a", 0)) == (2, 0, 0, 0)
    assert ix.digest(("a", 0), 0) == twin.digest(("a", 0), 0)
    assert ix.apply_within(("a", 0), events, 2, (3, 9, 9, 9)) is None  # 2 held + 2 could pass 3


def _set_match(tiers: list[set[int]], keys: list[int], pooled: set[int]) -> InstanceMatch | None:
    """What a set model says an instance holding ``tiers`` (GPU, CPU, disk) matches of ``keys``,
    the shared pool's ``pooled`` blocks counting for every instance; None for nothing."""
    counts, n_held = [0, 0, 0, 0], 0
    for k in keys:
        t = next((t for t in range(3) if k in tiers[t]), SHARED if k in pooled else None)
        if t is None:
            break
        counts[t] += 1
        n_held += 1
    return InstanceMatch(n_held, tuple(counts)) if n_held else None


def _range_tables_exact(ix: InvertedIndex, model: str) -> None:
    """Each GPU bank range's table (beyond 128 banks) holds, per key, the range's banks holding it,
    their holder count and the banks whose every instance holds it: what the banks hold."""
    shard = ix._shards[model]
    assert shard.ranges is not None
    shift = bank_shift(len(shard.banks))
    assert len(shard.ranges) == (len(shard.banks) + (1 << shift) - 1) >> shift
    for r, table in enumerate(shard.ranges):
        held: dict[int, int] = {}
        counts: dict[int, int] = {}
        full: dict[int, int] = {}
        for b in range(r << shift, min(len(shard.banks), (r + 1) << shift)):
            bit = 1 << (b - (r << shift))
            for key, mask in shard.banks[b].tiers[0].items():
                held[key] = held.get(key, 0) | bit
                counts[key] = counts.get(key, 0) + mask.bit_count()
                if mask == shard.bank_masks[b]:
                    full[key] = full.get(key, 0) | bit
        assert dict(table.items()) == held
        assert {k: table.holders(k) for k in held} == counts
        assert {k: table.full_banks(k) for k in held if table.full_banks(k)} == full


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), subset=st.booleans())
def test_bank_ranges_answer_like_sets(backend: str, seed: int, subset: bool) -> None:
    """Deployments of 700 instances over 130+ banks (ranges of 4 banks: their tables), each holding
    its prompts' first block but for a few, some a second or deeper block, on the GPU, CPU or in the
    pool; instances leave (a bank whose every remaining instance holds a block) and join (one that
    holds nothing). Matches and grouped matches equal the sets', and the range tables stay exact
    (they are built when the 129th bank comes, over what the first 128 hold)."""
    import random

    rng = random.Random(seed)
    ix = InvertedIndex(BACKENDS[backend])
    deployments = 12  # 8,400 instances: 132 banks
    size = 700
    firsts = [rng.getrandbits(64) for _ in range(deployments)]
    seconds = [[rng.getrandbits(64) for _ in range(3)] for _ in range(deployments)]
    deep = rng.getrandbits(64)
    names = [(f"d{i}", 0) for i in range(deployments * size)]
    held: dict[tuple[str, int], list[set[int]]] = {}
    for i, inst in enumerate(names):
        ix.add_instance(inst, "m")
        held[inst] = [set() for _ in range(N_TIERS)]
        dep = i // size
        if i % 97 == 5:  # (holds nothing: its bank is not whole for the first block)
            continue
        chain = [firsts[dep]]
        u = rng.random()
        if u < 0.02:
            chain.append(seconds[dep][rng.randrange(3)])
            if rng.random() < 0.5:
                chain.append(deep)
        tier = 1 if u < 0.005 else 0
        ix.store(inst, 0, chain[:1])
        held[inst][0].add(chain[0])
        if len(chain) > 1:
            ix.store(inst, tier, chain[1:])
            held[inst][tier] |= set(chain[1:])
    if rng.random() < 0.3:  # a pool copy of one deployment's second block
        ix.store(names[3], SHARED, seconds[1][:1])
        held[names[3]][SHARED].add(seconds[1][0])

    def check() -> None:
        live = list(held)
        pooled = set().union(*(h[SHARED] for h in held.values()))
        for _ in range(6):
            dep = rng.randrange(deployments)
            keys = [firsts[dep], seconds[dep][rng.randrange(3)], deep, rng.getrandbits(64)]
            keys = keys[: rng.randint(1, 4)]
            insts = rng.sample(live, rng.randint(1, len(live))) if subset else None
            want = {
                inst: m
                for inst in (live if insts is None else insts)
                if (m := _set_match(held[inst], keys, pooled))
            }
            assert ix.match("m", keys, insts) == want
            assert _flatten_groups(ix, "m", keys, insts, listed=16) == want
        _range_tables_exact(ix, "m")

    check()
    for inst in rng.sample(list(held), 300):  # leaves: some banks become whole for a block
        ix.drop_instance(inst)
        del held[inst]
    check()
    for j in range(200):  # joins into the freed slots: their banks are whole for nothing
        inst = (f"late{j}", 0)
        ix.add_instance(inst, "m")
        held[inst] = [set() for _ in range(N_TIERS)]
        if j % 3:
            ix.store(inst, 0, [firsts[j % deployments]])
            held[inst][0].add(firsts[j % deployments])
    check()
