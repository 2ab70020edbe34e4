"""Pruned rankings: one request's candidates as a ``CandidatePool`` (full candidates for the
instances that hold some of the prompt, per-row columns for everyone else), for the policies that
rank one (``PrunedPolicy.rank_top``, kvindex/scoring/base.py).

``PoolBuilder.pool`` finds the holders (the index's answer, grouped into match groups when it is a
``GroupedIndex``; speculative keys; degraded instances) and hands the rest over as the fleet's
columns (kvindex/scoring/fleet_table.py); the pool prices those rows with the cost model's terms
(kvindex/scoring/costs.py), natively where the kernels are built (kvindex/scoring/_kernels.pyx).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from kvindex.fleet.registry import Registry
from kvindex.index.base import NO_MATCH, GroupedIndex, InstanceMatch, MatchGroup
from kvindex.index.hybrid import hit_limit
from kvindex.instance import InstanceKey
from kvindex.scoring.base import Candidate, RouteRequest
from kvindex.scoring.candidates import CandidateBuilder
from kvindex.scoring.costs import cost_rows, rank_grouped, rank_others
from kvindex.scoring.fleet_table import FleetTables, ModelTable, smallest

try:
    from kvindex.scoring._kernels import mark_group_rows as _native_mark_group_rows
except ImportError:  # no compiler at install time: numpy
    _native_mark_group_rows = None


class PoolBuilder:
    """Builds one router's ``CandidatePool``s over the fleet's columns, which it keeps (``tables``:
    made on first use, they watch the registry and the ledger). It reads what its candidates are
    built from (``candidates``: the index, the ledger, the speculative keys, the degraded instances)."""

    def __init__(
        self,
        registry: Registry,
        candidates: CandidateBuilder,
        group_min_instances: int,
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.builder = candidates
        self.index = candidates.index
        self.ledger = candidates.ledger
        self.speculative = candidates.speculative
        self.degraded = candidates.degraded
        self.group_min_instances = group_min_instances
        self.clock = clock
        # Decided once here (an isinstance with a protocol would cost microseconds per Score).
        index = self.index
        self.grouped_index: GroupedIndex | None = index if isinstance(index, GroupedIndex) else None
        self._tables: FleetTables | None = None
        # model -> (slot layout, table, table version, row of each index slot), for match groups
        self._slot_rows: dict[str, tuple[int, ModelTable, int, np.ndarray]] = {}

    @property
    def tables(self) -> FleetTables:
        """Per-model columns of instance state (made on first use: they watch the registry)."""
        tables = self._tables
        if tables is None:
            tables = self._tables = FleetTables(self.registry, self.ledger)
        return tables

    def pool(
        self, request: RouteRequest, candidates: list[str] | None, spec_ttl: float
    ) -> CandidatePool | None:
        """The request's candidates for a pruned ranking: full ``Candidate`` objects for the
        instances that hold some of the prompt (in the index, or speculatively), columns for the
        others; None when no instance is routable."""
        table = self.tables.get(request.model)
        if table is None:
            return None
        chosen = _routable_mask(table, candidates)
        if chosen is None:
            return None
        mask, count, everyone = chosen
        keys = request.keys
        states = table.states
        row = table.row
        groups: list[MatchGroup] = []
        reach: dict[InstanceKey, int] = {}
        if keys:
            restrict = None if candidates is None else [states[i].key for i in np.flatnonzero(mask)]
            matches, groups = self._matches(request, restrict, reach)
        else:
            matches = {}
        # A hybrid model's instances holding a full-attention prefix the engine cannot reuse yet
        # are explicit too (Candidate.reach): only they can tell the ranking so.
        held = [k for k in reach if k not in matches] if reach else ()
        if everyone:  # a set lookup per holder rather than a numpy scalar read
            out = table.unroutable_set()
            rows = [i for k in matches if (i := row.get(k)) is not None and i not in out]
            rows += [i for k in held if (i := row.get(k)) is not None and i not in out]
        else:
            rows = [i for k in matches if (i := row.get(k)) is not None and mask[i]]
            rows += [i for k in held if (i := row.get(k)) is not None and mask[i]]
        if groups:
            group_of, marked = self._group_rows(request.model, table, groups, mask)
        else:
            group_of, marked = None, []
        if spec_ttl > 0 and keys:
            rows += self._speculative_rows(keys, table, mask, matches, groups, group_of)
        if group_of is not None and self.degraded:
            rows += self._degraded_rows(table, mask, matches, groups, group_of)
        explicit = self.builder.candidates(
            request, [states[i] for i in rows], spec_ttl, matches=matches, reach=reach
        )
        pool = CandidatePool(
            self.builder, request, table, mask, count, everyone, explicit, rows, spec_ttl, groups, group_of
        )
        if group_of is not None:
            # Per group, its candidates that are not explicit (explicit ones: pulled out above).
            counts = [0, *marked]
            for i in rows:
                g = group_of[i]
                if g:
                    counts[g] -= 1
            counts[0] = count - len(rows) - sum(counts)
            pool.group_counts = counts
        return pool

    def _matches(
        self, request: RouteRequest, restrict: list[InstanceKey] | None, reach: dict[InstanceKey, int]
    ) -> tuple[dict[InstanceKey, Any], list[MatchGroup]]:
        """The index's answer for the prompt: per instance, and grouped when the index groups."""
        limit = hit_limit(request.prompt_tokens)
        grouped = self.grouped_index
        if grouped is not None:
            return grouped.match_groups(
                request.model, request.keys, restrict, self.group_min_instances, limit, reach
            )
        return self.index.match(request.model, request.keys, restrict, limit, reach), []

    def _speculative_rows(
        self,
        keys: list[int],
        table: ModelTable,
        mask: np.ndarray,
        matches: dict[InstanceKey, InstanceMatch],
        groups: list[MatchGroup],
        group_of: np.ndarray | None,
    ) -> list[int]:
        """The rows of the instances whose speculative keys continue their match: full candidates
        (past 0 blocks for a non-holder, past its group's answer for a group's member, whose answer
        goes into ``matches``); and those with a marked prefix of a hybrid model's prompt (their
        index answers are all in ``matches``, so a marked holder is one already)."""
        now = self.clock()
        n_keys = len(keys)
        row = table.row
        rows = []
        for inst, held in self.speculative.by_instance():
            if inst in matches:
                continue
            i = row.get(inst)
            if i is None or not mask[i]:
                continue
            g = int(group_of[i]) if group_of is not None else 0
            depth = groups[g - 1].match.length if g else 0
            expiry = held.get(keys[depth]) if depth < n_keys else None
            if expiry is not None and expiry > now:
                rows.append(i)
                if g:
                    matches[inst] = groups[g - 1].match
        for inst in self.speculative.marked():  # hybrid models' committed prompts (answers all listed)
            if inst in matches or (i := row.get(inst)) is None or not mask[i] or i in rows:
                continue
            if self.speculative.extend(inst, keys, 0) or self.speculative.reach(inst, keys, 0):
                rows.append(i)
        return rows

    def _degraded_rows(
        self,
        table: ModelTable,
        mask: np.ndarray,
        matches: dict[InstanceKey, InstanceMatch],
        groups: list[MatchGroup],
        group_of: np.ndarray,
    ) -> list[int]:
        """The rows of the degraded members of match groups: full candidates (a degraded instance
        is credited only part of its match, not its group's terms; its answer goes into ``matches``)."""
        rows = []
        for inst in self.degraded:
            i = table.row.get(inst)
            if i is None or not mask[i] or inst in matches:
                continue
            g = int(group_of[i])
            if g:
                rows.append(i)
                matches[inst] = groups[g - 1].match
        return rows

    def _group_rows(
        self, model: str, table: ModelTable, groups: list[MatchGroup], mask: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """Per table row, the match group (1-based) of its instance, 0 for none; and per group, how
        many of its rows are in ``mask``."""
        cached = self._slot_rows.get(model)
        known = -1 if cached is None or cached[1] is not table or cached[2] != table.version else cached[0]
        assert self.grouped_index is not None  # groups come from its match_groups only
        layout, owners = self.grouped_index.slot_layout(model, known)
        if layout != known or cached is None:
            get = table.row.get
            slot_rows = np.array([-1 if o is None else get(o, -1) for o in owners], dtype=np.int64)
            cached = self._slot_rows[model] = (layout, table, table.version, slot_rows)
        slot_rows = cached[3]
        group_of = np.zeros(table.n, dtype=np.int32)
        marked = []
        if _native_mark_group_rows is not None:
            candidate = mask.view(np.uint8)
            for g, group in enumerate(groups, 1):
                marked.append(_native_mark_group_rows(group.masks, slot_rows, candidate, group_of, g))
            return group_of, marked
        for g, group in enumerate(groups, 1):
            held = np.unpackbits(np.frombuffer(group.masks, dtype=np.uint8), bitorder="little")
            rows = slot_rows[: len(held)][held.view(bool)]
            rows = rows[rows >= 0]
            group_of[rows] = g
            marked.append(int(np.count_nonzero(mask[rows])))
        return group_of, marked


class CandidatePool:
    """One request's candidates, for a pruned ranking (Policy ``rank_top``).

    ``explicit`` are full candidates: the routable instances that hold some of the prompt, except
    the members of large match groups. The others are ranked through per-row columns: those that
    hold nothing of it (group 0: ``CandidateBuilder.candidates`` with no match) and the members of each match
    group g >= 1 (``groups[g - 1]``: many instances with one answer of the index, such as a
    fleet-wide system prompt), whose terms differ from group 0's only by constants of the answer
    (``templates``: one candidate per group, of which only the match's terms are read). ``wait``,
    ``prefill``, ``fetch`` and the costs per table row are kvindex/scoring/costs.py's terms as
    columns: the same float64 operations in the same order, hence bit-identical to
    ``CandidateBuilder.candidates`` (tests/unit/test_cost_forms.py). ``materialize`` turns rows into full
    candidates through ``CandidateBuilder.candidates`` itself.
    """

    def __init__(
        self,
        builder: CandidateBuilder,
        request: RouteRequest,
        table: ModelTable,
        mask: np.ndarray,
        count: int,
        everyone: bool,
        explicit: list[Candidate],
        explicit_rows: list[int],
        spec_ttl: float,
        groups: list[MatchGroup] | None = None,
        group_of: np.ndarray | None = None,
    ) -> None:
        self.builder = builder
        self.request = request
        self.table = table
        self.mask = mask  # the request's candidates, by row (read only: may be the table's own)
        self.count = count  # how many
        # Every routable row is a candidate (no candidate list, the common case): shortcuts apply.
        self.everyone = everyone
        self.explicit = explicit
        self.explicit_rows = np.array(explicit_rows, dtype=np.int64)
        self.spec_ttl = spec_ttl
        # Tie-breaks of the rankings: emptier cache, fewer requests (reported + in flight), key.
        n = table.n
        self.kv = table.kv[:n]
        self.load = table.load[:n]
        self.key_rank = table.ranks()
        # Match groups ranked by columns; group_of: per row, its group (0: none). None: no groups.
        self.groups = groups or []
        self.group_of = group_of if self.groups else None

    @cached_property
    def templates(self) -> list[Candidate]:
        """Per group (0: no match), a candidate with the group's answer, for its constant terms
        (blocks, tokens by tier, hit, miss, fetch); its instance's own terms are not meant."""
        # (an instance whose match is credited in full: a degraded one's is cut; when every one is
        # degraded, every group member is explicit and only the no-match template is read)
        degraded = self.builder.degraded
        state = next((s for s in self.table.states if s.key not in degraded), self.table.states[0])
        matches = [NO_MATCH] + [g.match for g in self.groups]
        # (no speculative keys: the members whose keys extend their answer are explicit)
        return [
            self.builder.candidates(self.request, [state], 0.0, matches={state.key: m})[0] for m in matches
        ]

    @cached_property
    def group_counts(self) -> list[int]:
        """Per group (0: no match), how many of the request's candidates are in it (not explicit;
        PoolBuilder.pool sets it from the rows it marked)."""
        if self.group_of is None:
            return [self.count - len(self.explicit)]
        counts: list[int] = np.bincount(
            self.group_of[self.rest_rows], minlength=len(self.groups) + 1
        ).tolist()
        return counts

    def group_rows(self, g: int) -> np.ndarray:
        """The rows of group g among the request's candidates that are not explicit, ascending."""
        rows = self.rest_rows
        if self.group_of is None:
            return rows if g == 0 else rows[:0]
        mine: np.ndarray = rows[self.group_of[rows] == g]
        return mine

    @cached_property
    def blocks(self) -> np.ndarray:
        """Blocks matched per row for the others (0, or their group's answer)."""
        if self.group_of is None:
            return np.zeros(self.table.n, dtype=np.int64)
        depth = np.array([t.blocks for t in self.templates], dtype=np.int64)
        blocks: np.ndarray = depth[self.group_of]
        return blocks

    # The cost terms of the others, per row (only the ttft policy reads them: made on first use).

    @cached_property
    def wait(self) -> np.ndarray:
        """CandidateBuilder.candidates' wait per row (the table's cache: do not modify)."""
        costs = self.builder.costs
        model = costs.prefill(self.request.model)
        shape = costs.engine
        return self.table.waits(
            self.builder.clock(),
            model.b_ms_per_token,
            shape.step_ms,
            shape.chunk_tokens,
            shape.decode_ms_per_seq,
            costs.drain_rate(model),
        )[: self.table.n]

    def _prefill_terms(self, miss: int) -> tuple[float, float]:
        """(per_running, alone) of a miss of ``miss`` tokens (costs.prefill_terms)."""
        return self.builder.costs.prefill_terms(self.request.model, miss, self.request.prompt_tokens)

    @cached_property
    def _terms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per group (0: no match), its prefill terms and fetch (costs.cost_rows' ga, gb, gf), and
        the rows' groups (empty: no groups, every row in group 0)."""
        prompt = self.request.prompt_tokens
        if self.group_of is None:
            a, b = self._prefill_terms(prompt)
            return np.array([a]), np.array([b]), np.zeros(1), _NO_GROUPS
        terms = [self._prefill_terms(prompt)] + [
            self._prefill_terms(t.miss_tokens) for t in self.templates[1:]
        ]
        return (
            np.array([a for a, _ in terms]),
            np.array([b for _, b in terms]),
            np.array([t.fetch_ms for t in self.templates]),
            self.group_of,
        )

    def _columns(self, k: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: the candidates' prefill, estimate and the ttft policy's cost at ``k``
        (costs.cost_rows: the definition over the rows)."""
        n = self.table.n
        ga, gb, gf, group = self._terms
        prefill, est, cost = np.empty(n), np.empty(n), np.empty(n)
        cost_rows(self.wait, self.table.running_now[:n], group, ga, gb, gf, k, prefill, est, cost)
        return prefill, est, cost

    @cached_property
    def _unweighted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._columns(0.0)

    @property
    def prefill(self) -> np.ndarray:
        """The candidates' prefill per row: of the whole prompt, or of its group's miss."""
        return self._unweighted[0]

    @property
    def est(self) -> np.ndarray:
        """Candidate.est_ttft_ms per row (costs.est_ttft_ms: wait + prefill + fetch)."""
        return self._unweighted[1]

    def cost(self, k: float) -> np.ndarray:
        """The ttft policy's cost per row with congestion weight ``k`` (costs.weighted_cost)."""
        return self._unweighted[2] if not k else self._columns(k)[2]

    def rank_others(self, k: float, top_k: int) -> tuple[np.ndarray, float, int] | None:
        """The ttft policy's selection of the others in one pass (costs.rank_others, rank_grouped):
        the ``top_k`` rows first in (``cost(k)``, kv, load, key) order, of each group when there are
        match groups, the lowest prefill of any row and how many rows wait at most that long; None
        for a large ``top_k``, where an insertion into a sorted buffer would not pay: then the
        columns (``smallest``)."""
        if not 0 < top_k <= 64:
            return None
        table = self.table
        n = table.n
        explicit = np.sort(self.explicit_rows)
        ga, gb, gf, group = self._terms
        if self.group_of is not None:
            n_groups = len(ga)
            out = np.empty(top_k * n_groups, dtype=np.int64)
            filled = np.empty(n_groups, dtype=np.int64)
            low, waiting = rank_grouped(
                self.wait, table.running_now[:n], self.mask.view(np.uint8), explicit, group, ga, gb, gf,
                k, self.kv, self.load, self.key_rank, out, filled,
            )  # fmt: skip
            chosen = np.concatenate([out[g * top_k : g * top_k + filled[g]] for g in range(n_groups)])
            return chosen, low, waiting
        out = np.empty(top_k, dtype=np.int64)
        found, low, waiting = rank_others(
            self.wait, table.running_now[:n], self.mask.view(np.uint8), explicit,
            self.request.prompt_tokens > 0, float(ga[0]), float(gb[0]), k, self.kv, self.load,
            self.key_rank, out,
        )  # fmt: skip
        return out[:found], low, waiting

    def materialize(self, rows: list[int] | np.ndarray) -> list[Candidate]:
        states = self.table.states
        group_of = self.group_of
        if group_of is None:
            matches: dict[InstanceKey, InstanceMatch] = {}
        else:
            groups = self.groups
            matches = {states[i].key: groups[g - 1].match for i in rows if (g := group_of[i])}
        return self.builder.candidates(
            self.request, [states[i] for i in rows], self.spec_ttl, matches=matches
        )

    def top(
        self,
        columns: list[np.ndarray] | Callable[[Candidate], list[np.ndarray]],
        key: Callable[[Candidate], Any],
        top_k: int,
    ) -> list[Candidate]:
        """The first ``top_k`` candidates in ``key`` order: the explicit ones and the best ``top_k``
        others of each group, chosen on ``columns`` (per row, the others' values of ``key``'s
        leading terms, in order; the instance key, ``key``'s last term, is added here). A callable
        gives them for a group from its template candidate (``templates``); a list serves every
        group (right when the leading terms do not depend on the match within a group)."""
        if self.group_of is None:
            cols = columns(self.templates[0]) if callable(columns) else columns
            rows = smallest([*cols, self.key_rank], self.rest_rows, top_k)
        else:
            parts = []
            for g, template in enumerate(self.templates):
                cols = columns(template) if callable(columns) else columns
                parts.append(smallest([*cols, self.key_rank], self.group_rows(g), top_k))
            rows = np.concatenate(parts)
        cands = self.explicit + self.materialize(rows)
        cands.sort(key=key)
        return cands[:top_k]

    def column(self, rest: np.ndarray, explicit: list[float]) -> np.ndarray:
        """A per-row column: ``rest`` for the others, ``explicit`` at the explicit candidates' rows."""
        out = rest.copy()
        out[self.explicit_rows] = explicit
        return out

    def of_everyone(self, rest: np.ndarray, explicit: list[float]) -> np.ndarray:
        """``column`` at the request's candidates only (in row order)."""
        out = self.column(rest, explicit)
        return out if self.everyone and len(out) == self.count else out[self.mask]

    def smallest(self, cost: np.ndarray, top_k: int) -> np.ndarray:
        """The ``top_k`` others first in (``cost``, kv, load, instance key) order, unordered (of
        each group, with match groups)."""
        table = self.table
        if self.group_of is not None:
            tie = table.tie_order()
            columns = [cost, self.kv, self.load, self.key_rank] if tie is None else [cost, tie]
            parts = [smallest(columns, self.group_rows(g), top_k) for g in range(len(self.groups) + 1)]
            return np.concatenate(parts)
        tie = table.tie_order()
        n = table.n
        others = self.count - len(self.explicit)
        if tie is None or not self.everyone or others <= top_k or top_k <= 0:
            columns = [cost, self.kv, self.load, self.key_rank] if tie is None else [cost, tie]
            return smallest(columns, self.rest_rows, top_k)
        # Every routable row is a candidate: the explicit ones and the unroutable rows are set aside
        # at +inf instead of listing the others' rows, and the common case (an idle fleet: at least
        # top_k others tied on the lowest cost) is a minimum and one comparison, not a partition of
        # the whole fleet.
        c = cost.copy()
        c[self.explicit_rows] = np.inf
        if self.count != n:
            c[table.unroutable_rows()] = np.inf
        low = c.min()
        at_low = c == low
        if np.count_nonzero(at_low) >= top_k:
            below = _NO_ROWS
            ties = np.flatnonzero(at_low)
        else:
            pivot = np.partition(c, top_k - 1)[top_k - 1]
            below = np.flatnonzero(c < pivot)
            ties = np.flatnonzero(c == pivot)
        need = top_k - len(below)
        if len(ties) > need:
            ties = ties[np.argpartition(tie[ties], need - 1)[:need]]
        return np.concatenate((below, ties)) if len(below) else ties

    @cached_property
    def rest(self) -> np.ndarray:
        """Per row, whether it is a candidate that holds nothing of the prompt."""
        rest = self.mask.copy()
        rest[self.explicit_rows] = False
        return rest

    @cached_property
    def rest_rows(self) -> np.ndarray:
        """The others' rows, ascending."""
        if self.everyone:
            rows = self.table.routable_rows()
            if not len(self.explicit_rows):
                return rows
            kept: np.ndarray = rows[self.rest[rows]]
            return kept
        return np.flatnonzero(self.rest)


_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_GROUPS = np.zeros(0, dtype=np.int32)


def _routable_mask(table: ModelTable, candidates: list[str] | None) -> tuple[Any, int, bool] | None:
    """The rows a pruned ranking may choose (a view of the routable column when every instance is a
    candidate: nothing modifies a pool's mask), how many, and whether that is every routable one;
    None when there is none."""
    n = table.n
    if candidates is None:
        count = len(table.routable_rows())
        return (table.routable[:n], count, True) if count else None
    mask = table.routable[:n].copy()
    wanted = np.zeros(n, dtype=bool)
    wanted[table.rows_of(set(candidates))] = True
    mask &= wanted
    count = int(np.count_nonzero(mask))
    if not count:
        return None
    return mask, count, count == len(table.routable_rows())
