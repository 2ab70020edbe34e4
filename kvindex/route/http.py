"""HTTP pieces of the routing proxy (kvindex/route/proxy.py) and its disaggregated path: errors in
OpenAI's shape, the headers forwarded to an engine, a failed engine connection's kind, and a parsed
body's prompt as the fields of a kvindex request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from google.protobuf.message_factory import GetMessageClass
from multidict import CIMultiDict, CIMultiDictProxy

from kvindex.route.openai_body import PromptSpec

# Headers that describe one connection, not the message (RFC 9110 7.6.1), plus what aiohttp sets.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def openai_error(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None
) -> web.Response:
    """An error in OpenAI's shape (what the official clients parse and show)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}
    return web.json_response(body, status=status)


def lower_headers(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def forward_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The client's headers minus the per-connection ones (aiohttp sets Host and Content-Length)."""
    hop = HOP_BY_HOP | {h.strip().lower() for h in headers.get("connection", "").split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in hop)


def fields_taken(message: Any, spec: PromptSpec) -> dict[str, Any] | None:
    """The prompt of ``spec`` as fields of ``message`` (ScoreRequest / CommitRequest); None when the
    prompt is text and this kvindex API has no text field (before text tokenization existed)."""
    fields = message.DESCRIPTOR.fields_by_name
    out: dict[str, Any] = {}
    if spec.lora and "lora" in fields:
        out["lora"] = spec.lora
    if spec.salt and "salt" in fields:
        out["salt"] = spec.salt
    if spec.token_ids is not None:
        out["token_ids"] = spec.token_ids
        return out
    form = "prompt" if spec.prompt is not None else "messages"
    if form not in fields:
        return None
    value: Any = spec.prompt if form == "prompt" else spec.messages
    if form == "messages" and not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    out[form] = value
    # The chat options: a nested PromptOptions message where the API has one, else flat fields.
    nested = fields.get("prompt_options")
    option_fields = nested.message_type.fields_by_name if nested is not None else fields
    options: dict[str, Any] = {}
    for name, option in spec.options.items():
        fd = option_fields.get(name)
        if fd is None or fd.is_repeated:
            continue  # an option this API does not take: the index applies vLLM's default
        if fd.type == fd.TYPE_STRING and not isinstance(option, str):
            option = json.dumps(option, separators=(",", ":"), ensure_ascii=False)
        options[name] = option
    if nested is not None and options:
        out["prompt_options"] = GetMessageClass(nested.message_type)(**options)
    else:
        out.update(options)
    return out


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return "disconnected"
    return "other"


def relayed_response(
    upstream: aiohttp.ClientResponse, chunked: bool, headers: dict[str, str]
) -> web.StreamResponse:
    """The answer relayed to the client: the engine's status and headers (not the per-connection
    ones), its length unless the body is changed on the way (``chunked``), then ``headers``."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in upstream.headers.items():
        if name.lower() not in HOP_BY_HOP:
            response.headers.add(name, value)
    if upstream.content_length is not None and not chunked:
        response.content_length = upstream.content_length
    response.headers.update(headers)
    return response


async def engine_models(
    session: aiohttp.ClientSession, endpoints: list[str], headers: Any, timeout: aiohttp.ClientTimeout
) -> tuple[dict[str, Any], list[Any]]:
    """Every engine's ``/v1/models`` merged by model id (each lists what it serves), and each
    endpoint's answer: its model list, or the exception its request raised."""

    async def one(endpoint: str) -> list[Any]:
        async with session.get(f"http://{endpoint}/v1/models", headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                return []
            data = json.loads(await resp.read())
            return list(data.get("data", [])) if isinstance(data, dict) else []

    merged: dict[str, Any] = {}
    results = await asyncio.gather(*(one(e) for e in endpoints), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            continue
        for model in result:
            if isinstance(model, dict) and isinstance(model.get("id"), str):
                merged.setdefault(model["id"], model)
    return merged, list(results)
