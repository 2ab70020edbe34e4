"""gRPC KvIndex service: argument checking, key computation, and response building.

Runs on the same asyncio loop as ingestion, so every call sees a consistent index without locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple, NoReturn

import grpc
import numpy as np

from kvindex.api.errors import BadRequest
from kvindex.api.handlers import Malformed
from kvindex.api.listing import InstanceListing, add_rows, check_view, decode_token, encode_token
from kvindex.api.lookup import LookupEncoder
from kvindex.api.methods import (
    COMMIT_METHOD,
    EXPLAIN,
    LABELS,
    LIST_INSTANCES,
    LOOKUP,
    RELEASE_METHOD,
    SCORE,
    STATS,
    Method,
)
from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import NO_MATCH, GroupedIndex, KvBlockIndex
from kvindex.index.hybrid import hit_limit
from kvindex.instance import InstanceKey
from kvindex.keys import keys_from_le_bytes, model_seed
from kvindex.observability.counters import IngestCounters, Metrics
from kvindex.scoring.base import DECODE_ROLE, PREFILL_ROLE, RouteRequest, prompt_length
from kvindex.scoring.explain import verdict
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.outcomes import INVALID, Report
from kvindex.scoring.pick import PickOptions
from kvindex.scoring.policies import POLICY_NAMES
from kvindex.scoring.ranker import Ranker, ScoreResult
from kvindex.tokenize import ChatOptions, TokenizeError, Tokenizers, bounded_json
from kvindex.tokenize.bounded_json import TooDeep
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.groups import describe as describe_groups
from kvindex.wire.schema import MAX_MODEL_LEN, U64_MAX
from kvindex.wire.subjects import WORKER_ID_RE

MAX_PROMPT_TOKENS = 4_000_000
MAX_BLOCK_KEYS = 1_000_000
MAX_CANDIDATES = 100_000
# A text prompt this long (~16 K tokens) is tokenized in a worker thread before its call is answered
# on the event loop (KvIndexServicer.pretokenize); shorter ones cost the loop a few ms at most.
OFFLOAD_CHARS = 1 << 16

_seed = lru_cache(maxsize=4096)(model_seed)

U32_MAX = (1 << 32) - 1


def _u64(n: int) -> int:
    """A count as a uint64 field takes it: saturated. Counters and sums a worker can drive (its
    seqs, its block size times a prompt's blocks) must never make a reply fail to build: protobuf
    raises on a value out of range, and the call would fail for every caller from then on."""
    return n if n <= U64_MAX else U64_MAX


def _u32(n: int) -> int:
    return n if n <= U32_MAX else U32_MAX


def _u64_map(counts: Mapping[str, int]) -> dict[str, int]:
    return {name: _u64(n) for name, n in counts.items()}


class Prompt(NamedTuple):
    """A request's prompt resolved: block keys, length in tokens and, for text, the token ids."""

    block_size: int  # 0 when the model is unknown
    keys: list[int]
    tokens: int  # L: the token count (given, tokenized, or whole blocks)
    token_ids: np.ndarray | None = None  # computed from prompt or messages


# The four prompt forms, in the order error messages name them.
PROMPT_FORMS = ("token_ids", "block_keys", "prompt", "messages")
# PromptOptions fields that only a chat uses.
CHAT_OPTIONS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
    "documents",
)


