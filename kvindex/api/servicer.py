"""gRPC KvIndex service: argument checking, key computation, and response building.

Runs on the same asyncio loop as ingestion, so every call sees a consistent index without locks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from functools import lru_cache
from typing import Any, NoReturn

import grpc
import numpy as np

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import NO_MATCH, InstanceKey, KvBlockIndex
from kvindex.keys import keys_from_le_bytes, model_seed
from kvindex.observability.counters import IngestCounters, Metrics
from kvindex.scoring.base import DECODE_ROLE, PREFILL_ROLE, RouteRequest
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.policies import POLICY_NAMES
from kvindex.scoring.router import Router
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.schema import MAX_MODEL_LEN
from kvindex.wire.subjects import WORKER_ID_RE

MAX_PROMPT_TOKENS = 4_000_000
MAX_BLOCK_KEYS = 1_000_000
MAX_CANDIDATES = 100_000

_seed = lru_cache(maxsize=4096)(model_seed)


class BadRequest(ValueError):
    """An argument error; becomes INVALID_ARGUMENT with this message."""


def _check_candidates(candidates: Sequence[str]) -> list[str] | None:
    if not candidates:
        return None
    if len(candidates) > MAX_CANDIDATES:
        raise BadRequest(f"at most {MAX_CANDIDATES} candidates are allowed, got {len(candidates)}")
    out = list(candidates)
    for cand in out:
        worker, sep, rank = cand.partition("/")
        if not WORKER_ID_RE.fullmatch(worker) or (sep and not (rank.isdigit() and rank.isascii())):
            raise BadRequest(
                f"candidate {cand!r} is not an instance id: expected 'worker' or 'worker/dp_rank' "
                "with worker matching [A-Za-z0-9_-]{1,128}"
            )
    return out


def _tier_blocks(t: Sequence[int]) -> pb.TierBlocks:
    return pb.TierBlocks(gpu=t[0], cpu=t[1], disk=t[2], shared=t[3])


def _prompt_tokens(request: Any, block_size: int, keys: list[int]) -> int:
    """L: the token count when tokens were sent, else the caller's figure, else whole blocks."""
    if len(request.token_ids):
        return len(request.token_ids)
    return request.prompt_tokens or len(keys) * block_size


def _load(state: InstanceState, now: float) -> pb.Load:
    load = state.load
    age = state.status_age(now)
    return pb.Load(
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        kv_usage=load.kv_usage,
        status_age_s=-1.0 if age is None else age,
    )


def _invariant_part(state: InstanceState) -> pb.RankedInstance:
    """The fields of a ranked instance that change only with a heartbeat (status age excluded)."""
    load = state.load
    return pb.RankedInstance(
        instance_id=state.instance_id,
        worker=state.worker,
        dp_rank=state.dp_rank,
        load=pb.Load(
            running=load.running,
            waiting=load.waiting,
            waiting_prefill_tokens=load.waiting_prefill_tokens,
            kv_usage=load.kv_usage,
        ),
    )


