"""A fake OpenAI-compatible engine (what vLLM's API server looks like to a router): /v1/completions
and /v1/chat/completions, streaming (SSE) or not, /v1/models; it records every body it receives
and what it sent, and can hold a stream after its first chunk (to cancel or shut down mid-stream).
Like vLLM with ``--enable-prompt-tokens-details``, it reports ``usage`` with
``prompt_tokens_details.cached_tokens`` (``cached_tokens``; None: no details) in a non-streamed
answer, and in a stream's last chunk (``choices: []``) when ``stream_options.include_usage`` asks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web


def sse_chunks(name: str, n: int) -> list[bytes]:
    """The SSE events a stream of ``n`` tokens is made of, the last one ``[DONE]``."""
    events = [
        json.dumps(
            {"id": f"cmpl-{name}", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
        )
        for i in range(n)
    ]
    return [f"data: {e}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def usage_chunk(name: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> bytes:
    """vLLM's last chunk of a stream that asked for usage."""
    chunk = {
        "id": f"cmpl-{name}",
        "object": "text_completion",
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


class FakeOpenAIEngine:
    def __init__(self, name: str, model: str, tokens: int = 4) -> None:
        self.name = name
        self.model = model
        self.tokens = tokens
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.sent: list[bytes] = []  # the whole body of each finished response
        self.aborted = 0
        self.gate: asyncio.Event | None = None  # set to an Event: streams wait on it after chunk one
        self.gate_before_first = False  # wait at the gate before the first chunk (still "prefilling")
        self.holding = asyncio.Event()  # a stream is waiting at the gate
        self.status = 200
        self.cached_tokens: int | None = 0  # reported in usage.prompt_tokens_details
        self.streaming: web.Request | None = None  # the request whose stream is at the gate
        # Awaited before each completion is answered (an engine that prefills first: a test makes its
        # KV events known to the index here, as a real engine's arrive before its answer).
        self.before_answer: Callable[[], Awaitable[None]] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeOpenAIEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)  # same port again after close()
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def cut(self) -> None:
        """The engine dies mid-stream: the connection of the held stream drops."""
        assert self.streaming is not None and self.streaming.transport is not None
        self.streaming.transport.close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.name}]}
        )

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        body: dict[str, Any] = json.loads(raw)
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 7
        if self.before_answer is not None:
            await self.before_answer()
        if not body.get("stream"):
            out = json.dumps(
                {
                    "id": f"cmpl-{self.name}",
                    "served_by": self.name,
                    "n": len(self.bodies),
                    "usage": usage(prompt_tokens, self.tokens, self.cached_tokens),
                }
            ).encode()
            self.sent.append(out)
            return web.Response(body=out, status=self.status, content_type="application/json")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        sent = b""
        try:
            if self.gate_before_first and self.gate is not None:
                self.streaming = request
                self.holding.set()
                await self.gate.wait()
            chunks = sse_chunks(self.name, self.tokens)
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.insert(-1, usage_chunk(self.name, prompt_tokens, self.tokens, self.cached_tokens))
            for i, chunk in enumerate(chunks):
                await response.write(chunk)
                sent += chunk
                if i == 0 and self.gate is not None and not self.gate_before_first:
                    self.streaming = request
                    self.holding.set()
                    await self.gate.wait()
                await asyncio.sleep(0.005)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        self.sent.append(sent)
        return response
