"""TensorRT-LLM bridge end to end: streaming map events (signed hashes, lora_name, cache_salt, locality,
per-block mm_keys), the pull API's dict events (stored / updated cache level / removed), and the
trtllm_* Prometheus metrics."""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest

from kvindex.keys import block_keys, block_keys_extra, mm_extra
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import (
    FakeEngine,
    MetricsPage,
    TrtBatch,
    TrtMmKey,
    TrtRemoved,
    TrtStored,
    encode,
    fake_hash,
    lookup,
    running_bridge,
    settle,
    signed64,
)

MODEL = "nemotron-test"
BS = 8
P = list(range(30_000, 30_000 + 4 * BS))
KEYS = block_keys(P, BS, MODEL)


def batch(*events: Any, rank: int = 0) -> bytes:
    return encode(TrtBatch(ts=time.time(), events=list(events), data_parallel_rank=rank))


def hashes(tag: str, n: int) -> list[int]:
    return [signed64(fake_hash(tag, i)) for i in range(n)]


def shim(nats: EmbeddedNats, eng: FakeEngine, **kw: Any) -> Any:
    return running_bridge(nats.url, eng, engine="trtllm", worker_id="trt1", model=MODEL, block_size=BS, **kw)


async def test_trtllm_streaming_events(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    h, lh, sh, mh = hashes("plain", 4), hashes("lora", 2), hashes("salt", 2), hashes("mm", 2)
    image = bytes(range(100, 132))
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(TrtStored(h[:3], None, P[:24], BS, locality="local")))
        await engine.publish(batch(TrtStored(h[3:], h[2], P[24:], BS), TrtRemoved(h[3:])))
        await engine.publish(batch(TrtStored(lh, None, P[:16], BS, lora_id=4, lora_name="fin")))
        await engine.publish(batch(TrtStored(sh, None, P[:16], BS, cache_salt="acme")))
        mm = [[TrtMmKey(hash=image, start_offset=3)], []]
        await engine.publish(batch(TrtStored(mh, None, P[:16], BS, mm_keys=mm)))
        await settle(bridge, service, [engine])
        assert bridge.stats.snapshot().get("skipped", {}) == {}
    assert await lookup(stub, MODEL, token_ids=P) == {"trt1/0": (3, (3, 0, 0, 0))}
    assert await lookup(stub, MODEL, token_ids=P, lora="fin") == {"trt1/0": (2, (2, 0, 0, 0))}
    assert await lookup(stub, MODEL, token_ids=P, salt="acme") == {"trt1/0": (2, (2, 0, 0, 0))}
    mm_keys = block_keys_extra(P[:16], BS, MODEL, extras=[mm_extra(image, 3), b""])
    assert mm_keys[0] != KEYS[0] and mm_keys[1] != KEYS[1]  # the image changes the whole chain
    assert await lookup(stub, MODEL, block_keys=mm_keys) == {"trt1/0": (2, (2, 0, 0, 0))}
    # The suffix as docs/wire.md spells it, and the vectors it publishes.
    assert mm_extra(image, 3) == b"\x01" + struct.pack("<qI", 3, 32) + image
    doc_extras = [mm_extra("img-1", 1), mm_extra("img-1", -1)]
    assert block_keys_extra([1, 2, 3, 4], 2, "m", extras=doc_extras) == [
        9074535537195300705,
        12593102442893123645,
    ]


async def test_trtllm_pull_api_events(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    h = [fake_hash("pull", i) for i in range(3)]

    def block(i: int) -> dict[str, Any]:
        tokens = [
            {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in P[i * BS : (i + 1) * BS]
        ]
        return {
            "type": "stored_block",
            "block_hash": h[i],
            "tokens": tokens,
            "cache_level": 0,
            "priority": 35,
        }

    events = [
        {
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [100, 400]},
            "window_size": 64,
        },
        {
            "event_id": 1,
            "data": {"type": "stored", "parent_hash": None, "blocks": [block(0), block(1), block(2)]},
            "window_size": 64,
            "attention_dp_rank": 0,
        },
    ]
    moved = {
        "event_id": 2,
        "data": {
            "type": "updated",
            "block_hash": h[1],
            "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1},
            "priority": None,
        },
    }
    removed = {"event_id": 3, "data": {"type": "removed", "block_hashes": [h[2]]}, "window_size": 64}
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(*events))
        await engine.publish(batch(moved, removed))
        await settle(bridge, service, [engine])
        assert bridge.stats.get("events", "ignored") == 1
    # Block 0 on GPU, block 1 offloaded to host memory, block 2 evicted.
    assert await lookup(stub, MODEL, token_ids=P) == {"trt1/0": (2, (1, 1, 0, 0))}


