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


async def test_a_move_before_sending_is_awaited_in_order_and_bounded() -> None:
    """RequestLedger.move_before_sending (a retry's re-commit, kvindex/route/proxy.py) over the
    in-process client of a real servicer: over when it returns, in order with the request's other
    index calls; a commit slower than the wait is not waited for, and still comes before the release."""
    import asyncio

    from kvindex.api.servicer import KvIndexServicer
    from kvindex.client.local import LocalKvIndexClient
    from kvindex.core import build_core
    from kvindex.route.lifecycle import RequestLedger, ordered
    from kvindex.scoring.ledger import FINISHED
    from kvindex.tokenize import Tokenizers

    core = build_core()
    for worker in ("a", "b"):
        core.index.add_instance((worker, 0), "m")
        core.registry.add((worker, 0), "m", 4).last_heartbeat_at = core.registry.clock()
    servicer = KvIndexServicer(core.index, core.registry, core.counters, None, core.ranker, Tokenizers())
    client = LocalKvIndexClient(servicer, refresh_interval=0)
    delay = 0.0

    async def commit(instance_id: str) -> bool:
        await asyncio.sleep(delay)  # an index slow to answer
        return await client.commit("r1", instance_id, "m", token_ids=list(range(16)))

    class Events:
        moves: list[bool] = []

        def released(self, phase: str, found: bool | None, reported: bool, status: str, wake: bool) -> None:
            pass

        def moved(self, committed: bool) -> None:
            self.moves.append(committed)

    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: object) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        tasks.add(task)
        return task

    ledger = RequestLedger(client, "r1", ordered(spawn), Events(), commit=commit)
    ledger.active = True
    entries = core.ranker.ledger
    assert await ledger.move_before_sending("a/0", 1.0) is True
    assert [e.instance for e in entries._entries.values()] == [("a", 0)]
    delay = 0.3
    assert await ledger.move_before_sending("b/0", 0.02) is None  # not answered in time: not waited for
    assert [e.instance for e in entries._entries.values()] == [("a", 0)]
    ledger.release(FINISHED)  # runs after the move it follows
    await asyncio.wait(tasks)
    assert Events.moves == [True, True] and len(entries) == 0
    assert await ledger.move_before_sending("ghost/0", 1.0) is False  # the index does not take it
    await client.close()
