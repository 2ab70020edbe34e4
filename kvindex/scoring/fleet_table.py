"""Per-model columns of instance state, kept current at heartbeats and commits, for pruned rankings.

An instance that holds nothing of a prompt costs ``wait + prefill(all) + 0 fetch``: its terms depend
only on its own state (last heartbeat's load, requests routed since) and on the request's length.
This table keeps that state in numpy columns, one row per instance of a model, updated when it
changes: the registry and the ledger report which instances changed (``Registry.watch``,
``Ledger.watch``) and ``refresh`` rewrites just those rows before the next ranking. A ranking then
builds full ``Candidate`` objects only for the instances that hold some of the prompt and for the
few best others, and selects those others with a handful of vector operations instead of a Python
object per instance (ranker.py, ``Ranker.score`` with ``top_k``).

The rows are priced by the cost model's row loops (kvindex/scoring/costs.py ``wait_rows``: the
definition itself, compiled), so a value computed here is the candidates' (tests/unit/test_cost_forms.py
compares them on random inputs, tests/unit/test_pruned_ranking.py the rankings against the exhaustive
path over random fleets).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.instance import InstanceKey
from kvindex.scoring.costs import wait_rows
from kvindex.scoring.ledger import Ledger
from kvindex.wire.schema import Load

try:
    from kvindex.scoring._kernels import rendezvous_weights as _native_weights
except ImportError:  # no compiler at install time
    _native_weights = None

_xxh3 = xxhash.xxh3_64_intdigest
# Per row, what the rankings read (sums are kept here: a sum per row at a heartbeat is cheaper than a
# vector sum per request). Written by ``ModelTable.write``, in this order.
_FLOAT_COLS = (
    "queued",  # waiting_prefill_tokens of the last heartbeat
    "heartbeat_at",  # its local time (0 when none)
    "tokens_new",  # ledger: prefill tokens routed since that heartbeat
    "queued_now",  # queued + tokens_new (the wait's input where the queue does not drain)
    "running_now",  # running + requests routed since
    "kv",  # kv_usage
    "load",  # running + waiting + in flight (Candidate.load)
    "queue",  # waiting + in flight (llmd's queue)
    "busy_until",  # ledger: when the prefill work routed there ends (0 when none; costs.ledger_ms)
)
_BOOL_COLS = ("drains", "routable")  # a reported queue and a heartbeat time; not a pool, not stale
# A row's values, in that order (float64 holds the ints and bools exactly).
Row = tuple[float, ...]


def rendezvous_weights(ids: list[bytes], seed: int) -> np.ndarray:
    """kvindex.scoring.home's weights, ``xxh3_64(id, seed)`` per id, as a uint64 array."""
    out = np.empty(len(ids), dtype=np.uint64)
    if _native_weights is not None:
        _native_weights(ids, seed & 0xFFFFFFFFFFFFFFFF, out)
    else:
        out[:] = [_xxh3(i, seed & 0xFFFFFFFFFFFFFFFF) for i in ids]
    return out


