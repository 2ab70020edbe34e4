"""Garbage collection for a long-running index: collections that do not stall the event loop.

A fleet's state lives in Python objects (registry states, sequencer cursors, their records: ~33
tracked objects per instance; the block tables are native and untracked). CPython's full collection
traverses every tracked object, and the loop serving Score and ingesting events waits for it:
measured, 1.43 s of CPU for a full collection with 224,000 instances joined (7.5 M tracked objects),
so ~45 ms at 7,000. Such a collection comes when enough new objects have survived, so at random.

So, every ``freeze_every`` seconds the objects alive then are frozen (``gc.freeze``: moved to the
permanent generation, which collections do not traverse; O(1)). Collections then look only at what
is newer: the fleet's state after a freeze costs them nothing. Objects freed by reference counting
are still freed at once; what freezing keeps is garbage *cycles* among frozen objects, so every
``full_every`` seconds the frozen objects are unfrozen, collected in one full pass (the one pause
left, logged as ``gc_full`` with its duration and what it freed) and frozen again. ``stop`` unfreezes
(a process may run more than one service: tests).
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GcConfig:
    enabled: bool = True
    freeze_every: float = 30.0  # s between freezes of the objects alive
    full_every: float = 3600.0  # s between full collections of the frozen objects (cycles)


class GcPolicy:
    """Freezes the long-lived objects periodically (``run``, a task on the service's loop)."""

    def __init__(self, config: GcConfig, log: Any, clock: Any = time.monotonic) -> None:
        self.config = config
        self.log = log
        self.clock = clock
        self.freezes = 0
        self.full_collections = 0
        self._last_full = clock()

    def tick(self) -> None:
        """Freeze what is alive now; first a full pass over the frozen objects when it is due."""
        now = self.clock()
        if now - self._last_full >= self.config.full_every:
            self._last_full = now
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            started = time.perf_counter()
            freed = gc.collect()
            self.full_collections += 1
            self.log.info(
                "gc_full", seconds=round(time.perf_counter() - started, 4), frozen=frozen, freed=freed
            )
        gc.freeze()
        self.freezes += 1

    async def run(self) -> None:
        if not self.config.enabled:
            return
        while True:
            await asyncio.sleep(self.config.freeze_every)
            self.tick()

    def stop(self) -> None:
        if self.config.enabled:
            gc.unfreeze()
