# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Native hot path of the index: a u64 -> u64 open-addressing table and the loops over it.

Why not a library table: the index sees constant churn (blocks evicted, new ones stored). preshed
(spaCy's pre-hashed map) never reclaims tombstones and doubles on every resize, so a long-running
index would grow without bound; CPython dicts cost ~80 bytes per key and a Python-level loop per
block. This table stores 16 bytes per cell, uses linear probing with backward-shift deletion (no
tombstones, so lookups never slow down with churn) and shrinks when mostly empty.

A cell's value is a bitmask of instance slots (one 64-slot bank per table); value 0 marks an empty
cell, so any u64 key (0 included) can be stored and an entry disappears when its last holder does.
The pure-Python twin with the same API is _pytable.py; tests run both against a brute-force model.

kvindex has three more extensions, each with its own pure-Python path: the block-key chain
(kvindex/_keys_native.pyx), the wire frame loop (kvindex/ingest/_frames.pyx) and the rankings'
kernels (kvindex/scoring/_kernels.pyx).
"""

from cpython.long cimport PyLong_AsUnsignedLongLong
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.bytearray cimport PyByteArray_AS_STRING

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil
    int __builtin_popcountll(unsigned long long) nogil
    void __builtin_prefetch(const void*) nogil

# How many blocks ahead a match prefetches table cells. The walk's probes are independent of each
# other, so issuing them early overlaps cache misses (a large table does not fit in cache).
DEF PREFETCH = 16


cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)

cdef extern from "<sys/mman.h>" nogil:
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE


cdef struct Cell:
    uint64_t key
    uint64_t val


DEF HUGE_PAGE = 2 * 1024 * 1024


cdef Cell* _alloc_cells(uint64_t cap) except NULL:
    """Zeroed cells. Large tables ask for transparent huge pages: a table probed at random costs a
    TLB miss per probe with 4 KB pages, and its first touches would page-fault thousands of times."""
    cdef size_t size = cap * sizeof(Cell)
    cdef void* mem
    if size >= HUGE_PAGE:  # a power of two, so a multiple of the alignment
        mem = aligned_alloc(HUGE_PAGE, size)
        if mem != NULL:
            madvise(mem, size, MADV_HUGEPAGE)  # advice only: fine if the kernel says no
            memset(mem, 0, size)
    else:
        mem = calloc(cap, sizeof(Cell))
    if mem == NULL:
        raise MemoryError()
    return <Cell*>mem


cdef inline uint64_t _mix(uint64_t k) noexcept nogil:
    # Keys are usually xxh3 outputs, but callers may send any u64 (tests use 1, 2, 3...):
    # a murmur3 finalizer keeps clustered keys from clustering in the table.
    k ^= k >> 33
    k *= 0xff51afd7ed558ccdULL
    k ^= k >> 33
    k *= 0xc4ceb9fe1a85ec53ULL
    k ^= k >> 33
    return k


cdef uint64_t* _key_array(list keys) except NULL:
    cdef Py_ssize_t n = len(keys), i
    cdef uint64_t* out = <uint64_t*>malloc((n if n else 1) * sizeof(uint64_t))
    if out == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            out[i] = PyLong_AsUnsignedLongLong(keys[i])
    except BaseException:
        free(out)
        raise
    return out


cdef class KeyArray:
    """A request's keys as u64, converted once per match and shared by the banks it walks, with
    their mixed hashes (``_mix``): a match over many banks probes each key in every one of them."""

    cdef uint64_t* data
    cdef uint64_t* mixed
    cdef Py_ssize_t n

    def __cinit__(self, list keys, uint64_t xor=0):
        cdef Py_ssize_t i
        self.mixed = NULL
        self.data = _key_array(keys)
        self.n = len(keys)
        if xor:  # a KV-cache group's keys (hybrid.py: key ^ G(group))
            for i in range(self.n):
                self.data[i] ^= xor
        self.mixed = <uint64_t*>malloc((self.n if self.n else 1) * sizeof(uint64_t))
        if self.mixed == NULL:
            raise MemoryError()
        for i in range(self.n):
            self.mixed[i] = _mix(self.data[i])

    def __dealloc__(self):
        free(self.data)
        free(self.mixed)

    def __len__(self):
        return self.n


cdef class KeyLog:
    """Append-only u64 buffer: the keys one (instance, tier) added, for O(own blocks) clearing."""

    cdef uint64_t* data
    cdef Py_ssize_t size
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.data = NULL
        self.size = 0
        self.cap = 0

    def __dealloc__(self):
        free(self.data)

    cdef int push(self, uint64_t key) except -1:
        cdef uint64_t* grown
        if self.size == self.cap:
            self.cap = 16 if self.cap == 0 else self.cap * 2
            grown = <uint64_t*>realloc(self.data, self.cap * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self.data = grown
        self.data[self.size] = key
        self.size += 1
        return 0

    def __len__(self):
        return self.size

    def __iter__(self):
        cdef Py_ssize_t i
        for i in range(self.size):
            yield self.data[i]

    def nbytes(self):
        return self.cap * sizeof(uint64_t)

    def reset(self):
        free(self.data)
        self.data = NULL
        self.size = 0
        self.cap = 0


cdef class BlockTable:
    """u64 key -> u64 bitmask of holders (nonzero), open addressing with linear probing."""

    cdef Cell* cells
    cdef uint64_t mask
    cdef Py_ssize_t count
    # Models with more than one bank: a table per tier saying which banks hold each key (bit
    # bank >> shift: inverted.bank_shift), kept here as keys appear and disappear, so that a match
    # walks only those banks. ``siblings`` are the other banks' tables of this tier sharing this
    # bank's bit (> 64 banks).
    # A summary may report to one of its own (a GPU bank range's table to the model's GPU summary:
    # inverted._Shard.ranges), the same way.
    cdef BlockTable summary
    cdef uint64_t group_bit
    cdef list siblings
    # A GPU summary's holder counts: per cell, how many instances of the model (or of its bank range)
    # hold the key on the GPU (NULL elsewhere). With them a match skips the leading blocks every
    # instance holds instead of walking each bank through them (a fleet-wide system prompt), and the
    # banks of a range whose every instance holds a block (the prompts' first block of a deployment).
    cdef unsigned int* aux
    # A GPU bank range's table (inverted._Shard.ranges): per cell, the banks of the range whose every
    # instance holds the key (a subset of the cell's banks; NULL elsewhere). A bank's GPU table
    # reporting to it knows its instances' slots (``occupied``, from inverted._Shard) and tells it
    # whenever a key's holders become or stop being all of them.
    cdef uint64_t* full
    cdef uint64_t occupied

    def __cinit__(self, Py_ssize_t capacity=16):
        cdef uint64_t cap = 16
        while cap < <uint64_t>capacity:
            cap <<= 1
        self.cells = _alloc_cells(cap)
        self.mask = cap - 1
        self.count = 0
        self.summary = None
        self.group_bit = 0
        self.siblings = []
        self.aux = NULL
        self.full = NULL
        self.occupied = 0

    def __dealloc__(self):
        free(self.cells)
        free(self.aux)
        free(self.full)

    # -- C level -------------------------------------------------------------------------------

    cdef inline uint64_t _slot(self, uint64_t key) noexcept nogil:
        """Index of the cell holding key, or of the empty cell where it would go."""
        cdef uint64_t i = _mix(key) & self.mask
        cdef Cell* cells = self.cells
        while cells[i].val != 0 and cells[i].key != key:
            i = (i + 1) & self.mask
        return i

    cdef inline uint64_t get(self, uint64_t key) noexcept nogil:
        return self.cells[self._slot(key)].val

    cdef inline uint64_t get_mixed(self, uint64_t key, uint64_t mixed) noexcept nogil:
        """``get`` with the key's ``_mix`` already computed."""
        cdef uint64_t i = mixed & self.mask
        cdef Cell* cells = self.cells
        while cells[i].val != 0 and cells[i].key != key:
            i = (i + 1) & self.mask
        return cells[i].val

    cdef int _rehash(self, uint64_t cap) except -1:
        cdef Cell* old = self.cells
        cdef uint64_t old_cap = self.mask + 1
        cdef Cell* cells = _alloc_cells(cap)
        cdef uint64_t i, j, m = cap - 1
        cdef unsigned int* old_aux = self.aux
        cdef unsigned int* aux = NULL
        cdef uint64_t* old_full = self.full
        cdef uint64_t* full = NULL
        if old_aux != NULL:
            aux = <unsigned int*>calloc(cap, sizeof(unsigned int))
            if aux == NULL:
                free(cells)
                raise MemoryError()
        if old_full != NULL:
            full = <uint64_t*>calloc(cap, sizeof(uint64_t))
            if full == NULL:
                free(cells)
                free(aux)
                raise MemoryError()
        for i in range(old_cap):
            if old[i].val != 0:
                j = _mix(old[i].key) & m
                while cells[j].val != 0:
                    j = (j + 1) & m
                cells[j] = old[i]
                if aux != NULL:
                    aux[j] = old_aux[i]
                if full != NULL:
                    full[j] = old_full[i]
        self.cells = cells
        self.mask = m
        self.aux = aux
        self.full = full
        free(old)
        free(old_aux)
        free(old_full)
        return 0

    cdef int _rehash_for(self, Py_ssize_t n) except -1:
        """Make room for ``n`` more keys at once (no growth during a bulk insert)."""
        cdef uint64_t cap = self.mask + 1
        while (self.count + n) * 10 > cap * 7:
            cap <<= 1
        if cap != self.mask + 1:
            self._rehash(cap)
        return 0

    cdef inline int _reserve_one(self) except -1:
        # Grow at 70 % load: linear probing stays short (~1.7 probes per hit).
        if (self.count + 1) * 10 > (self.mask + 1) * 7:
            self._rehash((self.mask + 1) * 2)
        return 0

    cdef void _delete_at(self, uint64_t i) noexcept nogil:
        """Backward-shift deletion: later cells of the probe run move up, leaving no tombstone."""
        cdef Cell* cells = self.cells
        cdef uint64_t m = self.mask
        cdef uint64_t j = i, home
        while True:
            j = (j + 1) & m
            if cells[j].val == 0:
                break
            home = _mix(cells[j].key) & m
            # Move cell j into the hole at i unless its home lies cyclically in (i, j].
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                cells[i] = cells[j]
                if self.aux != NULL:
                    self.aux[i] = self.aux[j]
                if self.full != NULL:
                    self.full[i] = self.full[j]
                i = j
        cells[i].val = 0
        cells[i].key = 0
        if self.aux != NULL:
            self.aux[i] = 0
        if self.full != NULL:
            self.full[i] = 0
        self.count -= 1

    cdef int _add_holder(self, uint64_t key, uint64_t bit, bint new_bit, unsigned int n,
                         bint all_hold=False) except -1:
        """This table is a summary: ``n`` more holders of ``key`` under ``bit`` (``new_bit``: the
        reporting table did not hold the key before; ``all_hold``: now every instance of that bank
        holds it, for a range table's ``full``). Passed on to this table's own summary."""
        cdef Cell* cell
        cdef uint64_t i
        cdef bint fresh = False
        if not new_bit and self.aux == NULL:
            return 0  # nothing changes here: the bit is set and nothing is counted
        self._reserve_one()
        i = self._slot(key)
        cell = &self.cells[i]
        if cell.val == 0:
            cell.key = key
            cell.val = bit
            self.count += 1
            fresh = True
        elif not cell.val & bit:
            cell.val |= bit
            fresh = True
        if self.aux != NULL:
            self.aux[i] += n
        if all_hold and self.full != NULL:
            self.full[i] |= bit
        if self.summary is not None:
            self.summary._add_holder(key, self.group_bit, fresh, n)
        return 0

    cdef int _drop_holder(self, uint64_t key, uint64_t bit, bint gone) except -1:
        """This table is a summary: one holder of ``key`` under ``bit`` fewer (``gone``: none is
        left under ``bit``). Passed on to this table's own summary."""
        cdef uint64_t i
        cdef bint left = False
        if not gone and self.aux == NULL:
            return 0
        i = self._slot(key)
        if not self.cells[i].val:
            return 0
        if self.aux != NULL:
            self.aux[i] -= 1
        if self.full != NULL:  # (a holder left: not every instance of that bank holds it now)
            self.full[i] &= ~bit
        if gone:
            self.cells[i].val &= ~bit
            if self.cells[i].val == 0:
                self._delete_at(i)
                left = True
        if self.summary is not None:
            self.summary._drop_holder(key, self.group_bit, left)
        return 0

    cdef inline int _left(self, uint64_t key, bint gone) except -1:
        """One holder of ``key`` left this table (``gone``: the last one): tell the summary, whose
        bit stays while a sibling sharing it holds the key."""
        cdef BlockTable sib
        if gone:
            for sib in self.siblings:
                if sib.get(key):
                    gone = False
                    break
        return self.summary._drop_holder(key, self.group_bit, gone)

    def enable_counts(self):
        """Keep a holder count per key (a model's GPU summary; see ``aux``), zero for now: the
        bank tables linked afterwards report their holders."""
        if self.aux == NULL:
            self.aux = <unsigned int*>calloc(self.mask + 1, sizeof(unsigned int))
            if self.aux == NULL:
                raise MemoryError()

    def enable_full(self):
        """Keep per key the banks whose every instance holds it (a GPU bank range's table; see
        ``full``), none for now: the bank tables linked afterwards report them."""
        if self.full == NULL:
            self.full = <uint64_t*>calloc(self.mask + 1, sizeof(uint64_t))
            if self.full == NULL:
                raise MemoryError()

    def full_banks(self, uint64_t key):
        """A range table's banks whose every instance holds ``key`` (0 when absent)."""
        cdef uint64_t i = self._slot(key)
        if self.full == NULL or not self.cells[i].val:
            return 0
        return self.full[i]

    def set_occupied(self, uint64_t occupied, KeyLog log=None):
        """This bank's instances are now the slots of ``occupied`` (a join or a leave: the leaving
        instance's keys are already cleared). A range table above hears of each key whose holders
        became or stopped being all of them. Such a key is held by every instance that stays, so
        ``log``, the GPU key log of one of them (the caller picks the shortest), names them all:
        O(that instance's keys) a join or leave, not O(the bank's). None: no instance stays."""
        cdef uint64_t old = self.occupied, v, at, key
        cdef Py_ssize_t n
        cdef BlockTable summary = self.summary
        self.occupied = occupied
        if summary is None or summary.full == NULL or old == occupied or log is None:
            return
        for n in range(log.size):
            key = log.data[n]
            v = self.get(key)
            if v and (v == old) != (v == occupied):
                at = summary._slot(key)
                if summary.cells[at].val:
                    if v == occupied:
                        summary.full[at] |= self.group_bit
                    else:
                        summary.full[at] &= ~self.group_bit

    def holders(self, uint64_t key):
        """A counting summary's holder count of ``key`` (0 when absent)."""
        cdef uint64_t i = self._slot(key)
        if self.aux == NULL or not self.cells[i].val:
            return 0
        return self.aux[i]

    def link_summary(self, BlockTable summary, uint64_t group_bit):
        """Report this table's keys to ``summary`` under ``group_bit`` from now on (and now: its
        holders, or its own counts when it is a counting summary itself)."""
        cdef uint64_t i
        self.summary = summary
        self.group_bit = group_bit
        summary._rehash_for(self.count)
        for i in range(self.mask + 1):
            if self.cells[i].val:
                summary._add_holder(
                    self.cells[i].key, group_bit, True,
                    self.aux[i] if self.aux != NULL else __builtin_popcountll(self.cells[i].val),
                    self.cells[i].val == self.occupied)

    def set_siblings(self, list siblings):
        self.siblings = siblings

    cdef int _maybe_shrink(self) except -1:
        # Halve when under 1/8 full so that a fleet that shrinks gives memory back.
        cdef uint64_t cap = self.mask + 1
        if self.summary is not None:
            self.summary._maybe_shrink()
        if cap > 1024 and <uint64_t>self.count * 8 < cap:
            while cap > 1024 and <uint64_t>self.count * 4 < cap:
                cap >>= 1
            self._rehash(cap)
        return 0

    # -- bulk operations (the ingest hot path) --------------------------------------------------

    cdef inline int _set(self, uint64_t key, uint64_t bit, KeyLog log) except -1:
        """Set ``bit`` on ``key``; 1 when it was not set (the key is then logged), else 0."""
        cdef Cell* cell
        self._reserve_one()
        cell = &self.cells[self._slot(key)]
        if cell.val == 0:
            cell.key = key
            cell.val = bit
            self.count += 1
            if self.summary is not None:
                self.summary._add_holder(key, self.group_bit, True, 1, bit == self.occupied)
        elif cell.val & bit:
            return 0
        else:
            cell.val |= bit
            if self.summary is not None:
                self.summary._add_holder(key, self.group_bit, False, 1, cell.val == self.occupied)
        log.push(key)
        return 1

    cdef inline int _unset(self, uint64_t key, uint64_t bit) except -1:
        """Clear ``bit`` on ``key``; 1 when it was set. The caller shrinks afterwards."""
        cdef uint64_t i = self._slot(key)
        cdef bint gone
        if self.cells[i].val & bit:
            self.cells[i].val ^= bit
            gone = self.cells[i].val == 0
            if gone:
                self._delete_at(i)
            if self.summary is not None:
                self._left(key, gone)
            return 1
        return 0

    def add_bit(self, object keys, uint64_t bit, KeyLog log):
        """Set ``bit`` on every key; returns (newly set count, xor of those keys). Logs new keys."""
        cdef Py_ssize_t added = 0
        cdef uint64_t x = 0, key
        for obj in keys:
            key = PyLong_AsUnsignedLongLong(obj)
            if self._set(key, bit, log):
                added += 1
                x ^= key
        return added, x

    def remove_bit(self, object keys, uint64_t bit):
        """Clear ``bit`` on every key; returns (cleared count, xor of those keys)."""
        cdef Py_ssize_t removed = 0
        cdef uint64_t x = 0, key
        for obj in keys:
            key = PyLong_AsUnsignedLongLong(obj)
            if self._unset(key, bit):
                removed += 1
                x ^= key
        if removed:
            self._maybe_shrink()
        return removed, x

    def clear_logged(self, KeyLog log, uint64_t bit):
        """Clear ``bit`` on every key in ``log``; returns how many had it."""
        cdef Py_ssize_t n, cleared = 0
        for n in range(log.size):
            cleared += self._unset(log.data[n], bit)
        self._maybe_shrink()
        return cleared

    def compact_log(self, KeyLog log, uint64_t bit):
        """Rewrite ``log`` to hold each key that still has ``bit`` exactly once; returns its length."""
        cdef BlockTable seen = BlockTable(log.size * 2)
        cdef Py_ssize_t n, kept = 0
        cdef uint64_t key, i
        for n in range(log.size):
            key = log.data[n]
            if self.get(key) & bit:
                seen._reserve_one()
                i = seen._slot(key)
                if seen.cells[i].val == 0:
                    seen.cells[i].key = key
                    seen.cells[i].val = 1
                    seen.count += 1
                    log.data[kept] = key
                    kept += 1
        log.size = kept
        return kept

    def differ(self, KeyLog log, uint64_t bit, list want_keys, Py_ssize_t held):
        """A resumable comparison of the ``held`` keys holding ``bit`` (found through ``log``) with
        ``want_keys`` (distinct); see Differ."""
        return Differ(self, log, bit, want_keys, held)

    # -- Python-level access (tests, snapshots, debugging) --------------------------------------

    def get_mask(self, uint64_t key):
        return self.get(key)

    def __len__(self):
        return self.count

    def __contains__(self, object key):
        return self.get(PyLong_AsUnsignedLongLong(key)) != 0

    def capacity(self):
        return self.mask + 1

    def nbytes(self):
        return (self.mask + 1) * (sizeof(Cell) + (sizeof(unsigned int) if self.aux != NULL else 0)
                                  + (sizeof(uint64_t) if self.full != NULL else 0))

    def items(self):
        cdef uint64_t i
        return [(self.cells[i].key, self.cells[i].val) for i in range(self.mask + 1) if self.cells[i].val]


cdef inline void _prefetch(BlockTable table, uint64_t key) noexcept nogil:
    __builtin_prefetch(&table.cells[_mix(key) & table.mask])


cdef inline void _prefetch_mixed(BlockTable table, uint64_t mixed) noexcept nogil:
    __builtin_prefetch(&table.cells[mixed & table.mask])


cdef class Differ:
    """Compares what one (instance, tier) holds with a snapshot, a bounded number of keys per step.

    Pass 1 looks every snapshot key up (keys within a snapshot tier are distinct, per the protocol):
    those not held are missing. If the number held equals the instance's count, nothing is extra and
    the comparison is done - the usual outcome of a periodic check. Only otherwise does pass 2 build
    a set of the snapshot's keys and walk the instance's key log for the extra ones.

    Done in steps between which the event loop runs, a worker with hundreds of thousands of blocks
    never stalls ingestion or queries for long. The instance's own blocks must not change between
    steps (the consumer holds its batches while a snapshot repair is pending); other instances may
    change the table freely, because every step looks keys up afresh.
    """

    cdef BlockTable table
    cdef KeyLog log
    cdef uint64_t bit
    cdef BlockTable want
    cdef uint64_t* karr
    cdef list keys
    cdef Py_ssize_t n, held, hits, pos, built, log_pos, converted
    cdef readonly list missing
    cdef readonly list extra

    def __cinit__(self, BlockTable table, KeyLog log, uint64_t bit, list want_keys, Py_ssize_t held):
        self.table = table
        self.log = log
        self.bit = bit
        self.keys = want_keys
        self.n = len(want_keys)
        self.held = held
        self.want = None
        # Keys are converted from Python ints step by step, just ahead of their use.
        self.karr = <uint64_t*>malloc((self.n if self.n else 1) * sizeof(uint64_t))
        if self.karr == NULL:
            raise MemoryError()
        self.converted = self.hits = self.pos = self.built = self.log_pos = 0
        self.missing = []
        self.extra = []

    def __dealloc__(self):
        free(self.karr)

    def step(self, Py_ssize_t budget=16384):
        """Examine up to ``budget`` keys (all when negative); True when the comparison is done."""
        cdef BlockTable table = self.table
        cdef uint64_t key, i, bit = self.bit
        cdef Py_ssize_t j, end, size, limit
        if budget < 0:
            budget = self.n + self.log.size + self.n + 1
        # Pass 1: which snapshot keys are not held.
        end = min(self.n, self.pos + budget)
        limit = min(self.n, end + PREFETCH)
        while self.converted < limit:
            self.karr[self.converted] = PyLong_AsUnsignedLongLong(self.keys[self.converted])
            self.converted += 1
        for j in range(self.pos, end):
            if j + PREFETCH < self.n:
                _prefetch(table, self.karr[j + PREFETCH])
            if table.get(self.karr[j]) & bit:
                self.hits += 1
            else:
                self.missing.append(self.karr[j])
        budget -= end - self.pos
        self.pos = end
        if self.pos < self.n:
            return False
        if self.hits == self.held:
            return True
        # Pass 2 (something is extra): a set of the snapshot's keys, then the instance's log.
        if self.want is None:
            self.want = BlockTable(self.n * 2 + 16)
            self.want._rehash_for(self.n)
        want = self.want
        end = min(self.n, self.built + budget)
        for j in range(self.built, end):
            key = self.karr[j]
            i = want._slot(key)
            if want.cells[i].val == 0:
                want.cells[i].key = key
                want.cells[i].val = 1
                want.count += 1
        budget -= end - self.built
        self.built = end
        if self.built < self.n:
            return False
        size = self.log.size  # the log may have been reset if the instance was dropped meanwhile
        end = min(size, self.log_pos + budget)
        for j in range(self.log_pos, end):
            if j + PREFETCH < size:
                _prefetch(table, self.log.data[j + PREFETCH])
            key = self.log.data[j]
            if table.get(key) & bit:
                want._reserve_one()
                i = want._slot(key)
                if want.cells[i].val == 0:  # held, not wanted; marked so a twice-logged key counts once
                    self.extra.append(key)
                    want.cells[i].key = key
                    want.cells[i].val = 2
                    want.count += 1
        self.log_pos = end
        return self.log_pos >= size


cdef int _walk_gpu_drops(BlockTable gpu, KeyArray keys, uint64_t alive, uint64_t* masks,
                         Py_ssize_t* lens, Py_ssize_t start) noexcept:
    """The GPU walk: the slots of ``alive`` that matched at least one block, by the key where they
    drop out: (mask, matched blocks) pairs, at most 64 (one bank); returns how many. Every slot of
    ``alive`` holds the first ``start`` keys on the GPU (the model's holder counts said so): the
    walk starts after them. The grouped match uses the masks as they are (a group grows per
    drop-out key, not per slot); _walk_gpu lists them per slot."""
    cdef Py_ssize_t i
    cdef uint64_t still
    cdef int count = 0
    cdef Py_ssize_t n = keys.n
    cdef uint64_t* karr = keys.data
    cdef uint64_t* mixed = keys.mixed
    if start < n and not alive & gpu.get_mixed(karr[start], mixed[start]):
        # No slot holds the first key walked (a bank sharing its summary bit with a holder's): no
        # prefetches for a walk that ends here.
        if start:
            masks[0] = alive
            lens[0] = start
            return 1
        return 0
    for i in range(start, min(n, start + PREFETCH)):
        _prefetch_mixed(gpu, mixed[i])
    for i in range(start, n):
        if i + PREFETCH < n:
            _prefetch_mixed(gpu, mixed[i + PREFETCH])
        still = alive & gpu.get_mixed(karr[i], mixed[i])
        if still != alive:
            if i:
                masks[count] = alive ^ still
                lens[count] = i
                count += 1
            alive = still
            if not alive:
                return count
    if alive:
        masks[count] = alive
        lens[count] = n
        count += 1
    return count


cdef int _walk_gpu(BlockTable gpu, KeyArray keys, uint64_t alive,
                   int* slots, Py_ssize_t* lens, Py_ssize_t start) noexcept:
    """_walk_gpu_drops per slot: fills (slot, matched blocks) for slots that matched at least one
    block (at most 64, one bank) and returns how many."""
    cdef uint64_t drops[64]
    cdef Py_ssize_t drop_lens[64]
    cdef int n_drops = _walk_gpu_drops(gpu, keys, alive, drops, drop_lens, start)
    cdef int j, count = 0
    cdef uint64_t m
    for j in range(n_drops):
        m = drops[j]
        while m:
            slots[count] = __builtin_ctzll(m)
            lens[count] = drop_lens[j]
            count += 1
            m &= m - 1
    return count


def match_gpu_into(BlockTable gpu, KeyArray keys, uint64_t alive, list owners, dict out, dict same,
                   object match_type):
    """Longest consecutive prefix of ``keys`` per slot in ``alive``, one table (a 64-slot bank),
    stored straight into ``out``: ``owners[slot]`` -> ``match_type(n, (n, 0, 0, 0))`` for slots
    that matched at least one block, one object per matched length (kept in ``same``: equal matches
    are immutable and shared). No tuple per instance and no Python loop around the walk."""
    cdef int slots[64]
    cdef Py_ssize_t lens[64]
    cdef int count = _walk_gpu(gpu, keys, alive, slots, lens, 0)
    _emit_gpu(count, slots, lens, owners, out, same, match_type)


cdef inline int _emit_gpu(int count, int* slots, Py_ssize_t* lens, list owners, dict out, dict same,
                          object match_type) except -1:
    """_walk_gpu's matches into ``out``, one shared match object per matched length."""
    cdef int j
    for j in range(count):
        n = lens[j]
        m = same.get(n)
        if m is None:
            m = same[n] = tuple.__new__(match_type, (n, (n, 0, 0, 0)))
        out[owners[slots[j]]] = m
    return 0


cdef inline object _tiered_match(object match_type, long long* lengths, long long* counts, int slot):
    """A slot's answer from the tiered walk: (blocks matched, (gpu, cpu, disk, pool) blocks)."""
    return tuple.__new__(match_type, (lengths[slot], (
        counts[slot * 4], counts[slot * 4 + 1], counts[slot * 4 + 2], counts[slot * 4 + 3])))


cdef inline void _add_run(long long* counts, uint64_t mask, int tier, long long run) noexcept nogil:
    cdef int slot
    while mask:
        slot = __builtin_ctzll(mask)
        counts[slot * 4 + tier] += run
        mask &= mask - 1


cdef inline bint _in_pool(list pools, uint64_t key, uint64_t mixed):
    cdef BlockTable table
    for table in pools:
        if table.count and table.get_mixed(key, mixed):
            return True
    return False


cdef int _walk_tiered(BlockTable gpu, BlockTable cpu, BlockTable disk, list pools, KeyArray keys,
                      uint64_t alive, long long* counts, long long* lengths, Py_ssize_t start) except -1:
    """The tiered walk: ``lengths[slot]`` (blocks matched) and ``counts[slot * 4 + tier]`` for every
    slot of ``alive``; both arrays are zeroed here. The first ``start`` keys are on every slot's GPU
    (see _walk_gpu): they count as one run on the GPU."""
    cdef Py_ssize_t i, run = 0
    cdef uint64_t key, on_gpu, on_cpu, on_disk, in_pool, rest, still
    cdef uint64_t p_gpu = 0, p_cpu = 0, p_disk = 0, p_pool = 0, dropped
    cdef int slot
    cdef Py_ssize_t n = keys.n
    cdef uint64_t* karr = keys.data
    cdef uint64_t* mixed = keys.mixed
    cdef uint64_t h
    memset(counts, 0, 256 * sizeof(long long))
    memset(lengths, 0, 64 * sizeof(long long))
    if start:
        p_gpu, run = alive, start
    for i in range(start, min(n, start + PREFETCH)):
        _prefetch_mixed(gpu, mixed[i])
    for i in range(start, n):
        key = karr[i]
        h = mixed[i]
        if i + PREFETCH < n:
            _prefetch_mixed(gpu, mixed[i + PREFETCH])
        on_gpu = alive & gpu.get_mixed(key, h)
        rest = alive ^ on_gpu
        on_cpu = rest & cpu.get_mixed(key, h) if rest and cpu.count else 0
        rest ^= on_cpu
        on_disk = rest & disk.get_mixed(key, h) if rest and disk.count else 0
        rest ^= on_disk
        in_pool = rest if rest and pools and _in_pool(pools, key, h) else 0
        still = alive ^ rest ^ in_pool
        if on_gpu != p_gpu or on_cpu != p_cpu or on_disk != p_disk or in_pool != p_pool:
            if run:
                _add_run(counts, p_gpu, 0, run)
                _add_run(counts, p_cpu, 1, run)
                _add_run(counts, p_disk, 2, run)
                _add_run(counts, p_pool, 3, run)
            p_gpu, p_cpu, p_disk, p_pool, run = on_gpu, on_cpu, on_disk, in_pool, 0
        run += 1
        if still != alive:
            dropped = alive ^ still
            while dropped:
                slot = __builtin_ctzll(dropped)
                lengths[slot] = i
                dropped &= dropped - 1
            alive = still
            if not alive:
                break
    if run:
        _add_run(counts, p_gpu, 0, run)
        _add_run(counts, p_cpu, 1, run)
        _add_run(counts, p_disk, 2, run)
        _add_run(counts, p_pool, 3, run)
    while alive:
        slot = __builtin_ctzll(alive)
        lengths[slot] = n
        alive &= alive - 1
    return 0


def match_tiered(BlockTable gpu, BlockTable cpu, BlockTable disk, list pools, KeyArray keys, uint64_t alive):
    """Like match_gpu_into, but a block counts if it is on any local tier of the slot or in the pool.

    ``pools`` are the model's shared-tier tables (one per bank): any holder there makes the block
    loadable by every instance. Returns (slot, matched, gpu, cpu, disk, shared) per matched slot, each block
    attributed to the fastest tier holding it. Per-tier counts are accumulated over runs of equal
    holder patterns, so per-slot work happens only where the pattern changes.
    """
    cdef long long counts[256]
    cdef long long lengths[64]
    cdef int slot
    _walk_tiered(gpu, cpu, disk, pools, keys, alive, counts, lengths, 0)
    out = []
    for slot in range(64):
        if lengths[slot]:
            out.append((slot, lengths[slot], counts[slot * 4], counts[slot * 4 + 1],
                        counts[slot * 4 + 2], counts[slot * 4 + 3]))
    return out


cdef inline int _bank_shift(Py_ssize_t nb) noexcept nogil:
    """A bank's summary bit is its number >> this (inverted.bank_shift: 64 << shift >= banks)."""
    cdef int shift = 0
    while (<Py_ssize_t>64 << shift) < nb:
        shift += 1
    return shift


cdef tuple _banks_to_walk(list summaries, KeyArray keys, Py_ssize_t everyone, bint narrow=False):
    """(bank groups to walk (bit b >> shift), keys every instance holds on the GPU): how many leading
    keys the GPU summary counts ``everyone`` holders of (only with a counting summary, 0 otherwise),
    and the banks holding the first key on a local tier (all when the pool holds it).

    ``narrow``: after such leading keys, only the banks holding the next key on a local tier (all
    when the pool holds it; none when no key is left): in every other bank each candidate matched
    exactly the leading keys, all on the GPU, and the caller answers them so without a walk. A
    Mooncake-style fleet where every instance holds the prompts' first block then walks the few
    banks holding the second, not every bank (hybrid matches walk every bank after them)."""
    cdef uint64_t groups = 0xFFFFFFFFFFFFFFFFULL, key
    cdef BlockTable gpu_summary
    cdef Py_ssize_t start = 0, n = keys.n
    cdef uint64_t i
    if summaries is None:
        return groups, 0
    gpu_summary = <BlockTable>summaries[0]
    if everyone > 0 and gpu_summary.aux != NULL:
        while start < n:
            i = gpu_summary._slot(keys.data[start])
            if not gpu_summary.cells[i].val or gpu_summary.aux[i] != <unsigned int>everyone:
                break
            start += 1
    if start and narrow and start == n:
        return 0, start
    if (start == 0 or narrow):
        key = keys.data[start]
        if not (<BlockTable>summaries[3]).get(key):
            groups = (gpu_summary.get(key) | (<BlockTable>summaries[1]).get(key)
                      | (<BlockTable>summaries[2]).get(key))
    return groups, start


cdef inline int _group_add(list g, Py_ssize_t b, uint64_t mask) except -1:
    """Add ``mask`` (bank b's slots) to group ``g``: [match, count, [[bank, mask]...]] (banks
    ascending: a bank's slots are added before the next bank's)."""
    cdef list pairs = <list>g[2], last
    g[1] = <Py_ssize_t>g[1] + __builtin_popcountll(mask)
    if pairs:
        last = <list>pairs[len(pairs) - 1]
        if <Py_ssize_t>last[0] == b:
            last[1] = <uint64_t>last[1] | mask
            return 0
    pairs.append([b, mask])
    return 0


# _Planner.plan's decisions per bank.
DEF NO_WALK = 0
DEF WALK = 1
DEF PROBE = 2


cdef struct _Level:
    uint64_t gpu  # bank ranges holding the key on the GPU (the model's GPU summary)
    uint64_t local  # ... on the CPU or disk
    bint pool  # the shared pool holds it: every instance of the model can load it


cdef class _Planner:
    """Which banks of a model a match walks, from which key, and which it answers without a walk
    (match_banks_into, match_banks_grouped). Per bank range (a bit of the model's summaries), from
    the leading keys every instance holds (``start``), key by key:

    - a range the model's summaries say does not hold the key on any tier: every candidate of its
      undecided banks matched exactly the keys before it, on the GPU (no walk);
    - otherwise its range table (``ranges``: GPU key -> banks of the range holding it, and those
      whose every instance holds it) splits them: the banks not holding the key matched the keys
      before it, those where every instance holds it go on to the next key without a walk, and
      the others (some instances hold it) are walked from it;
    - without a range table (below inverted.RANGE_MIN_SHIFT), or with a CPU, disk or pool copy of
      the key in the range, its undecided banks are walked from that key.

    So a deployment's instances that all hold their prompts' first block (Mooncake: every request
    starts with it) cost a range-table probe per range and key, not a walk of each of their banks:
    the cost follows the ranges and the banks holding the next block, which alone are walked. The
    summaries are probed once per key (cached across ranges)."""

    cdef list summaries, ranges
    cdef KeyArray keys
    cdef _Level* levels
    cdef _Level small[32]  # (no allocation for prompts of up to 32 blocks)
    cdef Py_ssize_t known, nb
    cdef int shift
    cdef BlockTable gpu_s, cpu_s, disk_s, pool_s

    def __cinit__(self, list summaries, list ranges, KeyArray keys, Py_ssize_t nb):
        if keys.n <= 32:
            self.levels = self.small
        else:
            self.levels = <_Level*>malloc(keys.n * sizeof(_Level))
            if self.levels == NULL:
                raise MemoryError()
        self.summaries = summaries
        self.ranges = ranges
        self.keys = keys
        self.known = 0
        self.nb = nb
        self.shift = _bank_shift(nb)
        self.gpu_s = <BlockTable>summaries[0]
        self.cpu_s = <BlockTable>summaries[1]
        self.disk_s = <BlockTable>summaries[2]
        self.pool_s = <BlockTable>summaries[3]

    def __dealloc__(self):
        if self.levels != self.small:
            free(self.levels)

    cdef _Level* level(self, Py_ssize_t d) noexcept:
        cdef uint64_t key, h
        cdef _Level* lv
        while self.known <= d:
            key = self.keys.data[self.known]
            h = self.keys.mixed[self.known]
            lv = &self.levels[self.known]
            lv.pool = self.pool_s.count and self.pool_s.get_mixed(key, h) != 0
            lv.gpu = self.gpu_s.get_mixed(key, h)
            lv.local = 0
            if self.cpu_s.count:
                lv.local = self.cpu_s.get_mixed(key, h)
            if self.disk_s.count:
                lv.local |= self.disk_s.get_mixed(key, h)
            self.known += 1
        return &self.levels[d]

    cdef uint64_t first_ranges(self, Py_ssize_t start) noexcept:
        """The ranges a match must look at: all after leading keys every instance holds, else those
        holding the first key (all when the pool holds it)."""
        cdef _Level* lv
        cdef Py_ssize_t n_ranges = (self.nb + (1 << self.shift) - 1) >> self.shift
        cdef uint64_t every = 0xFFFFFFFFFFFFFFFFULL if n_ranges >= 64 else ((<uint64_t>1) << n_ranges) - 1
        if start or self.keys.n == 0:
            return every
        lv = self.level(0)
        if lv.pool:
            return every
        return lv.gpu | lv.local

    cdef uint64_t walk_ranges(self, Py_ssize_t start) noexcept:
        """Without range tables: the ranges walked from ``start``, those that may hold that key
        (all when the pool holds it); every candidate of the others matched ``start`` keys."""
        cdef _Level* lv
        if start >= self.keys.n:
            return 0
        lv = self.level(start)
        if lv.pool:
            return 0xFFFFFFFFFFFFFFFFULL
        return lv.gpu | lv.local

    cdef uint64_t may_hold(self, Py_ssize_t r, Py_ssize_t d, BlockTable table) noexcept:
        """The banks of range r that may hold key d on some tier (range table and summaries)."""
        cdef _Level* lv
        if d >= self.keys.n:
            return 0
        lv = self.level(d)
        if lv.pool or lv.local & ((<uint64_t>1) << r):
            return 0xFFFFFFFFFFFFFFFFULL
        if not lv.gpu & ((<uint64_t>1) << r):
            return 0
        return table.get(self.keys.data[d])

    cdef int plan(self, Py_ssize_t r, Py_ssize_t start, Py_ssize_t* depth, char* walk) except -1:
        """Range r's banks r << shift ...: per bank i of the range, ``depth[i]`` (-1: nothing to do)
        and ``walk[i]``: NO_WALK, every candidate matched depth[i] keys on the GPU; WALK, walk from
        key depth[i]; PROBE, the candidates holding key depth[i] on the GPU matched one more than
        depth[i] keys (none holds the next key), the others depth[i]. Returns how many banks the
        range has."""
        cdef Py_ssize_t b0 = r << self.shift, m = min(<Py_ssize_t>1 << self.shift, self.nb - b0)
        cdef Py_ssize_t d = start, n = self.keys.n, i
        cdef uint64_t undecided, held, full, some, deeper, rb = (<uint64_t>1) << r, at
        cdef _Level* lv
        cdef BlockTable table = None
        cdef char walk_it
        if m <= 0:
            return 0
        if m > 64:  # (beyond 4,096 banks: no range tables) one decision for the range, in depth[0]
            undecided = 1
        else:
            undecided = 0xFFFFFFFFFFFFFFFFULL if m == 64 else ((<uint64_t>1) << m) - 1
            if self.ranges is not None and r < len(self.ranges):
                table = <BlockTable>self.ranges[r]
        if table is None:  # one decision for every bank of the range
            walk_it = WALK
            if d == n:
                walk_it = NO_WALK
            else:
                lv = self.level(d)
                if not (lv.pool or lv.local & rb or lv.gpu & rb):
                    walk_it = NO_WALK
            for i in range(min(m, 64)):
                depth[i] = d
                walk[i] = walk_it
            return m
        for i in range(m):
            depth[i] = -1
            walk[i] = 0
        while undecided:
            if d == n:
                _decide(undecided, d, NO_WALK, depth, walk)
                break
            lv = self.level(d)
            if lv.pool or lv.local & rb:
                _decide(undecided, d, WALK, depth, walk)
                break
            if not lv.gpu & rb:
                _decide(undecided, d, NO_WALK, depth, walk)
                break
            at = table._slot(self.keys.data[d])
            held = table.cells[at].val
            full = table.full[at] if table.full != NULL else 0
            # Banks not holding the key: their candidates matched the keys before it. Banks all of
            # whose instances hold it: on to the next key. Banks some of whose instances hold it:
            # walked from it, or only probed for it when none of them holds the next key (a prompt's
            # first block that most of a deployment holds, its second block elsewhere).
            _decide(undecided & ~held, d, NO_WALK, depth, walk)
            some = undecided & held & ~full
            if some:
                deeper = self.may_hold(r, d + 1, table)
                _decide(some & deeper, d, WALK, depth, walk)
                _decide(some & ~deeper, d, PROBE, depth, walk)
            undecided &= full
            d += 1
        return m


cdef inline void _decide(uint64_t banks, Py_ssize_t d, char walk_it, Py_ssize_t* depth, char* walk) noexcept:
    cdef int i
    while banks:
        i = __builtin_ctzll(banks)
        depth[i] = d
        walk[i] = walk_it
        banks &= banks - 1


cdef inline Py_ssize_t _leading(list summaries, KeyArray keys, Py_ssize_t everyone) noexcept:
    """How many leading keys the GPU summary counts ``everyone`` holders of (0 without counts)."""
    cdef BlockTable gpu_summary
    cdef Py_ssize_t start = 0
    cdef uint64_t i
    if summaries is None or everyone <= 0:
        return 0
    gpu_summary = <BlockTable>summaries[0]
    if gpu_summary.aux == NULL:
        return 0
    while start < keys.n:
        i = gpu_summary._slot(keys.data[start])
        if not gpu_summary.cells[i].val or gpu_summary.aux[i] != <unsigned int>everyone:
            break
        start += 1
    return start


cdef inline Py_ssize_t _plan_range(
    _Planner planner, bint tables, Py_ssize_t r, Py_ssize_t start, int shift, Py_ssize_t nb,
    uint64_t uniform, Py_ssize_t* depth, char* walk,
) except -1:
    """Range ``r``'s banks to look at (their count) and, in ``depth`` / ``walk``, from which key and
    how (match_banks_into, match_banks_grouped): the one bank when there are no summaries
    (``planner`` None); one decision for the whole range without range tables; else the planner's
    per bank."""
    if planner is None:
        depth[0] = 0
        walk[0] = WALK
        return 1
    if not tables:
        depth[0] = start
        walk[0] = WALK if (uniform >> r) & 1 else NO_WALK
        return min(<Py_ssize_t>1 << shift, nb - (r << shift))
    return planner.plan(r, start, depth, walk)


def match_banks_into(list bank_tiers, list alive, list bank_owners, list summaries, list pools,
                     KeyArray keys, dict out, dict same, object match_type, Py_ssize_t everyone=-1,
                     list ranges=None):
    """A whole match over a model's banks in one call (inverted.InvertedIndex.match): which banks to
    walk, each bank's walk, and the results stored into ``out`` (``owner -> match_type(n, (gpu, cpu,
    disk, shared))``, equal GPU-only matches shared through ``same``).

    ``bank_tiers[b]`` are bank b's four tables, ``alive[b]`` its candidate slots and
    ``bank_owners[b]`` the instance in each slot. ``summaries`` (per tier, key ->
    banks holding it, bit b >> shift, inverted.bank_shift; None with a single bank) and ``ranges``
    (per bank range, its GPU table: None below inverted.RANGE_MIN_SHIFT) say which banks to walk
    from which key (_Planner); ``pools`` are the shared-tier tables to consult (the shared summary,
    or each bank's). ``everyone``: how many instances the model has (-1: unknown); the leading keys
    that many hold on the GPU (the GPU summary's counts) are matched by every candidate without
    walking a bank. Done natively because at thousands of instances the Python loop around the
    per-bank walks cost more than the walks themselves."""
    cdef Py_ssize_t b, nb = len(bank_tiers), start, r, i, m, at, d
    cdef int shift = _bank_shift(nb)
    cdef uint64_t mask, todo, held, uniform = 0
    cdef int slots[64]
    cdef Py_ssize_t lens[64]
    cdef long long counts[256]
    cdef long long lengths[64]
    cdef Py_ssize_t depth[64]
    cdef char walk[64]
    cdef int count, slot
    cdef BlockTable gpu, cpu, disk
    cdef list tiers, owners
    cdef bint any_pool = len(pools) > 0
    cdef _Planner planner
    if keys.n == 0:
        return
    if summaries is None:  # one bank: walk it
        todo = 1
        planner = None
        start = 0
    else:
        start = _leading(summaries, keys, everyone)
        planner = _Planner(summaries, ranges, keys, nb)
        todo = planner.first_ranges(start)
        if ranges is None:  # one decision per range: walk from ``start`` where it may hold the key
            uniform = planner.walk_ranges(start)
    while todo:
        r = __builtin_ctzll(todo)
        todo &= todo - 1
        m = _plan_range(planner, ranges is not None, r, start, shift, nb, uniform, depth, walk)
        for i in range(m):
            at = i if m <= 64 and ranges is not None else 0
            if depth[at] < 0:
                continue
            b = (r << shift) + i
            mask = alive[b]
            if not mask:
                continue
            if walk[at] != WALK:
                # Every candidate of the bank matched depth[at] keys on the GPU (NO_WALK), or one more
                # where it holds the next (PROBE).
                held = 0
                if walk[at] == PROBE:
                    d = depth[at]
                    held = mask & (<BlockTable>(<list>bank_tiers[b])[0]).get_mixed(keys.data[d], keys.mixed[d])
                count = 0
                while mask:
                    slots[count] = __builtin_ctzll(mask)
                    lens[count] = depth[at] + ((held >> slots[count]) & 1)
                    if lens[count]:
                        count += 1
                    mask &= mask - 1
                _emit_gpu(count, slots, lens, <list>bank_owners[b], out, same, match_type)
                continue
            tiers = <list>bank_tiers[b]
            owners = <list>bank_owners[b]
            gpu = <BlockTable>tiers[0]
            cpu = <BlockTable>tiers[1]
            disk = <BlockTable>tiers[2]
            if any_pool or cpu.count or disk.count:
                _walk_tiered(gpu, cpu, disk, pools, keys, mask, counts, lengths, depth[at])
                for slot in range(64):
                    if lengths[slot]:
                        out[owners[slot]] = _tiered_match(match_type, lengths, counts, slot)
            else:
                count = _walk_gpu(gpu, keys, mask, slots, lens, depth[at])
                _emit_gpu(count, slots, lens, owners, out, same, match_type)


def match_banks_grouped(list bank_tiers, list alive, list bank_owners, list summaries, list pools,
                        KeyArray keys, dict out, object match_type, Py_ssize_t everyone=-1,
                        Py_ssize_t listed=-1, list ranges=None):
    """match_banks_into's match, grouped by its answer, so that a prompt every instance holds costs
    per bank range and per distinct answer, not per instance. Answers of at most ``listed``
    instances are stored into ``out`` per instance as match_banks_into does; returns ``[match,
    count, masks]`` for each larger one (``masks``: bytes of one little-endian u64 per bank, the
    slots with that answer). Equal answers are one group whether from a GPU-only or a tiered walk.
    The banks that need no walk (_Planner) join the group of their length in one C array per
    length."""
    cdef Py_ssize_t b, nb = len(bank_tiers), j, start, r, i, m, at, d, count_all
    cdef int shift = _bank_shift(nb)
    cdef uint64_t mask, todo, held, uniform = 0
    cdef uint64_t drops[64]
    cdef Py_ssize_t lens[64]
    cdef long long counts[256]
    cdef long long lengths[64]
    cdef Py_ssize_t depth[64]
    cdef char walk[64]
    cdef int count, slot
    cdef BlockTable gpu, cpu, disk
    cdef list tiers, g, owners, large = []
    # Per length, the slots of the banks answered without a walk (NULL: none), and how many.
    cdef uint64_t** bulk = NULL
    cdef Py_ssize_t* bulk_count = NULL
    cdef uint64_t* bulk_small[65]  # (no allocation for prompts of up to 64 blocks)
    cdef Py_ssize_t count_small[65]
    cdef uint64_t* row
    cdef bint any_pool = len(pools) > 0
    cdef dict groups = {}
    cdef dict by_length = {}  # GPU-only answers: matched length -> its group
    cdef _Planner planner
    if keys.n == 0:
        return large
    if summaries is None:  # one bank: walk it
        todo = 1
        planner = None
        start = 0
    else:
        start = _leading(summaries, keys, everyone)
        planner = _Planner(summaries, ranges, keys, nb)
        todo = planner.first_ranges(start)
        if ranges is None:  # one decision per range: walk from ``start`` where it may hold the key
            uniform = planner.walk_ranges(start)
    try:
        while todo:
            r = __builtin_ctzll(todo)
            todo &= todo - 1
            m = _plan_range(planner, ranges is not None, r, start, shift, nb, uniform, depth, walk)
            for i in range(m):
                at = i if m <= 64 and ranges is not None else 0
                d = depth[at]
                if d < 0 or (d == 0 and walk[at] == NO_WALK):
                    continue
                b = (r << shift) + i
                mask = alive[b]
                if not mask:
                    continue
                if walk[at] == NO_WALK and bulk != NULL and bulk[d] != NULL:  # (the usual case, inline)
                    bulk[d][b] |= mask
                    bulk_count[d] += __builtin_popcountll(mask)
                    continue
                if walk[at] != WALK:
                    if bulk == NULL:
                        if keys.n < 65:
                            memset(bulk_small, 0, (keys.n + 1) * sizeof(uint64_t*))
                            memset(count_small, 0, (keys.n + 1) * sizeof(Py_ssize_t))
                            bulk, bulk_count = bulk_small, count_small
                        else:
                            bulk = <uint64_t**>calloc(keys.n + 1, sizeof(uint64_t*))
                            bulk_count = <Py_ssize_t*>calloc(keys.n + 1, sizeof(Py_ssize_t))
                            if bulk == NULL or bulk_count == NULL:
                                free(bulk)
                                free(bulk_count)
                                bulk = NULL
                                raise MemoryError()
                    if walk[at] == PROBE:  # the holders of key d matched d + 1 keys, the others d
                        held = mask & (<BlockTable>(<list>bank_tiers[b])[0]).get_mixed(keys.data[d], keys.mixed[d])
                        _bulk_add(bulk, bulk_count, d + 1, b, held, nb, by_length, groups, match_type)
                        mask &= ~held
                    _bulk_add(bulk, bulk_count, d, b, mask, nb, by_length, groups, match_type)
                    continue
                tiers = <list>bank_tiers[b]
                gpu = <BlockTable>tiers[0]
                cpu = <BlockTable>tiers[1]
                disk = <BlockTable>tiers[2]
                if any_pool or cpu.count or disk.count:
                    _walk_tiered(gpu, cpu, disk, pools, keys, mask, counts, lengths, d)
                    for slot in range(64):
                        if lengths[slot]:
                            m_ = _tiered_match(match_type, lengths, counts, slot)
                            g = groups.get(m_)
                            if g is None:
                                g = groups[m_] = [m_, 0, []]
                            _group_add(g, b, (<uint64_t>1) << slot)
                else:
                    count = _walk_gpu_drops(gpu, keys, mask, drops, lens, d)
                    for j in range(count):
                        _group_add(_length_group(lens[j], by_length, groups, match_type), b, drops[j])
        for g in groups.values():
            row = NULL
            d = (<tuple>g[0])[0]
            if bulk != NULL and d <= keys.n and bulk[d] != NULL and by_length.get(d) is g:
                row = bulk[d]
            if row != NULL:  # its walked banks' slots join the others
                for pair in <list>g[2]:
                    row[<Py_ssize_t>(<list>pair)[0]] |= <uint64_t>(<list>pair)[1]
                count_all = <Py_ssize_t>g[1] + bulk_count[d]
                if count_all > listed:
                    large.append([g[0], count_all, (<char*>row)[:nb * 8]])
                    continue
                m_ = g[0]
                for b in range(nb):
                    mask = row[b]
                    owners = <list>bank_owners[b]
                    while mask:
                        out[owners[__builtin_ctzll(mask)]] = m_
                        mask &= mask - 1
                continue
            if <Py_ssize_t>g[1] > listed:
                large.append([g[0], g[1], _pairs_bytes(<list>g[2], nb)])
                continue
            m_ = g[0]
            for pair in <list>g[2]:
                owners = <list>bank_owners[<Py_ssize_t>(<list>pair)[0]]
                mask = (<list>pair)[1]
                while mask:
                    out[owners[__builtin_ctzll(mask)]] = m_
                    mask &= mask - 1
    finally:
        if bulk != NULL:
            for d in range(keys.n + 1):
                free(bulk[d])
        if bulk != bulk_small:
            free(bulk)
            free(bulk_count)
    return large


cdef inline int _bulk_add(uint64_t** bulk, Py_ssize_t* bulk_count, Py_ssize_t d, Py_ssize_t b, uint64_t mask,
                          Py_ssize_t nb, dict by_length, dict groups, object match_type) except -1:
    """Slots ``mask`` of bank b matched ``d`` keys on the GPU, answered without a walk: into the
    length's C array (made with its group when new)."""
    if not mask or not d:
        return 0
    if bulk[d] == NULL:
        _length_group(d, by_length, groups, match_type)  # (groups in order of discovery)
        bulk[d] = <uint64_t*>calloc(nb, sizeof(uint64_t))
        if bulk[d] == NULL:
            raise MemoryError()
    bulk[d][b] |= mask
    bulk_count[d] += __builtin_popcountll(mask)
    return 0


cdef inline list _length_group(Py_ssize_t n, dict by_length, dict groups, object match_type):
    """The group of the GPU-only answer of ``n`` blocks (made when new; a tiered walk's equal
    answer shares it)."""
    cdef list g = by_length.get(n)
    if g is None:
        m = tuple.__new__(match_type, (n, (n, 0, 0, 0)))
        g = groups.get(m)
        if g is None:
            g = groups[m] = [m, 0, []]
        by_length[n] = g
    return g


cdef bytes _pairs_bytes(list pairs, Py_ssize_t nb):
    cdef bytearray raw = bytearray(nb * 8)
    cdef char* p = PyByteArray_AS_STRING(raw)
    cdef uint64_t mask
    cdef Py_ssize_t b
    for pair in pairs:
        b = (<list>pair)[0]
        mask = (<list>pair)[1]
        memcpy(p + b * 8, &mask, 8)
    return bytes(raw)


# -- a batch's events in one call (the ingest hot path for small events) ----------------------------

DEF N_TIERS = 4
DEF SHARED_TIER = 3
DEF OP_STORED = 0
DEF OP_REMOVED = 1
DEF OP_CLEARED = 2
# A key log is compacted once it holds more than twice its live keys plus this (inverted.py).
DEF COMPACT_SLACK = 1024
DEF CHUNK = 32


cdef struct EventRef:
    int op
    int tier  # -1: every tier (a cleared event without one)
    Py_ssize_t start  # its keys are keybuf[start:end]
    Py_ssize_t end


cdef class _Scratch:
    """Growable buffers reused across calls (one batch is applied at a time; the GIL is held)."""
    cdef uint64_t* keys
    cdef Py_ssize_t keys_cap
    cdef EventRef* refs
    cdef Py_ssize_t refs_cap

    def __cinit__(self):
        self.keys = NULL
        self.refs = NULL
        self.keys_cap = self.refs_cap = 0

    def __dealloc__(self):
        free(self.keys)
        free(self.refs)

    cdef int reserve(self, Py_ssize_t n_refs, Py_ssize_t n_keys) except -1:
        cdef void* grown
        if n_refs > self.refs_cap:
            grown = realloc(self.refs, n_refs * sizeof(EventRef))
            if grown == NULL:
                raise MemoryError()
            self.refs = <EventRef*>grown
            self.refs_cap = n_refs
        if n_keys > self.keys_cap:
            grown = realloc(self.keys, n_keys * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self.keys = <uint64_t*>grown
            self.keys_cap = n_keys
        return 0


cdef _Scratch _scratch = _Scratch()


def apply_events(list events, dict tier_numbers, list tables, list logs, uint64_t bit,
                 list counts, list xors, object result_type, tuple group_masks=(0,)):
    """Apply a batch's events (objects with ``op``, ``tier`` name and ``keys``) in order for the
    instance with ``bit``: ``tables`` are its bank's tables and ``logs`` its key logs, per tier;
    ``counts`` and ``xors`` are its per-tier digests, updated in place. Returns
    ``result_type(stored, removed, cleared, stored events, removed events, cleared events,
    stored on a local tier, highest group named)`` (base.Applied). A stored or removed event's keys are taken as group
    keys: XORed with ``group_masks[event.group]`` (hybrid.py; 0 for group 0).

    One call per batch instead of one per event: small events (an engine step stores a few blocks)
    were dominated by the Python calls around each store. Two passes: every event is read and every
    key converted first (a bad one raises before anything changes), then the keys are applied with
    the table cells PREFETCH keys ahead requested early, so that cache misses overlap across
    events."""
    cdef Py_ssize_t i, n = len(events), k, nk, total_keys = 0, end
    cdef Py_ssize_t n_ev[3]
    cdef int op, t, t0, t1, touched_removed = 0, local = 0, group, top_group = 0
    cdef uint64_t key, gmask, cleared = 0, total_added = 0, total_removed = 0
    cdef uint64_t added[N_TIERS]
    cdef uint64_t removed[N_TIERS]
    cdef uint64_t xor[N_TIERS]
    cdef BlockTable table
    cdef KeyLog log
    cdef list keys
    cdef _Scratch scratch = _scratch
    cdef EventRef* ref
    cdef uint64_t* buf
    n_ev[0] = n_ev[1] = n_ev[2] = 0
    for t in range(N_TIERS):
        added[t] = removed[t] = xor[t] = 0
    # Pass 1: read the events.
    for i in range(n):
        total_keys += len(events[i].keys)
    scratch.reserve(n, total_keys)
    buf = scratch.keys
    total_keys = 0
    for i in range(n):
        ev = events[i]
        op = ev.op
        if op < 0 or op > 2:
            raise ValueError(f"unknown event op {op!r}")
        n_ev[op] += 1
        ref = &scratch.refs[i]
        ref.op = op
        tier = ev.tier
        ref.tier = -1 if tier is None else tier_numbers[tier]
        ref.start = ref.end = total_keys
        if op == OP_CLEARED:
            continue
        if ref.tier < 0:
            raise ValueError("a stored or removed event needs a tier")
        keys = ev.keys
        nk = len(keys)
        group = ev.group
        if group > top_group:
            top_group = group
        gmask = group_masks[group]
        for k in range(nk):
            buf[total_keys + k] = PyLong_AsUnsignedLongLong(keys[k]) ^ gmask
        total_keys += nk
        ref.end = total_keys
    # Pass 2: apply them in order.
    try:
        for i in range(n):
            ref = &scratch.refs[i]
            op = ref.op
            t = ref.tier
            if op == OP_CLEARED:
                # One tier, or all of them; the tier's own log names every key it holds.
                if t < 0:
                    t0, t1 = 0, N_TIERS
                else:
                    t0, t1 = t, t + 1
                for t in range(t0, t1):
                    log = <KeyLog>logs[t]
                    held = counts[t] + <object>added[t] - <object>removed[t]
                    if held:
                        (<BlockTable>tables[t]).clear_logged(log, bit)
                        cleared += held
                    counts[t] = 0
                    xors[t] = 0
                    # (the batch's totals keep what was stored or removed before the clear)
                    total_added += added[t]
                    total_removed += removed[t]
                    added[t] = removed[t] = xor[t] = 0
                    log.reset()
                continue
            table = <BlockTable>tables[t]
            end = ref.end
            if op == OP_STORED:
                log = <KeyLog>logs[t]
                for k in range(ref.start, end):
                    if k + PREFETCH < end:
                        __builtin_prefetch(&table.cells[_mix(buf[k + PREFETCH]) & table.mask])
                    if table._set(buf[k], bit, log):
                        added[t] += 1
                        xor[t] ^= buf[k]
                if t != SHARED_TIER:
                    local = 1
            else:
                for k in range(ref.start, end):
                    if k + PREFETCH < end:
                        __builtin_prefetch(&table.cells[_mix(buf[k + PREFETCH]) & table.mask])
                    if table._unset(buf[k], bit):
                        removed[t] += 1
                        xor[t] ^= buf[k]
                touched_removed |= 1 << t
    finally:
        # Whatever was applied is accounted for, even if a later event raised.
        for t in range(N_TIERS):
            if added[t] or removed[t]:
                counts[t] = counts[t] + <object>added[t] - <object>removed[t]
                xors[t] = xors[t] ^ <object>xor[t]
            if touched_removed >> t & 1:
                table = <BlockTable>tables[t]
                table._maybe_shrink()
                log = <KeyLog>logs[t]
                if log.size > 2 * <Py_ssize_t>counts[t] + COMPACT_SLACK:
                    table.compact_log(log, bit)
    return tuple.__new__(result_type, (
        total_added + added[0] + added[1] + added[2] + added[3],
        total_removed + removed[0] + removed[1] + removed[2] + removed[3],
        cleared,
        n_ev[0],
        n_ev[1],
        n_ev[2],
        local == 1,
        top_group,
    ))


# -- hybrid-attention groups (kvindex/index/hybrid.py; the pure-Python twin is _pytable.hybrid_hits) --

DEF R_FULL = 0
DEF R_SLIDING = 1
DEF R_CHUNKED = 2
DEF R_MAMBA = 3
DEF MAX_RULES = 64
DEF MAX_MEMBERS = 1024


cdef class _HeldCache:
    """Per rule group and block, the bank's slots holding the block in every member group (on some
    tier, or anywhere when the shared pool has it), probed on first use: a slot's scan reads only
    the blocks it reaches, and the slots of a bank share the probes."""

    cdef uint64_t* masks  # rules x n
    cdef unsigned char* known
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t n_rules, Py_ssize_t n):
        self.n = n
        self.masks = <uint64_t*>malloc((n_rules * n if n_rules * n else 1) * sizeof(uint64_t))
        self.known = <unsigned char*>calloc(n_rules * n if n_rules * n else 1, 1)
        if self.masks == NULL or self.known == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.masks)
        free(self.known)