class ModelTable:
    """One model's instances as rows; columns are float64 (exact for the integers involved)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.n = 0
        self.version = 0  # bumped when rows move (membership): cached per-row data is then stale
        self.row: dict[InstanceKey, int] = {}
        self.states: list[InstanceState] = []
        # Per row, the Load and capacity its values were last computed from, when only its heartbeat
        # time can change them while those stay (see FleetTables.refresh); None: not so. Lists, not
        # a tuple per row: no container is made per heartbeat that the collector would track.
        self.basis_load: list[object] = []
        self.basis_capacity: list[object] = []
        self.ids: list[bytes] = []
        self.by_worker: dict[str, set[InstanceKey]] = {}
        cap = 16
        # The columns are rows of two blocks (views), so that a refresh writes all of them for all
        # its rows in two assignments; each column stays contiguous for the rankings' vector work.
        self._floats = np.zeros((len(_FLOAT_COLS), cap))
        self._bools = np.zeros((len(_BOOL_COLS), cap), dtype=bool)
        self._views()
        self.key_rank = np.zeros(cap, dtype=np.int64)
        self._ranks_stale = False
        self._weights: OrderedDict[int, np.ndarray] = OrderedDict()
        # Derived per-row data kept across requests (a large fleet mostly does not change between
        # two requests): ``writes`` counts every change of the rows' values or membership.
        self.writes = 0
        self._written: list[int] = []  # rows written since the waits were last brought up to date
        self._waits: _Waits | None = None
        self._tie: np.ndarray | None = None  # see tie_order
        self._tie_writes = -1
        self._tie_asked = -1
        self._routable_rows: np.ndarray | None = None
        self._unroutable_rows: np.ndarray | None = None
        self._unroutable_set: set[int] = set()
        self._routable_listed = -1  # _routable_changes when the routable rows were listed
        self._routable_changes = 0  # bumped when a row's routable flag (or any row) moves

    # -- membership --------------------------------------------------------------------------

    def _views(self) -> None:
        """The columns, as views of the blocks' rows (in _FLOAT_COLS and _BOOL_COLS order)."""
        (
            self.queued,
            self.heartbeat_at,
            self.tokens_new,
            self.queued_now,
            self.running_now,
            self.kv,
            self.load,
            self.queue,
            self.busy_until,
        ) = self._floats
        self.drains, self.routable = self._bools

    def _grow(self) -> None:
        cap = 2 * len(self.routable)
        self._floats = _grown(self._floats, self.n, cap)
        self._bools = _grown(self._bools, self.n, cap)
        self._views()
        key_rank = np.zeros(cap, dtype=np.int64)
        key_rank[: self.n] = self.key_rank[: self.n]
        self.key_rank = key_rank

    def add(self, state: InstanceState) -> int:
        if self.n == len(self.routable):
            self._grow()
        i = self.n
        self.n += 1
        self.row[state.key] = i
        self.states.append(state)
        self.basis_load.append(None)
        self.basis_capacity.append(None)
        self.ids.append(state.instance_id.encode())
        self.by_worker.setdefault(state.worker, set()).add(state.key)
        self._moved()
        return i

    def remove(self, key: InstanceKey) -> None:
        i = self.row.pop(key)
        last = self.n - 1
        if i != last:  # the last row fills the hole
            moved = self.states[last]
            self.states[i] = moved
            self.basis_load[i] = self.basis_load[last]
            self.basis_capacity[i] = self.basis_capacity[last]
            self.ids[i] = self.ids[last]
            self.row[moved.key] = i
            self._floats[:, i] = self._floats[:, last]
            self._bools[:, i] = self._bools[:, last]
        self.states.pop()
        self.basis_load.pop()
        self.basis_capacity.pop()
        self.ids.pop()
        self.routable[last] = False
        self.n = last
        workers = self.by_worker[key[0]]
        workers.discard(key)
        if not workers:
            del self.by_worker[key[0]]
        self._moved()

    def _moved(self) -> None:
        self.version += 1
        self.writes += 1
        self._routable_changes += 1
        self._ranks_stale = True
        self._weights.clear()

    def ranks(self) -> np.ndarray:
        """Each row's position in instance-key order (the rankings' last tie-break)."""
        if self._ranks_stale:
            order = sorted(range(self.n), key=lambda i: self.states[i].key)
            self.key_rank[order] = np.arange(self.n)
            self._ranks_stale = False
        return self.key_rank[: self.n]

    def weights(self, seed: int) -> np.ndarray:
        """Rendezvous weights of every row for ``seed`` (cached per seed until rows move)."""
        w = self._weights.get(seed)
        if w is None:
            w = self._weights[seed] = rendezvous_weights(self.ids, seed)
            if len(self._weights) > 32:  # 8 B per instance each: 2 MB at 8,192 instances
                self._weights.popitem(last=False)
        else:
            self._weights.move_to_end(seed)
        return w

    def rows_of(self, wanted: set[str]) -> list[int]:
        """Rows named by a candidate list (instance ids ``worker/rank`` or bare worker ids)."""
        rows = set()
        for name in wanted:
            for key in self.by_worker.get(name, ()):
                rows.add(self.row[key])
            worker, sep, rank = name.rpartition("/")
            if sep and rank.isdigit():
                i = self.row.get((worker, int(rank)))
                if i is not None:
                    rows.add(i)
        return sorted(rows)

    # -- state -------------------------------------------------------------------------------

    def write(self, rows: list[int], values: list[Row]) -> None:
        """Rows' new values (``row_values``): one conversion, one assignment per block."""
        # float64 holds every value exactly as the column assignments did (ints below 2**53, bools
        # as 0.0 / 1.0, which convert back to the same bools).
        block = np.array(values, dtype=np.float64).T
        nf = len(_FLOAT_COLS)
        routable = block[-1] != 0.0
        if not np.array_equal(self.routable[rows], routable):  # (heartbeats rarely change it)
            self._routable_changes += 1
        self._floats[:, rows] = block[:nf]
        self._bools[:, rows] = block[nf:]
        self.writes += 1
        if len(self._written) <= self.n:  # beyond that, the next waits() recomputes every row
            self._written += rows

    def write_times(self, rows: list[int], times: list[float]) -> None:
        """Rows whose heartbeat time alone moved (their other values are what they were). Only a
        row whose reported queue drains reads the time (its wait), so only those are recomputed."""
        self.heartbeat_at[rows] = times
        if len(self._written) <= self.n:
            index = np.array(rows, dtype=np.int64)
            self._written += index[self.drains[index]].tolist()

    # -- derived columns ---------------------------------------------------------------------

    def routable_rows(self) -> np.ndarray:
        """The routable rows, ascending (cached until the table changes)."""
        if self._routable_listed != self._routable_changes or self._routable_rows is None:
            self._cache_routable()
        return self._routable_rows  # type: ignore[return-value]

    def unroutable_rows(self) -> np.ndarray:
        """The other rows (pools, stale instances), ascending (cached until the table changes)."""
        if self._routable_listed != self._routable_changes or self._unroutable_rows is None:
            self._cache_routable()
        return self._unroutable_rows  # type: ignore[return-value]

    def unroutable_set(self) -> set[int]:
        """``unroutable_rows`` as a set (cached until the table changes)."""
        if self._routable_listed != self._routable_changes or self._unroutable_rows is None:
            self._cache_routable()
        return self._unroutable_set

    def _cache_routable(self) -> None:
        routable = self.routable[: self.n]
        self._routable_rows = np.flatnonzero(routable)
        self._unroutable_rows = np.flatnonzero(~routable)
        self._unroutable_set = set(self._unroutable_rows.tolist())
        self._routable_listed = self._routable_changes

    def waits(
        self, now: float, b_ms: float, step_ms: float, chunk: int, dps: float, drain_rate: float
    ) -> np.ndarray:
        """Per row, the candidates' wait (costs.wait_rows: ``queue_wait`` of the reported queue
        drained until ``now`` plus what was routed since, or the ledger's work left if longer).

        Kept across calls: a row's value changes only when the row is written or while its
        reported queue is still draining or the ledger's work on it not yet over. The drained queue
        ``max(0, q - (now - at) * rate)`` and the work left ``busy_until - now`` are non-increasing
        in ``now`` (every rounding step is monotone), so once both reach 0 they stay 0 and the row
        is not recomputed again until written; a clock that goes back, other engine parameters or
        moved rows recompute everything. The array is the cache itself: read it, do
        not keep or modify it."""
        params = (b_ms, step_ms, chunk, dps, drain_rate)
        cache = self._waits
        n = self.n
        if (
            cache is None
            or cache.params != params
            or cache.version != self.version
            or now < cache.now
            or len(self._written) > n
        ):
            rows = None
        elif self._written:
            # (a row listed twice is computed twice, to the same value, and listed draining once)
            rows = np.concatenate((cache.active, np.array(self._written, dtype=np.int64)))
        elif len(cache.active):
            rows = cache.active
        else:
            cache.now = now
            return cache.wait
        self._written = []
        if rows is None:
            cache = self._waits = _Waits(
                params, self.version, now, np.empty(n), _NO_ROWS, np.zeros(n, np.uint8)
            )
        assert cache is not None
        cache.now = now
        draining = np.empty(n if rows is None else len(rows), dtype=np.int64)
        found = wait_rows(
            self.queued,
            self.heartbeat_at,
            self.tokens_new,
            self.queued_now,
            self.running_now,
            self.busy_until,
            self.drains.view(np.uint8),
            _NO_ROWS if rows is None else rows,
            n if rows is None else len(rows),
            now,
            b_ms,
            step_ms,
            float(chunk),
            dps,
            drain_rate,
            cache.wait,
            draining,
            cache.seen,
        )
        cache.active = draining[:found]
        return cache.wait

    def tie_order(self) -> np.ndarray | None:
        """Each row's position in (kv, load, instance key) order, the rankings' tie-breaks after the
        cost, as one unique column; None while the table keeps changing between requests.

        Sorting costs more than one selection, so it is made only once the table was seen unchanged
        twice in a row (a quiet fleet), and then serves every request until the next change."""
        if self._tie_writes == self.writes:
            return self._tie
        if self._tie_asked != self.writes:
            self._tie_asked = self.writes
            return None
        n = self.n
        order = np.lexsort((self.ranks(), self.load[:n], self.kv[:n]))
        tie = np.empty(n, dtype=np.int64)
        tie[order] = np.arange(n)
        self._tie = tie
        self._tie_writes = self.writes
        return tie


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _grown(block: np.ndarray, n: int, cap: int) -> np.ndarray:
    """A block of columns with room for ``cap`` rows, its first ``n`` copied."""
    new = np.zeros((len(block), cap), dtype=block.dtype)
    new[:, :n] = block[:, :n]
    return new