class KvIndexServicer(pb_grpc.KvIndexServicer):
    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        counters: IngestCounters,
        metrics: Metrics | None = None,
        router: Router | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.counters = counters
        self.metrics = metrics
        self.router = router or Router(index, registry)
        # instance -> (load it was built from, instance_id, RankedInstance with the invariant fields)
        self._invariant: dict[InstanceKey, tuple[object, str, pb.RankedInstance]] = {}
        self._latency = {
            name: metrics.rpc_latency.labels(name) if metrics else None
            for name in ("Score", "Lookup", "ListInstances", "Stats", "Commit", "Release")
        }

    # -- request decoding ----------------------------------------------------------------------

    def prompt_keys(self, request: Any) -> tuple[int, list[int]]:
        """(block_size, block keys) of the request's prompt; block_size 0 when the model is unknown."""
        model = request.model
        if not model:
            raise BadRequest("model is required")
        if len(model) > MAX_MODEL_LEN:
            raise BadRequest(f"model name is longer than {MAX_MODEL_LEN} characters")
        n_tokens = len(request.token_ids)
        n_keys = len(request.block_keys)
        if n_tokens and n_keys:
            raise BadRequest("set exactly one of token_ids and block_keys, not both")
        if not n_tokens and not n_keys:
            raise BadRequest("one of token_ids or block_keys is required (the prompt is empty)")
        block_size = self.registry.block_size(model) or 0
        if n_keys:
            if request.lora or request.salt:
                raise BadRequest("lora and salt apply to token_ids only; block_keys already include them")
            if n_keys > MAX_BLOCK_KEYS:
                raise BadRequest(f"at most {MAX_BLOCK_KEYS} block_keys are allowed, got {n_keys}")
            return block_size, list(request.block_keys)
        if n_tokens > MAX_PROMPT_TOKENS:
            raise BadRequest(f"at most {MAX_PROMPT_TOKENS} token_ids are allowed, got {n_tokens}")
        if not block_size:
            return 0, []
        # Protobuf repeated fields expose __array__: numpy copies them without a Python int per token.
        raw = np.array(request.token_ids, dtype=np.uint32).tobytes()
        return block_size, keys_from_le_bytes(raw, block_size, _seed(model, request.lora, request.salt))

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BadRequest) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")  # context.abort raises

    def _observe(self, method: str, started: float) -> None:
        hist = self._latency[method]
        if hist is not None:
            hist.observe(time.perf_counter() - started)

    # -- RPCs ----------------------------------------------------------------------------------

    def score_request(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        """One Score, unary or streamed: check the arguments (BadRequest), rank, build the response."""
        started = time.perf_counter()
        block_size, keys = self.prompt_keys(request)
        candidates = _check_candidates(request.candidates)
        policy = request.policy or None
        if policy is not None and policy not in POLICY_NAMES:
            raise BadRequest(f"unknown policy {policy!r}; one of {', '.join(POLICY_NAMES)}")
        role = request.role or PREFILL_ROLE
        if role not in (PREFILL_ROLE, DECODE_ROLE):
            raise BadRequest(f"role must be {PREFILL_ROLE!r} or {DECODE_ROLE!r}, got {role!r}")
        if request.commit and not request.request_id:
            raise BadRequest("commit needs a request_id (Release refers to it)")
        response = self.score(request, block_size, keys, candidates, policy, role)
        self._observe("Score", started)
        return response

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        try:
            return self.score_request(request)
        except BadRequest as exc:
            await self._abort(context, exc)

    async def ScoreStream(
        self, requests: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        async for request in requests:
            try:
                response = self.score_request(request)
            except BadRequest as exc:
                response = pb.ScoreResponse(
                    model=request.model, request_id=request.request_id, error=str(exc)
                )
            yield response

    def score(
        self,
        request: pb.ScoreRequest,
        block_size: int,
        keys: list[int],
        candidates: list[str] | None,
        policy: str | None,
        role: str,
    ) -> pb.ScoreResponse:
        model = request.model
        response = pb.ScoreResponse(
            model=model, block_size=block_size, total_blocks=len(keys), request_id=request.request_id
        )
        chosen = self.router.policies["decode"] if role == DECODE_ROLE else self.router.policy(policy)
        response.policy = chosen.name
        response.cost_unit = chosen.cost_unit
        if not block_size:
            return response  # unknown model: empty ranking, not an error
        prompt = _prompt_tokens(request, block_size, keys)
        route = RouteRequest(model, keys, prompt, block_size, request.request_id, role)
        result = self.router.score(route, candidates, policy, commit=request.commit, top_k=request.top_k)
        if result.committed is not None:
            response.committed_instance_id = result.committed.instance_id
        choices = result.choices[: request.top_k] if request.top_k else result.choices
        now = self.registry.clock()
        explain = request.explain
        add = response.ranked.add
        invariant = self._invariant
        if len(invariant) > 4 * len(choices) + 1024:  # instances come and go: forget old entries
            invariant.clear()
        for choice in choices:
            c = choice.candidate
            state = c.state
            # Copying a cached message (identity and the last heartbeat's load) costs a third of
            # building it from keyword arguments; only the per-request fields are set one by one.
            cached = invariant.get(state.key)
            if cached is None or cached[0] is not state.load or cached[1] != state.instance_id:
                cached = invariant[state.key] = (state.load, state.instance_id, _invariant_part(state))
            r = add()
            r.CopyFrom(cached[2])
            age = state.status_age(now)
            r.load.status_age_s = -1.0 if age is None else age
            r.cost = choice.cost
            r.matched_blocks = c.blocks
            t = c.match.tiers
            m = r.matched
            m.gpu, m.cpu, m.disk, m.shared = t[0], t[1], t[2], t[3]
            r.matched_tokens = c.hit_tokens
            r.est_ttft_ms = c.est_ttft_ms
            r.wait_ms = c.wait_ms
            r.prefill_ms = c.prefill_ms
            r.fetch_ms = c.fetch_ms
            t = c.tokens_by_tier
            m = r.matched_tokens_by_tier
            m.gpu, m.cpu, m.disk, m.shared = t[0], t[1], t[2], t[3]
            if explain:
                r.explain = choice.reason or "ranked"
        return response

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        started = time.perf_counter()
        try:
            if not request.request_id:
                raise BadRequest("request_id is required")
            worker, sep, rank = request.instance_id.partition("/")
            if not (sep and WORKER_ID_RE.fullmatch(worker) and rank.isdigit() and rank.isascii()):
                raise BadRequest(f"instance_id {request.instance_id!r} must be 'worker/dp_rank'")
            block_size, keys = self.prompt_keys(request)
        except BadRequest as exc:
            await self._abort(context, exc)
        ok = False
        if block_size:
            route = RouteRequest(
                request.model, keys, _prompt_tokens(request, block_size, keys), block_size, request.request_id
            )
            ok = self.router.commit(route, (worker, int(rank)))
        self._observe("Commit", started)
        return pb.CommitResponse(committed=ok)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        started = time.perf_counter()
        if not request.request_id or request.phase not in (PREFILL, FINISHED):
            await self._abort(
                context, BadRequest(f"request_id is required and phase must be {PREFILL!r} or {FINISHED!r}")
            )
        found = self.router.release(request.request_id, request.phase)
        self._observe("Release", started)
        return pb.ReleaseResponse(found=found)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        started = time.perf_counter()
        try:
            block_size, keys = self.prompt_keys(request)
            candidates = _check_candidates(request.candidates)
        except BadRequest as exc:
            await self._abort(context, exc)
        response = pb.LookupResponse(
            model=request.model, block_size=block_size, total_blocks=len(keys), block_keys=keys
        )
        states = self.registry.of_model(request.model)
        if candidates is not None:
            wanted = set(candidates)
            states = [s for s in states if s.worker in wanted or s.instance_id in wanted]
        matches = self.index.match(request.model, keys, [s.key for s in states]) if keys else {}
        ordered = sorted(states, key=lambda s: (-matches.get(s.key, NO_MATCH).length, s.key))
        for state in ordered:
            match = matches.get(state.key, NO_MATCH)
            response.matches.add(
                instance_id=state.instance_id,
                worker=state.worker,
                dp_rank=state.dp_rank,
                matched_blocks=match.length,
                matched=_tier_blocks(match.tiers),
            )
        self._observe("Lookup", started)
        return response

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        started = time.perf_counter()
        states = self.registry.of_model(request.model) if request.model else self.registry.all()
        now = self.registry.clock()
        response = pb.ListInstancesResponse()
        for state in sorted(states, key=lambda s: (s.model, s.key)):
            cap = state.capacity
            response.instances.add(
                instance_id=state.instance_id,
                worker=state.worker,
                dp_rank=state.dp_rank,
                model=state.model,
                block_size=state.block_size,
                epoch=state.epoch,
                last_seq=state.last_seq,
                load=_load(state, now),
                blocks=_tier_blocks(self.index.block_counts(state.key)),
                capacity=_tier_blocks([cap.get(t, 0) for t in range(4)]),
                batches=state.batches,
                gaps=state.gaps,
                missing_batches=state.missing_batches,
                restarts=state.restarts,
                pool=state.is_pool,
                stale=state.stale,
                sync=state.sync,
            )
        self._observe("ListInstances", started)
        return response

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        started = time.perf_counter()
        s = self.index.stats()
        c = self.counters
        response = pb.StatsResponse(
            models=s.models,
            instances=s.instances,
            distinct_blocks=_tier_blocks(s.distinct_blocks),
            entries=_tier_blocks(s.entries),
            batches_received=c.batches_received,
            batches_applied=c.batches_applied,
            batches_duplicate=c.duplicates,
            batches_stale_epoch=c.stale_epochs,
            gaps=c.gaps,
            missing_batches=c.missing_batches,
            restarts=c.restarts,
            status_received=c.status_received,
            events_stored=c.events_applied[0],
            events_removed=c.events_applied[1],
            events_cleared=c.events_applied[2],
            rejects_total=c.rejects_total,
            rejects_by_reason=dict(c.rejects),
            replays_requested=c.replays_requested,
            replays_ok=c.replays_ok,
            replays_failed=dict(c.replays_failed),
            snapshots_requested=dict(c.snapshots_requested),
            snapshots_applied=c.snapshots_applied,
            reconciled_blocks_added=c.snapshot_blocks_added,
            reconciled_blocks_removed=c.snapshot_blocks_removed,
            drift_detected=c.drift_detected,
            repairs_converged=c.repairs_converged,
            convergence_seconds_max=c.convergence_seconds_max,
            instances_stale=sum(1 for st in self.registry.all() if st.stale),
            index_bytes=s.nbytes,
        )
        self._observe("Stats", started)
        return response
