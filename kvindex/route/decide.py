"""The routing proxy's decision for a request (kvindex/route/proxy.py): the index's Score with the
proxy's settings, or, when the index rejects a request it cannot rank or cannot answer, the client's
fallback hash over the instances it knows; and what to tell the client when there is no decision.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from kvindex.client import (
    DEADLINE,
    ERROR,
    STREAM_BROKEN,
    UNAVAILABLE,
    AsyncKvIndexClient,
    BadRequest,
    Decision,
    IndexUnavailable,
    Target,
    prefix_key,
)
from kvindex.observability.logs import RateLimitedLog
from kvindex.route.gate import Admitted, Shed
from kvindex.route.http import fields_taken
from kvindex.route.metrics import RouteMetrics
from kvindex.route.openai_body import PromptSpec
from kvindex.scoring.admission import Estimate
from kvindex.scoring.objectives import Objective
from kvindex.v1 import kvindex_pb2 as pb

log = structlog.get_logger("kvindex.route")

# Fallback reasons the proxy adds to the client's (unavailable, deadline, stream_broken, error).
REJECTED = "rejected"  # the index refused the request (e.g. no tokenizer for the model)
TEXT_UNSUPPORTED = "text_unsupported"  # a text prompt, and this index API takes only token ids

# How the index says it cannot tokenize a model's text (kvindex/tokenize/registry.py);
# tests/integration/test_route.py checks the proxy recognises it from a real index.
_NO_TOKENIZER = "has no tokenizer configured"

# A Score that may have reached the index and committed although no answer came back: release it.
MAYBE_COMMITTED = frozenset({DEADLINE, STREAM_BROKEN, ERROR})

# Debug: a request with this header (1, true, yes, on) gets its decision explained in the response
# header of the same name (``explanation_header``), by the proxy and the picker; off by default (it
# costs an Explain call).
EXPLAIN_HEADER = "x-kvindex-explain"


def wants_explanation(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def estimates(trial: tuple[Decision | None, str]) -> list[Estimate]:
    """Admission's view of a decision: the index's estimates, or none (a fallback cannot judge)."""
    decision = trial[0]
    if decision is None or decision.source != "index" or decision.response is None:
        return []
    by_id = {r.instance_id: r for r in decision.response.ranked}
    return [Estimate.of(by_id[t.instance_id]) for t in decision.targets if t.instance_id in by_id]


def estimate_of(decision: Decision, instance_id: str) -> float | None:
    """The index's TTFT estimate (ms) for the instance the request went to, if it ranked it."""
    if decision.response is None:
        return None
    for ranked in decision.response.ranked:
        if ranked.instance_id == instance_id:
            return ranked.est_ttft_ms
    return None


