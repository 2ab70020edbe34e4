"""kvindex.client's request building, without a server: the prefix key covers every prompt form, chat
fields go as JSON and unknown ones are named. Over a real gRPC server: tests/integration/test_client.py."""

from __future__ import annotations

import pytest

from kvindex.client import (
    prefix_key,
)


def test_prefix_key_covers_every_prompt_form() -> None:
    tokens = list(range(100))
    # Only the first blocks count: prompts that share them hash alike.
    assert prefix_key(token_ids=tokens, block_size=4) == prefix_key(token_ids=[*tokens[:16], 1], block_size=4)
    assert prefix_key(token_ids=tokens, block_size=4) != prefix_key(token_ids=tokens[1:], block_size=4)
    assert prefix_key(block_keys=[1, 2, 3, 4, 5]) == prefix_key(block_keys=[1, 2, 3, 4, 9])
    system = "You are a helpful assistant. " * 20
    assert prefix_key(prompt=system + "Question A") == prefix_key(prompt=system + "Question B")
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    longer = [*chat, {"role": "assistant", "content": "hello"}]
    assert prefix_key(messages=chat) == prefix_key(messages=longer)
    assert prefix_key(messages=chat) != prefix_key(prompt=system)


def test_chat_fields_are_sent_as_json_and_unknown_fields_named() -> None:
    from kvindex.client.aio import _message
    from kvindex.v1 import kvindex_pb2 as pb

    # Any string field given a list or dict carries it as JSON (how `messages` and the chat options
    # travel once the request has them); salt stands in for them here.
    request = _message(pb.ScoreRequest, {"model": "m", "salt": {"enable_thinking": False}, "lora": None})
    assert request.salt == '{"enable_thinking":false}' and request.lora == ""
    with pytest.raises(TypeError, match=r"ScoreRequest.*no_such_field"):
        _message(pb.ScoreRequest, {"model": "m", "no_such_field": [1]})
