# cython: language_level=3, boundscheck=False, wraparound=False
"""Chained block keys in one C loop (kvindex.keys uses it when built; same results as its Python loop).

key[i] = XXH3_64(block i's little-endian uint32 tokens, seed = key[i-1]), key[-1] = seed.
"""

from libc.stdint cimport uint64_t

cdef extern from *:
    """
    #define XXH_INLINE_ALL
    #include "vendor/xxhash.h"
    """
    unsigned long long XXH3_64bits_withSeed(const void* data, size_t length, unsigned long long seed) nogil


def chain_keys(const unsigned char[::1] raw, Py_ssize_t block_size, uint64_t seed):
    """Keys of the full blocks of ``raw`` (LE uint32 tokens, ``block_size`` tokens per block)."""
    cdef Py_ssize_t step = block_size * 4
    cdef Py_ssize_t n = raw.shape[0] // step if step > 0 else 0
    cdef Py_ssize_t i
    cdef uint64_t key = seed
    cdef const unsigned char* base = &raw[0] if raw.shape[0] else NULL
    out = [None] * n
    for i in range(n):
        key = XXH3_64bits_withSeed(base + i * step, step, key)
        out[i] = key
    return out
