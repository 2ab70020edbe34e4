"""What routing needs from an OpenAI request body: the model and the prompt, in the form the engine
will tokenize.

Shared by the Envoy ext_proc endpoint picker (kvindex/route/ext_proc.py) and the routing proxy
(``kvindex route``): both read ``/v1/completions`` and ``/v1/chat/completions`` bodies and turn them
into the prompt fields of a ``ScoreRequest``. Bodies are never changed: this only reads them.

Completions: ``prompt`` is a string, a list of token ids, or a batch (a list of strings or of token
lists); a batch is routed by its first prompt (vLLM serves a batch on one instance). Chat:
``messages`` with the chat options vLLM reads (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, ``tools``, ``add_special_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvindex.api.errors import BadRequest
from kvindex.tokenize import bounded_json
from kvindex.tokenize.bounded_json import TooDeep

MAX_BODY_BYTES = 64 * 1024 * 1024
_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "add_special_tokens")


class BodyError(ValueError):
    """The body is not an OpenAI request routing can read; the message says what is wrong."""


@dataclass
class PromptSpec:
    """The routing-relevant part of one request. Exactly one of token_ids, prompt, messages is set."""

    model: str
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    # Chat/text options, only those the request gave (the index applies vLLM's defaults).
    options: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    lora: str = ""
    salt: str = ""


def parse_body(raw: bytes, path: str = "") -> PromptSpec:
    """Read an OpenAI completions or chat body. ``path`` (``/v1/chat/completions``, ...) breaks ties
    when a body has neither or both of ``prompt`` and ``messages``."""
    if len(raw) > MAX_BODY_BYTES:
        raise BodyError(f"request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are read")
    try:
        body = bounded_json.loads(raw, "the request body")
    except TooDeep as exc:
        raise BodyError(str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(f"request body must be a JSON object, got {type(body).__name__}")
    return parse_request(body, path)


def parse_request(body: dict[str, Any], path: str = "") -> PromptSpec:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BodyError("'model' (a non-empty string) is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BodyError("'stream' must be true or false")
    spec = PromptSpec(model=model, stream=stream)
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise BodyError("'cache_salt' must be a string")
        spec.salt = salt
    has_messages = "messages" in body
    has_prompt = "prompt" in body
    chat = has_messages if has_messages != has_prompt else path.endswith("/chat/completions")
    if chat:
        if not has_messages:
            raise BodyError("'messages' is required for chat completions")
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BodyError("'messages' must be a non-empty list")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise BodyError(f"messages[{i}] must be an object with a string 'role'")
        spec.messages = messages
        for name in _CHAT_OPTIONS:
            if name in body:
                if not isinstance(body[name], bool):
                    raise BodyError(f"'{name}' must be true or false")
                spec.options[name] = body[name]
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict):
                raise BodyError("'chat_template_kwargs' must be an object")
            spec.options["chat_template_kwargs"] = kwargs
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise BodyError("'tools' must be a list")
            spec.options["tools"] = tools
        return spec
    if not has_prompt:
        raise BodyError("'prompt' is required for completions")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BodyError("'prompt' is empty")
        spec.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
        spec.token_ids = prompt
    else:
        raise BodyError("'prompt' must be a non-empty string, a list of token ids, or a batch of either")
    if "add_special_tokens" in body:
        if not isinstance(body["add_special_tokens"], bool):
            raise BodyError("'add_special_tokens' must be true or false")
        spec.options["add_special_tokens"] = body["add_special_tokens"]
    return spec


def apply_prompt(request: Any, spec: PromptSpec) -> None:
    """Set the prompt fields of a Score/Lookup/Commit request from a parsed body."""
    if spec.token_ids is not None:
        request.token_ids.extend(spec.token_ids)
        return
    fields = request.DESCRIPTOR.fields_by_name
    if "prompt" not in fields:
        raise BadRequest(f"no tokenizer for model {spec.model!r} in this index: send token ids")
    if spec.prompt is not None:
        request.prompt = spec.prompt
    else:
        request.messages = json.dumps(spec.messages)