class Decider:
    """Decisions for one proxy (its client, settings, metrics and rate-limited log)."""

    def __init__(
        self, client: AsyncKvIndexClient, config: Any, metrics: RouteMetrics, limited_log: RateLimitedLog
    ) -> None:
        """``config``: the proxy's RouteConfig (policy, pick, temperature, top_k, score_timeout)."""
        self.client = client
        self.config = config
        self.metrics = metrics
        self.limited_log = limited_log
        # Models whose text/chat requests the index cannot tokenize: said once per model (a fallback
        # counter alone leaves a whole model routed blind without anyone noticing).
        self._text_hash_only: set[str] = set()

    def _hash_decision(self, spec: PromptSpec, request_id: str, reason: str) -> Decision | None:
        """The client's fallback, asked directly: when the index answered but cannot decide."""
        client = self.client
        known = client.instances.instances(spec.model)
        if client.fallback is None or not known:
            return None
        key = prefix_key(
            token_ids=spec.token_ids,
            prompt=spec.prompt,
            messages=spec.messages,
            block_size=client.instances.block_size(spec.model),
            blocks=client.fallback_blocks,
        )
        chosen = client.fallback.choose(key, known)[: self.config.top_k]
        targets = [Target(k.instance_id, k.endpoint) for k in chosen]
        return Decision(spec.model, targets, source="fallback", reason=reason, request_id=request_id)

    async def decide(
        self, spec: PromptSpec, request_id: str, commit: bool = True, **extra: Any
    ) -> tuple[Decision | None, str]:
        """The decision, or None and why there is none (no instance of the model is known).
        ``commit``: commit the first choice (not for a held request's look); ``extra``: more
        ScoreRequest fields (the decode pick's role and candidates)."""
        started = time.monotonic()
        why = ""
        try:
            fields = self._fields(spec, extra)
            if fields is None:
                decision = self._hash_decision(spec, request_id, TEXT_UNSUPPORTED)
            else:
                decision = await self.client.score(
                    spec.model,
                    top_k=self.config.top_k,
                    commit=commit,
                    request_id=request_id,
                    timeout=self.config.score_timeout,
                    **fields,
                )
        except BadRequest as exc:
            # The body was fine for us, so the engine may well serve it: route without the index.
            decision = self._hash_decision(spec, request_id, REJECTED)
            no_tokenizer = spec.token_ids is None and _NO_TOKENIZER in str(exc)
            if no_tokenizer and decision is not None:
                self._text_routing(spec.model, hash_only=True, why=str(exc))
            elif no_tokenizer:
                # No instance of the model is known at all: the missing tokenizer is not the
                # problem to report (nothing would be routed by the hash either).
                why = f"no instance serves model {spec.model!r}: the index knows none"
            else:
                self.limited_log.warning(
                    ("rejected", spec.model), "index_rejected_request", model=spec.model, error=str(exc)
                )
        except IndexUnavailable as exc:
            decision, why = None, self._index_failed(spec.model, exc)
        finally:
            self.metrics.score_latency.observe(time.monotonic() - started)
        if decision is not None and decision.source == "fallback":
            self.metrics.fallbacks.labels(decision.reason).inc()
            if decision.reason == TEXT_UNSUPPORTED:
                self._text_routing(spec.model, hash_only=True, why="this index's API takes token ids only")
        elif decision is not None and spec.token_ids is None and spec.model in self._text_hash_only:
            self._text_routing(spec.model, hash_only=False)
        if decision is None and not why:
            why = f"no instance serves model {spec.model!r}: the index could not rank it, and none is known"
        return decision, why

    def _fields(self, spec: PromptSpec, extra: dict[str, Any]) -> dict[str, Any] | None:
        """The ScoreRequest fields of ``spec`` with the proxy's settings and ``extra`` (None: a text
        prompt this index's API cannot take)."""
        fields = fields_taken(pb.ScoreRequest, spec)
        if fields is None:
            return None
        if self.config.policy:
            fields["policy"] = self.config.policy
        if self.config.pick:
            fields["pick"] = self.config.pick
        if self.config.temperature is not None:
            fields["temperature"] = self.config.temperature
        fields.update(extra)
        return fields

    async def explain(
        self, spec: PromptSpec, request_id: str, **extra: Any
    ) -> tuple[pb.ExplainResponse | None, str]:
        """The ranking ``decide`` is about to get, explained by the index (its Explain: nothing
        committed, nothing changed; with the request id, a draw is the decision's own), or None and
        why not. For requests that ask (``x-kvindex-explain``), just before each decision."""
        fields = self._fields(spec, extra)
        if fields is None:
            return None, "this index's API takes token ids only: routed by a hash of the prompt"
        fields.update(model=spec.model, top_k=self.config.top_k, request_id=request_id)
        try:
            answer = await self.client.call(
                "Explain", pb.ScoreRequest(**fields), timeout=self.config.score_timeout
            )
        except BadRequest as exc:
            return None, f"the index cannot rank it: {exc}"
        except IndexUnavailable as exc:
            return None, f"the index did not explain it: {exc}"
        return answer, ""

    def _index_failed(self, model: str, exc: IndexUnavailable) -> str:
        """Why a request cannot be routed when the index did not answer and no instance of its
        model is known: for the client, so plain words (no gRPC status strings)."""
        client = self.client
        health = client.health
        if health.reachable is False:
            what = health.describe()
        elif exc.reason == DEADLINE:
            what = (
                f"the index at {client.target} did not answer within {self.config.score_timeout * 1000:g} ms"
            )
        elif exc.reason == UNAVAILABLE:
            what = f"the index at {client.target} is unreachable"
        else:
            status = exc.code.name if exc.code is not None else exc.reason
            what = f"the index at {client.target} could not answer ({status})"
        return (
            f"{what}, and no instance of model {model!r} is known to route to without it (none seen "
            "from the index since this proxy started, none given with --fallback-instance)"
        )

    def _text_routing(self, model: str, hash_only: bool, why: str = "") -> None:
        """Log when a model's text/chat requests start being routed by hash only, and when the
        index routes them again (it was restarted with a tokenizer for the model)."""
        if hash_only and model not in self._text_hash_only:
            self._text_hash_only.add(model)
            log.warning(
                "chat_routing_hash_only",
                model=model,
                why=why,
                effect="text and chat requests for this model are routed by a hash of the prompt, not "
                "by cache and load, until the index can tokenize them",
                fix=f"start kvindex serve with --tokenizer {model}=DIR (docs/tokenize.md), or send token ids",
            )
        elif not hash_only and model in self._text_hash_only:
            self._text_hash_only.discard(model)
            log.info("chat_routing_by_index", model=model)


