"""``kvindex route`` without servers: the prompt fields it forwards follow what the index API takes,
and the CLI without the route extra names it. Against fake engines and a real index:
tests/integration/test_route.py."""

from __future__ import annotations

import json
import sys

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from kvindex.route.http import fields_taken as _fields_taken
from kvindex.route.openai_body import parse_body
from kvindex.v1 import kvindex_pb2 as pb


def _text_api() -> type:
    """A ScoreRequest with text prompts and nested chat options, as the tokenize API has them."""
    t = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="route_text_api.proto", package="routetest", syntax="proto3"
    )
    opts = fdp.message_type.add(name="PromptOptions")
    opts.field.add(name="add_generation_prompt", number=1, type=t.TYPE_BOOL, label=t.LABEL_OPTIONAL)
    opts.field.add(name="chat_template_kwargs", number=3, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    opts.field.add(name="tools", number=4, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    req = fdp.message_type.add(name="ScoreRequest")
    req.field.add(name="model", number=1, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    req.field.add(name="salt", number=3, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    req.field.add(name="token_ids", number=4, type=t.TYPE_UINT32, label=t.LABEL_REPEATED)
    req.field.add(name="prompt", number=30, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    req.field.add(name="messages", number=31, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    req.field.add(
        name="prompt_options", number=32, type=t.TYPE_MESSAGE, label=t.LABEL_OPTIONAL,
        type_name=".routetest.PromptOptions",
    )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return GetMessageClass(pool.FindMessageTypeByName("routetest.ScoreRequest"))


def test_prompt_fields_follow_what_the_index_api_takes() -> None:
    chat = parse_body(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hé"}],
                "add_generation_prompt": False,
                "chat_template_kwargs": {"enable_thinking": False},
                "tools": [{"type": "function"}],
                "cache_salt": "s1",
            }
        ).encode(),
        "/v1/chat/completions",
    )
    text_api = _text_api()
    fields = _fields_taken(text_api, chat)
    assert fields is not None
    req = text_api(model="m", **fields)
    assert json.loads(req.messages) == [{"role": "user", "content": "hé"}] and req.salt == "s1"
    assert req.prompt_options.add_generation_prompt is False
    assert json.loads(req.prompt_options.chat_template_kwargs) == {"enable_thinking": False}
    assert json.loads(req.prompt_options.tools) == [{"type": "function"}]
    text = parse_body(b'{"model": "m", "prompt": "Hello"}', "/v1/completions")
    assert text_api(model="m", **_fields_taken(text_api, text)).prompt == "Hello"  # type: ignore[arg-type]
    # Token ids go as token_ids to any API; text only where the API has a field for it.
    ids = parse_body(b'{"model": "m", "prompt": [5, 6, 7]}')
    assert _fields_taken(pb.CommitRequest, ids) == {"token_ids": [5, 6, 7]}
    has_text = "prompt" in pb.ScoreRequest.DESCRIPTOR.fields_by_name
    assert (_fields_taken(pb.ScoreRequest, text) is not None) == has_text


def test_cli_without_the_route_extra_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvindex.cli import main

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp fails as if not installed
    monkeypatch.delitem(sys.modules, "kvindex.route.proxy", raising=False)
    assert main(["route", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvindex route: error: the routing proxy needs aiohttp, which is not installed: "
        "pip install 'kvindex[route]'\n"
    )
