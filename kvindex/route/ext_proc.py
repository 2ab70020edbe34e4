"""Envoy ext_proc endpoint picker: the Gateway API Inference Extension's Endpoint Picker protocol (v1).

Envoy-based gateways (kgateway, Istio, Envoy Gateway, GKE Gateway, NGINX Gateway Fabric) ask an
external processor where each inference request should go. For every HTTP request Envoy opens one
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream and sends, in order: the request
headers, the request body (in chunks, the last with ``end_of_stream``), then the response headers,
body and trailers. This picker:

1. buffers the request body, reads model and prompt (kvindex/route/openai_body.py) and ranks the
   instances with the index's own ``Score`` (commit: the request enters the in-flight ledger);
2. answers with header ``x-gateway-destination-endpoint`` = ``ip:port[,ip:port...]`` (the first is
   the pick, the rest are ranked fallbacks for Envoy's retries) and the same value in dynamic
   metadata under ``envoy.lb`` — the two never differ;
3. honours the subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``):
   only endpoints in it are eligible, 503 when none is;
4. on the response reads ``x-gateway-destination-endpoint-served`` (moving the ledger entry when
   Envoy fell back to another endpoint), releases the prefill at the first response body chunk and
   the request at the end of the response — or when the stream ends any other way (client gone,
   upstream reset), so the ledger never leaks. Where the gateway sends the response body, the final
   release carries the engine's ``usage`` (its cached tokens; kvindex/route/usage.py) and the time from
   the pick to the first response byte, which the index compares with its prediction
   (docs/feedback.md). A stream has ``usage`` only when its client asked for it
   (``stream_options.include_usage``) or the engine forces it (vLLM ``--enable-force-include-usage``).

Processing modes: Envoy's ``FULL_DUPLEX_STREAMED`` (what the Inference Extension configures) sends
body chunks without waiting for the headers' answer; the picker then answers the headers after the
last chunk and streams the body back unchanged. In ``BUFFERED`` mode Envoy waits for the headers'
answer first, so the picker continues the headers at once and sets the destination in the body's
answer. The mode comes from ``ProcessingRequest.protocol_config`` (sent by Envoy with the first
message); without it, full duplex is assumed, as the Inference Extension's own picker does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from kvindex.api.errors import BadRequest
from kvindex.api.handlers import Malformed
from kvindex.api.inprocess import run_sync
from kvindex.api.servicer import KvIndexServicer
from kvindex.client.local import LocalKvIndexClient
from kvindex.fleet.registry import InstanceState
from kvindex.route.decide import EXPLAIN_HEADER, admission_said, explanation_header, wants_explanation
from kvindex.route.envoy import (
    DESTINATION,
    FULL_DUPLEX,
    LB_NAMESPACE,
    NO_BODY,
    PREFILL_SUFFIX,
    PREFILLER,
    REQUEST_ID_HEADER,
    SERVED,
    headers_of,
    immediate,
    metadata_string,
    streamed_body,
    subset_hint,
)
from kvindex.route.gate import AdmissionGate, AdmissionMetrics, Shed
from kvindex.route.lifecycle import RequestLedger, report_of, run_now
from kvindex.route.openai_body import BodyError, PromptSpec, apply_prompt, parse_body
from kvindex.route.pd import (
    REMOTE,
    PairCosts,
    PdConfig,
    PdMetrics,
    PrefillOption,
    choose_prefill,
    decide_local,
    decode_candidates,
    prefill_candidates,
)
from kvindex.route.picker_state import Exchange, PickerMetrics, QuietEvents
from kvindex.route.usage import UsageReader
from kvindex.scoring.admission import AdmissionConfig, Estimate
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.objectives import ObjectiveDefaults, ObjectiveError
from kvindex.scoring.outcomes import Report
from kvindex.v1 import kvindex_pb2 as pb


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    """``ExternalProcessor`` over the index's own scoring (same process, same event loop): Score and
    the ledger's releases go through the in-process client (``LocalKvIndexClient``), each over
    before the picker answers Envoy (``run_now``)."""

    def __init__(
        self,
        servicer: KvIndexServicer,
        *,
        fallbacks: int = 3,
        policy: str = "",
        max_body_bytes: int = 16 * 1024 * 1024,
        log: Any = None,
        pd: PdConfig | None = None,
        admission: AdmissionConfig | None = None,
        objectives: ObjectiveDefaults | None = None,
    ) -> None:
        self.servicer = servicer
        self.client = LocalKvIndexClient(servicer, refresh_interval=0)
        self.registry = servicer.registry
        self.fallbacks = fallbacks
        self.policy = policy
        self.max_body_bytes = max_body_bytes
        self.log = log or structlog.get_logger("kvindex.ext_proc")
        self.metrics = PickerMetrics(servicer.metrics.registry if servicer.metrics else None)
        # Admission (kvindex/scoring/admission.py): a request held is an ext_proc stream not yet
        # answered; a request shed is answered 429 at once (the Inference Extension's protocol).
        self.objectives = objectives or ObjectiveDefaults()
        self.admission_metrics = AdmissionMetrics(
            "kvindex_ext_proc", servicer.metrics.registry if servicer.metrics else None
        )
        self.gate: AdmissionGate[pb.ScoreResponse] = AdmissionGate(
            admission or AdmissionConfig(), self.admission_metrics
        )
        # Disaggregated prefill/decode (--ext-proc-pd): decode destination + prefill header.
        self.pd = pd
        self.pd_costs = PairCosts(pd) if pd is not None else None
        self.pd_metrics = (
            PdMetrics(servicer.metrics.registry if servicer.metrics else None, "kvindex_ext_proc")
            if pd is not None
            else None
        )

    # -- the stream ----------------------------------------------------------------------------

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        self.metrics.streams.inc()
        ex = Exchange()
        try:
            async for msg in request_iterator:
                if type(msg) is Malformed:  # bytes that are not a ProcessingRequest (handlers.py)
                    self.metrics.picks.labels("bad_request").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.message)
                if msg.HasField("protocol_config"):
                    cfg = msg.protocol_config
                    ex.full_duplex = (
                        cfg.request_body_mode == FULL_DUPLEX
                        or cfg.send_body_without_waiting_for_header_response
                        or cfg.request_body_mode == NO_BODY
                    )
                kind = msg.WhichOneof("request")
                for response in await self._handle(ex, kind, msg):
                    yield response
                    if response.HasField("immediate_response"):
                        return
        finally:
            # However the stream ends (response done, client gone, upstream reset, Envoy restart),
            # the request leaves the in-flight ledger.
            self._finish(ex)

    async def _handle(
        self, ex: Exchange, kind: str | None, msg: ep.ProcessingRequest
    ) -> list[ep.ProcessingResponse]:
        if kind == "request_headers":
            ex.headers = headers_of(msg.request_headers.headers)
            ex.subset = subset_hint(msg.metadata_context)
            ex.request_id = ex.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
            ex.ledger = self._ledger(ex.request_id)
            if msg.request_headers.end_of_stream:  # no body (GET /v1/models, ...): pick by load
                return [await self._pick(ex, phase="request_headers")]
            if not ex.full_duplex:  # Envoy waits for this answer before it sends the body
                return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
            return []
        if kind == "request_body":
            body = msg.request_body
            ex.body += body.body
            if len(ex.body) > self.max_body_bytes:
                self.metrics.picks.labels("too_large").inc()
                return [immediate(413, f"request body over {self.max_body_bytes} bytes")]
            if not body.end_of_stream:
                return []
            if not ex.full_duplex:
                return [await self._pick(ex, phase="request_body")]
            picked = await self._pick(ex, phase="request_headers")
            if picked.HasField("immediate_response"):
                return [picked]
            return [picked, *streamed_body(bytes(ex.body), "request_body")]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            self._served(ex, msg.metadata_context)
            headers = headers_of(msg.response_headers.headers)
            ex.streaming = headers.get("content-type", "").startswith("text/event-stream")
            reportable = ex.committed and not ex.served_elsewhere
            if reportable and headers.get(":status", "200") == "200" and "content-encoding" not in headers:
                stream = headers.get("content-type", "").startswith("text/event-stream")
                ex.reader = UsageReader(stream)
            if msg.response_headers.end_of_stream:
                self._finish(ex)
            if ex.explained:  # asked for: the decision explained, to the client with the answer
                explained = ep.HeaderMutation(
                    set_headers=[
                        core_pb2.HeaderValueOption(
                            header=core_pb2.HeaderValue(key=EXPLAIN_HEADER, raw_value=ex.explained.encode()),
                            append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ]
                )
                common = ep.CommonResponse(header_mutation=explained)
                return [ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))]
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_body":
            body = msg.response_body
            if not ex.released_prefill and (body.body or body.end_of_stream):
                # The first bytes of the answer: the prefill is done (time queued included).
                now = ex.first_byte_at = time.monotonic()
                self.metrics.ttft.observe(now - ex.arrived)
                self.admission_metrics.observe_ttft(ex.model, ex.objective, now - ex.arrived)
                if ex.est_ms:
                    counts = ex.streaming and not ex.prefiller
                    self.gate.observe(ex.model, id(ex), ex.est_ms, now - ex.decided_at if counts else None)
                self._release(ex, PREFILL)
            if ex.reader is not None:
                ex.reader.feed(body.body)
                if body.end_of_stream and ex.ledger is not None:
                    ex.ledger.report = self._report(ex, ex.reader)
            if body.end_of_stream:
                self._finish(ex)
            if ex.full_duplex:
                return streamed_body(body.body, "response_body", end=body.end_of_stream)
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "response_trailers":
            self._finish(ex)
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []  # nothing else needs an answer

    # -- picking -------------------------------------------------------------------------------

    async def _pick(self, ex: Exchange, phase: str) -> ep.ProcessingResponse:
        """Rank, commit, and answer ``phase`` (request_headers or request_body) with the destination."""
        try:
            endpoints = await self._rank(ex)
        except (BodyError, BadRequest, ObjectiveError) as exc:
            self.metrics.picks.labels("bad_request").inc()
            return immediate(400, str(exc))
        if isinstance(endpoints, Shed):
            self.metrics.picks.labels("shed").inc()
            headers = {"retry-after": str(endpoints.retry_after_s)}
            if ex.explained:
                headers[EXPLAIN_HEADER] = ex.explained
            return immediate(429, endpoints.message, headers)
        if not endpoints:
            self.metrics.picks.labels("no_endpoint").inc()
            reason = "no ready endpoint in the subset hint" if ex.subset is not None else "no ready endpoint"
            return immediate(503, reason)
        value = ",".join(endpoints)
        self.metrics.picks.labels("picked").inc()
        mutation = ep.HeaderMutation(
            set_headers=[
                core_pb2.HeaderValueOption(
                    header=core_pb2.HeaderValue(key=DESTINATION, raw_value=value.encode()),
                    append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
            ]
        )
        if self.pd is not None:
            if ex.prefiller:
                mutation.set_headers.append(
                    core_pb2.HeaderValueOption(
                        header=core_pb2.HeaderValue(key=PREFILLER, raw_value=ex.prefiller.encode()),
                        append_action=core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                )
            else:  # the decode instance prefills itself; a client never chooses the prefiller
                mutation.remove_headers.append(PREFILLER)
        common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = value
        if phase == "request_headers":
            return ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)

    async def _rank(self, ex: Exchange) -> list[str] | Shed:
        """Endpoints best first (the pick and up to ``fallbacks`` more); [] when none is eligible;
        Shed when admission sheds the request."""
        eligible = self._eligible(ex.subset)
        if not eligible:
            return []
        if not ex.body:  # a request without a body: the least loaded eligible instance
            return self._by_load(eligible)
        spec = parse_body(bytes(ex.body), ex.headers.get(":path", ""))
        ex.model = spec.model
        ex.objective = self.objectives.of(spec.model, ex.headers)
        if self.pd is not None:
            candidates, role = decode_candidates(eligible), "decode"
            if not candidates:
                return []
        else:
            candidates, role = sorted(s.instance_id for s in eligible), ""
        scored: list[pb.ScoreRequest] = []
        explain = wants_explanation(ex.headers.get(EXPLAIN_HEADER, ""))
        explained: list[tuple[pb.ExplainResponse | None, str]] = []

        async def attempt(commit: bool) -> pb.ScoreResponse:
            if explain:  # the ranking this Score gets, explained first (Explain changes nothing)
                explained.append(self._explain(self._score_request(spec, ex, candidates, False, role)))
            request = self._score_request(spec, ex, candidates, commit, role)
            response = self._score(request)
            scored.append(request)
            if response.committed_instance_id:
                ex.request = request
                self._committed(ex, response.committed_instance_id)
            return response

        admitted = await self.gate.admit(
            spec.model,
            ex.objective,
            ex.arrived,
            attempt,
            lambda r: [Estimate.of(x) for x in r.ranked] if r.block_size else [],
            self._undo(ex),
        )
        if explained:
            ex.explained = explanation_header(*explained[-1], admission_said(admitted, ex.objective))
        if isinstance(admitted, Shed):
            return admitted
        response = admitted.trial
        request = pb.ScoreRequest()
        request.CopyFrom(scored[-1])
        request.commit = True  # what PD's later picks copy (a held request was looked at without)
        ex.est_ms, ex.decided_at = admitted.est_ms, time.monotonic()
        ex.picked_at = ex.decided_at
        if spec.stream and ex.est_ms and admitted.pick < len(response.ranked):
            first = response.ranked[admitted.pick].instance_id
            self.gate.awaiting(spec.model, id(ex), ex.est_ms, ex.decided_at, first)
        if response.block_size and (admitted.pick or not admitted.committed):
            # Admission chose a later-ranked instance (the first within the objective), or the
            # request was re-scored without commit after waiting: commit it where it goes.
            self._commit_on(ex, spec, response.ranked[admitted.pick].instance_id, role)
            picked = response.ranked[admitted.pick]
            rest = [r for i, r in enumerate(response.ranked) if i != admitted.pick]
            del response.ranked[:]
            response.ranked.extend([picked, *rest])
        if not response.block_size:
            # A model the index has not heard of: any eligible endpoint may still serve it.
            return self._by_load(eligible)
        if self.pd is not None and response.ranked:
            response = self._plan_prefill(ex, spec, request, response, eligible)
        # Ranks of one data-parallel engine share its endpoint: each endpoint once, at its best rank.
        ranked = list(dict.fromkeys(r.endpoint for r in response.ranked if r.endpoint))
        return ranked[: 1 + self.fallbacks]

    def _plan_prefill(
        self,
        ex: Exchange,
        spec: PromptSpec,
        decode_request: pb.ScoreRequest,
        decoded: pb.ScoreResponse,
        eligible: list[InstanceState],
    ) -> pb.ScoreResponse:
        """PD: pick the prefill instance for the decode pick (``ex.prefiller``), or leave the prefill
        to a decode instance (conditional disaggregation, kvindex/route/pd.py): then the request is a
        whole one, and the decode instances are ranked again by TTFT (prefix held, queue). Returns
        the ranking whose endpoints are the destination."""
        assert self.pd is not None and self.pd_costs is not None and self.pd_metrics is not None
        top = decoded.ranked[0]
        prompt_tokens = decoded.prompt_tokens or decoded.total_blocks * decoded.block_size
        why = decide_local(prompt_tokens, top.matched_tokens, self.pd)
        if why is None:
            state = self.registry.get((top.worker, top.dp_rank))
            group = (state.pd_group or "") if state is not None else ""
            candidates = prefill_candidates(eligible, top.instance_id, group, self.pd.same_group)
            why = "no_prefill_instance"
            if candidates:
                request = pb.ScoreRequest()
                request.CopyFrom(decode_request)
                request.role = ""
                del request.candidates[:]
                request.candidates.extend(candidates)
                request.top_k = self.pd.prefill_top_k
                request.request_id = ex.request_id + PREFILL_SUFFIX
                ranked = self._score(request)
                ex.prefill = prefill = RequestLedger(self.client, request.request_id, run_now, QuietEvents())
                prefill.committed_on(ranked.committed_instance_id)
                groups = {s.instance_id: s.pd_group or "" for s in eligible}
                options = [
                    PrefillOption(r.instance_id, r.endpoint, r.est_ttft_ms, groups.get(r.instance_id, ""))
                    for r in ranked.ranked
                ]
                transfer = max(0, prompt_tokens - top.matched_tokens)
                pick = choose_prefill(options, top.instance_id, transfer, self.pd_costs)
                if pick is not None:
                    if pick.option.instance_id != ranked.committed_instance_id:
                        # The transfer made another instance cheaper: commit it there instead.
                        del request.candidates[:]
                        request.candidates.append(pick.option.instance_id)
                        self._score(request)
                    ex.prefiller = pick.option.endpoint
                    why = REMOTE
                else:
                    prefill.release(FINISHED)
        self.pd_metrics.served(why)
        if why == REMOTE:
            return decoded
        whole = pb.ScoreRequest()
        whole.CopyFrom(decode_request)
        whole.role = ""  # ranked and committed as a whole request, among the decode instances
        try:
            whole_ranked: pb.ScoreResponse | None = self._score(whole)
        except BadRequest:
            whole_ranked = None
        if whole_ranked is None or not whole_ranked.ranked:
            if ex.committed:
                self._recommit(ex, ex.committed, decode_request)
            return decoded
        ex.request = whole
        self._committed(ex, whole_ranked.committed_instance_id)
        return whole_ranked

    def _score_request(
        self, spec: PromptSpec, ex: Exchange, candidates: list[str], commit: bool = True, role: str = ""
    ) -> pb.ScoreRequest:
        request = pb.ScoreRequest(
            model=spec.model,
            salt=spec.salt,
            candidates=candidates,
            policy=self.policy,
            commit=commit,
            request_id=ex.request_id,
            role=role,
        )
        apply_prompt(request, spec)
        return request

    def _commit_on(self, ex: Exchange, spec: PromptSpec, instance: str, role: str = "") -> None:
        """Commit the request on ``instance`` (a Score with commit restricted to it replaces any
        entry the request had)."""
        if ex.committed and ex.committed != instance:
            self._drop(ex)
        if ex.committed == instance:
            return
        request = self._score_request(spec, ex, [instance], role=role)
        response = self._score(request)
        if response.committed_instance_id:
            ex.request = request
            self._committed(ex, response.committed_instance_id)

    def _undo(self, ex: Exchange) -> Any:
        """A pick not acted on (held or shed): its commit must not count against the instance."""

        async def undo(_response: pb.ScoreResponse) -> None:
            if ex.committed and ex.ledger is not None:
                await ex.ledger.undo()  # no wake: it goes back to the queue

        return undo

    def _eligible(self, subset: list[str] | None) -> list[InstanceState]:
        """Routable instances that announced where they serve (within the subset hint, if any)."""
        if subset is None:
            states = [s for s in self.registry.all() if s.endpoint]
        else:
            states = [s for endpoint in dict.fromkeys(subset) for s in self.registry.at_endpoint(endpoint)]
        return [s for s in states if not s.stale and not s.is_pool]

    def _by_load(self, eligible: list[InstanceState]) -> list[str]:
        ordered = sorted(eligible, key=lambda s: (s.load.running + s.load.waiting, s.endpoint))
        return list(dict.fromkeys(s.endpoint for s in ordered if s.endpoint))[: 1 + self.fallbacks]

    # -- the response side ---------------------------------------------------------------------

    def _served(self, ex: Exchange, metadata: core_pb2.Metadata) -> None:
        """Envoy says which endpoint served: move the ledger entry if it was a fallback."""
        served = metadata_string(metadata, LB_NAMESPACE, SERVED)
        if not served or ex.request is None or ex.finished:
            return
        at = self.registry.at_endpoint(served)
        if not at or any(st.instance_id == ex.committed for st in at):
            return
        instance = at[0].instance_id
        self.metrics.served_elsewhere.inc()
        self._drop(ex)  # then committed again where it is served (a unified entry)
        self._recommit(ex, instance, ex.request)
        # Committed there only now that the engine answers: its prediction is the index's view after
        # the engine ran the request (a non-streamed answer, or a stream's headers sent with the
        # first token, comes after the prefill, whose KV events the index may have applied), which
        # would count the request's own blocks as its hit: its report is no evidence, not sent.
        ex.served_elsewhere = True

    def _recommit(self, ex: Exchange, instance: str, like: pb.ScoreRequest) -> None:
        """Commit the request to ``instance`` (a unified entry: prefill and decode there)."""
        request = pb.ScoreRequest()
        request.CopyFrom(like)
        request.role = ""
        del request.candidates[:]
        request.candidates.append(instance)
        try:
            response = self._score(request)
        except BadRequest:
            self._committed(ex, "")
            return
        self._committed(ex, response.committed_instance_id)

    def _report(self, ex: Exchange, reader: UsageReader) -> Report | None:
        reader.finish()
        ttft_ms = max(0.0, (ex.first_byte_at - ex.picked_at) * 1000) if ex.picked_at else None
        return report_of(reader.usage, reader.stream, ttft_ms)

    # -- the ledger (kvindex/route/lifecycle.py) ------------------------------------------------

    def _ledger(self, request_id: str) -> RequestLedger:
        return RequestLedger(self.client, request_id, run_now, self)

    def _score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        """A Score through the in-process client, over before this returns (BadRequest as the
        servicer raises it)."""
        response: pb.ScoreResponse = run_sync(self.client.call("Score", request))
        return response

    def _explain(self, request: pb.ScoreRequest) -> tuple[pb.ExplainResponse | None, str]:
        try:
            return self.servicer.explain_request(request), ""
        except BadRequest as exc:
            return None, f"the index cannot rank it: {exc}"

    def _committed(self, ex: Exchange, instance_id: str) -> None:
        if ex.ledger is not None:
            ex.ledger.committed_on(instance_id)

    def _drop(self, ex: Exchange) -> None:
        """The request's entry goes (it is committed elsewhere next): not its end, no wake-up."""
        if ex.ledger is not None:
            run_sync(ex.ledger.undo())

    def released(self, phase: str, found: bool | None, reported: bool, status: str, wake: bool) -> None:
        """LedgerEvents: what became of a report is counted; an instance has room, so held requests
        may fit now (unless the release undid a decision)."""
        if status:
            self.metrics.reports.labels(status).inc()
        if wake:
            self.gate.wake()

    def moved(self, committed: bool) -> None:
        pass  # Envoy's fallbacks are committed again by a Score (_served), not moved

    def _release(self, ex: Exchange, phase: str) -> None:
        if ex.prefill is not None:
            # The decode side answers once the prefill step is over: the prefill entry goes first.
            ex.prefill.release(FINISHED)
        if phase == PREFILL:
            ex.released_prefill = True
        if ex.ledger is not None:
            ex.ledger.release(phase)

    def _finish(self, ex: Exchange) -> None:
        if not ex.finished:
            ex.finished = True
            self._release(ex, FINISHED)
            self.gate.correction.finish(ex.model, id(ex))  # no first token awaited any more
