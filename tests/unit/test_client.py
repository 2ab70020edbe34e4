"""kvindex.client without a server: the prefix key covers every prompt form, chat fields go as JSON
and unknown ones are named, the static fallback list is read (and a bad entry named), and the
fallback's instance list prefers what the index reported. Over a real gRPC server:
tests/integration/test_client.py."""

from __future__ import annotations

import pytest

from kvindex.client import (
    InstanceCache,
    prefix_key,
    static_instances,
)
from kvindex.v1 import kvindex_pb2 as pb


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


def test_static_fallback_instances_are_read_and_bad_entries_named() -> None:
    got = static_instances({"llama": ["node-3=10.0.3.7:8000", "node-4/1=10.0.3.8:8000", "10.0.3.9:8000"]})
    assert [(k.instance_id, k.endpoint) for k in got["llama"]] == [
        ("node-3/0", "10.0.3.7:8000"),  # a worker id is its rank 0, as the index names it
        ("node-4/1", "10.0.3.8:8000"),
        ("10.0.3.9:8000", "10.0.3.9:8000"),  # no id: the endpoint is the id
    ]
    for bad, said in (
        ({"llama": ["http://x:80"]}, "'http://x:80'"),
        ({"llama": ["=10.0.0.1:80"]}, "empty instance id"),
        ({"llama": ["node-3=10.0.0.1"]}, "not 'host:port'"),
        ({"llama": "10.0.0.1:80"}, "not the string"),
        ({"": ["10.0.0.1:80"]}, "model ''"),
        (["10.0.0.1:80"], "want a mapping"),
    ):
        with pytest.raises(ValueError, match=said):
            static_instances(bad)  # type: ignore[arg-type]


def test_the_index_report_of_a_model_replaces_its_static_instances() -> None:
    cache = InstanceCache(static=static_instances({"llama": ["s1=10.0.0.1:80"], "other": ["10.0.0.2:80"]}))
    assert [k.instance_id for k in cache.instances("llama")] == ["s1/0"] and not cache.seen("llama")
    assert sorted(cache.models()) == ["llama", "other"]
    cache.replace([pb.InstanceInfo(instance_id="w1/0", model="llama", endpoint="10.0.1.1:80")])
    assert [k.instance_id for k in cache.instances("llama")] == ["w1/0"] and cache.seen("llama")
    # Reported with no routable instance (all stale): the report still wins over the static list.
    cache.replace([pb.InstanceInfo(instance_id="o1/0", model="other", endpoint="10.0.1.2:80", stale=True)])
    assert cache.instances("other") == [] and cache.instances("llama")[0].instance_id == "w1/0"