async def test_trtllm_load(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    page = MetricsPage(
        "# TYPE trtllm_num_requests_running gauge\n"
        'trtllm_num_requests_running{engine_type="trtllm",model_name="nemotron-test"} 7.0\n'
        "# TYPE trtllm_num_requests_waiting gauge\n"
        'trtllm_num_requests_waiting{engine_type="trtllm",model_name="nemotron-test"} 3.0\n'
        "# TYPE trtllm_kv_cache_utilization gauge\n"
        'trtllm_kv_cache_utilization{engine_type="trtllm",model_name="nemotron-test"} 0.75\n'
        "# TYPE trtllm_prompt_tokens counter\n"
        'trtllm_prompt_tokens_total{engine_type="trtllm",model_name="nemotron-test"} 5000.0\n'
        "# TYPE trtllm_request_success counter\n"
        'trtllm_request_success_total{engine_type="trtllm",finished_reason="stop",model_name="m"} 8.0\n'
        'trtllm_request_success_total{engine_type="trtllm",finished_reason="length",model_name="m"} 2.0\n'
    )
    try:
        async with shim(nats_server, engine, metrics_url=page.url, scrape_interval=0.05):

            def loaded() -> bool:
                state = service.registry.get(("trt1", 0))
                return state is not None and state.load.running == 7

            await wait_until(loaded, what="load in the index")
        (info,) = (await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))).instances
        assert (info.load.running, info.load.waiting, info.load.waiting_prefill_tokens) == (7, 3, 1500)
        assert info.load.kv_usage == pytest.approx(0.75)
    finally:
        page.close()


async def test_trtllm_variable_sliding_windows_are_kv_cache_groups(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    """TensorRT-LLM's variable sliding window attention keeps one cache per window size and names it
    (``window_size``) on every pull-API event: the largest window is the full-attention group, the
    others sliding-window groups, and the index applies the hybrid rule over them."""
    h = [fake_hash("vswa", i) for i in range(4)]

    def block(i: int) -> dict[str, Any]:
        tokens = [
            {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in P[i * BS : (i + 1) * BS]
        ]
        return {
            "type": "stored_block",
            "block_hash": h[i],
            "tokens": tokens,
            "cache_level": 0,
            "priority": 35,
        }

    def event(n: int, window: int, data: dict[str, Any]) -> dict[str, Any]:
        return {"event_id": n, "data": data, "window_size": window}

    created = {"type": "created", "num_blocks_per_cache_level": [100, 0]}
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(event(0, 16, created), event(1, 4096, created)))
        await engine.publish(
            batch(
                event(2, 16, {"type": "stored", "parent_hash": None, "blocks": [block(0), block(1)]}),
                event(
                    3, 4096, {"type": "stored", "parent_hash": None, "blocks": [block(i) for i in range(4)]}
                ),
            )
        )
        await settle(bridge, service, [engine])
        publisher = bridge.ranks[0].publisher
        assert publisher is not None
        assert publisher.groups == [
            {"kind": "sliding_window", "block_size": BS, "window": 16},
            {"kind": "full_attention", "block_size": BS},
        ]
        await publisher.heartbeat()
        await wait_until(
            lambda: (s := service.registry.get(("trt1", 0))) is not None and bool(s.groups_announced),
            what="the windows announced",
        )
        (info,) = (await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))).instances
        assert (info.state, info.kv_groups) == ("exact", "sliding_window(16) + full_attention")
        # 31 tokens may hit: the full-attention window holds 3 blocks of them, the 16-token window the
        # two blocks before token 16 only, so 16 tokens are reusable.
        assert await lookup(stub, MODEL, token_ids=P) == {"trt1/0": (2, (2, 0, 0, 0))}
        await engine.publish(batch(event(4, 16, {"type": "removed", "block_hashes": [h[1]]})))
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"trt1/0": (1, (1, 0, 0, 0))}
        assert bridge.stats.snapshot().get("skipped", {}) == {}
