"""Hostile input (issue 32), the pure half: request deserializers that never raise, JSON nested beyond
the depth limit in prompt fields, msgpack nested beyond what the decoder follows in batches and
heartbeats, and sequence numbers at the ends of u64. The half over real gRPC and NATS is
tests/integration/test_hostile_input.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvindex.api.errors import BadRequest
from kvindex.api.handlers import Malformed, deserializer
from kvindex.api.servicer import KvIndexServicer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.observability.counters import IngestCounters
from kvindex.route.openai_body import BodyError, parse_body
from kvindex.tokenize import TokenizeError, Tokenizers, bounded_json
from kvindex.tokenize.bounded_json import MAX_JSON_DEPTH, TooDeep
from kvindex.tokenize.chat import conversation
from kvindex.v1 import kvindex_pb2 as pb
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir

# KvIndex's unary methods (the seventh, ScoreStream, is streamed).
UNARY_METHODS = ("Score", "Lookup", "Commit", "Release", "ListInstances", "Stats")
# Field 1 holding the bytes ff fe: a string in every request but StatsRequest (no fields: an unknown
# field there, which parses).
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def test_deserializer_returns_what_is_wrong_instead_of_raising() -> None:
    parse = deserializer(pb.ScoreRequest)
    bad = parse(b"\xff")
    assert isinstance(bad, Malformed)
    assert bad.message == (
        "the request is not a valid kvindex.v1.ScoreRequest message: Wire format was corrupt"
    )
    utf8 = parse(BAD_UTF8)
    assert isinstance(utf8, Malformed) and "bad UTF-8" in utf8.message
    good = pb.ScoreRequest(model="m", token_ids=[1])
    assert parse(good.SerializeToString()) == good


# -- item 3: JSON nested beyond the limit in prompt fields -------------------------------------------


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def test_bounded_json_takes_the_limit_and_refuses_one_more() -> None:
    assert bounded_json.loads(nested_list(MAX_JSON_DEPTH), "x") is not None
    assert bounded_json.loads(nested_object(MAX_JSON_DEPTH).encode(), "x") is not None
    for text in (
        nested_list(MAX_JSON_DEPTH + 1),
        nested_object(MAX_JSON_DEPTH + 1),
        "[" * 5000,
        '{"a":' * 1000,
    ):
        with pytest.raises(TooDeep, match=f"x is nested deeper than {MAX_JSON_DEPTH} levels"):
            bounded_json.loads(text, "x")
    # Brackets inside strings are no nesting.
    assert bounded_json.loads(json.dumps(["[" * 1000]), "x") == ["[" * 1000]


CHAT = '[{"role": "user", "content": "hello"}]'
DEEP_PROMPTS = {
    "messages": (pb.ScoreRequest(model="m", messages="[" * 5000), "messages"),
    "messages-500-deep": (
        pb.ScoreRequest(model="m", messages=f'[{{"role": "user", "content": "x", "x": {nested_list(500)}}}]'),
        "messages",
    ),
    "tools": (
        pb.ScoreRequest(model="m", messages=CHAT, prompt_options=pb.PromptOptions(tools="[" * 5000)),
        "prompt_options.tools",
    ),
    "documents": (
        pb.ScoreRequest(
            model="m", messages=CHAT, prompt_options=pb.PromptOptions(documents=nested_list(200))
        ),
        "prompt_options.documents",
    ),
    "chat_template_kwargs": (
        pb.ScoreRequest(
            model="m", messages=CHAT, prompt_options=pb.PromptOptions(chat_template_kwargs='{"a":' * 1000)
        ),
        "prompt_options.chat_template_kwargs",
    ),
}


@pytest.mark.parametrize(("request_", "field"), DEEP_PROMPTS.values(), ids=list(DEEP_PROMPTS))
def test_prompt_fields_nested_beyond_the_limit_are_bad_requests(
    request_: pb.ScoreRequest, field: str
) -> None:
    servicer = KvIndexServicer(InvertedIndex(), Registry(), IngestCounters())
    for request in (request_, copy_as(request_, pb.LookupRequest), copy_as(request_, pb.CommitRequest)):
        with pytest.raises(BadRequest, match=f"^{field} is nested deeper than {MAX_JSON_DEPTH} levels"):
            servicer.resolve(request)


def copy_as(request: pb.ScoreRequest, cls: type) -> Any:
    """The request's prompt fields in another request type (Lookup, Commit)."""
    out = cls(model=request.model, messages=request.messages)
    out.prompt_options.CopyFrom(request.prompt_options)
    return out


def test_tool_call_arguments_nested_beyond_the_limit_are_refused() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(TokenizeError, match=r"function\.arguments is nested deeper than 128 levels"):
        conversation(messages, "string")


def test_openai_body_nested_beyond_the_limit_is_a_body_error() -> None:
    for body in (
        b'{"model": "m", "messages": ' + b"[" * 5000,
        b'{"model": "m", "prompt": "x", "extra": ' + nested_list(200).encode() + b"}",
    ):
        with pytest.raises(BodyError, match="the request body is nested deeper than 128 levels"):
            parse_body(body, "/v1/chat/completions")


def test_a_chat_at_the_depth_limit_renders(tmp_path: Path) -> None:
    # Nesting the limit lets through must not fail later, in the template (tojson recursing): a tool
    # whose parameters take the whole depth, rendered with the Llama 3 template's tojson(indent=4).
    tokenizers = Tokenizers.from_dirs({"m": str(make_tokenizer_dir(tmp_path / "llama3", "llama3"))})
    servicer = KvIndexServicer(InvertedIndex(), Registry(), IngestCounters(), tokenizers=tokenizers)
    params: Any = {}  # one level, and three around it: [ {function: {parameters: ...}} ]
    for _ in range(MAX_JSON_DEPTH - 4):
        params = {"a": params}
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": params}}])
    request = pb.ScoreRequest(model="m", messages=CHAT, prompt_options=pb.PromptOptions(tools=tools))
    assert servicer.resolve(request).tokens > MAX_JSON_DEPTH
    deeper = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"a": params}}}])
    request.prompt_options.tools = deeper
    with pytest.raises(BadRequest, match=r"prompt_options\.tools is nested deeper"):
        servicer.resolve(request)
