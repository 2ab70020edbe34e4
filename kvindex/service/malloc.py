"""glibc malloc settings for ``kvindex serve``: large per-request buffers reused, not faulted in anew.

A Score with a 256 K-token prompt allocates a few MiB per call (the 750 KB request, protobuf's arena for
262,144 ids, their numpy copy and bytes, the key list). With glibc's defaults the heap top above
128 KiB is returned to the kernel after each call and faulted back, zeroed, on the next: measured
(benchmarks/README.md, "Long contexts"), a third of the server's CPU was the kernel's page faults, and
fixing the thresholds took its CPU per call from 6.7 to 4.4 ms. Setting them also turns off glibc's
dynamic threshold, so the process keeps up to TRIM_THRESHOLD of free heap instead of returning it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # allocations below this come from the heap (glibc's dynamic maximum)
TRIM_THRESHOLD = 64 << 20  # free heap top kept before it is returned to the kernel
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def reuse_large_allocations(environ: Mapping[str, str] = os.environ) -> bool:
    """Set the thresholds, unless the operator set glibc's own variables (their choice wins) or the C
    library is not glibc. True when set."""
    if any(name in environ for name in ENV):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False  # musl and others: no mallopt; nothing to tune
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
