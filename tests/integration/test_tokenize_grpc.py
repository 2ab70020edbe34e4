"""Text and chat prompts over a real gRPC server: Score, ScoreStream, Lookup and Commit with ``prompt`` or
``messages`` answer exactly as with the equivalent ``token_ids``; bad requests get INVALID_ARGUMENT
saying what is wrong; the tokenization cache's Prometheus counters move."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import free_port
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir
from tests.conftest import wait_until
from tests.integration.test_cli import KVINDEX, read_log_until, run_cli
from workers_shim.publisher import Publisher

BS = 16
CHAT = [
    {"role": "system", "content": "You are a routing assistant. " * 20},
    {"role": "user", "content": "Which instance holds my prefix? " * 6},
    {"role": "assistant", "content": "The one that served your last turn."},
    {"role": "user", "content": "And if it is busy?"},
]
PROMPT = "Summarize the following document about KV caches. " * 30


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tok")
    return {
        "llama": str(make_tokenizer_dir(root / "llama3", "llama3")),
        "qwen": str(make_tokenizer_dir(root / "chatml", "chatml")),
    }


@pytest.fixture
async def svc(make_service: Callable[..., Awaitable[IndexService]], tok_dirs: dict[str, str]) -> IndexService:
    return await make_service(tokenizers=tok_dirs)


@pytest.fixture
async def kv(svc: IndexService) -> AsyncIterator[pb_grpc.KvIndexStub]:
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        yield pb_grpc.KvIndexStub(channel)


def reference(tok_dirs: dict[str, str]) -> Tokenizers:
    """A second, independent registry: what the server should have computed."""
    return Tokenizers.from_dirs(tok_dirs)


async def fleet(
    make_publisher: Callable[..., Awaitable[Publisher]], svc: IndexService, model: str
) -> list[Publisher]:
    pubs = [
        await make_publisher(worker=f"{model}-w{i}", model=model, block_size=BS, capacity={"gpu": 5000})
        for i in range(3)
    ]
    for p in pubs:
        await p.heartbeat()
    await wait_until(lambda: len(svc.registry.of_model(model)) == 3, what="instances registered")
    return pubs


def ranking(reply: pb.ScoreResponse) -> list[tuple[str, int, int]]:
    return [(r.instance_id, r.matched_blocks, r.matched_tokens) for r in reply.ranked]


async def test_text_requests_rank_like_their_token_ids(
    svc: IndexService,
    kv: pb_grpc.KvIndexStub,
    make_publisher: Callable[..., Awaitable[Publisher]],
    tok_dirs: dict[str, str],
) -> None:
    ref = reference(tok_dirs)
    chat_ids = ref.encode_chat("llama", CHAT).tolist()
    prompt_ids = ref.encode_prompt("llama", PROMPT).tolist()
    pubs = await fleet(make_publisher, svc, "llama")
    # w0 holds the chat's first half, w1 the whole chat, w2 the completions prompt.
    keys = block_keys(chat_ids, BS, "llama")
    pubs[0].stored(keys[: len(keys) // 2])
    pubs[1].stored(keys)
    pubs[2].stored(block_keys(prompt_ids, BS, "llama"))
    for p in pubs:
        await p.flush()
    await wait_until(lambda: svc.index.stats().entries[0] >= len(keys) * 3 // 2, what="blocks indexed")

    messages = json.dumps(CHAT)
    by_text = await kv.Score(pb.ScoreRequest(model="llama", messages=messages))
    by_ids = await kv.Score(pb.ScoreRequest(model="llama", token_ids=chat_ids))
    assert ranking(by_text) == ranking(by_ids)
    assert by_text.ranked[0].instance_id == "llama-w1/0" and by_text.ranked[0].matched_blocks == len(keys)
    assert by_text.prompt_tokens == by_ids.prompt_tokens == len(chat_ids)
    assert by_text.total_blocks == len(keys)

    by_text = await kv.Score(pb.ScoreRequest(model="llama", prompt=PROMPT))
    by_ids = await kv.Score(pb.ScoreRequest(model="llama", token_ids=prompt_ids))
    assert ranking(by_text) == ranking(by_ids) and by_text.ranked[0].instance_id == "llama-w2/0"

    # Lookup shows the ids it computed (what vLLM's /tokenize returns) and the same matches.
    looked = await kv.Lookup(pb.LookupRequest(model="llama", messages=messages))
    assert list(looked.token_ids) == chat_ids and looked.prompt_tokens == len(chat_ids)
    direct = await kv.Lookup(pb.LookupRequest(model="llama", token_ids=chat_ids))
    assert list(looked.block_keys) == list(direct.block_keys)
    assert [(m.instance_id, m.matched_blocks) for m in looked.matches] == [
        (m.instance_id, m.matched_blocks) for m in direct.matches
    ]
    assert list(direct.token_ids) == []  # ids are echoed for text prompts only

    # Options: no generation prompt, add_special_tokens on a prompt, lora/salt folded into the keys.
    opts = pb.PromptOptions(add_generation_prompt=False)
    looked = await kv.Lookup(pb.LookupRequest(model="llama", messages=messages, prompt_options=opts))
    assert list(looked.token_ids) == ref.encode_chat("llama", CHAT, add_generation_prompt=False).tolist()
    opts = pb.PromptOptions(add_special_tokens=False)
    looked = await kv.Lookup(pb.LookupRequest(model="llama", prompt=PROMPT, prompt_options=opts))
    assert list(looked.token_ids) == prompt_ids[1:]  # without the BOS
    salted = await kv.Lookup(pb.LookupRequest(model="llama", prompt=PROMPT, salt="s1"))
    salted_ids = await kv.Lookup(pb.LookupRequest(model="llama", token_ids=prompt_ids, salt="s1"))
    assert list(salted.block_keys) == list(salted_ids.block_keys) != list(direct.block_keys)

    # A chat with tools and template kwargs, on the ChatML model (template from chat_template.jinja).
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find blocks"}}]
    opts = pb.PromptOptions(tools=json.dumps(tools), chat_template_kwargs=json.dumps({"default_system": "x"}))
    looked = await kv.Lookup(pb.LookupRequest(model="qwen", messages=messages, prompt_options=opts))
    assert list(looked.token_ids) == ref.encode_chat("qwen", CHAT, tools=tools).tolist()


async def test_commit_and_stream_take_text_too(
    svc: IndexService,
    kv: pb_grpc.KvIndexStub,
    make_publisher: Callable[..., Awaitable[Publisher]],
    tok_dirs: dict[str, str],
) -> None:
    await fleet(make_publisher, svc, "llama")
    chat_ids = reference(tok_dirs).encode_chat("llama", CHAT).tolist()
    n_blocks = len(chat_ids) // BS
    committed = await kv.Commit(
        pb.CommitRequest(request_id="r1", instance_id="llama-w2/0", model="llama", messages=json.dumps(CHAT))
    )
    assert committed.committed
    # The committed chat's blocks are now speculatively on w2: the token-id form of it sees them there.
    # (Which instance ranks first is the policy's business: w2 is busy with r1's prefill.)
    reply = await kv.Score(pb.ScoreRequest(model="llama", token_ids=chat_ids))
    matched = {r.instance_id: r.matched_blocks for r in reply.ranked}
    assert matched["llama-w2/0"] == n_blocks and sum(matched.values()) == n_blocks

    requests = [
        pb.ScoreRequest(model="llama", messages=json.dumps(CHAT), request_id="a"),
        pb.ScoreRequest(model="nobody", prompt="hi", request_id="b"),
        pb.ScoreRequest(model="llama", prompt=PROMPT, request_id="c"),
    ]
    call = kv.ScoreStream()
    replies = []
    for req in requests:
        await call.write(req)
        replies.append(await call.read())
    await call.done_writing()
    assert [r.request_id for r in replies] == ["a", "b", "c"]
    assert not replies[0].error
    assert {r.instance_id: r.matched_blocks for r in replies[0].ranked}["llama-w2/0"] == n_blocks
    assert "no tokenizer configured" in replies[1].error
    assert not replies[2].error and replies[2].prompt_tokens > 0


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"prompt": "hi", "token_ids": [1, 2]},
            "exactly one of token_ids, block_keys, prompt and messages; got token_ids and prompt",
        ),
        ({"prompt": "hi", "messages": "[]"}, "got prompt and messages"),
        ({}, "one of token_ids, block_keys, prompt or messages is required"),
        ({"model": "unknown-model", "prompt": "hi"}, "model 'unknown-model' has no tokenizer configured"),
        ({"messages": "[{'role': 'user'}"}, "messages is not valid JSON"),
        ({"messages": '{"role": "user"}'}, "messages must be a JSON list"),
        ({"messages": '[{"role": "user", "content": [{"type": "image_url"}]}]'}, "only text parts"),
        (
            {"messages": '[{"role": "user", "content": "x"}]', "prompt_options": {"tools": "{"}},
            "tools is not valid JSON",
        ),
        (
            {
                "messages": '[{"role": "user", "content": "x"}]',
                "prompt_options": {"chat_template_kwargs": "[1]"},
            },
            "chat_template_kwargs must be a JSON object",
        ),
        (
            {
                "messages": '[{"role": "assistant", "content": "x"}]',
                "prompt_options": {"continue_final_message": True},
            },
            "continue_final_message and add_generation_prompt are not compatible",
        ),
        ({"prompt": "hi", "prompt_options": {"add_generation_prompt": False}}, "applies to messages only"),
        (
            {"token_ids": [1, 2], "prompt_options": {"add_special_tokens": True}},
            "apply to prompt or messages only",
        ),
    ],
)
async def test_bad_text_requests_are_invalid_argument(
    kv: pb_grpc.KvIndexStub, fields: dict[str, object], match: str
) -> None:
    fields = {"model": "llama", **fields}
    if "prompt_options" in fields:
        fields["prompt_options"] = pb.PromptOptions(**fields["prompt_options"])  # type: ignore[arg-type]
    for call, request_type in ((kv.Score, pb.ScoreRequest), (kv.Lookup, pb.LookupRequest)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request_type(**fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.Commit(pb.CommitRequest(request_id="r", instance_id="w/0", **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in (err.value.details() or "")


async def test_a_template_that_raises_is_invalid_argument(
    make_service: Callable[..., Awaitable[IndexService]], tmp_path: Path
) -> None:
    svc = await make_service(
        tokenizers={"mistral": str(make_tokenizer_dir(tmp_path / "sp", "sentencepiece"))}
    )
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        kv = pb_grpc.KvIndexStub(channel)
        bad = json.dumps([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.Lookup(pb.LookupRequest(model="mistral", messages=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the chat template rejected the request: Conversation roles must alternate" in (
            err.value.details() or ""
        )


async def test_cache_counters_move(svc: IndexService, kv: pb_grpc.KvIndexStub) -> None:
    def sample(name: str, **labels: str) -> float:
        value = svc.metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value

    assert sample("kvindex_tokenize_models") == 2
    assert sample("kvindex_tokenize_cache_lookups_total", result="hit") == 0
    await kv.Lookup(pb.LookupRequest(model="llama", messages=json.dumps(CHAT)))
    misses = sample("kvindex_tokenize_cache_lookups_total", result="miss")
    assert misses > 0 and sample("kvindex_tokenize_cache_tokens_total", result="miss") > 100
    await kv.Lookup(pb.LookupRequest(model="llama", messages=json.dumps(CHAT)))
    assert sample("kvindex_tokenize_cache_lookups_total", result="miss") == misses  # nothing new to encode
    assert sample("kvindex_tokenize_cache_lookups_total", result="hit") == misses
    # One more turn: the earlier turns hit, only the new one is encoded.
    longer = [
        *CHAT,
        {"role": "assistant", "content": "Then the next best."},
        {"role": "user", "content": "ok"},
    ]
    hits = sample("kvindex_tokenize_cache_tokens_total", result="hit")
    await kv.Lookup(pb.LookupRequest(model="llama", messages=json.dumps(longer)))
    assert sample("kvindex_tokenize_cache_tokens_total", result="hit") > hits + 100
    assert sample("kvindex_tokenize_requests_total", form="chat") == 3
    assert sample("kvindex_tokenize_cache_bytes") > 0
    with pytest.raises(grpc.aio.AioRpcError):
        await kv.Lookup(pb.LookupRequest(model="llama", messages="[]"))
    assert sample("kvindex_tokenize_errors_total", form="chat") == 1


def test_serve_with_tokenizer_flags(tok_dirs: dict[str, str], tmp_path: Path) -> None:
    """``kvindex serve --tokenizer MODEL=DIR`` as a user runs it, queried by ``kvindex lookup --messages``;
    a directory without tokenizer.json stops serve at once with the reason."""
    port = free_port()
    argv = [KVINDEX, "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(port), "--metrics-port", "-1"]
    proc = subprocess.Popen(
        [*argv, "--tokenizer", f"llama={tok_dirs['llama']}", "--tokenizer", f"qwen={tok_dirs['qwen']}"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        read_log_until(proc, "kvindex_serving")
        (tmp_path / "chat.json").write_text(json.dumps(CHAT))
        out = run_cli(
            "lookup",
            "--server",
            f"127.0.0.1:{port}",
            "--model",
            "qwen",
            "--messages",
            f"@{tmp_path / 'chat.json'}",
        )
        assert out.returncode == 0, out.stderr
        got = [int(x) for x in json.loads(out.stdout)["tokenIds"]]
        assert got == reference(tok_dirs).encode_chat("qwen", CHAT).tolist()
        # No qwen instance yet: the tokenization is the answer, and the user is told nothing can match.
        assert "note: no instance of model 'qwen' is known to the index" in out.stderr
        out = run_cli("score", "--server", f"127.0.0.1:{port}", "--model", "other", "--prompt", "hi")
        assert out.returncode == 1 and "no tokenizer configured" in out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    bad = subprocess.run(
        [*argv, "--tokenizer", f"llama={tmp_path}"], capture_output=True, text=True, timeout=30, check=False
    )
    assert bad.returncode == 2 and "no tokenizer.json" in bad.stderr
    bad = subprocess.run(
        [*argv, "--tokenizer", "llama"], capture_output=True, text=True, timeout=30, check=False
    )
    assert bad.returncode != 0 and "expected MODEL=DIR" in bad.stderr


async def test_a_long_chat_is_tokenized_off_the_event_loop(
    svc: IndexService,
    kv: pb_grpc.KvIndexStub,
    make_publisher: Callable[..., Awaitable[Publisher]],
    tok_dirs: dict[str, str],
) -> None:
    """A chat past OFFLOAD_CHARS is tokenized in a worker thread first: Scores of token ids sent while
    it is being tokenized are answered before it (before, the event loop was held until it was done),
    and its answer is the one its token ids give."""
    from kvindex.api.servicer import OFFLOAD_CHARS
    from kvtools.testing.tokenizer_fixtures import corpus

    await fleet(make_publisher, svc, "llama")
    text = " ".join(corpus(6000, seed=3))
    assert len(text) > 4 * OFFLOAD_CHARS
    chat = json.dumps([{"role": "system", "content": text}, {"role": "user", "content": "Go on."}])
    long_score = asyncio.ensure_future(kv.Score(pb.ScoreRequest(model="llama", messages=chat)))
    await asyncio.sleep(0.05)  # sent, and being tokenized (~0.3-2 s cold on this machine)
    await kv.Score(pb.ScoreRequest(model="llama", token_ids=list(range(64))))
    assert not long_score.done()
    reply = await long_score
    ids = reference(tok_dirs).encode_chat("llama", json.loads(chat))
    again = await kv.Score(pb.ScoreRequest(model="llama", token_ids=ids.tolist()))
    assert reply.prompt_tokens == len(ids) and ranking(reply) == ranking(again)
