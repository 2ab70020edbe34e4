"""Counting and logging what ingest refuses: a malformed message (``reject``) or one refused by a
limit (``refuse``). Every stage that refuses something is handed this one object when it is built
(kvindex/core.py), so the counts and the rate limits of the logs are shared, and no stage reaches
back to the consumer for them."""

from __future__ import annotations

from typing import Any

from kvindex.fleet.registry import instance_id
from kvindex.ingest.limits import LimitExceeded
from kvindex.instance import InstanceKey
from kvindex.observability.counters import IngestCounters
from kvindex.observability.logs import RateLimitedLog
from kvindex.wire.errors import WireError


class Rejects:
    """Counts by reason (and worker), logs with the worker id, rate-limited per (worker, reason)."""

    def __init__(self, counters: IngestCounters, log: Any) -> None:
        self.counters = counters
        self._reject_log = RateLimitedLog(log)
        # Refusals by a limit: once per (instance, reason) per minute, with the count suppressed.
        self._limit_log = RateLimitedLog(log, interval=60.0)

    def refuse(self, instance: InstanceKey, reason: str, message: str, **kw: Any) -> None:
        """Count a limit refusal and log it once per (instance, reason) per minute."""
        self.counters.reject(reason, instance[0])
        self._limit_log.warning(
            (instance_id(instance), reason),
            "limit_refused",
            worker=instance[0],
            dp_rank=instance[1],
            reason=reason,
            error=message,
            **kw,
        )

    def reject(self, worker: str | None, subject: str, exc: WireError) -> None:
        """Count a rejected message and log it (limit refusals once per minute per (worker, reason);
        other rejects by the general rate limit)."""
        self.counters.reject(exc.reason, worker)
        log, event = (
            (self._limit_log, "limit_refused")
            if isinstance(exc, LimitExceeded)
            else (self._reject_log, "message_rejected")
        )
        log.warning(
            (worker or subject, exc.reason),
            event,
            worker=worker,
            subject=subject,
            reason=exc.reason,
            error=exc.message,
        )
