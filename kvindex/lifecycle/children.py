"""Child processes that do not outlive us.

A child we start (the embedded nats-server, the demo's ``kvindex serve``) asks the kernel for
SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), so even a SIGKILLed parent leaves no
orphan holding ports. The request is made between fork and exec (``preexec_fn``); libc is looked up
here, in the parent, because loading a library in a forked child of a threaded process can deadlock.
Elsewhere this is a no-op: our own Python processes also watch their parent (``kvindex/lifecycle/
run.py``), which works everywhere.

Linux ties the signal to the parent *thread*: start children from the event-loop thread (asyncio
subprocesses do), not from a short-lived worker thread.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child receive ``sig`` when this process dies (None if unsupported)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()
    prctl = _PRCTL

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec
