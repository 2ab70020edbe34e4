"""``kvindex route --pd``: the proxy's two-step serving of a disaggregated request.

The proxy asks the index for the decode instance (``decode_fields``: role ``decode``, among decode
instances), then ``prepare`` plans the request (kvindex/route/pd.py), runs the prefill step over
HTTP when the plan says so, and hands the proxy the body its decode step sends (the client's plus
``kv_transfer_params``) with the headers that say how it was served. The proxy forwards and relays
the decode step as any request. Ledger: the decode instance holds the request under its id (a
decode entry; a prefill entry when it prefills itself); the prefill instance holds
``<id>:prefill`` from its pick to the end of its answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web

from kvindex.client import BadRequest, Decision, IndexUnavailable, Target
from kvindex.route.http import fields_taken
from kvindex.route.lifecycle import RequestLedger
from kvindex.route.openai_body import PromptSpec
from kvindex.route.pd import (
    CACHED_ON_DECODE,
    NO_ESTIMATE,
    NO_KV_PARAMS,
    NO_PREFILL_INSTANCE,
    PREFILL_FAILED,
    REMOTE,
    SHORT_INPUT,
    PairCosts,
    PdConfig,
    PdMetrics,
    PdPlan,
    PrefillOption,
    choose_prefill,
    decide_local,
    decode_body,
    decode_candidates,
    kv_params_of,
    prefill_body,
    prefill_candidates,
)
from kvindex.scoring.ledger import FINISHED
from kvindex.v1 import kvindex_pb2 as pb

if TYPE_CHECKING:
    from kvindex.route.proxy import RouteProxy

log = structlog.get_logger("kvindex.route.pd")

PD_HEADER = "x-kvindex-pd"  # "remote", or "local;reason=..." (the decode instance prefilled itself)
PREFILL_INSTANCE_HEADER = "x-kvindex-prefill-instance"
PREFILL_SUFFIX = ":prefill"  # the prefill step's ledger id: the request's id + this
# Planned local (not after a failed prefill step): the request is a whole one, and the decode
# instance to prefill it is chosen again by the TTFT ranking (it may hold the prompt's prefix).
WHOLE_BY_TTFT = frozenset({SHORT_INPUT, CACHED_ON_DECODE, NO_PREFILL_INSTANCE})

# A first-byte callback the proxy calls with the decode target that answered.
FirstByte = Callable[[Target], None]


class PdRoute:
    """Disaggregated serving for one :class:`RouteProxy` (its client, engine session, ledger)."""

    def __init__(self, proxy: RouteProxy, config: PdConfig) -> None:
        self.proxy = proxy
        self.config = config
        self.costs = PairCosts(config)
        self.metrics = PdMetrics(proxy.metrics.registry, "kvindex_route")

    def decode_fields(self, model: str) -> dict[str, Any]:
        """Extra Score fields for the decode pick: the decode ranking, among decode instances (all
        instances while none is known yet: the index's answer then names them)."""
        decodes = decode_candidates(self.proxy.client.instances.instances(model))
        return {"role": "decode", "candidates": decodes} if decodes else {"role": "decode"}

    async def prepare(
        self,
        request: web.Request,
        raw: bytes,
        spec: PromptSpec,
        decision: Decision,
        ledger: RequestLedger,
        headers: Any,
    ) -> tuple[bytes, dict[str, str], FirstByte | None, Decision]:
        """(the body to send, response headers to add, first-byte callback, the decision whose
        targets to send it to: the decode pick's, or, when a decode instance prefills the request
        itself, the TTFT ranking of the decode instances). ``ledger``: the request's entry (on the
        decode instance); the prefill step's is ``<id>:prefill``."""
        prefill = self.proxy.ledger(ledger.request_id + PREFILL_SUFFIX, spec)
        plan = await self.plan(spec, decision, prefill)
        if plan.remote:
            assert plan.prefill is not None
            body = json.loads(raw)  # parse_body accepted it: a JSON object
            params, why = await self._prefill(request, body, plan, prefill, headers)
            if params is not None:
                self.metrics.served(REMOTE)
                return (*self._remote(body, params, plan), decision)
            plan.reason, plan.prefill = why, None
        self.metrics.served(plan.reason)
        if plan.reason in WHOLE_BY_TTFT:
            whole = await self._whole(spec, decision, ledger.request_id)
            if whole is not None:
                return raw, {PD_HEADER: plan.header()}, None, whole
        if decision.committed and decision.targets:
            # The decode instance prefills too: its ledger entry becomes a whole request's.
            ledger.move(decision.targets[0].instance_id)
        return raw, {PD_HEADER: plan.header()}, None, decision

    async def _whole(self, spec: PromptSpec, decision: Decision, request_id: str) -> Decision | None:
        """The request served whole by a decode instance: the one the TTFT ranking (prefix held,
        queue) puts first among them, committed as a whole request under the request's id (the
        decode pick's entry is replaced). None when the index cannot rank it now."""
        fields = fields_taken(pb.ScoreRequest, spec)
        if fields is None or decision.response is None:
            return None
        if self.proxy.config.policy:
            fields["policy"] = self.proxy.config.policy
        decodes = decode_candidates(self.proxy.client.instances.instances(spec.model))
        try:
            whole = await self.proxy.client.score(
                spec.model,
                candidates=decodes or None,
                top_k=self.proxy.config.top_k,
                commit=True,
                request_id=request_id,
                timeout=self.proxy.config.score_timeout,
                **fields,
            )
        except (BadRequest, IndexUnavailable) as exc:
            log.debug("pd_whole_score_failed", request_id=request_id, error=str(exc))
            return None
        if whole.source != "index" or not whole.targets:
            return None
        return whole

    def _remote(
        self, body: dict[str, Any], params: dict[str, Any], plan: PdPlan
    ) -> tuple[bytes, dict[str, str], FirstByte]:
        assert plan.prefill is not None
        prefill_id = plan.prefill.option.instance_id
        sent = time.monotonic()

        def first_byte(target: Target) -> None:
            seconds = time.monotonic() - sent
            self.metrics.decode_first_byte_seconds.observe(seconds)
            self.costs.observe(prefill_id, target.instance_id, plan.transfer_tokens, seconds * 1000.0)

        added = {PD_HEADER: plan.header(), PREFILL_INSTANCE_HEADER: prefill_id}
        return decode_body(body, params), added, first_byte

    async def plan(self, spec: PromptSpec, decision: Decision, prefill: RequestLedger) -> PdPlan:
        """Local or two steps, and with which prefill instance (committed as ``prefill``, the
        request's ``<id>:prefill`` entry)."""
        response = decision.response
        if decision.source != "index" or response is None or not response.ranked or not decision.targets:
            return PdPlan(NO_ESTIMATE)
        decode = decision.targets[0]
        prompt_tokens = response.prompt_tokens or (
            len(spec.token_ids) if spec.token_ids is not None else response.total_blocks * response.block_size
        )
        matched = next((r.matched_tokens for r in response.ranked if r.instance_id == decode.instance_id), 0)
        why = decide_local(prompt_tokens, matched, self.config)
        if why is not None:
            return PdPlan(why, prompt_tokens=prompt_tokens)
        client = self.proxy.client
        members = client.instances.instances(spec.model)
        groups = {m.instance_id: m.pd_group for m in members}
        candidates = prefill_candidates(
            members, decode.instance_id, groups.get(decode.instance_id, ""), self.config.same_group
        )
        if not candidates:
            return PdPlan(NO_PREFILL_INSTANCE, prompt_tokens=prompt_tokens)
        fields = fields_taken(pb.ScoreRequest, spec)
        if fields is None:
            return PdPlan(NO_ESTIMATE, prompt_tokens=prompt_tokens)
        if self.proxy.config.policy:
            fields["policy"] = self.proxy.config.policy
        prefill_id = prefill.request_id
        request_id = prefill_id.removesuffix(PREFILL_SUFFIX)
        try:
            ranked = await client.score(
                spec.model,
                candidates=candidates,
                top_k=self.config.prefill_top_k,
                commit=True,
                request_id=prefill_id,
                timeout=self.proxy.config.score_timeout,
                **fields,
            )
        except (BadRequest, IndexUnavailable) as exc:
            log.debug("pd_prefill_score_failed", request_id=request_id, error=str(exc))
            return PdPlan(NO_ESTIMATE, prompt_tokens=prompt_tokens)
        if ranked.source != "index" or ranked.response is None:
            return PdPlan(NO_ESTIMATE, prompt_tokens=prompt_tokens)
        transfer = max(0, prompt_tokens - matched)
        options = [
            PrefillOption(r.instance_id, r.endpoint, r.est_ttft_ms, groups.get(r.instance_id, ""))
            for r in ranked.response.ranked
        ]
        pick = choose_prefill(options, decode.instance_id, transfer, self.costs)
        prefill.active = ranked.committed
        if pick is None:
            prefill.release(FINISHED)
            return PdPlan(NO_PREFILL_INSTANCE, prompt_tokens=prompt_tokens)
        prefill.active = True  # released when the prefill step ends, however it ends
        if pick.option.instance_id != ranked.committed_instance_id:
            # The transfer made another instance cheaper than the index's first: the entry moves
            # there (kept where it is if the index does not take it; released at the step's end).
            instance_id = pick.option.instance_id
            prefill.run(lambda: self._recommit(prefill_id, instance_id, spec))
        return PdPlan(REMOTE, pick, transfer, prompt_tokens)

    async def _recommit(self, prefill_id: str, instance_id: str, spec: PromptSpec) -> None:
        fields = fields_taken(pb.CommitRequest, spec) or {}
        try:
            await self.proxy.client.commit(
                prefill_id, instance_id, spec.model, timeout=self.proxy.config.release_timeout, **fields
            )
        except (BadRequest, IndexUnavailable, TypeError) as exc:
            log.debug("pd_prefill_recommit_failed", request_id=prefill_id, error=str(exc))

    async def _prefill(
        self,
        request: web.Request,
        body: dict[str, Any],
        plan: PdPlan,
        entry: RequestLedger,
        headers: Any,
    ) -> tuple[dict[str, Any] | None, str]:
        """The prefill step: its answer's ``kv_transfer_params``, or None and why there are none
        (``entry``: the step's ``<id>:prefill`` ledger entry, released when it ends)."""
        assert plan.prefill is not None
        request_id = entry.request_id.removesuffix(PREFILL_SUFFIX)
        option = plan.prefill.option
        sent = headers.copy()
        sent.popall("accept-encoding", None)  # the answer is read here, not relayed
        sent["content-type"] = "application/json"
        sent["x-request-id"] = request_id
        url = f"http://{option.endpoint}{request.path_qs}"
        started = time.monotonic()
        status, answer = 0, b""
        try:
            async with self.proxy.session.post(
                url,
                data=prefill_body(body),
                headers=sent,
                timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout),
            ) as resp:
                status = resp.status
                answer = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.proxy.limited_log.warning(
                ("pd_prefill_failed", option.endpoint), "pd_prefill_failed",
                instance=option.instance_id, endpoint=option.endpoint, error=repr(exc), request_id=request_id,
            )  # fmt: skip
            return None, PREFILL_FAILED
        finally:
            # However the step ended (answered, failed, the client gone): the prefill is over.
            entry.release(FINISHED)
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        if status != 200:
            self.proxy.limited_log.warning(
                ("pd_prefill_status", option.endpoint), "pd_prefill_failed",
                instance=option.instance_id, endpoint=option.endpoint, status=status, request_id=request_id,
                answer=answer[:200].decode("utf-8", "replace"),
            )  # fmt: skip
            return None, PREFILL_FAILED
        params = kv_params_of(answer)
        if params is None:
            self.proxy.limited_log.warning(
                ("pd_no_kv_params", option.endpoint), "pd_no_kv_transfer_params",
                instance=option.instance_id, endpoint=option.endpoint, request_id=request_id,
            )  # fmt: skip
            return None, NO_KV_PARAMS
        return params, REMOTE
