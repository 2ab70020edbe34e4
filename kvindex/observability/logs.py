"""structlog setup: JSON lines when not on a TTY (or when asked), readable console output otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import structlog


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """``fmt`` is ``json``, ``console`` or ``auto`` (console on a TTY, JSON otherwise)."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class RateLimitedLog:
    """Logs the first occurrence per key, then at most once per ``interval`` with a suppressed count.

    A worker that floods malformed batches must not flood the logs too.
    """

    def __init__(self, log: Any, interval: float = 10.0, clock: Any = time.monotonic) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}

    def warning(self, key: tuple[str, ...], event: str, **kw: Any) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return
        suppressed = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        if len(self._last) > 10_000:  # bounded: forget the oldest keys
            for old in sorted(self._last, key=lambda k: self._last[k][0])[:5_000]:
                del self._last[old]
        if suppressed:
            kw["suppressed_since_last"] = suppressed
        self._log.warning(event, **kw)
