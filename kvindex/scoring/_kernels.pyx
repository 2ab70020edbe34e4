# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Native kernels of the pruned rankings: the queue wait of a fleet's rows, the ttft policy's
selection of the best rows (per match group), a match group's rows, the rendezvous weights.

Each is a loop over numpy columns that repeats a scalar definition operation for operation in
float64 (the build turns off FMA contraction), so its values are bit-identical to the scalar ones:
the cost model is kvindex/scoring/costs.py (``queued_now``, ``queue_ms``, ``prefill_terms``,
``est_ttft_ms``, ``weighted_cost``), the rendezvous weights are kvindex/scoring/home.py's.
tests/unit/test_cost_forms.py compares every form on random inputs. Without a C compiler at install time
the rankings use the numpy columns (kvindex/scoring/fleet_table.py, ``CandidatePool`` in
kvindex/scoring/ranker.py) instead.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.math cimport copysign, floor, fmod
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil


# -- rendezvous weights (kvindex.scoring.home) ------------------------------------------------------

cdef extern from *:
    """
    #include "../_xxh3.h"
    """
    uint64_t kvx_xxh3_64(const void* data, size_t length, uint64_t seed) nogil


def rendezvous_weights(list ids, uint64_t seed, uint64_t[::1] out):
    """``out[i] = xxh3_64(ids[i], seed)`` (bytes ids): the rendezvous weights of kvindex.scoring.home
    for a whole fleet in one loop, for the pruned rankings' home lookups (kvindex/scoring/fleet_table.py)."""
    cdef Py_ssize_t i, n = len(ids)
    cdef bytes b
    if out.shape[0] < n:
        raise ValueError("out is shorter than ids")
    for i in range(n):
        b = <bytes>ids[i]
        out[i] = kvx_xxh3_64(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), seed)


# -- queue waits of a fleet's rows (kvindex/scoring/fleet_table.py) ---------------------------------

cdef inline double _py_floordiv(double vx, double wx) noexcept nogil:
    """Python's float ``vx // wx`` (CPython's float_floor_div, also numpy's floor_divide), wx != 0."""
    cdef double mod = fmod(vx, wx)
    cdef double div = (vx - mod) / wx
    cdef double floordiv
    if mod:
        if (wx < 0) != (mod < 0):
            div -= 1.0
    if div:
        floordiv = floor(div)
        if div - floordiv > 0.5:
            floordiv += 1.0
    else:
        floordiv = copysign(0.0, vx / wx)
    return floordiv


def wait_rows(const double[::1] queued, const double[::1] status_at, const double[::1] tokens_new,
              const double[::1] queued_now, const double[::1] running_now,
              const double[::1] busy_until, const unsigned char[::1] drains, const long long[::1] rows, Py_ssize_t count,
              double now, double b_ms, double step_ms, double chunk, double dps, double drain_rate,
              double[::1] wait, long long[::1] draining, unsigned char[::1] seen):
    """The pruned rankings' queue wait of ``count`` rows (``rows[:count]``, or rows 0..count-1 when
    ``rows`` is empty; a row listed twice is computed twice, to the same value), written to
    ``wait[row]``; the rows whose reported queue is still draining or whose ledger work is not over
    go to ``draining`` once each (``seen``: a zeroed flag per row, zeroed again on return), and
    their number is returned.

    Per row, kvindex.scoring.costs' ``wait_ms(queue_ms(queued_now(...)), ledger_ms(...))`` with
    the same float64 operations in the same order, hence bit-identical: queued = max(0, reported -
    (now - heartbeat) * rate) + routed since where the queue drains, else reported + routed since;
    wait = b * queued + ceil(queued / chunk) * (step + dps * running), 0 without a queue; then the
    ledger's work left, busy_until - now, where that is longer. One loop instead of some twenty
    numpy passes (fleet_table's numpy form)."""
    cdef Py_ssize_t j, i, out = 0
    cdef bint listed = rows.shape[0] > 0
    cdef double q, steps, w, left
    if chunk == 0:
        raise ZeroDivisionError("chunk_tokens is 0")
    for j in range(count):
        i = rows[j] if listed else j
        if drain_rate != 0 and drains[i]:
            q = queued[i] - (now - status_at[i]) * drain_rate
            if q > 0:
                if not seen[i]:
                    seen[i] = 1
                    draining[out] = i
                    out += 1
            else:
                q = 0.0
            q = q + tokens_new[i]
        else:
            q = queued_now[i]
        if q > 0:
            # ceil(q / chunk) as -(-q // chunk): 1 for 0 < q <= chunk (what the floor division
            # gives there, exactly), without its fmod for the usual queue shorter than a chunk.
            steps = 1.0 if q <= chunk else -_py_floordiv(-q, chunk)
            w = (dps * running_now[i] + step_ms) * steps
            w = w + b_ms * q
        else:
            w = 0.0
        left = (busy_until[i] - now) * 1000.0
        if left > 0:
            if not seen[i]:
                seen[i] = 1
                draining[out] = i
                out += 1
            if left > w:
                w = left
        wait[i] = w
    for j in range(out):
        seen[draining[j]] = 0
    return out


