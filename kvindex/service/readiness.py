"""Is the index ready to answer routers? Decided from the sync state the consumer keeps per instance.

Not ready:
- while the NATS connection is down (nothing new is heard, answers go stale);
- after start, until the initial sync is done: every instance heard within the first heartbeat
  window (``window`` seconds after subscribing; workers heartbeat every 0.5 s) is in sync: its
  snapshot was applied or its gap replayed (``sync == "synced"``, no repair pending) and every batch
  its last heartbeat announced was applied. Instances that went stale or were forgotten meanwhile do
  not count (they are not ranked). With JetStream the stream must also be read to its end. The wait
  is bounded by ``grace``: then the index is ready anyway and says which instances were still
  syncing (a worker that never answers snapshot requests must not keep the index out for ever);
- once stopping (SIGTERM: before the in-flight RPCs are given their grace).

Instances joining after the initial sync do not take readiness away: the index answers for the
others meanwhile, and a joining instance is ranked with what the index already holds of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

from kvindex.fleet.registry import Registry
from kvindex.instance import InstanceKey
from kvindex.sequencer.cursor import Sequencer


@dataclass
class ReadinessConfig:
    window: float = 1.0  # first heartbeat window (s): instances heard in it must sync before ready
    grace: float = 30.0  # ready at the latest this long after subscribing (s), synced or not
    tick: float = 0.1  # how often readiness is re-evaluated until the initial sync is done (s)
    # After it, only the NATS connection can take readiness away, and its changes wake the check at
    # once: the tick is then a safety net. (Every wake-up of an idle index costs CPU on a host whose
    # cores may be serving a CPU engine's prefill.)
    settled_tick: float = 1.0


class Readiness:
    """Pure decision (``evaluate``); the service calls it every ``tick`` and on NATS events."""

    def __init__(
        self,
        registry: Registry,
        sequencer: Sequencer,
        config: ReadinessConfig | None = None,
        log: Any = None,
    ) -> None:
        self.registry = registry
        self.sequencer = sequencer
        self.config = config or ReadinessConfig()
        self.log = log or structlog.get_logger("kvindex.readiness")
        self.started_at: float | None = None
        self.initial: set[InstanceKey] | None = None  # heard within the first window
        self._waiting: deque[InstanceKey] = deque()  # of those, maybe not in sync yet (heard order)
        self.synced = False  # the initial sync is done (latched)
        self.stopping = False
        self.reason = "starting"

    def start(self, now: float) -> None:
        """Subscribed: the first heartbeat window starts now."""
        self.started_at = now

    def pending(self) -> list[InstanceKey]:
        """Instances of the first window that are not in sync yet."""
        assert self.initial is not None
        return sorted(key for key in self.initial if self._pending(key))

    def _pending(self, key: InstanceKey) -> bool:
        state = self.registry.get(key)
        if state is None or state.stale:
            return False  # forgotten or silent: not ranked, so not waited for
        cursor = self.sequencer.cursor(key)
        # (sync "queued": its snapshot waits for a repair to end, kvindex/repair/machine.py)
        return (
            cursor is None
            or cursor.repairing is not None
            or state.repair.sync != "synced"
            or cursor.applied < state.heartbeat.seq
        )

    def _still_waiting(self) -> bool:
        """Whether an instance of the first window is not in sync yet, checking them in the order
        they were heard (which is about the order their snapshots are served) and dropping those
        found in sync from the front; with none left, every instance once more (one may have fallen
        out of sync meanwhile). A tick costs what was synced since the last, not a walk over the
        fleet (7,000 instances walked every 0.1 s cost ~10 % of the core an index starting into them
        needs)."""
        waiting = self._waiting
        while waiting and not self._pending(waiting[0]):
            waiting.popleft()
        if waiting:
            return True
        self._waiting = deque(self.pending())
        return bool(self._waiting)

    def evaluate(self, now: float, connected: bool, caught_up: bool = True) -> tuple[bool, str]:
        """(ready, reason) at ``now``; logs the moment the initial sync completes."""
        if self.stopping:
            return False, "stopping"
        if self.started_at is None:
            return False, "starting"
        if not self.synced:
            elapsed = now - self.started_at
            if elapsed < self.config.window:
                return False, "first_heartbeat_window"
            if self.initial is None:
                heard = [s.key for s in self.registry.all()]
                self.initial, self._waiting = set(heard), deque(heard)
            if self._still_waiting() or not caught_up:
                if elapsed < self.config.grace:
                    return False, "initial_sync"
                pending = self.pending()
                self.log.warning(
                    "ready_after_grace",
                    grace=self.config.grace,
                    still_syncing=[f"{w}/{r}" for w, r in pending[:20]],
                    still_syncing_count=len(pending),
                    stream_caught_up=caught_up,
                )
            else:
                self.log.info("initial_sync_done", instances=len(self.initial), seconds=round(elapsed, 3))
            self.synced = True
        if not connected:
            return False, "nats_disconnected"
        return True, "ready"
