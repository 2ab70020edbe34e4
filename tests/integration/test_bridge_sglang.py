"""SGLang bridge end to end: tagged-array events with signed int64 hashes, one page per BlockStored,
storage media (GPU, CPU_PINNED, DISK, EXTERNAL), salted stores (BlockStoredWithMetadata), attention-DP
ranks in the batch, 2-frame replay answers, and SGLang's /metrics."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import (
    FakeEngine,
    MetricsPage,
    SgBatch,
    SgCleared,
    SgMetadata,
    SgRemoved,
    SgStored,
    SgStoredWithMetadata,
    encode,
    fake_hash,
    lookup,
    running_bridge,
    settle,
    signed64,
)

MODEL = "qwen-test"
BS = 2  # --page-size 2
P = list(range(7000, 7000 + 6 * BS))
KEYS = block_keys(P, BS, MODEL)
# SGLang's hashes: the first 8 bytes of a SHA-256 as a signed int64 (many are negative).
H = [signed64(fake_hash("sg", i)) for i in range(6)]
assert any(h < 0 for h in H)


def pages(first: int, end: int, parent: int | None, medium: str = "GPU", **kw: Any) -> list[SgStored]:
    """One BlockStored per page, each chaining from the one before."""
    out: list[SgStored] = []
    for i in range(first, end):
        cls = SgStoredWithMetadata if "metadata" in kw else SgStored
        out.append(cls([H[i]], parent, P[i * BS : (i + 1) * BS], BS, None, medium, **kw))
        parent = H[i]
    return out


def batch(*events: Any, rank: int | None = 0) -> bytes:
    return encode(SgBatch(ts=time.time(), events=list(events), attn_dp_rank=rank))


def shim(nats: EmbeddedNats, eng: FakeEngine, **kw: Any) -> Any:
    return running_bridge(nats.url, eng, engine="sglang", worker_id="sg1", model=MODEL, block_size=BS, **kw)


async def test_sglang_pages_media_gap_and_clear(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine(layout=2).start()  # SGLang answers replays as [seq, payload]
    try:
        async with shim(nats_server, engine) as bridge:
            await engine.publish(batch(*pages(0, 4, None)))
            # HiCache backs pages up to host memory and disk, and to a shared pool (Mooncake).
            await engine.publish(batch(*pages(0, 4, None, "CPU_PINNED")), send=False)  # lost: replayed
            await engine.publish(batch(*pages(0, 2, None, "DISK"), *pages(4, 6, H[3], "EXTERNAL")))
            await settle(bridge, service, [engine])
            assert await lookup(stub, MODEL, token_ids=P) == {"sg1/0": (6, (4, 0, 0, 2))}
            assert bridge.stats.get("frames", "replay_2frame") >= 1

            await engine.publish(batch(SgRemoved(H[:4], "GPU"), SgRemoved(H[2:4])))  # medium omitted: GPU
            await settle(bridge, service, [engine])
            # GPU copies gone (the second remove targets blocks no longer held there): pages 0-3 now
            # come from host memory, 4-5 from the pool.
            assert await lookup(stub, MODEL, token_ids=P) == {"sg1/0": (6, (0, 4, 0, 2))}

            await engine.publish(batch(SgCleared()))
            await settle(bridge, service, [engine])
            # A cache flush empties the local tiers, not the shared pool.
            assert await lookup(stub, MODEL, token_ids=P) == {"sg1/0": (0, (0, 0, 0, 0))}
            assert await lookup(stub, MODEL, block_keys=KEYS[4:]) == {"sg1/0": (2, (0, 0, 0, 2))}
            assert bridge.stats.get("skipped", "removed_not_held") == 2
    finally:
        await engine.close()


async def test_sglang_salted_pages_and_bigram_tokens(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine(layout=2).start()
    try:
        async with shim(nats_server, engine) as bridge:
            await engine.publish(batch(*pages(0, 3, None, metadata=SgMetadata(cache_salt="tenant-9"))))
            # EAGLE bigram pages: tokens as (token, next token) pairs.
            bigram = [[P[i], P[i + 1]] for i in range(0, 2 * BS)]
            h = [signed64(fake_hash("bigram", i)) for i in range(2)]
            await engine.publish(
                batch(
                    SgStored([h[0]], None, bigram[:BS], BS, None, "GPU"),  # type: ignore[arg-type]
                    SgStored([h[1]], h[0], bigram[BS:], BS, None, "GPU"),  # type: ignore[arg-type]
                )
            )
            await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P, salt="tenant-9") == {"sg1/0": (3, (3, 0, 0, 0))}
        assert await lookup(stub, MODEL, token_ids=P) == {"sg1/0": (2, (2, 0, 0, 0))}
    finally:
        await engine.close()


async def test_sglang_attention_dp_ranks_on_one_endpoint_and_load(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine(layout=2).start()
    page = MetricsPage(
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{dp_rank="0",model_name="qwen-test",tp_rank="0"} 5.0\n'
        'sglang:num_running_reqs{dp_rank="1",model_name="qwen-test",tp_rank="0"} 1.0\n'
        'sglang:num_running_reqs{dp_rank="1",model_name="qwen-test",tp_rank="1"} 1.0\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{dp_rank="0",model_name="qwen-test",tp_rank="0"} 4.0\n'
        'sglang:num_queue_reqs{dp_rank="1",model_name="qwen-test",tp_rank="0"} 0.0\n'
        "# TYPE sglang:token_usage gauge\n"
        'sglang:token_usage{dp_rank="0",model_name="qwen-test",tp_rank="0"} 0.5\n'
        'sglang:token_usage{dp_rank="1",model_name="qwen-test",tp_rank="0"} 0.125\n'
        "# TYPE sglang:prompt_tokens_total counter\n"
        'sglang:prompt_tokens_total{dp_rank="0",model_name="qwen-test",tp_rank="0"} 3000.0\n'
        "# TYPE sglang:num_requests_total counter\n"
        'sglang:num_requests_total{dp_rank="0",model_name="qwen-test",tp_rank="0"} 10.0\n'
    )
    try:
        async with running_bridge(
            nats_server.url,
            engine,
            engine="sglang",
            worker_id="sg2",
            model=MODEL,
            block_size=BS,
            dp_ranks=(0, 1),
            one_endpoint=True,
            metrics_url=page.url,
            scrape_interval=0.05,
        ) as bridge:
            await engine.publish(batch(*pages(0, 2, None), rank=0))
            await engine.publish(batch(*pages(0, 5, None), rank=1))
            await engine.publish(batch(*pages(0, 1, None), rank=7))  # a rank this shim does not serve
            await settle(bridge, service, [engine])
            assert bridge.stats.get("skipped", "unexpected_dp_rank") == 1

            def loaded() -> bool:
                states = [service.registry.get(("sg2", r)) for r in (0, 1)]
                return all(s is not None and s.load.running > 0 for s in states)

            await wait_until(loaded, what="load of both ranks")
        assert await lookup(stub, MODEL, token_ids=P) == {
            "sg2/0": (2, (2, 0, 0, 0)),
            "sg2/1": (5, (5, 0, 0, 0)),
        }
        listed = {
            i.instance_id: i.load for i in (await stub.ListInstances(pb.ListInstancesRequest())).instances
        }
        assert (listed["sg2/0"].running, listed["sg2/0"].waiting, listed["sg2/0"].waiting_prefill_tokens) == (
            5,
            4,
            1200,
        )
        assert listed["sg2/0"].kv_usage == pytest.approx(0.5)
        assert (listed["sg2/1"].running, listed["sg2/1"].waiting) == (1, 0)  # tp_rank 1 not counted twice
        assert listed["sg2/1"].kv_usage == pytest.approx(0.125)
    finally:
        page.close()
        await engine.close()
