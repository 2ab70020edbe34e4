# cython: language_level=3, boundscheck=False, wraparound=False
"""Chained block keys in one C loop (kvindex.keys uses it when built; same results as its Python loop).

key[i] = XXH3_64(block i's little-endian uint32 tokens, seed = key[i-1]), key[-1] = seed.
The hash is the project's own XXH3-64 (kvindex/_xxh3.h), checked against the ``xxhash`` package.
"""

from libc.stdint cimport uint64_t

cdef extern from "_xxh3.h":
    uint64_t kvx_xxh3_64(const void* data, size_t length, uint64_t seed) nogil


def xxh3_64(const unsigned char[::1] data, uint64_t seed=0):
    """XXH3-64 of ``data`` with ``seed`` (the native hash on its own, for tests and benchmarks)."""
    cdef const unsigned char* base = &data[0] if data.shape[0] else NULL
    return kvx_xxh3_64(base, data.shape[0], seed)


def chain_keys(const unsigned char[::1] raw, Py_ssize_t block_size, uint64_t seed):
    """Keys of the full blocks of ``raw`` (LE uint32 tokens, ``block_size`` tokens per block)."""
    cdef Py_ssize_t step = block_size * 4
    cdef Py_ssize_t n = raw.shape[0] // step if step > 0 else 0
    cdef Py_ssize_t i
    cdef uint64_t key = seed
    cdef const unsigned char* base = &raw[0] if raw.shape[0] else NULL
    out = [None] * n
    for i in range(n):
        key = kvx_xxh3_64(base + i * step, step, key)
        out[i] = key
    return out