# -- the ttft policy's best rows (kvindex/scoring/ranker.py, CandidatePool.rank_others) -------------

cdef inline bint _before(double c1, double kv1, double ld1, long long r1,
                         double c2, double kv2, double ld2, long long r2) noexcept nogil:
    """(cost, kv, load, key rank) order."""
    if c1 != c2:
        return c1 < c2
    if kv1 != kv2:
        return kv1 < kv2
    if ld1 != ld2:
        return ld1 < ld2
    return r1 < r2


cdef inline void _insert(double* bc, long long* br, Py_ssize_t base, Py_ssize_t j, double c,
                         double kv, double ld, long long rank, long long row) noexcept nogil:
    """Put (c, kv, ld, rank, row) into the sorted top-k buffer that starts at ``base``, at ``j`` (its
    first free place, or its last one when full) or before: the entries it ranks before move down
    one place (bc holds cost, kv, load per entry; br key rank, row)."""
    while j > base and _before(c, kv, ld, rank, bc[3 * (j - 1)], bc[3 * (j - 1) + 1],
                               bc[3 * (j - 1) + 2], br[2 * (j - 1)]):
        bc[3 * j] = bc[3 * (j - 1)]
        bc[3 * j + 1] = bc[3 * (j - 1) + 1]
        bc[3 * j + 2] = bc[3 * (j - 1) + 2]
        br[2 * j] = br[2 * (j - 1)]
        br[2 * j + 1] = br[2 * (j - 1) + 1]
        j -= 1
    bc[3 * j] = c
    bc[3 * j + 1] = kv
    bc[3 * j + 2] = ld
    br[2 * j] = rank
    br[2 * j + 1] = row


cdef inline bint _listed(const long long[::1] rows, Py_ssize_t n, long long row) noexcept nogil:
    """Whether ``row`` is in the ascending ``rows[:n]`` (binary search)."""
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if rows[mid] < row:
            lo = mid + 1
        else:
            hi = mid
    return lo < n and rows[lo] == row


def rank_others(const double[::1] wait, const double[::1] running, const unsigned char[::1] mask,
                const long long[::1] explicit_rows, bint has_prompt, double a, double b, double k,
                const double[::1] kv, const double[::1] load, const long long[::1] key_rank,
                long long[::1] out):
    """The ttft policy's pruned ranking over the rows that hold nothing of the prompt (the request's
    candidates in ``mask`` that are not in ``explicit_rows``, sorted), in one loop (and a count)
    instead of a dozen numpy passes (kvindex/scoring/policies/ttft.py, ``rank_top``).

    Per row: prefill = a * running + b (0 without a prompt; kvindex.scoring.costs.prefill_terms),
    est = wait + prefill, cost = est + k * (prefill + 0.0) when k, else est (costs.est_ttft_ms and
    costs.weighted_cost with no fetch): the operations of CandidatePool's columns in order. Puts
    the first ``len(out)`` rows in (cost, kv, load, key rank) order into ``out`` (unordered) and
    returns (how many, the lowest prefill of every row, how many rows wait at most that long): the
    last two are what the congestion bound (``_uncongested``) counts."""
    cdef Py_ssize_t n = wait.shape[0], top_k = out.shape[0], i, j, filled = 0
    cdef Py_ssize_t n_explicit = explicit_rows.shape[0], waiting = 0
    cdef double low = 0.0, p, c
    cdef double* bc = <double*>malloc((top_k + 1) * 3 * sizeof(double))
    cdef long long* br = <long long*>malloc((top_k + 1) * 2 * sizeof(long long))
    if bc == NULL or br == NULL:
        free(bc)
        free(br)
        raise MemoryError()
    try:
        if not has_prompt:  # every prefill is 0.0, as 0.0 * running + 0.0 is
            a = b = 0.0
        for i in range(n):
            p = a * running[i] + b
            if i == 0 or p < low:  # the lowest prefill of every row
                low = p
            c = wait[i] + p
            if k:
                c = c + k * (p + 0.0)
            if filled == top_k and c > bc[3 * (filled - 1)]:
                continue  # after every buffered row whatever the tie-breaks (the common case)
            if not mask[i] or _listed(explicit_rows, n_explicit, i):
                continue
            # Insert into the sorted buffer of the best ``top_k`` so far (bc: cost, kv, load;
            # br: key rank, row), unless it comes after all of them in a full buffer.
            if filled == top_k and not _before(c, kv[i], load[i], key_rank[i],
                                               bc[3 * (filled - 1)], bc[3 * (filled - 1) + 1],
                                               bc[3 * (filled - 1) + 2], br[2 * (filled - 1)]):
                continue
            _insert(bc, br, 0, filled if filled < top_k else top_k - 1, c, kv[i], load[i],
                    key_rank[i], i)
            if filled < top_k:
                filled += 1
        for i in range(n):
            waiting += wait[i] <= low
        for j in range(filled):
            out[j] = br[2 * j + 1]
    finally:
        free(bc)
        free(br)
    return filled, low, waiting


