"""The bridge's block size comes from the engine: learned from its KV events (or vLLM's /metrics)
when ``--block-size`` is not given, checked when it is, and a conflict stops kvshim loudly (exit 1,
both sizes named) instead of skipping every event. Also: the ``--endpoint`` a bridge announces."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.test_bridge_fakes import (
    FakeEngine,
    MetricsPage,
    VllmBatch,
    VllmRemoved,
    VllmStored,
    WireTap,
    encode,
    expect,
    fake_hash,
    running_bridge,
    settle,
)
from workers_shim.bridges import Bridge, BridgeConfig, blocksize
from workers_shim.bridges.blocksize import BlockSizeConflict
from workers_shim.bridges.native import NativeStored

KVSHIM = str(Path(sys.executable).with_name("kvshim"))
MODEL = "bs-model"
P = list(range(7000, 7000 + 128))  # four blocks of 32, eight of 16


def stored(tokens: list[int], size: int, parent: Any = None, tag: str = "p") -> VllmStored:
    n = len(tokens) // size
    hashes = [fake_hash(tag, size, i) for i in range(n)]
    return VllmStored(hashes, parent, tokens, size, None, "GPU", None)


def batch(*events: Any) -> bytes:
    return encode(VllmBatch(time.time(), list(events), 0))


def shim(nats: EmbeddedNats, eng: FakeEngine, **kw: Any) -> Any:
    return running_bridge(nats.url, eng, engine="vllm", worker_id="w1", model=MODEL, **kw)


async def test_without_block_size_it_is_learned_before_anything_is_published(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    tap = await WireTap().start(nats_server.url, "w1")
    try:
        async with shim(nats_server, engine) as bridge:  # vLLM started with --block-size 32
            await engine.publish(batch(VllmRemoved([fake_hash("old")], "GPU")))  # nothing keyed yet
            await wait_until(lambda: bridge.links[0].applied == 0, what="first batch consumed")
            await asyncio.sleep(0.3)  # > heartbeat interval: a heartbeat would have gone out by now
            assert bridge.block_size is None and bridge.ranks[0].publisher is None
            assert service.registry.get(("w1", 0)) is None and tap.batches == []
            await engine.publish(batch(stored(P, 32)))
            await settle(bridge, service, [engine])
            assert bridge.block_size == 32 and bridge.failure is None
            assert bridge.stats.get("batches", "before_block_size") == 1
        state = service.registry.get(("w1", 0))
        assert state is not None and state.block_size == 32
        await expect(stub, MODEL, {"w1/0": (4, (4, 0, 0, 0))}, token_ids=P)
        assert tap.keys("stored") == set(block_keys(P, 32, MODEL))
    finally:
        await tap.close()


async def test_given_block_size_that_the_engine_contradicts_stops_the_bridge(
    nats_server: EmbeddedNats, service: IndexService, engine: FakeEngine
) -> None:
    tap = await WireTap().start(nats_server.url, "w1")
    try:
        async with shim(nats_server, engine, block_size=16) as bridge:
            await engine.publish(batch(stored(P, 32)))
            await asyncio.wait_for(bridge.failed.wait(), 5)
            assert isinstance(bridge.failure, BlockSizeConflict)
            assert (bridge.failure.engine_size, bridge.failure.size) == (32, 16)
            assert "announce 32" in str(bridge.failure) and "--block-size says 16" in str(bridge.failure)
            await engine.publish(batch(stored(P[:64], 16, tag="q")))  # nothing more is applied
            await asyncio.sleep(0.1)
        assert tap.keys("stored") == set()  # never keyed with the wrong size
    finally:
        await tap.close()


async def test_conflict_in_the_replayed_history_fails_the_start(
    nats_server: EmbeddedNats, service: IndexService, engine: FakeEngine
) -> None:
    await engine.publish(batch(stored(P, 32)), send=False)  # published before the shim started
    bridge = Bridge(
        BridgeConfig(
            engine="vllm",
            zmq=engine.endpoint,
            replay=engine.replay_endpoint,
            worker_id="w1",
            model=MODEL,
            block_size=16,
            nats_url=nats_server.url,
            stats_log_interval=0,
        )
    )
    with pytest.raises(BlockSizeConflict, match=r"announce 32 .* says 16"):
        await bridge.start()
    assert bridge.ranks[0].publisher is None or bridge.ranks[0].publisher._closed


async def test_metrics_tell_the_block_size_before_any_event_and_events_must_agree(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    page = MetricsPage(
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="512"} 1.0\n'
    )
    try:
        async with shim(nats_server, engine, metrics_url=page.url, scrape_interval=0.05) as bridge:
            # An idle engine: the heartbeat (with the size and the endpoint) goes out anyway.
            await wait_until(lambda: service.registry.get(("w1", 0)) is not None, what="a heartbeat")
            state = service.registry.get(("w1", 0))
            assert state is not None and state.block_size == 32
            await wait_until(lambda: state.endpoint == page.url.split("/")[2], what="endpoint")
            (info,) = (await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))).instances
            assert info.endpoint == page.url.split("/")[2]  # 127.0.0.1:PORT of --metrics-url
            await engine.publish(batch(stored(P, 32)))
            await expect(stub, MODEL, {"w1/0": (4, (4, 0, 0, 0))}, token_ids=P)
            # The engine restarts with another block size: its first store is checked again.
            engine.restart()
            await engine.publish(batch(stored(P, 16, tag="r")))
            await asyncio.wait_for(bridge.failed.wait(), 5)
            assert isinstance(bridge.failure, BlockSizeConflict)
            assert "announce 16" in str(bridge.failure) and "/metrics" in str(bridge.failure)
    finally:
        page.close()


async def test_bridge_announces_the_endpoint_it_is_given(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    async with shim(nats_server, engine, block_size=32, endpoint="10.1.2.3:8000"):
        await wait_until(lambda: service.registry.endpoint("w1/0") == "10.1.2.3:8000", what="endpoint")
    with pytest.raises(ValueError, match="port"):
        Bridge(BridgeConfig(engine="vllm", zmq="tcp://x:1", worker_id="w", model="m", endpoint="h:x"))


def test_sglang_partial_pages_are_not_a_conflict() -> None:
    def page(n_tokens: int, size: int) -> NativeStored:
        return NativeStored([1], None, list(range(n_tokens)), size, "gpu")

    seen = blocksize.evidence([page(16, 16), page(16, 16), page(5, 5)], kv_group=0)
    assert blocksize.learn(seen, partial_blocks=True) == 16
    assert blocksize.conflict(seen, 16, partial_blocks=True) is None
    assert blocksize.conflict(seen, 16, partial_blocks=False) == 5  # vLLM never stores short blocks
    assert blocksize.conflict(blocksize.evidence([page(32, 32)], 0), 16, partial_blocks=True) == 32
    # Stores of other KV groups, token-less placeholders and inconsistent ones tell nothing.
    other = NativeStored([1, 2], None, list(range(64)), 32, "gpu", group=1)
    tokenless = NativeStored([1], None, [], 0, "cpu")
    assert blocksize.evidence([other, tokenless, NativeStored([1, 2], None, [1, 2, 3], 0, "gpu")], 0) == []
    assert blocksize.evidence([NativeStored([1, 2], None, list(range(8)), 0, "gpu")], 0) == [(4, False)]


async def test_kvshim_exits_non_zero_naming_both_sizes(nats_server: EmbeddedNats) -> None:
    engine = await FakeEngine().start()
    await engine.publish(batch(stored(P, 32)), send=False)
    try:
        proc = await asyncio.create_subprocess_exec(
            KVSHIM,
            "vllm",
            "--zmq",
            engine.endpoint,
            "--replay",
            engine.replay_endpoint,
            "--worker-id",
            "cli1",
            "--model",
            MODEL,
            "--block-size",
            "16",
            "--nats",
            nats_server.url,
            "--log-format",
            "json",
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1
        last = err.decode().strip().splitlines()[-1]
        assert last.startswith("kvshim vllm: block size conflict") and "32" in last and "16" in last
    finally:
        await engine.close()
    bad = await asyncio.create_subprocess_exec(
        KVSHIM, "vllm", "--zmq", "tcp://x:1", "--worker-id", "w", "--model", "m", "--endpoint", "http://h:1",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await bad.communicate()
    assert bad.returncode == 2 and "not a DNS name" in err.decode()
