"""The asyncio client: Score over one long-lived ScoreStream, unary Commit / Release / Lookup /
ListInstances / Stats, per-call deadlines, stream reopening, and the fallback decision.

See README.md in this folder for the design and the failure modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from kvindex.api.errors import BadRequest
from kvindex.api.methods import METHODS, method
from kvindex.client.channel import call_metadata, create_channel
from kvindex.client.errors import IndexUnavailable
from kvindex.client.fallback import (
    Fallback,
    InstanceCache,
    KnownInstance,
    RendezvousFallback,
    prefix_key,
    static_instances,
)
from kvindex.observability.logs import RateLimitedLog
from kvindex.security import ClientTLS
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 0.5  # seconds; Score answers in about a millisecond when the index is healthy
# ListInstances asked in pages of this many: ~0.5 MB and ~0.1 s of the index's loop a full page,
# under every gRPC client's 4 MB default, and the index serves other calls between pages.
LIST_PAGE = 4096
REFRESH_SHARE = 20  # the fallback's refresh waits at least this many times what the last one took

# Why a decision came from the fallback (a metric label).
UNAVAILABLE = "unavailable"  # cannot connect / connection lost
DEADLINE = "deadline"  # no answer within the call's deadline
STREAM_BROKEN = "stream_broken"  # the stream broke under the call twice (first time: retried)
ERROR = "error"  # any other server-side failure (INTERNAL, UNAUTHENTICATED, ...)
INDEX_EMPTY = "index_empty"  # the index answered but knows no instance of a model seen before

_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def _reason(code: grpc.StatusCode | None) -> str:
    if code is None:
        return STREAM_BROKEN
    if code in _UNAVAILABLE_CODES:
        return UNAVAILABLE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DEADLINE
    return ERROR


@dataclass(frozen=True, slots=True)
class Target:
    """Where to send a request: the instance and the ``host:port`` it announced ("" if none)."""

    instance_id: str
    endpoint: str


@dataclass(slots=True)
class Decision:
    """A routing decision: ``targets`` best first (retry the next on a connection failure).

    ``source`` is ``"index"`` (a Score answer, kept in ``response``) or ``"fallback"`` (the index
    did not answer; ``reason`` says why, and nothing was committed).
    """

    model: str
    targets: list[Target]
    source: str
    reason: str = ""
    request_id: str = ""
    committed_instance_id: str = ""
    response: pb.ScoreResponse | None = None

    @property
    def committed(self) -> bool:
        """The index added the request to its in-flight ledger: Release it when done."""
        return bool(self.committed_instance_id)

    @property
    def endpoint(self) -> str:
        return self.targets[0].endpoint if self.targets else ""

    @property
    def instance_id(self) -> str:
        return self.targets[0].instance_id if self.targets else ""


@dataclass
class ClientStats:
    """Plain counters (a proxy exports them as it likes)."""

    decisions: Counter[str] = field(default_factory=Counter)  # index / fallback
    fallbacks: Counter[str] = field(default_factory=Counter)  # by reason
    errors: Counter[str] = field(default_factory=Counter)  # "Method:reason" of failed unary calls
    streams_opened: int = 0
    streams_broken: int = 0
    retries: int = 0  # Score calls re-sent once on a new stream
    refreshes: int = 0  # ListInstances refreshes of the fallback's cache
    refresh_errors: int = 0


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


@dataclass
class IndexHealth:
    """Whether the index answers, as this client last saw it (``client.health``): for a readiness
    check, and for errors that can say since when. Times are wall-clock (``time.time()``).

    Any answer makes it reachable (an error answer too: the index is there). It becomes unreachable
    when a call cannot connect (``UNAVAILABLE``) or when a refresh of the instance list fails for
    any reason (a ListInstances that cannot be answered within a second is as good as no index); a
    single Score past its deadline does not (a slow index still answers)."""

    target: str
    reachable: bool | None = None  # None: no call has finished yet
    changed_at: float | None = None  # when it last became reachable or unreachable
    last_answer_at: float | None = None  # the index's last answer of any kind
    reason: str = ""  # while unreachable: unavailable, deadline, stream_broken or error
    status: str = ""  # while unreachable: the gRPC status name, when there was one
    detail: str = ""  # while unreachable: the status and its message (for logs, not for users)

    def describe(self) -> str:
        """One sentence for a person, with no gRPC internals: where the index is, since when it
        fails and when it last answered."""
        if self.reachable is not False:
            return f"the index at {self.target} answers"
        since = _utc(self.changed_at) if self.changed_at is not None else "start"
        last = "no answer since this process started"
        if self.last_answer_at is not None:
            last = f"last answer at {_utc(self.last_answer_at)}"
        what = {
            DEADLINE: "has not answered in time",
            ERROR: f"has failed its calls ({self.status or 'error'})",
        }.get(self.reason, "has been unreachable")
        return f"the index at {self.target} {what} since {since} ({last})"

    def json(self) -> dict[str, Any]:
        """For a health endpoint."""
        return {
            "index": self.target,
            "index_reachable": self.reachable,
            "index_changed_at": _utc(self.changed_at) if self.changed_at is not None else None,
            "index_last_answer_at": _utc(self.last_answer_at) if self.last_answer_at is not None else None,
        }


class _StreamBroken(Exception):
    def __init__(self, why: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(why)
        self.code = code


class _ScoreStream:
    """One ScoreStream call: requests written in order, answers matched to them in order (the
    server answers every request, errors included, in order)."""

    def __init__(self, call: Any, on_broken: Callable[[], None]) -> None:
        self.call = call
        self.pending: deque[tuple[asyncio.Future[pb.ScoreResponse], float, str]] = deque()
        self.lock = asyncio.Lock()
        self.broken: _StreamBroken | None = None
        self._on_broken = on_broken
        self.reader = asyncio.create_task(self._read(), name="kvindex-client-score-stream")

    async def _read(self) -> None:
        why = _StreamBroken("the index closed the score stream")
        try:
            async for response in self.call:
                if not self.pending:
                    why = _StreamBroken("an answer arrived for no request")
                    break
                fut, _, request_id = self.pending.popleft()
                if request_id and response.request_id != request_id:
                    why = _StreamBroken(f"answer for {response.request_id!r} arrived for {request_id!r}")
                    fut.cancel()
                    break
                if not fut.done():
                    fut.set_result(response)
        except grpc.aio.AioRpcError as exc:
            why = _StreamBroken(f"{exc.code().name}: {exc.details()}", exc.code())
        except asyncio.CancelledError:
            why = _StreamBroken("score stream closed by the client", grpc.StatusCode.CANCELLED)
        except Exception as exc:  # anything else ends the stream: calls fail over, nothing hangs
            why = _StreamBroken(f"score stream failed: {exc!r}")
        self.fail(why)

    def fail(self, why: _StreamBroken) -> None:
        if self.broken is None:
            self.broken = why
            self._on_broken()
            self.call.cancel()
        while self.pending:
            fut, _, _ = self.pending.popleft()
            if not fut.done():
                fut.set_exception(why)
                fut.exception()  # retrieved here: nobody may be waiting on it any more

    async def send(self, request: pb.ScoreRequest) -> asyncio.Future[pb.ScoreResponse]:
        fut: asyncio.Future[pb.ScoreResponse] = asyncio.get_running_loop().create_future()
        async with self.lock:  # one write at a time, and the queue in the order of the writes
            if self.broken is not None:
                raise self.broken
            self.pending.append((fut, time.monotonic(), request.request_id))
            try:
                await self.call.write(request)
            except asyncio.CancelledError:
                # Interrupted mid-write (deadline): whether it went out is unknown, so answers could
                # no longer be matched to requests. This stream is done; calls on it fail over.
                self.fail(_StreamBroken("a write was interrupted"))
                raise
            except Exception as exc:
                # An AioRpcError's repr carries gRPC's debug_error_string: keep the status only.
                if isinstance(exc, grpc.aio.AioRpcError):
                    code = exc.code()
                    self.fail(_StreamBroken(f"write failed: {code.name}: {exc.details()}", code))
                else:
                    self.fail(_StreamBroken(f"write failed: {exc!r}"))
        return fut

    def oldest_wait(self) -> float:
        return time.monotonic() - self.pending[0][1] if self.pending else 0.0

    async def close(self) -> None:
        self.fail(_StreamBroken("score stream closed by the client", grpc.StatusCode.CANCELLED))
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader


def _message(cls: Any, fields: dict[str, Any]) -> Any:
    """``cls(**fields)`` without the None ones; a list or dict given for a string field (chat
    ``messages``, ``chat_template_kwargs``) is sent as JSON."""
    by_name = cls.DESCRIPTOR.fields_by_name
    values = {}
    for name, value in fields.items():
        if value is None:
            continue
        field_desc = by_name.get(name)
        if (
            field_desc is not None
            and field_desc.type == field_desc.TYPE_STRING
            and not field_desc.is_repeated  # (candidates: a list of strings, sent as one)
            and isinstance(value, list | dict | tuple)
        ):
            value = _json(value)
        values[name] = value
    try:
        return cls(**values)
    except ValueError as exc:  # a field this kvindex.v1 does not have (e.g. a newer server feature)
        raise TypeError(f"{cls.DESCRIPTOR.name}: {exc}") from None


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class AsyncKvIndexClient:
    """Routers' client for one index (``target`` ``host:port``), over one gRPC channel.

    ``tls`` (a ClientTLS: TLS/mTLS from PEM files) or ``credentials`` and ``token`` (bearer) secure
    the channel; ``timeout`` is the default
    per-call deadline in seconds; ``fallback`` (None: off) decides when the index cannot;
    ``refresh_interval`` is how often the fallback's instance list is refreshed from ListInstances
    (brief pages; 0: only from Score answers and explicit :meth:`refresh_instances`), never more
    often than 20 times what the last refresh took (a large fleet's list costs the index ~4 us an
    instance); a Score stream whose oldest
    unanswered request is older than ``stall_after`` seconds is replaced. ``fallback_instances``
    (model -> ``["HOST:PORT" or "ID=HOST:PORT", ...]``, :func:`static_instances`) is the fallback's
    instance list for a model the index has not reported to this client yet, so that a client that
    starts while the index is down still routes (ValueError naming a bad entry).
    ``health`` says whether the index answers, and since when (logged once per change).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTLS | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),
        timeout: float = DEFAULT_TIMEOUT,
        fallback: Fallback | None = None,
        use_fallback: bool = True,
        fallback_blocks: int = 4,
        refresh_interval: float = 5.0,
        stall_after: float = 5.0,
        channel: grpc.aio.Channel | None = None,
        fallback_instances: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = call_metadata(token, metadata)
        static = static_instances(fallback_instances) if fallback_instances else None
        self._connect(target, credentials, options, tls, channel)
        self.fallback: Fallback | None = (fallback or RendezvousFallback()) if use_fallback else None
        self.fallback_blocks = fallback_blocks
        self.instances = InstanceCache(static=static)
        self.health = IndexHealth(target)
        self.refresh_interval = refresh_interval
        self.stall_after = stall_after
        self.stats = ClientStats()
        self.log = structlog.get_logger("kvindex.client").bind(index=target)
        # While the index is down every request falls back: one line per reason and model per 10 s.
        self._fallback_log = RateLimitedLog(self.log)
        self._stream: _ScoreStream | None = None
        self._stream_lock = asyncio.Lock()
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False

    def _connect(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, object]],
        tls: ClientTLS | None,
        channel: grpc.aio.Channel | None,
    ) -> None:
        self.channel: grpc.aio.Channel | None = (
            channel if channel is not None else create_channel(target, credentials, options, tls)
        )
        self._owns_channel = channel is None
        self.stub = pb_grpc.KvIndexStub(self.channel)

    async def __aenter__(self) -> AsyncKvIndexClient:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Start refreshing the instance list (also done by the first call)."""
        if self._refresher is None and self.refresh_interval > 0 and not self._closed:
            self._refresher = asyncio.create_task(self._refresh_loop(), name="kvindex-client-refresh")

    async def open_stream(self) -> None:
        """Open the Score stream now rather than with the first Score (a router's first request
        then does not pay the stream's setup); the first Score opens it anyway."""
        self.start()
        await self._open_stream()

    async def close(self) -> None:
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._stream is not None:
            await self._stream.close()
        if self._owns_channel and self.channel is not None:
            await self.channel.close()

    # -- Score -------------------------------------------------------------------------------------

    async def score(
        self,
        model: str,
        *,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: Any = None,
        candidates: Iterable[str] | None = None,
        top_k: int = 0,
        commit: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        **fields: Any,
    ) -> Decision:
        """Rank the model's instances for a prompt (exactly one of token_ids / block_keys / prompt /
        messages); with ``commit``, the index records ``request_id`` on the first one.

        Other ScoreRequest fields (``lora``, ``salt``, ``policy``, ``explain``, ``role``,
        ``prompt_tokens``, and newer ones) pass through as keywords. When the index is unreachable,
        past the deadline, or fails, the fallback decides (counted in ``stats.fallbacks``);
        IndexUnavailable only when there is no fallback or no instance of the model is known.
        BadRequest when the index rejects the arguments.
        """
        self.start()
        request = _message(
            pb.ScoreRequest,
            {
                "model": model,
                "token_ids": token_ids,
                "block_keys": block_keys,
                "prompt": prompt,
                "messages": messages,
                "candidates": list(candidates) if candidates is not None else None,
                "top_k": top_k,
                "commit": commit,
                "request_id": request_id,
                **fields,
            },
        )
        deadline = self.timeout if timeout is None else timeout
        try:
            response = await asyncio.wait_for(self._score(request), deadline)
        except TimeoutError:
            self._check_stall()
            reason, why, code = DEADLINE, f"no Score answer within {deadline * 1000:.0f} ms", None
        except _StreamBroken as exc:
            reason, why, code = _reason(exc.code), str(exc), exc.code
            if reason == UNAVAILABLE:
                self._unreachable(reason, why, code)
        else:
            self._answered()
            if response.error:
                raise BadRequest(response.error)
            if not response.block_size and self.fallback is not None and self.instances.instances(model):
                # The model is unknown to the index but was served before: the index restarted and
                # has not heard the heartbeats yet. Route as if it were down.
                return self._fall_back(
                    request, INDEX_EMPTY, "the index knows no instance of the model", None, messages
                )
            self.instances.observe(response)
            self.stats.decisions["index"] += 1
            return Decision(
                model=model,
                targets=[Target(r.instance_id, r.endpoint) for r in response.ranked],
                source="index",
                request_id=response.request_id,
                committed_instance_id=response.committed_instance_id,
                response=response,
            )
        return self._fall_back(request, reason, why, code, messages)

    async def _score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        for attempt in (0, 1):
            stream = await self._open_stream()
            try:
                fut = await stream.send(request)
                return await fut
            except _StreamBroken:
                # Retried once on a new stream (a Commit under the same request_id replaces the
                # first, so a retry cannot leave two ledger entries); a second break is final.
                if attempt:
                    raise
                self.stats.retries += 1
        raise AssertionError("unreachable")

    async def _open_stream(self) -> _ScoreStream:
        stream = self._stream
        if stream is not None and stream.broken is None:
            return stream
        async with self._stream_lock:
            stream = self._stream
            if stream is None or stream.broken is not None:
                call = self.stub.ScoreStream(metadata=self.metadata)
                stream = self._stream = _ScoreStream(call, self._stream_broke)
                self.stats.streams_opened += 1
            return stream

    def _stream_broke(self) -> None:
        self.stats.streams_broken += 1

    def _check_stall(self) -> None:
        """A stream whose oldest request waits far beyond deadlines is replaced (the index hangs,
        or the connection is dead without a reset): its queue of late answers is bounded this way."""
        stream = self._stream
        if stream is not None and stream.broken is None and stream.oldest_wait() > self.stall_after:
            self.log.warning("score_stream_stalled", waiting_s=round(stream.oldest_wait(), 3))
            stream.fail(_StreamBroken("stalled"))

    def _fall_back(
        self,
        request: pb.ScoreRequest,
        reason: str,
        why: str,
        code: grpc.StatusCode | None,
        messages: Any,
    ) -> Decision:
        model = request.model
        known: list[KnownInstance] = self.instances.instances(model)
        if request.candidates:
            wanted = set(request.candidates)
            known = [k for k in known if k.instance_id in wanted or k.instance_id.partition("/")[0] in wanted]
        if self.fallback is None or not known:
            self.stats.errors[f"Score:{reason}"] += 1
            detail = "no fallback configured" if self.fallback is None else f"no known instance of {model!r}"
            raise IndexUnavailable(reason, f"Score: {why} ({detail})", code)
        key = prefix_key(
            token_ids=request.token_ids,
            block_keys=request.block_keys,
            prompt=getattr(request, "prompt", None) or None,
            messages=messages,
            block_size=self.instances.block_size(model),
            blocks=self.fallback_blocks,
        )
        chosen = self.fallback.choose(key, known)
        if request.top_k:
            chosen = chosen[: request.top_k]
        self.stats.decisions["fallback"] += 1
        self.stats.fallbacks[reason] += 1
        self._fallback_log.warning(
            (reason, model),
            "score_fallback",
            reason=reason,
            error=why,
            model=model,
            instance=chosen[0].instance_id,
        )
        return Decision(
            model=model,
            targets=[Target(k.instance_id, k.endpoint) for k in chosen],
            source="fallback",
            reason=reason,
            request_id=request.request_id,
        )

    # -- unary calls -------------------------------------------------------------------------------

    async def call(
        self, name: str, request: Any = None, *, timeout: float | None = None, **fields: Any
    ) -> Any:
        """Any unary method of the service (kvindex/api/methods.py) by its proto name, with
        ``request`` or a request made of ``fields``; the reply message. The methods below are this
        with their arguments and replies in Python terms; a method without one is called here.
        BadRequest when the index rejects the arguments, IndexUnavailable when it does not answer."""
        entry = method(name)
        if entry.streaming:
            raise ValueError(f"{name} is a stream: use score()")
        if request is None:
            request = _message(entry.request, fields)
        elif fields:
            raise TypeError("pass either a request or its fields")
        return await self._unary(entry.name, request, timeout)

    async def _unary(self, name: str, request: Any, timeout: float | None) -> Any:
        self.start()
        rpc = getattr(self.stub, METHODS[name].name)
        try:
            reply = await rpc(
                request, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                self._answered()
                raise BadRequest(exc.details()) from None
            reason = _reason(code)
            self.stats.errors[f"{name}:{reason}"] += 1
            if reason == UNAVAILABLE:
                self._unreachable(reason, f"{code.name}: {exc.details()}", code)
            raise IndexUnavailable(reason, f"{name}: {code.name}: {exc.details()}", code) from None
        else:
            self._answered()
            return reply

    async def commit(
        self,
        request_id: str,
        instance_id: str,
        model: str,
        *,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[int] | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> bool:
        """Record that ``request_id`` was sent to ``instance_id`` (after a Score without commit).
        False: the index does not know the instance or model. IndexUnavailable when it is down."""
        reply = await self.call(
            "Commit",
            request_id=request_id,
            instance_id=instance_id,
            model=model,
            token_ids=token_ids,
            block_keys=block_keys,
            timeout=timeout,
            **fields,
        )
        return bool(reply.committed)

    async def release(
        self, request_id: str, phase: str = "finished", *, timeout: float | None = None
    ) -> bool:
        """``phase`` "prefill" (first token out) or "finished". False: the index had no such entry
        (never committed, already released, or the index restarted)."""
        reply = await self.call(
            "Release", pb.ReleaseRequest(request_id=request_id, phase=phase), timeout=timeout
        )
        return bool(reply.found)

    async def release_reported(
        self,
        request_id: str,
        phase: str = "finished",
        *,
        cached_tokens: int | None = None,
        ttft_ms: float | None = None,
        prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> tuple[bool, str]:
        """Release with what the engine reported (docs/feedback.md): the engine's cached tokens
        (``usage.prompt_tokens_details.cached_tokens``), the TTFT measured here and the engine's
        prompt length; any may be None. Returns (found, what became of the report: "applied" or
        why it was ignored)."""
        request = pb.ReleaseRequest(request_id=request_id, phase=phase)
        if cached_tokens is not None:
            request.cached_tokens = cached_tokens
        if ttft_ms is not None:
            request.ttft_ms = ttft_ms
        if prompt_tokens is not None:
            request.prompt_tokens = prompt_tokens
        reply = await self.call("Release", request, timeout=timeout)
        return bool(reply.found), reply.report

    async def lookup(self, model: str, *, timeout: float | None = None, **fields: Any) -> pb.LookupResponse:
        return await self.call("Lookup", model=model, timeout=timeout, **fields)

    async def list_instances(
        self, model: str = "", *, timeout: float | None = None, view: str = "", page_size: int = LIST_PAGE
    ) -> list[pb.InstanceInfo]:
        """Every instance (of ``model``, or all), asked page by page (``page_size`` each, 0: in one
        answer; an index that predates pages answers everything at once), in the ``view`` asked
        ("full" or "brief": kvindex/api/listing.py). ``timeout`` is per page."""
        out: list[pb.InstanceInfo] = []
        token = ""
        while True:
            fields = {"model": model, "view": view, "page_size": page_size, "page_token": token}
            reply = await self.call("ListInstances", timeout=timeout, **fields)
            out.extend(reply.instances)
            token = reply.next_page_token
            if not token:
                break
        if not model:
            self.instances.replace(out)
        return out

    async def stats_rpc(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return await self.call("Stats", timeout=timeout)

    # -- the fallback's instance list --------------------------------------------------------------

    async def refresh_instances(self, timeout: float | None = None) -> bool:
        """Reload every model's instances from ListInstances; False (counted) if the index is down."""
        try:
            await self.list_instances(timeout=timeout, view="brief")
        except IndexUnavailable as exc:
            self.stats.refresh_errors += 1
            self._unreachable(exc.reason, str(exc), exc.code)
            return False
        self._answered()
        self.stats.refreshes += 1
        return True

    # -- the index's health, as seen from here ----------------------------------------------------

    def _answered(self) -> None:
        health = self.health
        now = time.time()
        health.last_answer_at = now
        if health.reachable is not True:
            was, since = health.reachable, health.changed_at
            health.reachable, health.changed_at = True, now
            health.reason = health.status = health.detail = ""
            if was is False and not self._closed:
                down = round(now - since, 1) if since is not None else None
                self.log.info("index_reachable", unreachable_for_s=down)

    def _unreachable(self, reason: str, detail: str, code: grpc.StatusCode | None = None) -> None:
        """The index cannot be reached: said once, when it changes (every call meanwhile falls back
        or fails, and is counted, but the log says it once)."""
        health = self.health
        if health.reachable is False or self._closed:
            return
        health.reachable, health.changed_at = False, time.time()
        health.reason, health.detail = reason, detail
        health.status = code.name if code is not None else ""
        last = health.last_answer_at
        self.log.warning(
            "index_unreachable",
            reason=reason,
            error=detail,
            last_answer_at=_utc(last) if last is not None else None,
            effect="Score falls back to a hash of the prompt over the instances known without it; "
            "where none is known it raises IndexUnavailable",
        )

    async def _refresh_loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.refresh_instances(timeout=max(self.timeout, 1.0))
            # A large fleet's listing takes the index ~4 us an instance (~1 s at 224,000): each
            # client spends at most ~1/REFRESH_SHARE of the index's time on it.
            took = time.monotonic() - started
            await asyncio.sleep(max(self.refresh_interval, REFRESH_SHARE * took))
