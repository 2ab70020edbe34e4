# cython: boundscheck=False, wraparound=False, cdivision=True
"""The direct dispatch's frame loop in C (kvindex/ingest/direct_dispatch.py has the same loop in
Python, used without a compiler and tested against this one).

``scan`` walks NATS protocol bytes from ``pos`` and hands every plain ``MSG`` frame of a registered
subscription (``direct``: sid bytes -> target with ``handler`` and ``backlog``) to its handler, in
order, until the buffer ends, a frame is incomplete, or a frame is for nats-py's own parser. The
Python loop costs ~0.7 us per message (a find, a split, a dict lookup, two slices); this one ~0.15.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memchr

cdef Py_ssize_t MAX_CONTROL_LINE = 4096  # nats-py's limit for a control line


cdef inline bint _space(char c) noexcept nogil:
    return c == c' ' or c == c'\t'


def scan(bytes whole, Py_ssize_t pos, dict direct, object failed):
    """(pos, taken, more): where it stopped, how many messages it handed over, and whether the frame
    at ``pos`` is for nats-py's parser (True) or the buffer holds no complete frame from there
    (False). ``failed(exc, subject)`` is told of a handler's exception; scanning goes on after it."""
    cdef const char* buf = PyBytes_AS_STRING(whole)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(whole)
    cdef Py_ssize_t taken = 0
    cdef const char* cr
    cdef Py_ssize_t eol, i, start, stop, size
    cdef Py_ssize_t tok_start[5]
    cdef Py_ssize_t tok_end[5]
    cdef int ntok
    cdef object target, subject, payload, sid
    while pos < n:
        # The control line: up to the first CRLF.
        i = pos
        eol = -1
        while i < n:
            cr = <const char*>memchr(buf + i, c'\r', n - i)
            if cr == NULL:
                break
            i = cr - buf
            if i + 1 < n and buf[i + 1] == c'\n':
                eol = i
                break
            if i + 1 >= n:
                break
            i += 1
        if eol < 0:
            return pos, taken, n - pos > MAX_CONTROL_LINE  # a line too long is the library's error
        if eol - pos < 4 or buf[pos] != c'M' or buf[pos + 1] != c'S' or buf[pos + 2] != c'G' or buf[pos + 3] != c' ':
            return pos, taken, True
        # Tokens after "MSG ": subject, sid, [reply,] size.
        ntok = 0
        i = pos + 4
        while i < eol and ntok < 5:
            while i < eol and _space(buf[i]):
                i += 1
            if i >= eol:
                break
            tok_start[ntok] = i
            while i < eol and not _space(buf[i]):
                i += 1
            tok_end[ntok] = i
            ntok += 1
        if ntok != 3 and ntok != 4:
            return pos, taken, True
        size = 0
        for i in range(tok_start[ntok - 1], tok_end[ntok - 1]):
            if buf[i] < c'0' or buf[i] > c'9' or size > 1 << 40:
                return pos, taken, True  # malformed: nats-py's parser says how
            size = size * 10 + (buf[i] - c'0')
        sid = PyBytes_FromStringAndSize(buf + tok_start[1], tok_end[1] - tok_start[1])
        target = direct.get(sid)
        if target is None or target.backlog:
            return pos, taken, True
        start = eol + 2
        stop = start + size
        if stop + 2 > n:
            return pos, taken, False  # the payload is still on its way
        # (A subject that is not UTF-8 becomes one the consumer rejects, not an exception here.)
        subject = PyUnicode_DecodeUTF8(buf + tok_start[0], tok_end[0] - tok_start[0], "replace")
        payload = PyBytes_FromStringAndSize(buf + start, size)
        pos = stop + 2
        taken += 1
        try:
            target.handler(subject, payload)
        except Exception as exc:  # never out of nats-py's read loop
            failed(exc, subject)
    return pos, taken, False
