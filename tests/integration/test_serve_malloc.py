"""``kvindex serve``'s glibc malloc thresholds (kvindex/service/malloc.py): a process that holds a few
MiB per call and frees them (a 256 K-token Score) reuses that memory instead of faulting it in again
every call; an operator's own MALLOC_* variables win. In child processes: mallopt is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

from kvindex.service.malloc import reuse_large_allocations

CHURN = """
import resource, sys
from kvindex.service.malloc import reuse_large_allocations
tuned = reuse_large_allocations() if sys.argv[1] == "tuned" else False
def calls():
    for _ in range(20):
        held = [bytes(2 << 20) for _ in range(6)]  # 12 MiB live at once, freed at the end of the call
        del held
calls()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
calls()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str, **env: str) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True, env=environ
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_call_memory_is_reused_not_faulted_in_again() -> None:
    tuned, tuned_faults = faults("tuned")
    untuned, untuned_faults = faults("default")
    assert tuned and not untuned
    # 20 calls of 12 MiB: glibc's defaults return the heap top after each and fault 3,000+ pages back.
    assert untuned_faults > 1000
    assert tuned_faults < untuned_faults // 20


def test_the_operators_malloc_variables_win() -> None:
    assert reuse_large_allocations({"MALLOC_TRIM_THRESHOLD_": "131072"}) is False
    tuned, _ = faults("tuned", MALLOC_MMAP_THRESHOLD_="131072")
    assert not tuned
