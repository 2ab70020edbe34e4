# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Native kernels of the pruned rankings that are not the cost model: a match group's rows, and the
rendezvous weights (kvindex/scoring/home.py's, for a whole fleet). The cost model's own row loops
(waits, costs, the ttft policy's selection) are kvindex/scoring/costs.py, compiled from its Python
source. Without a C compiler at install time the rankings use numpy instead.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
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
