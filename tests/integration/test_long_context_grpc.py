"""A 256 K-token agent context over a real gRPC server (issue 34, item 5): Score with the prompt's
262,144+ token ids and with the same conversation as ``messages`` rank by the whole 16,384-block prefix;
the conversation grown by a turn reuses the server's remembered prompt (only the new turn is encoded)
and matches the blocks it still shares."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.tokenizer_fixtures import corpus, make_tokenizer_dir
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

BS = 16
TOKENS = 256 * 1024


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tokenizer_dir(tmp_path_factory.mktemp("tok") / "llama3", "llama3"))


def long_chat(ref: Tokenizers) -> list[dict[str, str]]:
    """An agent conversation of at least TOKENS tokens: a system prompt, then user/assistant turns."""
    lines = corpus(4000, seed=3)
    chat = [{"role": "system", "content": "\n".join(lines[:40])}]
    i = 40
    while len(chat) < 1801:  # ends with a user message
        n = 3 + i % 5
        chat.append(
            {"role": ("user", "assistant")[len(chat) % 2], "content": "\n".join(lines[i % 3900 :][:n])}
        )
        i += n
    assert len(ref.encode_chat("llama", chat)) >= TOKENS
    return chat


@pytest.fixture
async def svc(make_service: Callable[..., Awaitable[IndexService]], tok_dir: str) -> IndexService:
    return await make_service(tokenizers={"llama": tok_dir})


@pytest.fixture
async def kv(svc: IndexService) -> AsyncIterator[pb_grpc.KvIndexStub]:
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        yield pb_grpc.KvIndexStub(channel)


async def test_a_256k_token_conversation_scores_by_its_whole_prefix(
    svc: IndexService,
    kv: pb_grpc.KvIndexStub,
    make_publisher: Callable[..., Awaitable[Publisher]],
    tok_dir: str,
) -> None:
    ref = Tokenizers.from_dirs({"llama": tok_dir})  # independent of the server's registry
    chat = long_chat(ref)
    ids = ref.encode_chat("llama", chat).tolist()
    keys = block_keys(ids, BS, "llama")
    assert len(keys) >= 16384
    pubs = [
        await make_publisher(worker=f"w{i}", model="llama", block_size=BS, capacity={"gpu": 40000})
        for i in range(3)
    ]
    # w0 holds the whole conversation, w1 its first half, w2 nothing of it.
    pubs[0].stored(keys)
    pubs[1].stored(keys[: len(keys) // 2])
    for p in pubs:
        await p.heartbeat()
    await wait_until(lambda: svc.index.stats().entries[0] >= len(keys) * 3 // 2, what="blocks indexed")
    await wait_until(lambda: len(svc.registry.of_model("llama")) == 3, what="instances registered")
    expected = {"w0/0": len(keys), "w1/0": len(keys) // 2, "w2/0": 0}

    by_ids = await kv.Score(pb.ScoreRequest(model="llama", token_ids=ids))
    assert by_ids.total_blocks == len(keys) and by_ids.prompt_tokens == len(ids)
    assert {r.instance_id: r.matched_blocks for r in by_ids.ranked} == expected
    assert by_ids.ranked[0].instance_id == "w0/0"

    stats = svc.tokenizers.cache.stats
    by_text = await kv.Score(pb.ScoreRequest(model="llama", messages=json.dumps(chat)))
    assert by_text.total_blocks == len(keys) and by_text.prompt_tokens == len(ids)
    assert {r.instance_id: r.matched_blocks for r in by_text.ranked} == expected
    assert stats.miss_tokens >= len(ids) - 100  # cold: (nearly) everything encoded once

    # The conversation grows by an answer and a question: the server reuses the remembered prompt,
    # encodes only the new turns, and w0 still matches every block the two prompts share.
    grown = [*chat, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And then?"}]
    grown_ids = ref.encode_chat("llama", grown).tolist()
    # (Llama 3's generation prompt is the next assistant turn's header: the old prompt is a prefix.)
    shared = next((i for i, (a, b) in enumerate(zip(ids, grown_ids, strict=False)) if a != b), len(ids))
    assert shared > len(ids) - 10
    misses, reused = stats.miss_tokens, stats.prefix_tokens
    by_text = await kv.Score(pb.ScoreRequest(model="llama", messages=json.dumps(grown)))
    assert by_text.prompt_tokens == len(grown_ids)
    assert by_text.ranked[0].instance_id == "w0/0" and by_text.ranked[0].matched_blocks == shared // BS
    assert stats.miss_tokens - misses < 50
    assert stats.prefix_tokens - reused > len(ids) - 100
