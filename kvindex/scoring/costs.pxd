# The C types of costs.py for its compiled build (setup.py): the source is costs.py, this file only
# types it (Cython's augmenting .pxd). Every function here is the Python one, compiled.
import cython

cpdef double drained_queue(double reported, double reported_at, double now, double rate)
cpdef double queued_now(double reported, object reported_at, double now, double rate, double routed)

@cython.locals(r=double, div=double, steps=double)
cpdef double chunks(double tokens, double chunk) except? -1

cpdef double queue_wait(
    double b_ms, double step_ms, double chunk, double dps, double queued, double running
) except? -1

@cython.locals(left=double)
cpdef double ledger_ms(double busy_until, double now)
cpdef double wait_ms(double queue, double ledger)
cpdef double prefill_at(double per_running, double alone, double running)
cpdef double fetch_ms(double f_cpu, double f_disk, double f_pool, double cpu, double disk, double pool)
cpdef double est_ttft_ms(double wait_ms, double prefill_ms, double fetch_ms)
cpdef double weighted_cost(double est_ms, double prefill_ms, double fetch_ms, double k)

@cython.locals(out=Py_ssize_t, listed=bint, j=Py_ssize_t, i=Py_ssize_t, q=double, ledger=double)
cpdef Py_ssize_t wait_rows(
    const double[::1] queued, const double[::1] heartbeat_at, const double[::1] tokens_new,
    const double[::1] queued_routed, const double[::1] running_now, const double[::1] busy_until,
    const unsigned char[::1] drains, const long long[::1] rows, Py_ssize_t count, double now,
    double b_ms, double step_ms, double chunk, double dps, double rate, double[::1] wait,
    long long[::1] draining, unsigned char[::1] seen,
) except -1

@cython.locals(grouped=bint, i=Py_ssize_t, g=Py_ssize_t, p=double, e=double)
cpdef cost_rows(
    const double[::1] wait, const double[::1] running, const int[::1] group, const double[::1] ga,
    const double[::1] gb, const double[::1] gf, double k, double[::1] prefill, double[::1] est,
    double[::1] cost,
)

cdef bint _before(
    double c1, double kv1, double ld1, long long r1, double c2, double kv2, double ld2, long long r2
) noexcept nogil

cdef void _insert(
    double[::1] bc, long long[::1] br, Py_ssize_t base, Py_ssize_t j, double c, double kv, double ld,
    long long rank, long long row,
) noexcept nogil

@cython.locals(lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t)
cdef bint _listed(const long long[::1] rows, Py_ssize_t n, long long row) noexcept nogil

@cython.locals(
    n=Py_ssize_t, top_k=Py_ssize_t, filled=Py_ssize_t, n_explicit=Py_ssize_t, waiting=Py_ssize_t,
    low=double, bc="double[::1]", br="long long[::1]", i=Py_ssize_t, j=Py_ssize_t, last=Py_ssize_t,
    p=double, c=double,
)
cpdef tuple rank_others(
    const double[::1] wait, const double[::1] running, const unsigned char[::1] mask,
    const long long[::1] explicit_rows, bint has_prompt, double a, double b, double k,
    const double[::1] kv, const double[::1] load, const long long[::1] key_rank, long long[::1] out,
)

@cython.locals(
    n=Py_ssize_t, n_groups=Py_ssize_t, top_k=Py_ssize_t, n_explicit=Py_ssize_t, waiting=Py_ssize_t,
    low=double, bc="double[::1]", br="long long[::1]", i=Py_ssize_t, j=Py_ssize_t, g=Py_ssize_t,
    f=Py_ssize_t, base=Py_ssize_t, last=Py_ssize_t, p=double, c=double,
)
cpdef tuple rank_grouped(
    const double[::1] wait, const double[::1] running, const unsigned char[::1] mask,
    const long long[::1] explicit_rows, const int[::1] group, const double[::1] ga,
    const double[::1] gb, const double[::1] gf, double k, const double[::1] kv,
    const double[::1] load, const long long[::1] key_rank, long long[::1] out, long long[::1] filled,
)