def _json_field(options: Any, name: str, kind: type) -> Any:
    raw = getattr(options, name)
    if not raw:
        return None
    try:
        value = bounded_json.loads(raw, f"prompt_options.{name}")
    except TooDeep as exc:
        raise BadRequest(str(exc)) from None
    except ValueError as exc:
        raise BadRequest(f"prompt_options.{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise BadRequest(f"prompt_options.{name} must be a JSON {'object' if kind is dict else 'list'}")
    return value


def chat_options(options: Any) -> ChatOptions:
    """PromptOptions -> ChatOptions with vLLM's chat defaults for what is not set."""
    return ChatOptions(
        add_generation_prompt=(
            options.add_generation_prompt if options.HasField("add_generation_prompt") else True
        ),
        continue_final_message=options.continue_final_message,
        chat_template_kwargs=_json_field(options, "chat_template_kwargs", dict),
        tools=_json_field(options, "tools", list),
        documents=_json_field(options, "documents", list),
        add_special_tokens=options.HasField("add_special_tokens") and options.add_special_tokens,
    )


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


def _load(state: InstanceState, now: float) -> pb.Load:
    load = state.load
    age = state.heartbeat_age(now)
    return pb.Load(
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        kv_usage=load.kv_usage,
        status_age_s=-1.0 if age is None else age,
    )


def _invariant_part(state: InstanceState) -> pb.RankedInstance:
    """The fields of a ranked instance that change only with a heartbeat (heartbeat age excluded)."""
    load = state.load
    return pb.RankedInstance(
        instance_id=state.instance_id,
        worker=state.worker,
        dp_rank=state.dp_rank,
        endpoint=state.endpoint or "",
        load=pb.Load(
            running=load.running,
            waiting=load.waiting,
            waiting_prefill_tokens=load.waiting_prefill_tokens,
            kv_usage=load.kv_usage,
        ),
    )


def release_report(request: pb.ReleaseRequest) -> Report | None:
    """The outcome report a Release carries, None without one."""
    has = request.HasField
    if not (has("cached_tokens") or has("ttft_ms") or has("prompt_tokens")):
        return None
    return Report(
        cached_tokens=request.cached_tokens if has("cached_tokens") else None,
        ttft_ms=request.ttft_ms if has("ttft_ms") else None,
        prompt_tokens=request.prompt_tokens if has("prompt_tokens") else None,
    )


class KvIndexServicer(pb_grpc.KvIndexServicer):
    def __init__(
        self,
        index: KvBlockIndex,
        registry: Registry,
        counters: IngestCounters,
        metrics: Metrics | None,
        ranker: Ranker,
        tokenizers: Tokenizers,
    ) -> None:
        """``metrics`` None: calls are not timed (a replay, tests)."""
        self.index = index
        self.registry = registry
        self.counters = counters
        self.metrics = metrics
        self.ranker = ranker
        self.tokenizers = tokenizers
        # instance -> (load it was built from, instance_id, endpoint, RankedInstance with the
        # invariant fields)
        self._invariant: dict[InstanceKey, tuple[object, str, str | None, pb.RankedInstance]] = {}
        # One histogram child per label of the method table (kvindex/api/methods.py).
        self._latency = {label: metrics.rpc_latency.labels(label) if metrics else None for label in LABELS}
        # Lookup answers encoded from the index's grouped answer (kvindex/api/lookup.py).
        self._lookups = LookupEncoder(registry, index) if isinstance(index, GroupedIndex) else None
        self._listing = InstanceListing(registry)

    # -- request decoding ----------------------------------------------------------------------

    def prompt_keys(self, request: Any) -> tuple[int, list[int]]:
        """(block_size, block keys) of the request's prompt; block_size 0 when the model is unknown."""
        prompt = self.resolve(request)
        return prompt.block_size, prompt.keys

    def resolve(self, request: Any) -> Prompt:
        """The request's prompt as block keys and a token count, from whichever form it was given in."""
        model = request.model
        if not model:
            raise BadRequest("model is required")
        if len(model) > MAX_MODEL_LEN:
            raise BadRequest(f"model name is longer than {MAX_MODEL_LEN} characters")
        n_tokens = len(request.token_ids)
        n_keys = len(request.block_keys)
        text = request.prompt
        chat = request.messages
        if bool(n_tokens) + bool(n_keys) + bool(text) + bool(chat) != 1:
            given = [f for f, v in zip(PROMPT_FORMS, (n_tokens, n_keys, text, chat), strict=True) if v]
            if not given:
                raise BadRequest(
                    "one of token_ids, block_keys, prompt or messages is required (the prompt is empty)"
                )
            raise BadRequest(
                f"set exactly one of token_ids, block_keys, prompt and messages; got {' and '.join(given)}"
            )
        block_size = self.registry.block_size(model) or 0
        if n_keys:
            if request.lora or request.salt:
                raise BadRequest("lora and salt apply to token_ids only; block_keys already include them")
            if n_keys > MAX_BLOCK_KEYS:
                raise BadRequest(f"at most {MAX_BLOCK_KEYS} block_keys are allowed, got {n_keys}")
            if request.HasField("prompt_options"):
                raise BadRequest("prompt_options apply to prompt or messages only")
            keys = list(request.block_keys)
            # LookupRequest has no prompt_tokens: whole blocks then.
            stated: int = request.prompt_tokens if hasattr(request, "prompt_tokens") else 0
            return Prompt(block_size, keys, stated or len(keys) * block_size)
        if n_tokens:
            if n_tokens > MAX_PROMPT_TOKENS:
                raise BadRequest(f"at most {MAX_PROMPT_TOKENS} token_ids are allowed, got {n_tokens}")
            if request.HasField("prompt_options"):
                raise BadRequest("prompt_options apply to prompt or messages only")
            if not block_size:
                return Prompt(0, [], n_tokens)
            # Protobuf repeated fields expose __array__: numpy copies them without a Python int per token.
            raw = np.array(request.token_ids, dtype=np.uint32).tobytes()
            keys = keys_from_le_bytes(raw, block_size, _seed(model, request.lora, request.salt))
            return Prompt(block_size, keys, n_tokens)
        ids = self._tokenize(request)
        if len(ids) > MAX_PROMPT_TOKENS:
            raise BadRequest(f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS} are allowed")
        if not block_size:
            return Prompt(0, [], len(ids), ids)
        keys = keys_from_le_bytes(ids.tobytes(), block_size, _seed(model, request.lora, request.salt))
        return Prompt(block_size, keys, len(ids), ids)

    async def pretokenize(self, request: Any) -> None:
        """A long text prompt (``OFFLOAD_CHARS`` or more) tokenized first in a worker thread, into
        the tokenizer's cache, so that the resolve which follows on the event loop finds it there:
        the tokenizers library encodes without the GIL in its batch calls (which the cache uses), so
        the loop keeps serving other calls meanwhile (a cold 256 K-token chat held it 0.15-0.6 s,
        now ~10 ms at a time). Errors are left for that resolve to report."""
        if len(request.prompt) + len(request.messages) < OFFLOAD_CHARS:
            return
        with contextlib.suppress(BadRequest):
            await asyncio.to_thread(self._tokenize, request)

    def _tokenize(self, request: Any) -> np.ndarray:
        """prompt or messages -> token ids, as vLLM's /v1/completions or /v1/chat/completions would."""
        options = request.prompt_options
        try:
            if request.prompt:
                for name in CHAT_OPTIONS:
                    # add_generation_prompt has presence (false is a setting); the rest: set if non-empty.
                    given = (
                        options.HasField(name) if name == "add_generation_prompt" else getattr(options, name)
                    )
                    if given:
                        raise BadRequest(f"prompt_options.{name} applies to messages only, not to a prompt")
                special = options.add_special_tokens if options.HasField("add_special_tokens") else True
                ids = self.tokenizers.encode_prompt(request.model, request.prompt, special)
            else:
                try:
                    messages = bounded_json.loads(request.messages, "messages")
                except TooDeep as exc:
                    raise BadRequest(str(exc)) from None
                except ValueError as exc:
                    raise BadRequest(f"messages is not valid JSON: {exc}") from exc
                ids = self.tokenizers.encode_chat_options(request.model, messages, chat_options(options))
        except TokenizeError as exc:
            raise BadRequest(str(exc)) from exc
        return ids

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BadRequest) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")  # context.abort raises

    def _done(self, method: Method, request: Any, response: Any, started: float) -> None:
        """A call answered (``started``: its perf_counter at the start): timed under the method's
        label. The recording servicer (kvindex/capture/recorder.py) also records the calls that
        changed routing state here."""
        hist = self._latency[method.label]
        if hist is not None:
            hist.observe(time.perf_counter() - started)

    # -- RPCs ----------------------------------------------------------------------------------

    def score_args(
        self, request: pb.ScoreRequest
    ) -> tuple[Prompt, list[str] | None, str | None, str, PickOptions]:
        """A Score's (or Explain's) arguments checked (BadRequest): the prompt, candidates, policy,
        role and pick."""
        prompt = self.resolve(request)
        candidates = _check_candidates(request.candidates)
        policy = request.policy or None
        if policy is not None and policy not in POLICY_NAMES:
            raise BadRequest(f"unknown policy {policy!r}; one of {', '.join(POLICY_NAMES)}")
        role = request.role or PREFILL_ROLE
        if role not in (PREFILL_ROLE, DECODE_ROLE):
            raise BadRequest(f"role must be {PREFILL_ROLE!r} or {DECODE_ROLE!r}, got {role!r}")
        if request.commit and not request.request_id:
            raise BadRequest("commit needs a request_id (Release refers to it)")
        return prompt, candidates, policy, role, self.pick_options(request)

    def checked_score(self, request: pb.ScoreRequest, **extra: Any) -> pb.ScoreResponse:
        """``score`` with the request's arguments checked (BadRequest) and resolved; ``extra``:
        ``score``'s ``quiet`` and ``results`` (Explain)."""
        prompt, candidates, policy, role, pick = self.score_args(request)
        return self.score(
            request,
            prompt.block_size,
            prompt.keys,
            candidates,
            policy,
            role,
            prompt_tokens=prompt.tokens,
            pick=pick,
            **extra,
        )

    def score_request(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        """One Score, unary or streamed: check the arguments (BadRequest), rank, build the response."""
        started = time.perf_counter()
        response = self.checked_score(request)
        if request.commit and response.committed_instance_id and self.metrics is not None:
            self.metrics.decisions[response.policy] += 1
        self._done(SCORE, request, response, started)
        return response

    def pick_options(self, request: pb.ScoreRequest) -> PickOptions:
        """The request's pick over the router's defaults (BadRequest when they make no sense)."""
        try:
            return self.ranker.picker.options(
                request.pick or None,
                request.temperature if request.HasField("temperature") else None,
                request.pick_seed if request.HasField("pick_seed") else None,
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc

    def explain_request(self, request: pb.ScoreRequest, quiet: bool = True) -> pb.ExplainResponse:
        """One Explain: the ranking a Score of ``request`` would answer (with explain, never
        committed), each ranked instance's state and the rest of its estimate, and the verdict
        (kvindex/scoring/explain.py). ``quiet``: the router is left as it was (Ranker.explain);
        False ranks as a Score does (a replay re-running a recorded Score). BadRequest as Score."""
        started = time.perf_counter()
        if request.commit:
            raise BadRequest(
                "Explain never commits: commit must be false (Score with commit routes a request)"
            )
        if not request.explain:
            explained = pb.ScoreRequest()
            explained.CopyFrom(request)
            explained.explain = True
            request = explained
        results: list[ScoreResult] = []
        ranking = self.checked_score(request, quiet=quiet, results=results)
        response = pb.ExplainResponse(ranking=ranking)
        ranker = self.ranker
        for choice in results[0].choices[: len(ranking.ranked)] if results else ():
            c = choice.candidate
            state = c.state
            name, why = ranker.state_of(state)
            response.instances.add(
                instance_id=state.instance_id,
                state=name,
                state_reason=why,
                credit=ranker.config.outcomes.degraded_credit if state.key in ranker.degraded else 1.0,
                miss_tokens=_u32(c.miss_tokens),
                queued_tokens=c.queued_tokens,
                routed_tokens=_u32(c.routed_tokens),
                in_flight=_u32(c.inflight),
                prefill_source=ranker.calibrator.status(state.model, state.instance_id).source,
            )
        v = verdict(ranking.ranked, ranking.cost_unit, ranking.picked_rank)
        response.verdict.CopyFrom(
            pb.Verdict(
                winner=v.winner,
                reason=v.reason,
                runner_up=v.runner_up,
                margin=v.margin,
                margin_ms=v.margin_ms,
                deciding_term=v.deciding_term,
                deciding_ms=v.deciding_ms,
                summary=v.summary,
            )
        )
        self._done(EXPLAIN, request, response, started)
        return response

    async def Explain(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        await self.pretokenize(request)
        try:
            return self.explain_request(request)
        except BadRequest as exc:
            await self._abort(context, exc)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        if request.prompt or request.messages:
            await self.pretokenize(request)
        try:
            return self.score_request(request)
        except BadRequest as exc:
            await self._abort(context, exc)

    async def ScoreStream(
        self, requests: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        async for request in requests:
            if type(request) is Malformed:  # bytes that are not a ScoreRequest (kvindex/api/handlers.py)
                yield pb.ScoreResponse(error=request.message)
                continue
            if request.prompt or request.messages:
                await self.pretokenize(request)  # (the stream's later requests wait: its order)
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
        prompt_tokens: int | None = None,
        pick: PickOptions | None = None,
        quiet: bool = False,
        results: list[ScoreResult] | None = None,
    ) -> pb.ScoreResponse:
        """Rank and build the response. A hot loop (every Score, a message per ranked instance):
        kept in one function, cached parts copied rather than rebuilt. ``quiet``: rank without
        changing the router (Ranker.explain; no commit); ``results`` receives the ranking's
        ScoreResult (Explain reads the candidates)."""
        model = request.model
        prompt = prompt_length(request, block_size, keys) if prompt_tokens is None else prompt_tokens
        response = pb.ScoreResponse(
            model=model,
            block_size=block_size,
            total_blocks=len(keys),
            request_id=request.request_id,
            prompt_tokens=_u32(prompt),  # (block keys x a worker's block size may pass 2**32)
        )
        chosen = self.ranker.policies["decode"] if role == DECODE_ROLE else self.ranker.policy(policy)
        response.policy = chosen.name
        response.cost_unit = chosen.cost_unit
        options = pick or self.ranker.picker.default
        response.pick = options.mode
        response.temperature = options.temperature
        if not block_size:
            return response  # unknown model: empty ranking, not an error
        route = RouteRequest(model, keys, prompt, block_size, request.request_id, role)
        if quiet:
            result = self.ranker.explain(route, candidates, policy, top_k=request.top_k, pick=pick)
        else:
            result = self.ranker.score(
                route, candidates, policy, commit=request.commit, top_k=request.top_k, pick=pick
            )
        if results is not None:
            results.append(result)
        if result.committed is not None:
            response.committed_instance_id = result.committed.instance_id
        choices = result.choices[: request.top_k] if request.top_k else result.choices
        drawn = result.pick
        if drawn is not None and drawn.drawn:
            response.pick_seed = drawn.seed
            response.pick_draw = drawn.draw
            response.picked_rank = drawn.rank
        probabilities = drawn.probabilities if drawn is not None and drawn.drawn else None
        now = self.registry.clock()
        explain = request.explain
        small = prompt <= U32_MAX  # the usual case: no instance's hit (at most the prompt) to saturate
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
            if (
                cached is None
                or cached[0] is not state.load
                or cached[1] != state.instance_id
                or cached[2] != state.endpoint
            ):
                cached = invariant[state.key] = (
                    state.load,
                    state.instance_id,
                    state.endpoint,
                    _invariant_part(state),
                )
            r = add()
            r.CopyFrom(cached[3])
            age = state.heartbeat_age(now)
            r.load.status_age_s = -1.0 if age is None else age
            r.cost = choice.cost
            r.matched_blocks = c.blocks
            t = c.match.tiers
            m = r.matched
            m.gpu, m.cpu, m.disk, m.shared = t[0], t[1], t[2], t[3]
            r.matched_tokens = c.hit_tokens if small else _u32(c.hit_tokens)
            r.est_ttft_ms = c.est_ttft_ms
            r.wait_ms = c.wait_ms
            r.prefill_ms = c.prefill_ms
            r.fetch_ms = c.fetch_ms
            t = c.tokens_by_tier
            m = r.matched_tokens_by_tier
            m.gpu, m.cpu, m.disk, m.shared = t[0], t[1], t[2], t[3]
            if explain:
                r.explain = choice.reason or "ranked"
        if probabilities is not None:
            for r, p in zip(response.ranked, probabilities, strict=False):
                r.pick_probability = p
        return response

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        started = time.perf_counter()
        try:
            if not request.request_id:
                raise BadRequest("request_id is required")
            worker, sep, rank = request.instance_id.partition("/")
            if not (sep and WORKER_ID_RE.fullmatch(worker) and rank.isdigit() and rank.isascii()):
                raise BadRequest(f"instance_id {request.instance_id!r} must be 'worker/dp_rank'")
            prompt = self.resolve(request)
        except BadRequest as exc:
            await self._abort(context, exc)
        ok = False
        if prompt.block_size:
            route = RouteRequest(
                request.model, prompt.keys, prompt.tokens, prompt.block_size, request.request_id
            )
            ok = self.ranker.commit(route, (worker, int(rank)))
        response = pb.CommitResponse(committed=ok)
        self._done(COMMIT_METHOD, request, response, started)
        return response

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        started = time.perf_counter()
        if not request.request_id or request.phase not in (PREFILL, FINISHED):
            await self._abort(
                context, BadRequest(f"request_id is required and phase must be {PREFILL!r} or {FINISHED!r}")
            )
        report = release_report(request)
        if report is not None and (why := report.malformed()) is not None:
            self.ranker.outcomes.ignore(INVALID)
            await self._abort(context, BadRequest(why))
        found, status = self.ranker.release_reported(request.request_id, request.phase, report)
        response = pb.ReleaseResponse(found=found, report=status)
        self._done(RELEASE_METHOD, request, response, started)
        return response

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse | bytes:
        """Every instance of the model with its match, best first. Without candidates, answered with
        the response's bytes (gRPC sends them as they are; an in-process caller parses them with
        ``pb.LookupResponse.FromString``): kvindex/api/lookup.py."""
        started = time.perf_counter()
        await self.pretokenize(request)
        try:
            prompt = self.resolve(request)
            candidates = _check_candidates(request.candidates)
        except BadRequest as exc:
            await self._abort(context, exc)
        block_size, keys = prompt.block_size, prompt.keys
        # Token ids known: the engine's last-token rule applies (a hybrid model's windows end there);
        # block keys alone: what the instances hold of them.
        limit = hit_limit(prompt.tokens) if request.token_ids or prompt.token_ids is not None else None
        if candidates is None and self._lookups is not None:
            encoded = self._lookups.encode(
                pb.LookupResponse(
                    model=request.model, block_size=block_size, total_blocks=len(keys), block_keys=keys
                ),
                pb.LookupResponse(
                    token_ids=None if prompt.token_ids is None else prompt.token_ids.tolist(),
                    prompt_tokens=_u32(prompt.tokens),
                ),
                keys,
                limit,
                request.max_instances,
            )
            self._done(LOOKUP, request, encoded, started)
            return encoded
        response = pb.LookupResponse(
            model=request.model,
            block_size=block_size,
            total_blocks=len(keys),
            block_keys=keys,
            prompt_tokens=_u32(prompt.tokens),
        )
        if prompt.token_ids is not None:
            response.token_ids.extend(prompt.token_ids.tolist())
        states = self.registry.of_model(request.model)
        if candidates is not None:
            wanted = set(candidates)
            states = [s for s in states if s.worker in wanted or s.instance_id in wanted]
        matches = self.index.match(request.model, keys, [s.key for s in states], limit) if keys else {}
        ordered = sorted(states, key=lambda s: (-matches.get(s.key, NO_MATCH).length, s.key))
        for state in ordered[: request.max_instances or None]:
            match = matches.get(state.key, NO_MATCH)
            response.matches.add(
                instance_id=state.instance_id,
                worker=state.worker,
                dp_rank=state.dp_rank,
                matched_blocks=match.length,
                matched=_tier_blocks(match.tiers),
            )
        self._done(LOOKUP, request, response, started)
        return response

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        """The instances (of a model, or all), in (model, key) order: all of them, or a page
        (kvindex/api/listing.py), in the full view or the brief one."""
        started = time.perf_counter()
        try:
            view = check_view(request.view)
            after = decode_token(request.page_token, request.model)
        except BadRequest as exc:
            await self._abort(context, exc)
        states, last = self._listing.page(request.model, after, request.page_size)
        response = pb.ListInstancesResponse(next_page_token=encode_token(last) if last is not None else "")
        now = self.registry.clock()
        add_rows(response, states, view, lambda r, state: self._full_row(r, state, now))
        self._done(LIST_INSTANCES, request, response, started)
        return response

    def _full_row(self, response: pb.ListInstancesResponse, state: InstanceState, now: float) -> None:
        calibrator = self.ranker.calibrator
        cap = state.capacity
        fit = calibrator.status(state.model, state.instance_id)
        response.instances.add(
            instance_id=state.instance_id,
            worker=state.worker,
            dp_rank=state.dp_rank,
            model=state.model,
            block_size=state.block_size,
            epoch=_u64(state.epoch),
            last_seq=_u64(state.last_seq),
            load=_load(state, now),
            blocks=_tier_blocks(self.index.block_counts(state.key)),
            capacity=_tier_blocks([cap.get(t, 0) for t in range(4)]),
            batches=_u64(state.batches),
            gaps=_u64(state.gaps),
            missing_batches=_u64(state.missing_batches),
            restarts=_u64(state.restarts),
            pool=state.is_pool,
            stale=state.stale,
            sync=state.repair.sync,
            endpoint=state.endpoint or "",
            approximate=state.approximate,
            role=state.role,
            pd_group=state.pd_group or "",
            kv_groups=describe_groups(state.groups_announced) if state.groups_announced else "",
            prefill=pb.PrefillFit(
                source=fit.source,
                a_ms=fit.model.a_ms,
                b_ms_per_token=fit.model.b_ms_per_token,
                c_ms_per_token2=fit.model.c_ms_per_token2,
                samples=fit.samples,
                error=fit.error or 0.0,
                has_error=fit.error is not None,
            ),
        )
        info = response.instances[-1]
        info.state, info.state_reason = self.ranker.state_of(state)
        counts = self.ranker.outcomes.instances.get(state.key)
        if counts is not None:
            by = counts.by_outcome
            info.outcomes_exact, info.outcomes_over = by["exact"], by["over"]
            info.outcomes_under = by["under"]

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        started = time.perf_counter()
        s = self.index.stats()
        c = self.counters
        response = pb.StatsResponse(
            models=s.models,
            instances=s.instances,
            distinct_blocks=_tier_blocks(s.distinct_blocks),
            entries=_tier_blocks(s.entries),
            batches_received=_u64(c.batches_received),
            batches_applied=_u64(c.batches_applied),
            batches_duplicate=_u64(c.duplicates),
            batches_stale_epoch=_u64(c.stale_epochs),
            gaps=_u64(c.gaps),
            missing_batches=_u64(c.missing_batches),
            restarts=_u64(c.restarts),
            status_received=_u64(c.heartbeats_received),
            events_stored=_u64(c.events_applied[0]),
            events_removed=_u64(c.events_applied[1]),
            events_cleared=_u64(c.events_applied[2]),
            rejects_total=_u64(c.rejects_total),
            rejects_by_reason=_u64_map(c.rejects),
            replays_requested=_u64(c.replays_requested),
            replays_ok=_u64(c.replays_ok),
            replays_failed=_u64_map(c.replays_failed),
            snapshots_requested=_u64_map(c.snapshots_requested),
            snapshots_applied=_u64(c.snapshots_applied),
            reconciled_blocks_added=_u64(c.snapshot_blocks_added),
            reconciled_blocks_removed=_u64(c.snapshot_blocks_removed),
            drift_detected=_u64(c.drift_detected),
            repairs_converged=_u64(c.repairs_converged),
            convergence_seconds_max=c.convergence_seconds_max,
            instances_stale=sum(1 for st in self.registry.all() if st.stale),
            index_bytes=s.nbytes,
        )
        self._done(STATS, request, response, started)
        return response