cdef struct _Rules:
    int n
    int kind[MAX_RULES]
    long long param[MAX_RULES]
    int start[MAX_RULES + 1]
    uint64_t members[MAX_MEMBERS]


cdef int _read_rules(list rules, _Rules* out) except -1:
    """(rule, param, member masks) tuples (hybrid.RuleGroup) into ``out``."""
    cdef Py_ssize_t r, m = 0
    if len(rules) > MAX_RULES:
        raise ValueError(f"{len(rules)} rule groups; at most {MAX_RULES}")
    out.n = len(rules)
    for r in range(out.n):
        kind, param, masks = rules[r]
        out.kind[r] = kind
        out.param[r] = param
        out.start[r] = m
        for mask in masks:
            if m >= MAX_MEMBERS:
                raise ValueError(f"more than {MAX_MEMBERS} member groups")
            out.members[m] = mask
            m += 1
    out.start[out.n] = m
    return 0


cdef inline uint64_t _held(_HeldCache cache, _Rules* rules, int r, Py_ssize_t j,
                           BlockTable gpu, BlockTable cpu, BlockTable disk, list pools,
                           uint64_t* karr):
    cdef Py_ssize_t at = r * cache.n + j
    cdef uint64_t m, key
    cdef int i
    if cache.known[at]:
        return cache.masks[at]
    m = <uint64_t>-1
    for i in range(rules.start[r], rules.start[r + 1]):
        key = karr[j] ^ rules.members[i]
        if pools and _in_pool(pools, key, _mix(key)):
            continue
        m &= gpu.get(key) | (cpu.get(key) if cpu.count else 0) | (disk.get(key) if disk.count else 0)
        if not m:
            break
    cache.masks[at] = m
    cache.known[at] = 1
    return m


