"""One routed request's life in the index's in-flight ledger, for every front end: the routing proxy
(kvindex/route/proxy.py), its disaggregated path (pd_proxy.py) and the ext_proc picker (ext_proc.py).

A request is scored (with commit, or looked at without while admission holds it), committed where
it goes, forwarded (and, when its first instance cannot be reached, served by another: the entry
moves), released at its first byte (``prefill``) and at its end however it ends (``finished``, with
the engine's report), or undone when the decision is not acted on (held or shed). ``RequestLedger``
holds that state and its rules: an entry is released at most once per phase, never before it may
exist, and never leaks; the report rides on the final release only when the index decided and
committed the request.

The index calls go through the client interface (``AsyncKvIndexClient`` over gRPC, or
``LocalKvIndexClient`` in the index's own process), run by the front end's ``Run``: the proxy runs
them in the background in order (a response never waits for the ledger, a release cannot overtake
the commit it follows); the picker runs them at once, in process (``run_now``: they never suspend),
so its answer to Envoy follows them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import structlog

from kvindex.api.inprocess import run_sync
from kvindex.client import BadRequest, IndexUnavailable
from kvindex.route.usage import Usage
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.outcomes import Report

log = structlog.get_logger("kvindex.route")

# Runs one index call of a request (a coroutine function) after the ones before it.
Run = Callable[[Callable[[], Awaitable[None]]], None]


class LedgerCalls(Protocol):
    """What a request's lifecycle asks of the index: the client's releases (kvindex/client)."""

    async def release(self, request_id: str, phase: str = ..., *, timeout: float | None = None) -> bool: ...

    async def release_reported(
        self,
        request_id: str,
        phase: str = ...,
        *,
        cached_tokens: int | None = None,
        ttft_ms: float | None = None,
        prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> tuple[bool, str]: ...


class LedgerEvents(Protocol):
    """What a front end does when the index answers a release (its metrics, its admission queue)."""

    def released(self, phase: str, found: bool | None, reported: bool, status: str, wake: bool) -> None:
        """``found`` None: the call failed; ``reported``: it carried the engine's report, and
        ``status`` is what became of it ("" when the index said nothing); ``wake``: an instance may
        have room now (not for the release that undoes a decision: the request goes back to the
        queue)."""
        ...

    def moved(self, committed: bool) -> None:
        """An entry moved to the instance that served (``committed``), or could not be (released)."""
        ...


def run_now(call: Callable[[], Awaitable[None]]) -> None:
    """``Run`` for the in-process client: the servicer's handlers never suspend, so the call is over
    when this returns (RuntimeError if one did)."""
    coro = call()
    assert isinstance(coro, Coroutine)
    run_sync(coro)


def report_of(usage: Usage | None, stream: bool, ttft_ms: float | None) -> Report | None:
    """What the final release tells the index (docs/feedback.md): the engine's cached tokens and
    prompt length, and ``ttft_ms`` when the first token was seen on its own (a stream, or a one-token
    answer); None when there is nothing to tell."""
    report = Report()
    if usage is not None:
        report.cached_tokens, report.prompt_tokens = usage.cached_tokens, usage.prompt_tokens
    if ttft_ms is not None and (stream or (usage is not None and usage.completion_tokens == 1)):
        report.ttft_ms = ttft_ms
    if report.cached_tokens is None and report.prompt_tokens is None and report.ttft_ms is None:
        return None
    return report


class RequestLedger:
    """One request's entry in the index's in-flight ledger, from the decision to the last release.

    ``commit`` commits the request on an instance id (the front end's way: a Commit with the prompt,
    or a Score restricted to it) and says whether the index took it; ``run`` runs the index calls."""

    def __init__(
        self,
        calls: LedgerCalls,
        request_id: str,
        run: Run,
        events: LedgerEvents,
        *,
        timeout: float | None = None,
        commit: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.calls = calls
        self.request_id = request_id
        self.run = run
        self.events = events
        self.timeout = timeout
        self._commit = commit
        # The index may hold an entry for the request (a Score committed it, or may have: its
        # answer never came): only then are releases sent (a fallback decision has nothing).
        self.active = False
        self.prefill_released = False
        self.finished = False
        # The report sent with the final release, for a request the index decided and committed
        # (after a deadline, a late commit may name another instance than the one that served it:
        # nothing to compare).
        self.reportable = False
        self.report: Report | None = None
        self._on = ""

    @property
    def committed(self) -> str:
        """The instance the entry is on, as far as this front end knows ("" for none)."""
        return self._on

    def committed_on(self, instance_id: str) -> None:
        """A Score with commit answered: the entry is on ``instance_id`` ("": none was made)."""
        self._on = instance_id
        self.active = bool(instance_id)

    def release(self, phase: str) -> None:
        """The prefill is over (the first byte is out) or the request is (``finished``): released
        once per phase, a ``prefill`` never after the end, nothing without an entry."""
        if not self.active or self.finished or (phase == PREFILL and self.prefill_released):
            return
        self.prefill_released = True
        self.finished = phase == FINISHED
        report = self.report if phase == FINISHED else None
        self.run(lambda: self._release(phase, report, wake=True))

    async def undo(self) -> None:
        """The decision was not acted on (the request is held or shed): its entry must not count
        against the instance. Awaited where the decision is dropped (before the request is looked
        at again); not the end of the request: it may be committed again."""
        self.active = False
        self._on = ""
        await self._release(FINISHED, None, wake=False)

    async def commit(self, instance_id: str) -> bool:
        """Commit the request on ``instance_id`` now (it was looked at without commit while it was
        held); whether the index took it."""
        try:
            return await self._committed(instance_id)
        except (IndexUnavailable, BadRequest, TypeError) as exc:
            log.debug("commit_failed", request_id=self.request_id, error=str(exc))
            return False

    def move(self, instance_id: str) -> None:
        """The request is served by ``instance_id``, not where it was committed: commit it there (a
        commit under the same request id replaces the entry), or release the entry if the index
        does not take it (it would count against an instance that is not serving the request)."""

        async def call() -> None:
            await self._move(instance_id)

        self.run(call)

    async def move_before_sending(self, instance_id: str, wait: float | None = None) -> bool | None:
        """``move``, awaited (in order with the calls before it): for a request about to be sent to
        ``instance_id`` (a retry). The commit prices the instance as the index sees it before the
        request runs there; once the engine has run it, its KV events would make the request's own
        prompt the predicted hit, and the engine's report would be judged against that. Whether the
        index took it; None when it has not answered within ``wait`` seconds (the request is not
        held longer: the commit goes on, ordered before the releases)."""
        moved: list[bool] = []
        over = asyncio.Event()

        async def call() -> None:
            try:
                moved.append(await self._move(instance_id))
            finally:
                over.set()

        self.run(call)
        try:
            await asyncio.wait_for(over.wait(), wait)
        except TimeoutError:
            return None
        return bool(moved and moved[0])

    async def _move(self, instance_id: str) -> bool:
        try:
            ok = await self._committed(instance_id)
        except (IndexUnavailable, BadRequest, TypeError) as exc:
            log.debug("recommit_failed", request_id=self.request_id, error=str(exc))
            ok = False
        self.events.moved(ok)
        if not ok:
            await self._release(FINISHED, None, wake=True)
        return ok

    async def _committed(self, instance_id: str) -> bool:
        assert self._commit is not None, "a front end that commits or moves entries says how"
        return await self._commit(instance_id)

    async def _release(self, phase: str, report: Report | None, wake: bool) -> None:
        found: bool | None = None
        status = ""
        try:
            if report is not None:
                found, status = await self.calls.release_reported(
                    self.request_id,
                    phase,
                    cached_tokens=report.cached_tokens,
                    ttft_ms=report.ttft_ms,
                    prompt_tokens=report.prompt_tokens,
                    timeout=self.timeout,
                )
            else:
                found = await self.calls.release(self.request_id, phase, timeout=self.timeout)
        except (IndexUnavailable, BadRequest) as exc:
            log.debug("release_failed", request_id=self.request_id, phase=phase, error=str(exc))
        self.events.released(phase, found, report is not None, status, wake)


def ordered(spawn: Callable[[Awaitable[None]], Any]) -> Run:
    """``Run`` for a front end that must not wait for the index: each call in a background task
    (``spawn``), after the one before it (whatever became of that one)."""
    tail: list[asyncio.Task[None] | None] = [None]

    def run(call: Callable[[], Awaitable[None]]) -> None:
        prev = tail[0]

        async def step() -> None:
            if prev is not None:
                await asyncio.wait([prev])  # never raises; a failed call does not stop the next
            await call()

        tail[0] = spawn(step())

    return run


__all__ = ["LedgerCalls", "LedgerEvents", "RequestLedger", "Run", "ordered", "report_of", "run_now"]
