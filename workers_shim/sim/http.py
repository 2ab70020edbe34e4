"""An OpenAI-compatible HTTP front for simulated engines, speaking vLLM's disaggregated protocol.

Each worker of a :class:`SimFleet` gets its own aiohttp server (``kvshim sim --http-port BASE``:
worker i on BASE+i, announced as its endpoint), so a router sees what it sees of vLLM:

- ``POST /v1/completions`` (``prompt`` as token ids, or text: its UTF-8 bytes are the token ids) and
  ``POST /v1/chat/completions`` (the messages' contents, likewise); ``max_tokens`` (default 16),
  ``stream`` (SSE: the first chunk at the first token, the rest at the end, then ``[DONE]``),
  ``cache_salt``; the answer's ``usage`` has ``prompt_tokens_details.cached_tokens``;
- ``kv_transfer_params`` as vLLM's KV connectors take them (NixlConnector's fields):

  * ``{"do_remote_decode": true}`` — a **prefill step**: the request runs with one output token, and
    the answer carries ``kv_transfer_params = {"do_remote_prefill": true, "do_remote_decode": false,
    "remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
    "remote_num_tokens", "tp_size"}``; the computed blocks are held for a pull (``kv_hold`` s);
  * ``{"do_remote_prefill": true, ...those fields}`` — a **decode step**: the engine pulls the KV from
    ``remote_host:remote_port`` (``GET /sim/kv/{remote_request_id}``, which hands the held blocks
    over once), then serves the request with those blocks received (``SimRequest.remote_blocks``,
    fetch cost ``fetch_ms_per_block["remote"]``) instead of computed. A pull that fails (unknown or
    expired id, the prefill instance gone) is counted and the engine prefills itself, as vLLM does
    after a failed transfer;
- ``GET /v1/models``, ``GET /health``, ``GET /sim/stats`` (the counters below, JSON).

A malformed request gets 400 naming the field, an unknown model 404 (as vLLM).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from kvindex.keys import block_keys
from workers_shim.sim.engine import Completion, SimRequest
from workers_shim.sim.fleet import SimFleet

log = structlog.get_logger("workers_shim.sim.http")

__all__ = ["SimHttpServer", "serve_fleet"]


@dataclass
class _Pending:
    first: asyncio.Future[Completion]
    done: asyncio.Future[Completion]


@dataclass
class _Held:
    keys: list[int]
    prompt_tokens: int
    expires: float


@dataclass
class SimHttpStats:
    requests: Counter[str] = field(default_factory=Counter)  # by kind: whole, prefill, decode
    kv_pulls_served: int = 0
    kv_pulls_failed: int = 0  # decode steps that could not get their KV (prefilled themselves)
    pulled_blocks: int = 0  # blocks decode steps pulled (the engine reuses all but a last full one)

    def json(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "kv_pulls_served": self.kv_pulls_served,
            "kv_pulls_failed": self.kv_pulls_failed,
            "pulled_blocks": self.pulled_blocks,
        }


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class SimHttpServer:
    """One worker's HTTP server. ``dispatch`` must receive the fleet's completions (``serve_fleet``
    wires it)."""

    def __init__(
        self,
        fleet: SimFleet,
        worker: str,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_hold: float = 30.0,
        pull_timeout: float = 5.0,
    ) -> None:
        self.fleet = fleet
        self.worker = worker
        self.model = model
        self.block_size = fleet.engines[worker].block_size
        self.host = host
        self.port = port
        self.kv_hold = kv_hold
        self.pull_timeout = pull_timeout
        self.stats = SimHttpStats()
        self._pending: dict[str, _Pending] = {}
        self._held: dict[str, _Held] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/sim/stats", self._stats)
        app.router.add_get("/sim/kv/{transfer_id}", self._pull)
        self.app = app

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> SimHttpServer:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.pull_timeout))
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def dispatch(self, c: Completion) -> None:
        """A completion of this worker: wake the request waiting for it."""
        pending = self._pending.get(c.request.id)
        if pending is None:
            return
        fut = pending.first if c.kind == "first_token" else pending.done
        if not fut.done():
            fut.set_result(c)

    # -- handlers ---------------------------------------------------------------------------------

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            tokens = self._tokens(body, chat=request.path.endswith("/chat/completions"))
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise _BadRequest(400, "max_tokens must be a positive integer", "max_tokens")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise _BadRequest(400, "stream must be a boolean", "stream")
            params = body.get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                raise _BadRequest(400, "kv_transfer_params must be an object", "kv_transfer_params")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise _BadRequest(400, "stream_options must be an object", "stream_options")
            # As vLLM: a stream ends with the usage chunk only when the client asks for it.
            include_usage = bool(options.get("include_usage"))
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise _BadRequest(400, "cache_salt must be a string", "cache_salt")
        except _BadRequest as exc:
            kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
            error = {"message": exc.message, "type": kind, "param": exc.param, "code": exc.status}
            return web.json_response({"error": error}, status=exc.status)
        keys = block_keys(tokens, self.block_size, self.model, salt=salt or None)
        params = params or {}
        remote_blocks = 0
        kind = "whole"
        if params.get("do_remote_decode"):
            kind, max_tokens, stream = "prefill", 1, False
        elif params.get("do_remote_prefill"):
            kind = "decode"
            remote_blocks = await self._pull_kv(params, keys)
        self.stats.requests[kind] += 1
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        req = SimRequest(rid, keys, len(tokens), max_tokens, remote_blocks=remote_blocks)
        loop = asyncio.get_running_loop()
        pending = self._pending[rid] = _Pending(loop.create_future(), loop.create_future())
        try:
            await self.fleet.submit(self.worker, req)
            if stream:
                return await self._stream(request, rid, pending, max_tokens, include_usage)
            done = await pending.done
        finally:
            self._pending.pop(rid, None)
        answer = self._answer(rid, "text_completion", " tok" * max_tokens, done, max_tokens)
        if kind == "prefill":
            answer["kv_transfer_params"] = self._hold(rid, keys, len(tokens))
        return web.json_response(answer)

    async def _stream(
        self, request: web.Request, rid: str, pending: _Pending, max_tokens: int, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await pending.first
        await response.prepare(request)
        chunk = {
            "id": rid,
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": " tok"}],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = await pending.done
        if max_tokens > 1:
            chunk["choices"] = [{"index": 0, "text": " tok" * (max_tokens - 1), "finish_reason": "length"}]
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if include_usage:
            last = self._answer(rid, "text_completion", "", done, max_tokens)
            last["choices"] = []
            await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _answer(self, rid: str, obj: str, text: str, c: Completion, max_tokens: int) -> dict[str, Any]:
        cached = c.reported_cached_tokens
        return {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": c.request.prompt_tokens,
                "completion_tokens": max_tokens,
                "total_tokens": c.request.prompt_tokens + max_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            "kv_transfer_params": None,
        }

    def _hold(self, rid: str, keys: list[int], prompt_tokens: int) -> dict[str, Any]:
        """Keep a prefill's blocks for one pull; the parameters a decode step needs to get them."""
        now = time.monotonic()
        for tid in [t for t, h in self._held.items() if h.expires <= now]:
            del self._held[tid]
        self._held[rid] = _Held(keys, prompt_tokens, now + self.kv_hold)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.worker,
            "remote_request_id": rid,
            "remote_block_ids": list(range(len(keys))),
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": prompt_tokens,
            "tp_size": 1,
        }

    async def _pull_kv(self, params: dict[str, Any], keys: list[int]) -> int:
        """Blocks received from the prefill instance named in ``params`` (0 when the pull failed)."""
        host, port, tid = (
            params.get("remote_host"),
            params.get("remote_port"),
            params.get("remote_request_id"),
        )
        if (
            not (isinstance(host, str) and isinstance(port, int) and isinstance(tid, str))
            or self._session is None
        ):
            self.stats.kv_pulls_failed += 1
            log.warning(
                "kv_pull_failed", worker=self.worker, why="incomplete kv_transfer_params", params=params
            )
            return 0
        try:
            async with self._session.get(f"http://{host}:{port}/sim/kv/{tid}") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                held = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.stats.kv_pulls_failed += 1
            log.warning("kv_pull_failed", worker=self.worker, remote=f"{host}:{port}", error=str(exc))
            return 0
        theirs = held.get("keys") if isinstance(held, dict) else None
        n = 0
        if isinstance(theirs, list):  # the blocks of the same prompt: as many as agree from the start
            for mine, their in zip(keys, theirs, strict=False):
                if mine != their:
                    break
                n += 1
        self.stats.pulled_blocks += n
        return n

    async def _pull(self, request: web.Request) -> web.Response:
        held = self._held.pop(request.match_info["transfer_id"], None)
        if held is None or held.expires <= time.monotonic():
            return web.json_response(
                {"error": "no such transfer (unknown, already pulled or expired)"}, status=404
            )
        self.stats.kv_pulls_served += 1
        return web.json_response({"keys": held.keys, "prompt_tokens": held.prompt_tokens})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "kvshim-sim"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _stats(self, request: web.Request) -> web.Response:
        engine = self.fleet.engines[self.worker]
        out = self.stats.json()
        out["engine_transferred_blocks"] = engine.stats.transferred_blocks
        out["engine_computed_tokens"] = engine.stats.computed_tokens
        return web.json_response(out)

    # -- request parsing ----------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise _BadRequest(400, f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest(400, "body must be a JSON object")
        model = body.get("model")
        if model != self.model:
            raise _BadRequest(404, f"The model `{model}` does not exist.", "model")
        return body

    def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest(400, "messages must be a non-empty list", "messages")
            text = "".join(str(m.get("content", "")) if isinstance(m, dict) else "" for m in messages)
            return list(text.encode())
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return list(prompt.encode())
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt)
        ):
            return prompt
        raise _BadRequest(400, "prompt must be a non-empty string or list of token ids", "prompt")


async def serve_fleet(
    fleet: SimFleet, model: str, host: str, base_port: int, **kwargs: Any
) -> list[SimHttpServer]:
    """One started server per worker of ``fleet``, worker i on ``base_port + i`` (0: any free port),
    receiving the fleet's completions."""
    servers: dict[str, SimHttpServer] = {}
    for i, worker in enumerate(fleet.engines):
        port = base_port + i if base_port else 0
        servers[worker] = await SimHttpServer(fleet, worker, model, host=host, port=port, **kwargs).start()
    previous = fleet.on_completion

    def on_completion(worker: str, c: Completion) -> None:
        if previous is not None:
            previous(worker, c)
        server = servers.get(worker)
        if server is not None:
            server.dispatch(c)

    fleet.on_completion = on_completion
    return list(servers.values())