class _Waits:
    """ModelTable.waits' cache: the wait column at ``now`` and the rows still draining (``seen``:
    the native loop's scratch flags, one per row)."""

    __slots__ = ("active", "now", "params", "seen", "version", "wait")

    def __init__(
        self,
        params: tuple[float, ...],
        version: int,
        now: float,
        wait: np.ndarray,
        active: np.ndarray,
        seen: np.ndarray,
    ) -> None:
        self.params = params
        self.version = version
        self.now = now
        self.wait = wait
        self.active = active
        self.seen = seen


def row_values(state: InstanceState, ledger: Ledger) -> Row:
    """An instance's row, in column order (_FLOAT_COLS, then _BOOL_COLS). (FleetTables.refresh
    builds its rows with the same _row; tests/unit/test_consumer_status.py checks the tables against this.)"""
    load = state.load
    at = state.last_heartbeat_at
    if state.key in ledger.busy:
        n_new, tokens_new, inflight = ledger.pending(state.key, at)
        busy = ledger.busy_until(state.key)
    else:
        n_new = tokens_new = inflight = 0
        busy = 0.0
    return _row(load, at, n_new, tokens_new, inflight, busy, not state.is_pool and not state.stale)


def _row(
    load: Load, at: float | None, n_new: int, tokens_new: int, inflight: int, busy: float, routable: bool
) -> Row:
    q = load.waiting_prefill_tokens
    running, waiting = load.running, load.waiting
    return (
        q,
        0.0 if at is None else at,
        tokens_new,
        q + tokens_new,
        running + n_new,
        load.kv_usage,
        running + waiting + inflight,
        waiting + inflight,
        busy,
        bool(q) and at is not None,
        routable,
    )