def explanation_header(
    explanation: pb.ExplainResponse | None, why_not: str, admission: dict[str, Any]
) -> str:
    """The ``x-kvindex-explain`` response header: compact JSON of the index's explanation (the verdict,
    and per ranked instance its state, cost and estimate term by term) and the proxy's admission
    decision (docs/observability.md, "Explaining a decision")."""
    out: dict[str, Any] = {}
    if explanation is None:
        out["error"] = why_not or "no explanation"
    else:
        r = explanation.ranking
        v = explanation.verdict
        out["policy"], out["cost_unit"], out["pick"] = r.policy, r.cost_unit, r.pick
        out["verdict"] = {
            "winner": v.winner,
            "reason": v.reason,
            "runner_up": v.runner_up,
            "margin": round(v.margin, 3),
            "margin_ms": round(v.margin_ms, 3),
            "deciding_term": v.deciding_term,
            "deciding_ms": round(v.deciding_ms, 3),
            "summary": v.summary,
        }
        states = {i.instance_id: i for i in explanation.instances}
        ranked = []
        for x in r.ranked:
            t = x.matched_tokens_by_tier
            more = states.get(x.instance_id)
            ranked.append(
                {
                    "instance": x.instance_id,
                    "state": more.state if more is not None else "",
                    "why_state": more.state_reason if more is not None else "",
                    "cost": round(x.cost, 3),
                    "est_ttft_ms": round(x.est_ttft_ms, 3),
                    "wait_ms": round(x.wait_ms, 3),
                    "prefill_ms": round(x.prefill_ms, 3),
                    "fetch_ms": round(x.fetch_ms, 3),
                    "matched_tokens": {"gpu": t.gpu, "cpu": t.cpu, "disk": t.disk, "shared": t.shared},
                    "running": x.load.running,
                    "waiting": x.load.waiting,
                    "explain": x.explain,
                }
            )
        out["ranked"] = ranked
    out["admission"] = admission
    # A header value: ASCII, one line.
    return json.dumps(out, separators=(",", ":"), ensure_ascii=True)


def admission_said(outcome: Admitted[Any] | Shed, objective: Objective) -> dict[str, Any]:
    """What admission did with a request (kvindex/route/gate.py), as its explanation shows it:
    admitted at once, held (for how long, because) then admitted, or shed (why)."""
    said: dict[str, Any]
    if isinstance(outcome, Shed):
        said = {"decision": "shed", "why": outcome.reason, "held_ms": round(outcome.waited_s * 1000, 1)}
    else:
        said = {
            "decision": "held" if outcome.held else "admitted",
            "why": outcome.reason
            or ("within its objective" if objective.ttft_ms is not None else "no objective"),
            "held_ms": round(outcome.waited_s * 1000, 1),
            "held_because": outcome.held,
            "pick": outcome.pick,  # the rank admission chose (0: the index's first)
        }
    return {**said, "ttft_slo_ms": objective.ttft_ms, "priority": objective.priority}
