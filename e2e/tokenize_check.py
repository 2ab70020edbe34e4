"""The e2e run's tokenization phase: kvindex's token ids for text prompts and chats against the engine's.

For each case the driver asks three parties for the prompt's token ids:

- kvindex: gRPC ``Lookup`` with ``prompt`` or ``messages`` (and ``prompt_options``), which echoes the
  ids it computed (``kvindex serve --tokenizer tiny-llama=<model dir>``);
- vLLM's ``/tokenize`` endpoint with the same request fields;
- vLLM serving the request for real (``/v1/completions`` or ``/v1/chat/completions``, one output token,
  ``return_token_ids``): the ids the engine ran (``prompt_token_ids``) and ``usage.prompt_tokens``.

For chats it also compares the rendered text (``return_prompt_text``) with kvindex's rendering, which
tells a template difference from an encoding difference. A case agrees when all of them are equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvindex.tokenize import ChatOptions, Tokenizers
from kvindex.v1 import kvindex_pb2 as pb

DOC = (
    "Prefix caching keeps the KV blocks of earlier prompts so that a request sharing their beginning "
    "skips that part of the prefill. A router that knows which instance holds which blocks can send "
    "each request where its prefix already is. "
)
SYSTEM = "You are a helpful assistant that answers briefly."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@dataclass
class Case:
    name: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # OpenAI request fields (also /tokenize's)


CASES = [
    Case("text", prompt="Hello world"),
    Case("text, spaces and newlines", prompt="  leading spaces,\nnew lines\n\n\tand a tab  "),
    Case("text, non-ASCII", prompt="naïve café, 東京 and 🙂 — “quoted”"),
    Case("text with special-token text", prompt="a <|eot_id|> b <|start_header_id|>user<|end_header_id|>"),
    Case("text starting with the BOS text", prompt="<|begin_of_text|>already there"),
    Case("text, add_special_tokens=false", prompt="Hello world", options={"add_special_tokens": False}),
    Case("document", prompt=DOC * 2 + "\nQuestion: what does prefix caching skip?"),
    Case(
        "chat: system + user",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}],
    ),
    Case(
        "chat: three turns",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is a KV block?"},
            {"role": "assistant", "content": "  A slice of the attention cache.  "},
            {"role": "user", "content": "And a prefix hit?"},
        ],
    ),
    Case(
        "chat: add_generation_prompt=false",
        messages=[{"role": "user", "content": "No header after me."}],
        options={"add_generation_prompt": False},
    ),
    Case(
        "chat: continue_final_message",
        messages=[
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two,"},
        ],
        options={"add_generation_prompt": False, "continue_final_message": True},
    ),
    Case(
        "chat: content parts",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
            }
        ],
    ),
    Case(
        "chat: tools",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        options={"tools": TOOLS},
    ),
    Case(
        "chat: chat_template_kwargs",
        messages=[{"role": "user", "content": "Think or not."}],
        options={"chat_template_kwargs": {"enable_thinking": False}},
    ),
    Case(
        "chat: developer role",
        messages=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hello"}],
    ),
    Case(
        "chat: assistant tool call",
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        options={"tools": TOOLS},
    ),
    Case(
        "chat: add_special_tokens=true",
        messages=[{"role": "user", "content": "Two BOS?"}],
        options={"add_special_tokens": True},
    ),
    Case(
        "chat: long system prompt",
        messages=[{"role": "system", "content": DOC * 2}, {"role": "user", "content": "Summarize."}],
    ),
]


def prompt_options(options: dict[str, Any]) -> pb.PromptOptions:
    out = pb.PromptOptions()
    for key in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        if key in options:
            setattr(out, key, options[key])
    for key in ("tools", "chat_template_kwargs"):
        if key in options:
            setattr(out, key, json.dumps(options[key]))
    return out


@dataclass
class Result:
    name: str
    ours: int
    tokenize_equal: bool
    engine_equal: bool
    usage_equal: bool
    text_equal: bool | None  # chats: our rendered text == vLLM's prompt_text
    detail: str = ""

    @property
    def agrees(self) -> bool:
        return self.tokenize_equal and self.engine_equal and self.usage_equal and self.text_equal is not False


def check(
    http: Callable[[str, dict[str, Any] | None], tuple[int, bytes]],
    base: str,
    stub: Any,
    model: str,
    tokenizers: Tokenizers,
) -> list[Result]:
    results = []
    for case in CASES:
        fields: dict[str, Any] = {"model": model}
        if case.prompt is not None:
            fields["prompt"] = case.prompt
            reply = stub.Lookup(
                pb.LookupRequest(
                    model=model, prompt=case.prompt, prompt_options=prompt_options(case.options)
                ),
                timeout=10,
            )
        else:
            fields["messages"] = case.messages
            reply = stub.Lookup(
                pb.LookupRequest(
                    model=model,
                    messages=json.dumps(case.messages),
                    prompt_options=prompt_options(case.options),
                ),
                timeout=10,
            )
        fields.update(case.options)
        ours = list(reply.token_ids)

        status, body = http(f"{base}/tokenize", fields)
        if status != 200:
            raise RuntimeError(f"/tokenize failed for {case.name!r} ({status}): {body[:300]!r}")
        tokens = json.loads(body)["tokens"]

        served = {**fields, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        if "tools" in case.options:
            served["tool_choice"] = "none"  # "auto" needs a tool parser; the tools still reach the template
        endpoint = "/v1/completions" if case.prompt is not None else "/v1/chat/completions"
        if case.messages is not None:
            served["return_prompt_text"] = True
        status, body = http(f"{base}{endpoint}", served)
        if status != 200:
            raise RuntimeError(f"{endpoint} failed for {case.name!r} ({status}): {body[:300]!r}")
        answer = json.loads(body)
        if case.prompt is not None:
            engine_ids = answer["choices"][0].get("prompt_token_ids")
            text_equal = None
        else:
            engine_ids = answer.get("prompt_token_ids")
            opts = ChatOptions(
                add_generation_prompt=case.options.get("add_generation_prompt", True),
                continue_final_message=case.options.get("continue_final_message", False),
                chat_template_kwargs=case.options.get("chat_template_kwargs"),
                tools=case.options.get("tools"),
            )
            rendered = tokenizers.render_chat(model, case.messages, opts)
            text_equal = rendered == answer.get("prompt_text")
        usage = answer["usage"]["prompt_tokens"]
        result = Result(
            case.name,
            len(ours),
            tokenize_equal=ours == tokens,
            engine_equal=ours == engine_ids,
            usage_equal=usage == len(ours),
            text_equal=text_equal,
        )
        if not result.agrees:
            result.detail = (
                f"ours {ours[:16]}... ({len(ours)}), /tokenize {tokens[:16]}... ({len(tokens)}), engine "
                f"{(engine_ids or [])[:16]}... usage {usage}"
            )
        results.append(result)
    return results


def table(results: list[Result]) -> list[str]:
    def mark(x: bool | None) -> str:
        return "-" if x is None else ("=" if x else "DIFFERS")

    agree = sum(r.agrees for r in results)
    lines = [
        f"Tokenization: {len(results)} requests, {agree} with kvindex's ids equal to vLLM's /tokenize, "
        "to the ids the engine ran and to usage.prompt_tokens",
        "",
        "| request | tokens (kvindex) | /tokenize | engine prompt_token_ids | usage.prompt_tokens "
        "| rendered text |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.ours} | {mark(r.tokenize_equal)} | {mark(r.engine_equal)} | "
            f"{mark(r.usage_equal)} | {mark(r.text_equal)} |"
        )
    for r in results:
        if r.detail:
            lines.append(f"- {r.name}: {r.detail}")
    return lines
