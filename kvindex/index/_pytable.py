"""Pure-Python twin of _native.pyx (same API), used where the extension could not be built.

It is the readable statement of what the native loops do, and the property tests run it against the
same brute-force model as the native table. It is several times slower and uses ~5x the memory.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

# Event operations (kvindex.wire.schema numbers; the index does not import the wire layer).
_STORED = 0
_CLEARED = 2
_SHARED = 3
_COMPACT_SLACK = 1024  # see inverted.py


class KeyLog:
    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = array("Q")

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[int]:
        return iter(self.data)

    def nbytes(self) -> int:
        return self.data.buffer_info()[1] * self.data.itemsize

    def reset(self) -> None:
        self.data = array("Q")


def KeyArray(keys: list[int], xor: int = 0) -> list[int]:  # named like the native class
    """See _native.KeyArray: the keys (XORed with ``xor``: a KV-cache group's), checked once per match."""
    for key in keys:
        if not 0 <= key < 1 << 64:
            raise OverflowError("keys are unsigned 64-bit integers")
    return [k ^ xor for k in keys] if xor else keys


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class Differ:
    """Same interface as the native Differ; the pure-Python twin does all the work up front."""

    def __init__(self, result: tuple[list[int], list[int]]) -> None:
        self.missing, self.extra = result

    def step(self, budget: int = 16384) -> bool:
        return True


class BlockTable:
    __slots__ = ("_d", "counts", "full", "group_bit", "occupied", "siblings", "summary")

    def __init__(self, capacity: int = 16) -> None:
        self._d: dict[int, int] = {}
        self.summary: BlockTable | None = None  # see _native.BlockTable: banks holding each key
        self.group_bit = 0
        self.siblings: list[BlockTable] = []
        self.counts: dict[int, int] | None = None  # a GPU summary's holder counts (_native: aux)
        self.full: dict[int, int] | None = None  # a range table's banks every instance of holds a key
        self.occupied = 0  # a bank's instances' slots (its range table's ``full``)

    def enable_counts(self) -> None:
        if self.counts is None:
            self.counts = {}

    def enable_full(self) -> None:
        if self.full is None:
            self.full = {}

    def full_banks(self, key: int) -> int:
        return 0 if self.full is None else self.full.get(key, 0)

    def set_occupied(self, occupied: int, log: KeyLog | None = None) -> None:
        """See _native.BlockTable.set_occupied (``log``: the GPU keys of an instance that stays)."""
        old, self.occupied = self.occupied, occupied
        summary = self.summary
        if summary is None or summary.full is None or old == occupied or log is None:
            return
        for key in log.data:
            held = self._d.get(key, 0)
            if held and (held == old) != (held == occupied) and key in summary._d:
                summary._set_full(key, self.group_bit, held == occupied)

    def _set_full(self, key: int, bit: int, on: bool) -> None:
        assert self.full is not None
        full = (self.full.get(key, 0) | bit) if on else (self.full.get(key, 0) & ~bit)
        if full:
            self.full[key] = full
        else:
            self.full.pop(key, None)

    def holders(self, key: int) -> int:
        return 0 if self.counts is None else self.counts.get(key, 0)

    def _add_holder(self, key: int, bit: int, new_bit: bool, n: int, all_hold: bool = False) -> None:
        """See _native: this table is a summary, ``n`` more holders of ``key`` under ``bit``
        (``all_hold``: every instance of that bank holds it now)."""
        if not new_bit and self.counts is None:
            return
        held = self._d.get(key, 0)
        self._d[key] = held | bit
        if self.counts is not None:
            self.counts[key] = self.counts.get(key, 0) + n
        if all_hold and self.full is not None:
            self._set_full(key, bit, True)
        if self.summary is not None:
            self.summary._add_holder(key, self.group_bit, not held & bit, n)

    def _drop_holder(self, key: int, bit: int, gone: bool) -> None:
        """See _native: one holder fewer (``gone``: none left under ``bit``)."""
        if not gone and self.counts is None:
            return
        held = self._d.get(key, 0)
        if not held:
            return
        if self.counts is not None:
            left = self.counts.get(key, 0) - 1
            if left:
                self.counts[key] = left
            else:
                self.counts.pop(key, None)
        if self.full is not None:
            self._set_full(key, bit, False)
        emptied = False
        if gone:
            held &= ~bit
            if held:
                self._d[key] = held
            else:
                del self._d[key]
                emptied = True
        if self.summary is not None:
            self.summary._drop_holder(key, self.group_bit, emptied)

    def _left(self, key: int, gone: bool) -> None:
        if gone and any(key in sib._d for sib in self.siblings):
            gone = False
        assert self.summary is not None
        self.summary._drop_holder(key, self.group_bit, gone)

    def link_summary(self, summary: BlockTable, group_bit: int) -> None:
        self.summary = summary
        self.group_bit = group_bit
        for key, held in self._d.items():
            n = self.counts.get(key, 0) if self.counts is not None else held.bit_count()
            summary._add_holder(key, group_bit, True, n, held == self.occupied)

    def set_siblings(self, siblings: list[BlockTable]) -> None:
        self.siblings = siblings

    def add_bit(self, keys: Iterable[int], bit: int, log: KeyLog) -> tuple[int, int]:
        d = self._d
        added = 0
        x = 0
        push = log.data.append
        for key in keys:
            if not 0 <= key < 1 << 64:
                raise OverflowError("keys are unsigned 64-bit integers")
            held = d.get(key, 0)
            if held & bit:
                continue
            d[key] = held | bit
            if self.summary is not None:
                self.summary._add_holder(key, self.group_bit, not held, 1, held | bit == self.occupied)
            added += 1
            x ^= key
            push(key)
        return added, x

    def remove_bit(self, keys: Iterable[int], bit: int) -> tuple[int, int]:
        d = self._d
        removed = 0
        x = 0
        for key in keys:
            held = d.get(key, 0)
            if held & bit:
                if held == bit:
                    del d[key]
                else:
                    d[key] = held ^ bit
                if self.summary is not None:
                    self._left(key, held == bit)
                removed += 1
                x ^= key
        return removed, x

    def clear_logged(self, log: KeyLog, bit: int) -> int:
        return self.remove_bit(log.data, bit)[0]

    def compact_log(self, log: KeyLog, bit: int) -> int:
        d = self._d
        live = [k for k in dict.fromkeys(log.data) if d.get(k, 0) & bit]
        log.data = array("Q", live)
        return len(live)

    def differ(self, log: KeyLog, bit: int, want_keys: list[int], held: int) -> Differ:
        return Differ(self.diff_logged(log, bit, want_keys))

    def diff_logged(self, log: KeyLog, bit: int, want_keys: Iterable[int]) -> tuple[list[int], list[int]]:
        d = self._d
        want = set(want_keys)
        held = {k for k in log.data if d.get(k, 0) & bit}
        return [k for k in want if k not in held], [k for k in held if k not in want]

    def get_mask(self, key: int) -> int:
        return self._d.get(key, 0)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def capacity(self) -> int:
        return len(self._d)

    def nbytes(self) -> int:
        return 0

    def items(self) -> list[tuple[int, int]]:
        return list(self._d.items())


def apply_events(
    events: list[Any],
    tier_numbers: dict[Any, int],
    tables: list[BlockTable],
    logs: list[KeyLog],
    bit: int,
    counts: list[int],
    xors: list[int],
    result_type: Any,
    group_masks: tuple[int, ...] = (0,),
) -> Any:
    """See _native.apply_events: a batch's events in order, one call."""
    added = removed = cleared = local = top_group = 0
    n_ev = [0, 0, 0]
    for ev in events:
        n_ev[ev.op] += 1
        if ev.op == _CLEARED:
            for t in range(len(tables)) if ev.tier is None else (tier_numbers[ev.tier],):
                if counts[t]:
                    tables[t].clear_logged(logs[t], bit)
                    cleared += counts[t]
                counts[t] = xors[t] = 0
                logs[t].reset()
            continue
        t = tier_numbers[ev.tier]
        top_group = max(top_group, ev.group)
        mask = group_masks[ev.group]
        keys = [k ^ mask for k in ev.keys] if mask else ev.keys
        if ev.op == _STORED:
            a, x = tables[t].add_bit(keys, bit, logs[t])
            counts[t] += a
            added += a
            local |= t != _SHARED
        else:
            a, x = tables[t].remove_bit(keys, bit)
            counts[t] -= a
            removed += a
            if len(logs[t]) > 2 * counts[t] + _COMPACT_SLACK:
                tables[t].compact_log(logs[t], bit)
        xors[t] ^= x
    return result_type(added, removed, cleared, *n_ev, bool(local), top_group)


def match_gpu(gpu: BlockTable, keys: list[int], alive: int, start: int = 0) -> list[tuple[int, int]]:
    get = gpu._d.get
    out = []
    for i in range(start, len(keys)):
        key = keys[i]
        still = alive & get(key, 0)
        if still != alive:
            if i:
                out += [(slot, i) for slot in _bits(alive ^ still)]
            alive = still
            if not alive:
                return out
    return out + [(slot, len(keys)) for slot in _bits(alive)]


def match_gpu_into(
    gpu: BlockTable,
    keys: list[int],
    alive: int,
    owners: list[Any],
    out: dict[Any, Any],
    same: dict[int, Any],
    match_type: Any,
) -> None:
    """See _native.match_gpu_into."""
    for slot, n in match_gpu(gpu, keys, alive):
        m = same.get(n)
        if m is None:
            m = same[n] = tuple.__new__(match_type, (n, (n, 0, 0, 0)))
        out[owners[slot]] = m


def match_tiered(
    gpu: BlockTable,
    cpu: BlockTable,
    disk: BlockTable,
    pools: list[BlockTable],
    keys: list[int],
    alive: int,
    start: int = 0,
) -> list[tuple[int, int, int, int, int, int]]:
    lengths: dict[int, int] = {}
    counts: dict[int, list[int]] = {slot: [start, 0, 0, 0] for slot in _bits(alive)} if start else {}
    n = len(keys)
    for i in range(start, n):
        key = keys[i]
        on_gpu = alive & gpu._d.get(key, 0)
        rest = alive ^ on_gpu
        on_cpu = rest & cpu._d.get(key, 0)
        rest ^= on_cpu
        on_disk = rest & disk._d.get(key, 0)
        rest ^= on_disk
        in_pool = rest if any(key in p._d for p in pools) else 0
        for tier, mask in enumerate((on_gpu, on_cpu, on_disk, in_pool)):
            for slot in _bits(mask):
                counts.setdefault(slot, [0, 0, 0, 0])[tier] += 1
        still = alive ^ rest ^ in_pool
        for slot in _bits(alive ^ still):
            lengths[slot] = i
        alive = still
        if not alive:
            break
    for slot in _bits(alive):
        lengths[slot] = n
    return [(slot, m, *counts[slot]) for slot, m in sorted(lengths.items()) if m]  # type: ignore[misc]


def match_banks_into(
    bank_tiers: list[list[BlockTable]],
    alive: list[int],
    bank_owners: list[list[Any]],
    summaries: list[BlockTable] | None,
    pools: list[BlockTable],
    keys: list[int],
    out: dict[Any, Any],
    same: dict[int, Any],
    match_type: Any,
    everyone: int = -1,
    ranges: list[BlockTable] | None = None,
) -> None:
    """See _native.match_banks_into: the banks holding the first block (summaries), each walked (the
    bank ranges' tables, which spare the native match walks, change no answer)."""
    if not keys:
        return
    walk = _walk_banks(bank_tiers, alive, summaries, pools, keys, everyone, bank_owners)
    for _b, owners, (slot, n, g, c, d, s) in walk:
        out[owners[slot]] = (
            same.setdefault(n, tuple.__new__(match_type, (n, (n, 0, 0, 0))))
            if (g, c, d, s) == (n, 0, 0, 0)
            else tuple.__new__(match_type, (n, (g, c, d, s)))
        )


def _walk_banks(
    bank_tiers: list[list[BlockTable]],
    alive: list[int],
    summaries: list[BlockTable] | None,
    pools: list[BlockTable],
    keys: list[int],
    everyone: int,
    bank_owners: list[list[Any]] | None = None,
) -> Iterator[tuple[int, Any, tuple[int, int, int, int, int, int]]]:
    """Per matched slot: (bank, its owners, (slot, matched, gpu, cpu, disk, shared))."""
    first = keys[0]
    groups = -1  # every bank
    start = 0
    if summaries is not None:
        if everyone > 0 and summaries[0].counts is not None:
            while start < len(keys) and summaries[0].holders(keys[start]) == everyone:
                start += 1
        if not start and not summaries[_SHARED].get_mask(first):
            groups = (
                summaries[0].get_mask(first) | summaries[1].get_mask(first) | summaries[2].get_mask(first)
            )
    shift = 0
    while 64 << shift < len(bank_tiers):  # a bank's summary bit: b >> shift (inverted.bank_shift)
        shift += 1
    for b, tiers in enumerate(bank_tiers):
        mask = alive[b]
        if not mask or not (groups >> (b >> shift)) & 1:
            continue
        gpu, cpu, disk = tiers[0], tiers[1], tiers[2]
        owners = bank_owners[b] if bank_owners is not None else None
        if pools or len(cpu) or len(disk):
            for row in match_tiered(gpu, cpu, disk, pools, keys, mask, start):
                yield b, owners, row
        else:
            for slot, n in match_gpu(gpu, keys, mask, start):
                yield b, owners, (slot, n, n, 0, 0, 0)


def match_banks_grouped(
    bank_tiers: list[list[BlockTable]],
    alive: list[int],
    bank_owners: list[list[Any]],
    summaries: list[BlockTable] | None,
    pools: list[BlockTable],
    keys: list[int],
    out: dict[Any, Any],
    match_type: Any,
    everyone: int = -1,
    listed: int = -1,
    ranges: list[BlockTable] | None = None,
) -> list[list[Any]]:
    """See _native.match_banks_grouped: small answers into ``out``, ``[match, count, masks]`` of
    the larger ones."""
    if not keys:
        return []
    nb = len(bank_tiers)
    groups: dict[Any, list[Any]] = {}
    for b, owners, (slot, n, g, c, d, s) in _walk_banks(
        bank_tiers, alive, summaries, pools, keys, everyone, bank_owners
    ):
        m = tuple.__new__(match_type, (n, (g, c, d, s)))
        entry = groups.get(m)
        if entry is None:
            entry = groups[m] = [m, [], [0] * nb]
        entry[1].append(owners[slot])
        entry[2][b] |= 1 << slot
    large = []
    for m, members, masks in groups.values():
        if len(members) > listed:
            large.append([m, len(members), b"".join(x.to_bytes(8, "little") for x in masks)])
        else:
            for inst in members:
                out[inst] = m
    return large


# -- hybrid-attention groups (kvindex/index/hybrid.py) --------------------------------------------

_FULL, _SLIDING, _CHUNKED, _MAMBA = 0, 1, 2, 3


def hybrid_hits(
    tiers: list[BlockTable],
    pools: list[BlockTable],
    keys: list[int],
    rules: list[tuple[int, int, tuple[int, ...]]],
    slots: list[int],
    bounds: list[int],
    block_size: int,
) -> list[int]:
    """See _native.hybrid_hits: per slot of one bank, the tokens every rule group lets it reuse,
    starting from its bound (tokens), by the fixed point of hybrid.hit_tokens. ``rules`` are
    (rule, param, member masks); a block counts for a rule group where every member holds its group
    key on some tier of the slot's bank, or in the shared pool."""
    cache: list[dict[int, int]] = [{} for _ in rules]

    def held(r: int, j: int) -> int:
        m = cache[r].get(j)
        if m is None:
            m = -1
            for gm in rules[r][2]:
                key = keys[j] ^ gm
                if any(pool.get_mask(key) for pool in pools):
                    continue
                m &= tiers[0].get_mask(key) | tiers[1].get_mask(key) | tiers[2].get_mask(key)
                if not m:
                    break
            cache[r][j] = m
        return m

    out = []
    for slot, bound in zip(slots, bounds, strict=True):
        bit = 1 << slot
        length = bound
        while True:
            before = length
            for r, (rule, param, _masks) in enumerate(rules):
                blocks = length // block_size
                if rule in (_FULL, _CHUNKED):
                    j = 0
                    if rule == _CHUNKED:
                        j = (length // param * param if length > 0 else 0) // block_size
                    while j < blocks and held(r, j) & bit:
                        j += 1
                    length = j * block_size
                elif rule == _SLIDING:
                    run = 0
                    hit = -1
                    for j in range(blocks - 1, -1, -1):
                        if held(r, j) & bit:
                            run += 1
                            if run >= param:
                                hit = j + run
                                break
                        else:
                            run = 0
                    length = (run if hit < 0 else hit) * block_size
                else:  # Mamba
                    j = blocks - 1
                    while j >= 0 and not held(r, j) & bit:
                        j -= 1
                    length = (j + 1) * block_size
            if length >= before:
                break
        out.append(length)
    return out


def tier_split(
    tiers: list[BlockTable], pools: list[BlockTable], keys: list[int], bit: int, n: int
) -> tuple[int, int, int, int]:
    """Blocks per fastest tier among the first ``n`` of ``keys`` for the slot of ``bit`` (pool: 3)."""
    counts = [0, 0, 0, 0]
    for j in range(n):
        key = keys[j]
        for t in range(3):
            if tiers[t].get_mask(key) & bit:
                counts[t] += 1
                break
        else:
            counts[_SHARED] += 1
    return (counts[0], counts[1], counts[2], counts[3])


def match_hybrid_into(
    bank_tiers: list[list[BlockTable]],
    alive: list[int],
    bank_owners: list[list[Any]],
    summaries: list[BlockTable] | None,
    pools: list[BlockTable],
    walked: list[int] | None,
    keys: list[int],
    rules: list[tuple[int, int, tuple[int, ...]]],
    limit: int,
    block_size: int,
    out: dict[Any, Any],
    match_type: Any,
    everyone: int = -1,
    reach: dict[Any, int] | None = None,
) -> None:
    """See _native.match_hybrid_into: the walked group's prefix per slot, lowered by the rules."""
    n = len(keys)
    top = min(n * block_size, limit)
    rows: list[tuple[int, Any, int, int, tuple[int, int, int, int] | None]]
    if walked is not None:
        rows = [
            (b, owners[slot], slot, length, (g, c, d, s))
            for b, owners, (slot, length, g, c, d, s) in _walk_banks(
                bank_tiers, alive, summaries, pools, walked, everyone, bank_owners
            )
        ]
    else:
        rows = [
            (b, owners[slot], slot, n, None)
            for b, owners in enumerate(bank_owners)
            for slot in _bits(alive[b])
        ]
    by_bank: dict[int, list[tuple[Any, int, int, Any]]] = {}
    for b, owner, slot, length, split in rows:
        by_bank.setdefault(b, []).append((owner, slot, length, split))
    for b, members in by_bank.items():
        tiers = bank_tiers[b]
        bounds = [min(length * block_size, top) for _o, _s, length, _t in members]
        hits = hybrid_hits(tiers, pools, keys, rules, [s for _o, s, _l, _t in members], bounds, block_size)
        for (owner, slot, length, split), hit, bound in zip(members, hits, bounds, strict=True):
            blocks = hit // block_size
            if reach is not None and walked is not None and hit < bound:
                reach[owner] = bound // block_size
            if not blocks:
                continue
            if split is not None and blocks == length:
                out[owner] = tuple.__new__(match_type, (blocks, split))
            else:
                walk = walked if walked is not None else keys
                out[owner] = tuple.__new__(
                    match_type, (blocks, tier_split(tiers, pools, walk, 1 << slot, blocks))
                )