class FleetTables:
    """The tables of every model, fed by the registry's and the ledger's change sets."""

    def __init__(self, registry: Registry, ledger: Ledger) -> None:
        self.registry = registry
        self.ledger = ledger
        self.tables: dict[str, ModelTable] = {}
        self._model_of: dict[InstanceKey, str] = {}
        self._registry_changes = registry.watch()
        self._ledger_changes = ledger.watch()
        # Instances that report no capacity and have not published a local block: whether they are
        # pools follows from local blocks seen and batches, which change on every batch and are not
        # watched; those are re-read for them at each refresh (once a local block is seen, only a
        # capacity, which is watched, can change it; bridges report capacity anyway).
        self._unsure: set[InstanceKey] = set()

    def refresh(self) -> None:
        """Bring the rows of every instance that changed since the last call up to date. A hot loop
        (before every pruned ranking, over every instance that changed): kept in one function, its
        reads hoisted."""
        changed = self._registry_changes
        if self._ledger_changes:
            changed |= self._ledger_changes
            self._ledger_changes.clear()
        get = self.registry.get
        if self._unsure:
            for key in self._unsure:
                state = get(key)
                if state is None:
                    changed.add(key)
                    continue
                table = self.tables.get(state.model)
                i = None if table is None else table.row.get(key)
                if i is None or table.routable[i] != (not state.is_pool and not state.stale):  # type: ignore[union-attr]
                    changed.add(key)
        if not changed:
            return
        keys = list(changed)
        changed.clear()
        # Membership first (a removal moves the last row), then every changed row's values, written
        # one block at a time for all of them.
        tables, model_of, unsure = self.tables, self._model_of, self._unsure
        live: list[InstanceState] = []
        rows: list[int] = []  # live's rows, while no row has moved
        moved = False
        for key in keys:
            state = get(key)
            if state is not None:
                # Mostly a heartbeat of a member: its row stays where it is.
                table = tables.get(state.model)
                i = None if table is None else table.row.get(key)
                # (Another state under the same key: forgotten and back since the last refresh. Its
                # row must not keep reading the old one: it is moved like any membership change.)
                if i is not None and table.states[i] is state:  # type: ignore[union-attr]
                    live.append(state)
                    rows.append(i)
                    if not state.capacity and not state.local_blocks_seen:
                        unsure.add(key)
                    elif unsure:
                        unsure.discard(key)
                    continue
            moved = True
            model = model_of.get(key)
            if model is not None:
                table = tables[model]
                table.remove(key)
                del model_of[key]
                if not table.n:
                    del tables[model]
            if state is None:
                unsure.discard(key)
                continue
            table = tables.get(state.model)
            if table is None:
                table = tables[state.model] = ModelTable(state.model)
            table.add(state)
            model_of[key] = state.model
            live.append(state)
            rows.append(-1)
            if not state.capacity and not state.local_blocks_seen:
                unsure.add(key)
            elif unsure:
                unsure.discard(key)
        ledger = self.ledger
        busy = ledger.busy
        # Per model: rows rewritten whole and their values; rows whose heartbeat time alone moved.
        pending: dict[str, tuple[ModelTable, list[int], list[Row], list[int], list[float]]] = {}
        for state, i in zip(live, rows, strict=True):
            entry = pending.get(state.model)
            if entry is None:
                entry = pending[state.model] = (tables[state.model], [], [], [], [])
            table = entry[0]
            key = state.key
            if moved:
                i = table.row[key]
            # row_values' reads, inline: they serve the test below too.
            load, at, capacity, stale = state.load, state.last_heartbeat_at, state.capacity, state.stale
            if key in busy:
                n_new, tokens_new, inflight = ledger.pending(key, at)
                busy_until = ledger.busy_until(key)
                steady = False
            else:
                # A heartbeat that changed nothing else (a Load and a capacity are replaced, never
                # modified): every other value of the row is what it was. A non-empty capacity
                # alone decides is_pool; no ledger entry, then or now: no requests since either.
                if (
                    table.basis_load[i] is load
                    and table.basis_capacity[i] is capacity
                    and at is not None
                    and not stale
                ):
                    entry[3].append(i)
                    entry[4].append(at)
                    continue
                n_new = tokens_new = inflight = 0
                busy_until = 0.0
                # (Without a capacity, a local block seen decides it too: that flag is never unset,
                # and a capacity reported later is a new object, which the test above sees.)
                steady = (bool(capacity) or state.local_blocks_seen) and at is not None and not stale
            entry[1].append(i)
            entry[2].append(
                _row(load, at, n_new, tokens_new, inflight, busy_until, not state.is_pool and not stale)
            )
            if steady:
                table.basis_load[i], table.basis_capacity[i] = load, capacity
            else:
                table.basis_load[i] = table.basis_capacity[i] = None
        for table, full, values, timed, times in pending.values():
            if full:
                table.write(full, values)
            if timed:
                table.write_times(timed, times)

    def get(self, model: str) -> ModelTable | None:
        self.refresh()
        return self.tables.get(model)


def smallest(columns: list[np.ndarray], rows: np.ndarray, m: int) -> np.ndarray:
    """The ``m`` rows (of ``rows``) that come first in lexicographic order of ``columns``
    (indexed by row), unordered. Exact with ties: a tie on one column is broken by the next, and the
    last column must be unique (the key rank)."""
    if m <= 0 or not len(rows):
        return rows[:0]
    if len(rows) <= m:
        return rows
    col = columns[0][rows]
    pivot = np.partition(col, m - 1)[m - 1]
    below = rows[col < pivot]
    ties = rows[col == pivot]
    need = m - len(below)
    if len(ties) > need and len(columns) > 1:
        ties = smallest(columns[1:], ties, need)
    return np.concatenate((below, ties))


def median_of(values: np.ndarray) -> float:
    """statistics.median of the values, with its arithmetic (mean of the two middle ones)."""
    n = len(values)
    i = n // 2
    if n % 2:
        return float(np.partition(values, i)[i])
    part = np.partition(values, (i - 1, i))
    return (float(part[i - 1]) + float(part[i])) / 2


__all__ = ["FleetTables", "ModelTable", "median_of", "rendezvous_weights", "smallest"]
