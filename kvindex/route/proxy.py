"""The routing proxy: OpenAI-compatible requests in, each forwarded to the engine the index chose.

Per request: read the body, ask the index (``Score`` with commit, top few) through
:class:`kvindex.client.AsyncKvIndexClient`, forward the same bytes to the first instance's announced
``endpoint`` (the next on a connection failure), stream the engine's bytes back unchanged, and keep
the index's in-flight ledger true: ``Release(prefill)`` at the first body byte, ``Release(finished)``
when the request ends, however it ends. The final release carries what the engine reported (its
cached tokens, from the answer's ``usage``) and the TTFT measured here; for a stream whose client did
not ask for ``usage``, the body gets ``stream_options.include_usage`` and the usage chunk is taken
out of the stream again. Design and failure modes: README.md in this folder.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from kvindex.client import (
    AsyncKvIndexClient,
    Decision,
    Target,
)
from kvindex.observability.logs import RateLimitedLog
from kvindex.route.config import RouteConfig
from kvindex.route.decide import (
    EXPLAIN_HEADER,
    MAYBE_COMMITTED,
    Decider,
    admission_said,
    estimate_of,
    estimates,
    explanation_header,
    wants_explanation,
)
from kvindex.route.gate import AdmissionGate, AdmissionMetrics, Admitted, Shed
from kvindex.route.http import (
    error_kind,
    fields_taken,
    forward_headers,
    lower_headers,
    openai_error,
    relayed_response,
)
from kvindex.route.lifecycle import RequestLedger, ordered, report_of
from kvindex.route.metrics import RouteMetrics
from kvindex.route.openai_body import MAX_BODY_BYTES, BodyError, PromptSpec, parse_body
from kvindex.route.pd_proxy import FirstByte, PdRoute
from kvindex.route.status import health_response, metrics_response, models_response, ready_response
from kvindex.route.usage import UsageReader, add_include_usage
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.objectives import Objective, ObjectiveError
from kvindex.v1 import kvindex_pb2 as pb

log = structlog.get_logger("kvindex.route")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
ENGINE_KEEPALIVE = 4.0  # seconds an idle engine connection is kept (uvicorn closes them at 5)


@dataclass(eq=False)
class _Request:
    """One request in the proxy: its ledger entry (kvindex/route/lifecycle.py) and what admission
    and the stage timings follow (the object is admission's key for the request)."""

    ledger: RequestLedger
    model: str = ""
    objective: Objective = field(default_factory=Objective)  # its TTFT is judged against it at the first byte
    est_ms: float = 0.0  # the index's TTFT estimate for the instance chosen, and when it was chosen
    decided_at: float = 0.0
    sent_at: float = 0.0  # the last attempt's send to an engine (the proxy's stage timings)
    # Asked for an explanation (``x-kvindex-explain``): the index's, of the last decision (or why
    # there is none), and the admission decision, returned in the response header of that name.
    explain: bool = False
    explanation: pb.ExplainResponse | None = None
    why_not: str = ""
    admission: dict[str, Any] = field(default_factory=dict)


class RouteProxy:
    """The proxy server. ``start()`` binds it (``port`` 0: a free one, see ``.port``), ``stop()``
    finishes in-flight requests within ``config.grace`` and closes everything."""

    def __init__(self, config: RouteConfig, client: AsyncKvIndexClient | None = None) -> None:
        self.config = config
        self._client = client
        self.metrics = RouteMetrics(lambda: self._client.stats if self._client is not None else None)
        self.admission_metrics = AdmissionMetrics("kvindex_route", self.metrics.registry)
        self.gate: AdmissionGate[tuple[Decision | None, str]] = AdmissionGate(
            config.admission, self.admission_metrics
        )
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        # An engine down or an index rejecting a model fails every request alike: log once per key
        # and interval (with a count of the rest); the metrics count every one.
        self.limited_log = RateLimitedLog(log)
        self.pd = PdRoute(self, config.pd) if config.pd is not None else None
        self._decider: Decider | None = None  # made in start(), with the client
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        for path in COMPLETION_PATHS:
            self.app.router.add_post(path, self.handle_completion)
        self.app.router.add_get("/v1/models", self.handle_models)
        self.app.router.add_get("/health", self.handle_health)
        self.app.router.add_get("/ready", self.handle_ready)
        self.app.router.add_get("/metrics", self.handle_metrics)

    @property
    def client(self) -> AsyncKvIndexClient:
        assert self._client is not None, "RouteProxy.start() first"
        return self._client

    @property
    def decider(self) -> Decider:
        assert self._decider is not None, "RouteProxy.start() first"
        return self._decider

    @property
    def session(self) -> aiohttp.ClientSession:
        """The engines' HTTP session (the proxy's and its disaggregated path's requests)."""
        assert self._session is not None, "RouteProxy.start() first"
        return self._session

    @property
    def port(self) -> int:
        assert self._runner is not None, "RouteProxy.start() first"
        return int(self._runner.addresses[0][1])

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        if self._client is None:  # made here: a gRPC aio channel belongs to the running loop
            self._client = AsyncKvIndexClient(
                cfg.index,
                tls=cfg.tls,
                token=cfg.token,
                timeout=cfg.score_timeout,
                fallback_blocks=cfg.fallback_blocks,
                refresh_interval=cfg.refresh_interval,
                fallback_instances=cfg.fallback_instances,
            )
        client = self._client
        self._decider = Decider(client, cfg, self.metrics, self.limited_log)
        self.metrics.index_reachable.set_function(lambda: 1.0 if client.health.reachable else 0.0)
        # Learn the fleet before the first request (and connect the channel): a fallback needs it.
        # An index down is logged by the client (index_unreachable), once, and again when it is back.
        await self.client.refresh_instances(timeout=max(1.0, cfg.score_timeout))
        await self.client.open_stream()
        # auto_decompress off: the engine's bytes reach the client as sent (Content-Encoding kept).
        self._session = aiohttp.ClientSession(
            # Idle engine connections are dropped before uvicorn (vLLM's server) drops them at 5 s:
            # a POST on a connection the server is closing fails, and would be retried elsewhere.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=cfg.connect_timeout, sock_connect=cfg.connect_timeout
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        # handler_cancellation: a client that goes away cancels its handler, which closes the engine
        # connection (vLLM then aborts the request) and releases the ledger entry.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=cfg.grace, access_log=None
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await self._site.start()
        log.info("route_started", host=cfg.host, port=self.port, index=cfg.index)

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish within the grace (then cancel them), send
        their last releases, close the engine connections and the index client."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()  # waits up to shutdown_timeout = grace for handlers
            self._runner = None
        await self.gate.stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.release_timeout + 1.0)
        if self._session is not None:
            await self._session.close()
        if self._client is not None:
            await self._client.close()
        log.info("route_stopped")

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- ledger (kvindex/route/lifecycle.py) ------------------------------------------------------

    def ledger(self, request_id: str, spec: PromptSpec) -> RequestLedger:
        """``request_id``'s entry in the index's ledger, its calls in the background in order
        (moved with a Commit of ``spec``'s prompt)."""
        return RequestLedger(
            self.client,
            request_id,
            ordered(self.spawn),
            self,
            timeout=self.config.release_timeout,
            commit=lambda instance_id: self._commit(request_id, instance_id, spec),
        )

    async def _commit(self, request_id: str, instance_id: str, spec: PromptSpec) -> bool:
        fields = fields_taken(pb.CommitRequest, spec)
        if fields is None:
            return False
        return await self.client.commit(
            request_id, instance_id, spec.model, timeout=self.config.release_timeout, **fields
        )

    def released(self, phase: str, found: bool | None, reported: bool, status: str, wake: bool) -> None:
        """LedgerEvents: a release answered (counted), and, unless it undid a decision, queued
        requests may fit now. (Told after the index has the release, so their new Score sees it.)"""
        if wake:
            self.gate.wake()
        if found is None:
            self.metrics.releases.labels(phase, "error").inc()
            if reported:
                self.metrics.reports.labels("error").inc()
            return
        if reported:
            self.metrics.reports.labels(status or "none").inc()
        self.metrics.releases.labels(phase, "found" if found else "not_found").inc()

    def moved(self, committed: bool) -> None:
        self.metrics.recommits.labels("committed" if committed else "failed").inc()

    async def _commit_first(self, decision: Decision, ledger: RequestLedger) -> None:
        """A request admitted from the queue was re-scored without commit: commit it where it goes
        before it is sent (an instance that refuses the connection then moves it, as always)."""
        target = next((t for t in decision.targets if t.endpoint), None)
        if target is not None and await ledger.commit(target.instance_id):
            decision.committed_instance_id = target.instance_id

    async def _undo(self, trial: tuple[Decision | None, str], ledger: RequestLedger) -> None:
        """A decision not acted on (the request is queued or shed): its commit must not count."""
        decision = trial[0]
        if decision is not None and (decision.committed or decision.reason in MAYBE_COMMITTED):
            await ledger.undo()

    # -- deciding ----------------------------------------------------------------------------------

    # -- handlers ----------------------------------------------------------------------------------

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        path = request.path
        code = "500"
        self.metrics.in_flight.inc()
        req: _Request | None = None
        decision: Decision | None = None
        try:
            read = await self._read(request)
            if isinstance(read, web.Response):
                code = str(read.status)
                return read
            raw, spec, objective = read
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            req = _Request(self.ledger(request_id, spec), spec.model, objective)
            req.explain = wants_explanation(request.headers.get(EXPLAIN_HEADER, ""))
            ledger = req.ledger
            pd = self.pd
            extra = pd.decode_fields(spec.model) if pd is not None else {}
            admitted = await self.gate.admit(
                spec.model,
                objective,
                received,
                lambda commit: self._decide(spec, request_id, req, commit, extra),
                estimates,
                lambda trial: self._undo(trial, ledger),
            )
            if isinstance(admitted, Shed):
                code = "429"
                return self._shed(admitted, req)
            decision, why = admitted.trial
            raw, strip_usage = await self._admitted(raw, spec, req, admitted)
            if decision is None or not decision.targets:
                code = "503"
                down = decision is None and self.client.health.reachable is False
                unavailable = openai_error(
                    503, why if decision is None else f"no instance serves model {spec.model!r}",
                    "service_unavailable", "index_unreachable" if down else "no_instance",
                )  # fmt: skip
                if req.explain:
                    unavailable.headers[EXPLAIN_HEADER] = self._explanation(req)
                return unavailable
            added: dict[str, str] | None = None
            first_byte: FirstByte | None = None
            if pd is not None:
                headers = forward_headers(request.headers)
                raw, added, first_byte, decision = await pd.prepare(
                    request, raw, spec, decision, ledger, headers
                )
                if first_byte is not None:
                    # Prefilled elsewhere: the decode engine's cached tokens count the transferred KV,
                    # which its own prediction never promised; comparing them would only mislead.
                    ledger.reportable = False
            response, code = await self._forward(
                request, raw, spec, decision, req, received, strip_usage, added, first_byte
            )
            if req.explain and not response.prepared:  # no engine reached (a relayed one has it)
                response.headers[EXPLAIN_HEADER] = self._explanation(req)
            return response
        except asyncio.CancelledError:
            code = "499"  # the client went away (or shutdown's grace ran out)
            if req is not None and decision is None:
                req.ledger.active = True  # cancelled while scoring: the commit may have been made
            raise
        finally:
            if req is not None:
                req.ledger.release(FINISHED)  # however the request ended: the ledger must not leak
                self.gate.correction.finish(req.model, req)  # no first token awaited any more
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(path, code).inc()

    async def _read(self, request: web.Request) -> tuple[bytes, PromptSpec, Objective] | web.Response:
        """The request's body and objective, or the error answer (413, 400) that refuses it."""
        try:
            raw = await request.read()
            spec = parse_body(raw, request.path)
        except web.HTTPRequestEntityTooLarge:
            return openai_error(
                413, f"request body larger than {MAX_BODY_BYTES} bytes", "invalid_request_error"
            )
        except BodyError as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        try:
            objective = self.config.objectives.of(spec.model, lower_headers(request.headers))
        except ObjectiveError as exc:
            self.limited_log.warning(("bad_objective", exc.header), "bad_objective", error=str(exc))
            return openai_error(400, str(exc), "invalid_request_error", param=exc.header)
        return raw, spec, objective

    def _shed(self, shed: Shed, req: _Request) -> web.Response:
        """Admission's refusal: 429 with when to come back (and the explanation, when asked)."""
        answer = openai_error(429, shed.message, "rate_limit_error", shed.reason)
        answer.headers["Retry-After"] = str(shed.retry_after_s)
        if req.explain:
            req.admission = admission_said(shed, req.objective)
            answer.headers[EXPLAIN_HEADER] = self._explanation(req)
        return answer

    async def _decide(
        self, spec: PromptSpec, request_id: str, req: _Request, commit: bool, extra: dict[str, Any]
    ) -> tuple[Decision | None, str]:
        """The decision (admission asks again after holding a request); explained first by the
        index when the request asked: Explain changes nothing, so it sees what the Score will."""
        if req.explain:
            req.explanation, req.why_not = await self.decider.explain(spec, request_id, **extra)
        return await self.decider.decide(spec, request_id, commit, **extra)

    def _explanation(self, req: _Request) -> str:
        return explanation_header(req.explanation, req.why_not, req.admission)

    async def _admitted(
        self, raw: bytes, spec: PromptSpec, req: _Request, admitted: Admitted[tuple[Decision | None, str]]
    ) -> tuple[bytes, bool]:
        """The admitted decision takes effect: its instance first (admission may pick a later-ranked
        one), committed there if it was looked at without commit, the ledger told what the index may
        hold; a stream the index can learn from asks for the engine's usage (stripped again on the
        way back: the second value). Returns the body to send."""
        decision = admitted.trial[0]
        ledger = req.ledger
        req.est_ms, req.decided_at = admitted.est_ms, time.monotonic()
        if req.explain:
            req.admission = admission_said(admitted, req.objective)
        if spec.stream and req.est_ms and decision is not None and admitted.pick < len(decision.targets):
            first = decision.targets[admitted.pick].instance_id
            self.gate.awaiting(spec.model, req, req.est_ms, req.decided_at, first)
        if decision is not None and admitted.pick:
            # Admission chose a later-ranked instance (the first within the objective): it goes
            # first, and the ledger entry follows it there (_forward's re-commit).
            t = decision.targets
            decision.targets = [t[admitted.pick], *t[: admitted.pick], *t[admitted.pick + 1 :]]
        if decision is not None and not admitted.committed and decision.source == "index":
            await self._commit_first(decision, ledger)
        ledger.active = decision is not None and (decision.committed or decision.reason in MAYBE_COMMITTED)
        # The engine's usage ends a stream only when asked for: ask, and strip it again below.
        ledger.reportable = decision is not None and decision.committed
        if spec.stream and ledger.reportable:
            asked = add_include_usage(raw)
            if asked is not None:
                return asked, True
        return raw, False

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        spec: PromptSpec,
        decision: Decision,
        req: _Request,
        received: float,
        strip_usage: bool = False,
        added: dict[str, str] | None = None,
        first_byte: FirstByte | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """Send ``raw`` to the decision's first reachable target and relay its answer, with the
        ``added`` response headers; ``first_byte`` is called with the target at its first byte."""
        assert self._session is not None
        targets = [t for t in decision.targets if t.endpoint]
        if not targets:
            ids = ", ".join(t.instance_id for t in decision.targets)
            msg = f"no instance of model {spec.model!r} announces an endpoint ({ids}; kvshim --endpoint)"
            return openai_error(503, msg, "service_unavailable", "no_endpoint"), "503"
        headers = forward_headers(request.headers)
        errors: list[str] = []
        for attempt, target in enumerate(targets):
            if attempt:
                self.metrics.retries.inc()
            if decision.committed and target.instance_id != decision.committed_instance_id:
                # The entry follows the request before it is sent there (a retry, or admission's
                # pick): committed after the engine had run it, the request's own KV events would
                # be its predicted hit, and the engine's report judged against that.
                # (Waited for as long as a decision may take.)
                moved = await req.ledger.move_before_sending(target.instance_id, self.config.score_timeout)
                decision.committed_instance_id = "" if moved is False else target.instance_id
            url = f"http://{target.endpoint}{request.path_qs}"
            req.sent_at = time.monotonic()
            if not attempt:
                self.metrics.stages.labels("before_forward").observe(req.sent_at - received)
            try:
                upstream = await self._session.request(request.method, url, data=raw, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = error_kind(exc)
                self.metrics.upstream_errors.labels(kind).inc()
                errors.append(f"{target.instance_id} at {target.endpoint}: {kind} ({exc!r})")
                self.limited_log.warning(
                    ("upstream_failed", target.endpoint, kind), "upstream_failed",
                    instance=target.instance_id, endpoint=target.endpoint, kind=kind, error=repr(exc),
                    request_id=req.ledger.request_id,
                )  # fmt: skip
                continue
            break
        else:
            msg = f"no instance of model {spec.model!r} could be reached: " + "; ".join(errors)
            return openai_error(502, msg, "bad_gateway", "upstream_unreachable"), "502"
        reason = "retry" if attempt else decision.source
        self.metrics.decisions.labels(reason).inc()
        est = estimate_of(decision, target.instance_id)
        try:
            return await self._relay(
                request, upstream, target, reason, req, received, strip_usage, added, first_byte, est
            )
        finally:
            upstream.close()  # a no-op after a full read (the connection went back to the pool)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        target: Target,
        reason: str,
        req: _Request,
        received: float,
        strip_usage: bool = False,
        added: dict[str, str] | None = None,
        first_byte: FirstByte | None = None,
        est_ttft_ms: float | None = None,
    ) -> tuple[web.StreamResponse, str]:
        if upstream.status >= 500:
            self.metrics.upstream_errors.labels("http_5xx").inc()
        stream = "true" if upstream.content_type == "text/event-stream" else "false"
        # The engine's usage is read from answers the index can learn from (a committed, successful,
        # uncompressed one); what is stripped changes the length, so the body is then chunked.
        reader: UsageReader | None = None
        if req.ledger.reportable and upstream.status == 200 and "Content-Encoding" not in upstream.headers:
            reader = UsageReader(stream == "true", strip=strip_usage)
        ours = {
            "x-kvindex-instance": target.instance_id,
            "x-kvindex-decision": reason,
            "x-kvindex-request-id": req.ledger.request_id,
            **(added or {}),
        }
        if est_ttft_ms is not None:  # what the index predicted, for a client to compare with
            ours["x-kvindex-est-ttft-ms"] = f"{est_ttft_ms:.1f}"
        if req.explain:
            ours[EXPLAIN_HEADER] = self._explanation(req)
        response = relayed_response(upstream, reader is not None and reader.strip, ours)
        await response.prepare(request)
        first = True
        written = False
        first_at = received
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The engine failed mid-body: the status is sent, so the client can only be shown
                # the connection cut (never a body that looks complete).
                self.metrics.upstream_errors.labels("stream").inc()
                self.limited_log.warning(
                    ("upstream_broke_mid_body", target.endpoint), "upstream_broke_mid_body",
                    instance=target.instance_id, error=repr(exc), request_id=req.ledger.request_id,
                )  # fmt: skip
                if request.transport is not None:
                    request.transport.close()
                return response, "502"
            if first:
                first = False
                first_at = self._first_byte(req, target, stream, reason, received, first_byte)
            if reader is not None:
                chunk = reader.feed(chunk)
                if not chunk:
                    continue
            try:
                await response.write(chunk)
            except ConnectionResetError:
                return response, "499"  # the client went away while we wrote
            if not written:
                written = True
                self.metrics.stages.labels("first_write").observe(time.monotonic() - first_at)
        if first:
            first_at = time.monotonic()
            self.metrics.ttft.labels(stream).observe(first_at - received)
            self.admission_metrics.observe_ttft(req.model, req.objective, first_at - received)
        if not await self._end_body(response, reader, req, stream == "true", (first_at - received) * 1000):
            return response, "499"  # the client went away while we wrote
        self.metrics.duration.labels(stream).observe(time.monotonic() - received)
        return response, str(upstream.status)

    async def _end_body(
        self,
        response: web.StreamResponse,
        reader: UsageReader | None,
        req: _Request,
        stream: bool,
        ttft_ms: float,
    ) -> bool:
        """The answer is over: the engine's report for the final release (``reader``: it was read),
        the usage chunk held back if it was not the client's, the end; False if the client went."""
        try:
            if reader is not None:
                tail = reader.finish()
                req.ledger.report = report_of(reader.usage, stream, ttft_ms)
                if tail:
                    await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:
            return False
        return True

    def _first_byte(
        self,
        req: _Request,
        target: Target,
        stream: str,
        reason: str,
        received: float,
        first_byte: FirstByte | None,
    ) -> float:
        """The engine's first bytes are out (a stream's first token, or the whole answer): the
        stage timings, TTFT against the objective and the estimate, the prefill released; when."""
        first_at = time.monotonic()
        self.metrics.stages.labels("upstream_first_byte").observe(first_at - req.sent_at)
        ttft = first_at - received  # queue time included
        self.metrics.ttft.labels(stream).observe(ttft)
        self.admission_metrics.observe_ttft(req.model, req.objective, ttft)
        if req.est_ms:
            # The first chunk of a stream is the first token: how good was the estimate?
            counts = stream == "true" and reason != "retry" and first_byte is None
            measured = first_at - req.decided_at if counts else None
            self.gate.observe(req.model, req, req.est_ms, measured)
        if first_byte is not None:
            first_byte(target)
        req.ledger.release(PREFILL)  # the first token (stream) or the whole answer is out
        return first_at

    async def handle_models(self, request: web.Request) -> web.Response:
        """The models of every known instance, merged by id (each engine lists what it serves)."""
        return await models_response(
            request, self.client, self.session, self.metrics, self.config.models_timeout
        )

    async def handle_health(self, request: web.Request) -> web.Response:
        return health_response(self.client, self.draining)

    async def handle_ready(self, request: web.Request) -> web.Response:
        return ready_response(self.client, self.draining)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)