def rank_grouped(const double[::1] wait, const double[::1] running, const unsigned char[::1] mask,
                 const long long[::1] explicit_rows, const int[::1] group, const double[::1] ga,
                 const double[::1] gb, const double[::1] gf, double k, const double[::1] kv,
                 const double[::1] load, const long long[::1] key_rank, long long[::1] out,
                 long long[::1] filled):
    """rank_others with the rows split into groups by match (``group[row]``; 0: the rows that hold
    nothing of the prompt, g > 0: the instances sharing one answer of the index): per row of group
    g, prefill = ga[g] * running + gb[g], est = wait + prefill + gf[g] (the fetch) and cost = est +
    k * (prefill + gf[g]) when k, else est (as in rank_others). Puts the first ``top_k = len(out) // len(ga)`` rows of
    each group in (cost, kv, load, key rank) order into ``out[g * top_k:]`` (unordered;
    ``filled[g]`` of them) and returns (the lowest prefill of every row, how many rows wait at most
    that long), as rank_others does."""
    cdef Py_ssize_t n = wait.shape[0], n_groups = ga.shape[0], i, j, g, base, last
    cdef Py_ssize_t top_k = out.shape[0] // n_groups if n_groups else 0
    cdef Py_ssize_t n_explicit = explicit_rows.shape[0], waiting = 0, f
    cdef double low = 0.0, p, c
    cdef double* bc
    cdef long long* br
    if top_k <= 0:
        raise ValueError("out must hold top_k rows per group")
    bc = <double*>malloc(n_groups * (top_k + 1) * 3 * sizeof(double))
    br = <long long*>malloc(n_groups * (top_k + 1) * 2 * sizeof(long long))
    if bc == NULL or br == NULL:
        free(bc)
        free(br)
        raise MemoryError()
    try:
        for g in range(n_groups):
            filled[g] = 0
        for i in range(n):
            g = group[i]
            p = ga[g] * running[i] + gb[g]
            if i == 0 or p < low:
                low = p
            c = wait[i] + p
            c = c + gf[g]
            if k:
                c = c + k * (p + gf[g])
            f = filled[g]
            base = g * (top_k + 1)
            last = base + f - 1
            if f == top_k and c > bc[3 * last]:
                continue
            if not mask[i] or _listed(explicit_rows, n_explicit, i):
                continue
            if f == top_k and not _before(c, kv[i], load[i], key_rank[i], bc[3 * last],
                                           bc[3 * last + 1], bc[3 * last + 2], br[2 * last]):
                continue
            _insert(bc, br, base, base + (f if f < top_k else top_k - 1), c, kv[i], load[i],
                    key_rank[i], i)
            if f < top_k:
                filled[g] = f + 1
        for i in range(n):
            waiting += wait[i] <= low
        for g in range(n_groups):
            for j in range(filled[g]):
                out[g * top_k + j] = br[2 * (g * (top_k + 1) + j) + 1]
    finally:
        free(bc)
        free(br)
    return low, waiting


# -- a match group's rows (kvindex/scoring/ranker.py, Ranker._group_rows) ---------------------------

def mark_group_rows(const unsigned char[::1] masks, const long long[::1] slot_rows,
                    const unsigned char[::1] candidate, int[::1] group_of, int g):
    """``group_of[row] = g`` for the table row of every slot in ``masks`` (a MatchGroup's, one
    little-endian u64 per bank; ``slot_rows[slot]``: the row, -1 for none); returns how many of
    those rows are ``candidate``. One loop over the set bits instead of numpy passes over every
    slot (kvindex/scoring/ranker.py, match groups)."""
    cdef Py_ssize_t nb = masks.shape[0] // 8, b, n_slots = slot_rows.shape[0]
    cdef Py_ssize_t slot
    cdef uint64_t m
    cdef long long row
    cdef Py_ssize_t count = 0
    for b in range(nb):
        memcpy(&m, &masks[b * 8], 8)
        while m:
            slot = b * 64 + __builtin_ctzll(m)
            m &= m - 1
            if slot >= n_slots:
                continue
            row = slot_rows[slot]
            if row < 0:
                continue
            group_of[row] = g
            count += candidate[row]
    return count