cdef long long _refine(_HeldCache cache, _Rules* rules, uint64_t bit, long long length,
                       Py_ssize_t block_size, BlockTable gpu, BlockTable cpu, BlockTable disk,
                       list pools, uint64_t* karr):
    """One slot's hit (tokens) from ``length``: every rule group lowers it until none does
    (hybrid.hit_tokens)."""
    cdef long long before
    cdef Py_ssize_t r, j, blocks, run, hit
    while True:
        before = length
        for r in range(rules.n):
            blocks = length // block_size
            if rules.kind[r] == R_FULL or rules.kind[r] == R_CHUNKED:
                j = 0
                if rules.kind[r] == R_CHUNKED and length > 0:
                    j = (length // rules.param[r] * rules.param[r]) // block_size
                while j < blocks and _held(cache, rules, r, j, gpu, cpu, disk, pools, karr) & bit:
                    j += 1
                length = j * block_size
            elif rules.kind[r] == R_SLIDING:
                run = 0
                hit = -1
                j = blocks - 1
                while j >= 0:
                    if _held(cache, rules, r, j, gpu, cpu, disk, pools, karr) & bit:
                        run += 1
                        if run >= rules.param[r]:
                            hit = j + run
                            break
                    else:
                        run = 0
                    j -= 1
                length = (run if hit < 0 else hit) * block_size
            else:
                j = blocks - 1
                while j >= 0 and not (_held(cache, rules, r, j, gpu, cpu, disk, pools, karr) & bit):
                    j -= 1
                length = (j + 1) * block_size
        if length >= before:
            return length


def hybrid_hits(list tiers, list pools, KeyArray keys, list rules, list slots, list bounds,
                Py_ssize_t block_size):
    """Per slot of one bank, the tokens it can reuse under every rule group of a hybrid model,
    lowered from its bound (tokens) to the rules' common fixed point (hybrid.hit_tokens):
    ``rules`` are (rule, param, member group masks), a block counts for a rule group where every
    member holds its group key (key ^ mask) on some tier of the bank, or in the shared pool."""
    cdef BlockTable gpu = tiers[0], cpu = tiers[1], disk = tiers[2]
    cdef _Rules r
    cdef Py_ssize_t i
    cdef long long length
    _read_rules(rules, &r)
    cdef _HeldCache cache = _HeldCache(r.n, keys.n)
    out = []
    for i in range(len(slots)):
        length = bounds[i]
        if length > keys.n * block_size:
            length = keys.n * block_size
        out.append(_refine(cache, &r, (<uint64_t>1) << <int>slots[i], length, block_size,
                           gpu, cpu, disk, pools, keys.data))
    return out


def match_hybrid_into(list bank_tiers, list alive, list bank_owners, list summaries, list pools,
                      KeyArray walked, KeyArray keys, list rules, long long limit,
                      Py_ssize_t block_size, dict out, object match_type, Py_ssize_t everyone=-1,
                      dict reach=None):
    """A hybrid model's whole match in one call (inverted.InvertedIndex._match_hybrid): per bank,
    the full-attention group's prefix walk over ``walked`` (its group keys; None when the model has
    no full attention: every candidate starts at the whole prompt), each candidate's hit lowered by
    the rule groups over the plain ``keys`` (hybrid_hits), and ``owner -> match_type(blocks,
    (gpu, cpu, disk, shared))`` stored into ``out`` for the ones left with a block, in the walked
    group's tier split (the walk's own when the rules did not lower it). ``reach``: also
    ``owner -> blocks`` of the walked group's own prefix (up to ``limit``) where the rules lowered
    it: what the walk found anyway, the prefix vLLM keeps a window at once a request diverges there."""
    cdef Py_ssize_t b, nb = len(bank_tiers), start = 0, n = keys.n, blocks
    cdef uint64_t mask, groups = 0xFFFFFFFFFFFFFFFFULL, bit
    cdef int slots[64]
    cdef Py_ssize_t lens[64]
    cdef long long counts[256]
    cdef long long lengths[64]
    cdef long long bound, hit
    cdef int count, slot, j
    cdef bint tiered
    cdef BlockTable gpu, cpu, disk
    cdef list tiers, owners
    cdef bint any_pool = len(pools) > 0
    cdef _Rules r
    cdef dict same = {}
    cdef long long top = n * block_size
    if n == 0:
        return
    if limit < top:
        top = limit
    _read_rules(rules, &r)
    cdef _HeldCache cache = _HeldCache(r.n, n)
    if walked is not None:
        groups, start = _banks_to_walk(summaries, walked, everyone)
    cdef int shift = _bank_shift(nb)
    for b in range(nb):
        if not (groups >> (b >> shift)) & 1:
            continue
        mask = alive[b]
        if not mask:
            continue
        tiers = <list>bank_tiers[b]
        owners = <list>bank_owners[b]
        gpu = <BlockTable>tiers[0]
        cpu = <BlockTable>tiers[1]
        disk = <BlockTable>tiers[2]
        tiered = any_pool or cpu.count or disk.count
        if walked is None:
            memset(lengths, 0, 64 * sizeof(long long))
            while mask:
                lengths[__builtin_ctzll(mask)] = n
                mask &= mask - 1
        elif tiered:
            _walk_tiered(gpu, cpu, disk, pools, walked, mask, counts, lengths, start)
        else:
            memset(lengths, 0, 64 * sizeof(long long))
            count = _walk_gpu(gpu, walked, mask, slots, lens, start)
            for j in range(count):
                lengths[slots[j]] = lens[j]
        memset(cache.known, 0, r.n * n)  # a bank's own slots
        for slot in range(64):
            if not lengths[slot]:
                continue
            bound = lengths[slot] * block_size
            if bound > top:
                bound = top
            bit = (<uint64_t>1) << slot
            hit = _refine(cache, &r, bit, bound, block_size, gpu, cpu, disk, pools, keys.data) if r.n else bound
            blocks = hit // block_size
            if reach is not None and walked is not None and hit < bound:
                reach[owners[slot]] = bound // block_size
            if not blocks:
                continue
            if walked is not None and tiered and blocks == lengths[slot]:
                out[owners[slot]] = _tiered_match(match_type, lengths, counts, slot)
            elif not tiered:
                m = same.get(blocks)
                if m is None:
                    m = same[blocks] = tuple.__new__(match_type, (blocks, (blocks, 0, 0, 0)))
                out[owners[slot]] = m
            else:
                out[owners[slot]] = tuple.__new__(match_type, (blocks, tier_split(
                    tiers, pools, walked if walked is not None else keys, bit, blocks)))


def tier_split(list tiers, list pools, KeyArray keys, uint64_t bit, Py_ssize_t n):
    """Blocks per fastest tier among the first ``n`` keys for the slot of ``bit`` (the pool: 3)."""
    cdef BlockTable gpu = tiers[0], cpu = tiers[1], disk = tiers[2]
    cdef long long c0 = 0, c1 = 0, c2 = 0, c3 = 0
    cdef Py_ssize_t j
    cdef uint64_t key
    if n > keys.n:
        n = keys.n
    for j in range(n):
        key = keys.data[j]
        if gpu.get(key) & bit:
            c0 += 1
        elif cpu.count and cpu.get(key) & bit:
            c1 += 1
        elif disk.count and disk.get(key) & bit:
            c2 += 1
        else:
            c3 += 1
    return (c0, c1, c2, c3)
