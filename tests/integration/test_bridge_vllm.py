"""vLLM bridge end to end: a fake vLLM (real ZMQ XPUB + ROUTER) -> the real bridge -> nats-server ->
kvindex -> gRPC Lookup. Batches are encoded with msgspec structs mirroring vLLM's own."""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest
import structlog
import xxhash

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import (
    FakeEngine,
    MetricsPage,
    OldVllmCleared,
    OldVllmRemoved,
    OldVllmStored,
    VllmBatch,
    VllmCleared,
    VllmRemoved,
    VllmStored,
    encode,
    expect,
    fake_hash,
    lookup,
    rank_engines,
    running_bridge,
    settle,
)

MODEL = "llama-test"
BS = 4
P = list(range(1000, 1000 + 6 * BS))  # six full blocks
KEYS = block_keys(P, BS, MODEL)
H = [fake_hash("p", i) for i in range(6)]


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> VllmStored:
    kw.setdefault("medium", "GPU")
    return VllmStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=kw.pop("block_size", BS),
        lora_id=kw.pop("lora_id", None),
        medium=kw.pop("medium"),
        lora_name=kw.pop("lora_name", None),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        **kw,
    )


def batch(*events: Any, rank: int = 0) -> bytes:
    return encode(VllmBatch(ts=time.time(), events=list(events), data_parallel_rank=rank))


def shim(nats: EmbeddedNats, eng: FakeEngine, **kw: Any) -> Any:
    return running_bridge(nats.url, eng, engine="vllm", worker_id="w1", model=MODEL, block_size=BS, **kw)


@pytest.mark.parametrize("flavor", ["map-int", "map-bytes", "array-int"])
async def test_event_shapes_store_chain_remove_clear(
    flavor: str,
    nats_server: EmbeddedNats,
    service: IndexService,
    stub: pb_grpc.KvIndexStub,
    engine: FakeEngine,
) -> None:
    hashes: list[Any] = [h.to_bytes(32, "big") for h in H] if flavor == "map-bytes" else list(H)
    if flavor == "array-int":
        s0 = OldVllmStored(hashes[:3], None, P[:12], BS, None, "GPU")
        s1 = OldVllmStored(hashes[3:], hashes[2], P[12:], BS, None)  # medium omitted: GPU
        rm = [OldVllmRemoved([hashes[5]], "GPU"), OldVllmRemoved([hashes[4]])]
        clear: Any = OldVllmCleared()
    else:
        s0, s1 = stored(hashes[:3], None, P[:12]), stored(hashes[3:], hashes[2], P[12:])
        rm = [VllmRemoved([hashes[5]], "GPU", 0), VllmRemoved([hashes[4]], "GPU", 0)]
        clear = VllmCleared()
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(s0))
        await engine.publish(batch(s1))
        await settle(bridge, service, [engine])
        reply = await stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=P))
        assert list(reply.block_keys) == KEYS
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (6, (6, 0, 0, 0))}

        await engine.publish(batch(*rm))
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (4, (4, 0, 0, 0))}

        await engine.publish(batch(clear, s0))
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (3, (3, 0, 0, 0))}
        assert bridge.stats.snapshot()["events"] == {"stored": 3, "removed": 2, "cleared": 1}
        assert bridge.stats.get("skipped", "unknown_parent") == 0


def spec_key(prev: int, tokens: list[int], extra: bytes = b"") -> int:
    """docs/wire.md §1 written out: xxh3(tokens LE u32 ‖ extra, seed = previous key)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens) + extra, seed=prev)


def spec_seed(model: str, lora: str = "", salt: str = "") -> int:
    return xxhash.xxh3_64_intdigest(f"{model}\0{lora}\0{salt}".encode())


async def test_lora_salt_and_multimodal_extra_keys(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    lora_h = [fake_hash("lora", i) for i in range(2)]
    salt_h = [fake_hash("salt", i) for i in range(3)]
    mm_h = [fake_hash("mm", i) for i in range(3)]
    digest = bytes(range(32))
    async with shim(nats_server, engine) as bridge:
        # LoRA: vLLM puts the adapter name first in every block's extra keys (and in lora_name).
        await engine.publish(
            batch(stored(lora_h, None, P[:8], lora_id=3, lora_name="sql", extra_keys=[["sql"], ["sql"]]))
        )
        # Cache salt: only in the extra keys of the block at token 0; the chain then continues.
        await engine.publish(batch(stored(salt_h[:1], None, P[:4], extra_keys=[["tenant-42"]])))
        await engine.publish(batch(stored(salt_h[1:], salt_h[0], P[4:12], extra_keys=[None, None])))
        # An image over tokens 2..9: (identifier, start relative to each block), then prompt embeddings.
        mm_extra = [[["img-7f3a", 2]], [["img-7f3a", -2]], [digest]]
        await engine.publish(batch(stored(mm_h, None, P[:12], extra_keys=mm_extra)))
        await settle(bridge, service, [engine])

    assert await lookup(stub, MODEL, token_ids=P[:8], lora="sql") == {"w1/0": (2, (2, 0, 0, 0))}
    assert await lookup(stub, MODEL, token_ids=P[:12], salt="tenant-42") == {"w1/0": (3, (3, 0, 0, 0))}
    # Neither adapter blocks, salted blocks nor image blocks pass for the plain prompt's.
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (0, (0, 0, 0, 0))}

    # The multimodal keys, derived independently from the spec text.
    ident = b"img-7f3a"
    item0 = b"\x01" + struct.pack("<qI", 2, len(ident)) + ident
    item1 = b"\x01" + struct.pack("<qI", -2, len(ident)) + ident
    item2 = b"\x02" + struct.pack("<I", 32) + digest
    k0 = spec_key(spec_seed(MODEL), P[0:4], item0)
    k1 = spec_key(k0, P[4:8], item1)
    k2 = spec_key(k1, P[8:12], item2)
    assert await lookup(stub, MODEL, block_keys=[k0, k1, k2]) == {"w1/0": (3, (3, 0, 0, 0))}
    # ... and the LoRA/salt ones: the name and the salt are in the seed, not in the blocks.
    lk0 = spec_key(spec_seed(MODEL, lora="sql"), P[0:4])
    assert await lookup(stub, MODEL, block_keys=[lk0, spec_key(lk0, P[4:8])]) == {"w1/0": (2, (2, 0, 0, 0))}


async def test_tokenless_offload_blocks_refcounts_and_media(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    def tokenless(hashes: list[int], medium: str) -> VllmStored:
        return stored(hashes, None, [], block_size=0, medium=medium)

    async with shim(nats_server, engine, media={"STORAGE": "shared"}) as bridge:
        await engine.publish(batch(stored(H[:3], None, P[:12])))
        await engine.publish(batch(stored(H[:3], None, P[:12])))  # a second physical copy (no dedupe)
        # The CPU offload connector stores placeholders, and repeats them.
        await engine.publish(batch(tokenless(H[:2], "CPU"), tokenless(H[:2], "CPU")))
        await engine.publish(batch(tokenless(H[2:3], "STORAGE")))
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (3, (3, 0, 0, 0))}

        await engine.publish(batch(VllmRemoved(H[:3], "GPU", 0)))  # one copy evicted: still on GPU
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (3, (3, 0, 0, 0))}

        await engine.publish(batch(VllmRemoved(H[:3], "GPU", 0)))  # the other: now only offloaded
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (3, (0, 2, 0, 1))}

        await engine.publish(batch(VllmRemoved(H[1:2], "CPU", 0)))  # one of two CPU references
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (3, (0, 2, 0, 1))}

        await engine.publish(
            batch(VllmRemoved(H[1:2], "CPU", 0), VllmRemoved([fake_hash("never")], "CPU", 0))
        )
        # Unknown placeholder, unknown medium: counted and skipped, the batch's other events apply.
        await engine.publish(
            batch(tokenless([fake_hash("x")], "CPU"), stored(H[3:4], H[2], P[12:16], medium="TAPE"))
        )
        await engine.publish(batch(stored(H[3:4], H[2], P[12:16], medium="DISK")))
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (1, (0, 1, 0, 0))}
        assert await lookup(stub, MODEL, block_keys=KEYS[2:4]) == {"w1/0": (2, (0, 0, 1, 1))}
        assert bridge.stats.get("skipped", "unknown_tokenless_block") == 1
        assert bridge.stats.get("skipped", "unknown_medium") == 1
        assert bridge.stats.get("skipped", "unknown_block_removed") == 1
        # The translation map keeps the held blocks only (H1 is gone from every tier).
        translator = bridge.ranks[0].translator
        assert translator is not None and set(translator.entries) == {H[0], H[2], H[3]}


async def test_block_size_mismatch_after_the_start_is_loud_and_never_mis_keyed(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    # (A conflict in the first keyed store stops the bridge: tests/integration/test_bridge_block_size.py.)
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(stored(H[2:3], None, P[:4])))  # confirms the block size
        await engine.publish(batch(stored(H[:1], None, P[:8], block_size=8)))  # an odd event
        await engine.publish(batch(stored(H[1:2], H[0], P[8:12])))  # a child of the skipped block
        await engine.publish(batch(stored(H[3:4], None, P[:3], block_size=3)))
        await settle(bridge, service, [engine])
        assert bridge.failure is None
        assert bridge.stats.get("skipped", "block_size_mismatch") == 1
        assert bridge.stats.get("skipped", "parent_unkeyable") == 1
        assert bridge.stats.get("skipped", "partial_block") == 1
        assert engine.replay_requests == [0]  # skipped chains do not trigger recovery
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (1, (1, 0, 0, 0))}


async def test_garbage_frames_do_not_kill_the_bridge(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    async with shim(nats_server, engine) as bridge:
        await engine.send_raw([b"kv-events"])  # one frame
        await engine.send_raw([b"kv-events", b"\x00\x01", b"x"])  # seq is not 8 bytes
        await engine.send_raw([b"a", b"b", b"c", b"d"])  # four frames
        await engine.publish(b"\xc1 not msgpack")
        await engine.publish(encode({"no": "events"}))
        await engine.publish(encode([1.0]))
        await engine.publish(
            batch(
                {"type": "BlockExploded"},
                {"type": "BlockStored", "block_hashes": ["nope"], "token_ids": []},
                ["BlockStored", [1]],
                42,
                stored(H[:2], None, P[:8]),
            )
        )
        await settle(bridge, service, [engine])
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (2, (2, 0, 0, 0))}
        assert bridge.stats.snapshot()["garbage"] == {
            "bad_frame_count": 2,
            "bad_seq_frame": 1,
            "malformed_msgpack": 1,
            "bad_batch": 2,
        }
        skipped = bridge.stats.snapshot()["skipped"]
        assert skipped == {"unknown_event_type": 1, "bad_hash": 1, "missing_field": 1, "bad_event": 1}
        assert bridge.links[0].applied == engine.seq - 1  # undecodable batches are not gaps
        assert engine.replay_requests == [0]


@pytest.mark.parametrize("layout", [3, 2])
async def test_gap_is_filled_from_replay_in_both_layouts(
    layout: int, nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine(layout=layout).start()
    try:
        async with shim(nats_server, engine) as bridge:
            await engine.publish(batch(stored(H[:2], None, P[:8])))
            await engine.publish(batch(stored(H[2:4], H[1], P[8:16])), send=False)  # lost on the way
            await engine.publish(batch(VllmRemoved(H[1:2], "CPU", 0)), send=False)  # lost as well
            await engine.publish(batch(stored(H[4:6], H[3], P[16:24])))
            await settle(bridge, service, [engine])
            assert engine.replay_requests == [0, 1]
            assert bridge.stats.get("frames", f"replay_{layout}frame") >= 1
            assert bridge.stats.get("recovery", "gap") == 1
            assert bridge.stats.get("skipped", "unknown_parent") == 0
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (6, (6, 0, 0, 0))}
    finally:
        await engine.close()


async def test_a_lost_last_batch_is_found_by_the_index_snapshot(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    """The last batch lost between engine and bridge leaves no gap to see (nothing came after it);
    a snapshot request (what an index asks for when the engine's answers show its blocks are wrong,
    docs/feedback.md) makes the bridge ask the engine's replay buffer first."""
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(stored(H[:2], None, P[:8])))
        await engine.publish(batch(stored(H[2:4], H[1], P[8:16])), send=False)  # lost, and the last
        await wait_until(lambda: bridge.links[0].applied == 0, what="first batch applied")
        await settle(bridge, service)
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (2, (2, 0, 0, 0))}
        service.consumer.repairs.reconcile(("w1", 0), "degraded")
        await expect(stub, MODEL, {"w1/0": (4, (4, 0, 0, 0))}, token_ids=P)
        assert bridge.stats.get("recovery", "snapshot_check") == 1
        assert engine.replay_requests == [0, 1]
        # Nothing missed: a later snapshot's check finds nothing new and applies nothing.
        service.consumer.repairs.reconcile(("w1", 0), "degraded")
        await wait_until(lambda: engine.replay_requests == [0, 1, 2], what="checked again")
        assert bridge.stats.get("recovery", "snapshot_check") == 1


async def test_mid_stream_start_recovers_history_from_replay(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    # The engine ran before the shim: nobody was subscribed to these.
    await engine.publish(batch(stored(H[:3], None, P[:12])))
    await engine.publish(batch(VllmRemoved(H[2:3], "GPU", 0)))
    await engine.publish(batch(stored(H[2:3], H[1], P[8:12]), stored(H[3:4], H[2], P[12:16])))
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(stored(H[4:6], H[3], P[16:24])))  # parent known only from history
        await settle(bridge, service, [engine])
        assert bridge.stats.get("skipped", "unknown_parent") == 0
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (6, (6, 0, 0, 0))}


async def test_unknown_parent_rebuilds_the_map_from_replay(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    await engine.publish(batch(stored(H[:3], None, P[:12])))
    # The replay socket does not answer at first: neither the start-up replay nor the gap's.
    engine.ignore_next = 2
    async with shim(nats_server, engine, replay_timeout=0.3) as bridge:
        await engine.publish(batch(stored(H[3:6], H[2], P[12:24]), VllmRemoved(H[3:4], "GPU", 0)))
        await settle(bridge, service, [engine])
        assert engine.replay_requests == [0, 0, 0]  # start-up, gap, then the rebuild that answered
        assert bridge.stats.get("recovery", "rebuild") == 1
        assert bridge.stats.get("skipped", "unknown_parent") == 0
    # The blocks stored before the shim came are not claimed (their store was never applied), but
    # the new ones chain from them correctly, and the rest of the batch applied.
    assert await lookup(stub, MODEL, block_keys=KEYS[4:6]) == {"w1/0": (2, (2, 0, 0, 0))}
    assert await lookup(stub, MODEL, block_keys=KEYS[3:6]) == {"w1/0": (0, (0, 0, 0, 0))}


async def test_unknown_parent_without_replay_is_counted_not_guessed(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    await engine.publish(batch(stored(H[:3], None, P[:12])))
    async with shim(nats_server, engine, replay=None) as bridge:
        await engine.publish(batch(stored(H[3:5], H[2], P[12:20])))
        await engine.publish(batch(stored(H[5:6], H[4], P[20:24])))  # descends from a skipped block
        await settle(bridge, service, [engine])
        assert bridge.stats.get("skipped", "unknown_parent") == 2
        assert bridge.stats.get("skipped", "parent_unkeyable") == 1
        assert bridge.stats.get("recovery", "joined_mid_stream") == 1
    assert await lookup(stub, MODEL, block_keys=KEYS[3:6]) == {"w1/0": (0, (0, 0, 0, 0))}
    assert engine.replay_requests == []


async def test_engine_restart_starts_a_new_epoch(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    Q = list(range(5000, 5000 + 2 * BS))
    async with shim(nats_server, engine) as bridge:
        await engine.publish(batch(stored(H[:3], None, P[:12])))
        await engine.publish(batch(stored(H[3:4], H[2], P[12:16])))
        await settle(bridge, service, [engine])
        first_epoch = bridge.ranks[0].publisher.epoch  # type: ignore[union-attr]
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (4, (4, 0, 0, 0))}

        engine.restart()  # the engine's seq starts over at 0: its cache is empty
        await engine.publish(batch(stored([fake_hash("q", 0), fake_hash("q", 1)], None, Q)))
        await wait_until(lambda: bridge.stats.get("recovery", "engine_restart") == 1, what="restart seen")
        await settle(bridge, service, [engine])
        assert bridge.ranks[0].publisher.epoch > first_epoch  # type: ignore[union-attr]
        assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (0, (0, 0, 0, 0))}
        assert await lookup(stub, MODEL, token_ids=Q) == {"w1/0": (2, (2, 0, 0, 0))}
        listed = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
        assert [i.epoch for i in listed.instances] == [bridge.ranks[0].publisher.epoch]  # type: ignore[union-attr]


@pytest.mark.parametrize("replay", [True, False])
async def test_unrecoverable_gap_resyncs_with_a_new_epoch(
    replay: bool,
    nats_server: EmbeddedNats,
    service: IndexService,
    stub: pb_grpc.KvIndexStub,
    engine: FakeEngine,
) -> None:
    engine.buffer_size = 1  # the replay buffer keeps only the newest batch
    kw = {} if replay else {"replay": None}
    async with shim(nats_server, engine, **kw) as bridge:
        await engine.publish(batch(stored(H[:3], None, P[:12])))
        await settle(bridge, service, [engine])
        first_epoch = bridge.ranks[0].publisher.epoch  # type: ignore[union-attr]
        await engine.publish(
            batch(VllmRemoved(H[:1], "GPU", 0)), send=False
        )  # lost, and gone from the buffer
        await engine.publish(batch(stored([fake_hash("z")], None, P[:4])))
        await settle(bridge, service, [engine])
        reason = "resync_gap_unrecoverable" if replay else "resync_gap_without_replay"
        assert bridge.stats.get("recovery", reason) == 1
        assert bridge.ranks[0].publisher.epoch > first_epoch  # type: ignore[union-attr]
    # Old blocks whose fate is unknown are gone with the old epoch; the newest store is known.
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (1, (1, 0, 0, 0))}


async def test_dp_ranks_on_consecutive_ports(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engines = await rank_engines(2)
    try:
        async with running_bridge(
            nats_server.url,
            *engines,
            engine="vllm",
            worker_id="w1",
            model=MODEL,
            block_size=BS,
            dp_ranks=(0, 1),
        ) as bridge:
            await engines[0].publish(batch(stored(H[:2], None, P[:8]), rank=0))
            await engines[1].publish(batch(stored(H[:4], None, P[:16]), rank=1))
            await engines[1].publish(batch(VllmRemoved(H[3:4], "GPU", 0), rank=1))
            await settle(bridge, service, engines)
            assert [link.stream.endpoint for link in bridge.links] == [e.endpoint for e in engines]
        assert await lookup(stub, MODEL, token_ids=P) == {
            "w1/0": (2, (2, 0, 0, 0)),
            "w1/1": (3, (3, 0, 0, 0)),
        }
    finally:
        for eng in engines:
            await eng.close()


async def test_load_from_prometheus_metrics(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    page = MetricsPage(
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="llama-test"} 3.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="llama-test"} 2.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="llama-test"} 0.25\n'
        "# TYPE vllm:request_prompt_tokens histogram\n"
        'vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="llama-test"} 10.0\n'
        'vllm:request_prompt_tokens_sum{engine="0",model_name="llama-test"} 1000.0\n'
        'vllm:request_prompt_tokens_count{engine="0",model_name="llama-test"} 10.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="8",engine="0",num_gpu_blocks="512",num_cpu_blocks="None"} 1.0\n'
    )
    try:
        async with shim(nats_server, engine, metrics_url=page.url, scrape_interval=0.05) as bridge:

            def loaded() -> bool:
                state = service.registry.get(("w1", 0))
                return state is not None and state.load.waiting_prefill_tokens == 200

            await wait_until(loaded, what="load in the index")
            (info,) = (await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))).instances
            assert (info.load.running, info.load.waiting, info.load.waiting_prefill_tokens) == (3, 2, 200)
            assert info.load.kv_usage == pytest.approx(0.25)
            assert info.capacity.gpu == 512
            # The engine's own config says 8 tokens per block, the shim was told 4: reported loudly.
            assert bridge.stats.get("load", "block_size_mismatch") >= 1
            page.text = "garbage{"
            await wait_until(lambda: bridge.stats.get("load", "error") >= 1, what="a failed scrape")
    finally:
        page.close()


async def test_reannounced_prefix_hits_are_not_reference_counted(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    # Engines that re-emit BlockStored for prefix-cache hits: --reannounce-tier gpu.
    async with shim(nats_server, engine, set_tiers=("gpu",)) as bridge:
        await engine.publish(batch(stored(H[:3], None, P[:12])))
        await engine.publish(batch(stored(H[:3], None, P[:12])))  # a prefix hit, announced again
        await engine.publish(batch(VllmRemoved(H[1:3], "GPU", 0)))  # one eviction removes it
        await settle(bridge, service, [engine])
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (1, (1, 0, 0, 0))}


async def test_hybrid_groups_and_bad_group_input(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub, engine: FakeEngine
) -> None:
    """A vLLM 0.32 hybrid model (group 0 sliding window of 8 tokens, group 1 full attention) over the
    real bridge and index; events with bad group information are counted, logged with the worker id,
    and lose nothing else."""

    def group(
        g: int, hashes: list[Any], tokens: list[int], kind: str | None, window: int | None = None
    ) -> Any:
        return VllmStored(
            hashes, None, tokens, BS, None, "GPU", None,
            group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
        )  # fmt: skip

    # vLLM's order: the sliding-window group (keeping the window before the prompt's end) first.
    step = [group(0, H[4:6], P, "sliding_window", 8), group(1, H, P, "full_attention")]
    bad = [
        group(3, H[:2], P[:8], None),  # a group index without a kind
        group(0, H[:1], P[:4], "sliding_window", 16),  # another window for group 0
        VllmRemoved([H[0]], "GPU", 7),  # a group never stored
        VllmRemoved([H[0]], "GPU", 4096),  # outside 0..1023
    ]
    with structlog.testing.capture_logs() as logs:
        async with shim(nats_server, engine) as bridge:
            await engine.publish(batch(*step, *bad))
            await settle(bridge, service, [engine])
            publisher = bridge.ranks[0].publisher
            assert publisher is not None
            await publisher.heartbeat()
            await wait_until(
                lambda: (s := service.registry.get(("w1", 0))) is not None and bool(s.groups_announced),
                what="the layout announced",
            )
            assert bridge.stats.snapshot()["skipped"] == {
                "group_without_kind": 2,
                "group_spec_mismatch": 1,
                "unknown_group_removed": 1,
                "bad_group": 1,
            }
    (info,) = (await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))).instances
    assert (info.state, info.kv_groups) == ("exact", "sliding_window(8) + full_attention")
    # 25 tokens: 24 may hit, and the window before token 24 (blocks 4, 5) is held: 6 blocks.
    assert await lookup(stub, MODEL, token_ids=[*P, 7]) == {"w1/0": (6, (6, 0, 0, 0))}
    # The prompt itself: 23 tokens may hit; no window of two blocks ends at or before token 20, where
    # full attention stops: nothing (a full-attention index alone would promise 5 blocks).
    assert await lookup(stub, MODEL, token_ids=P) == {"w1/0": (0, (0, 0, 0, 0))}
    skips = {e["reason"]: e for e in logs if e["event"] == "kv_event_skipped"}
    assert set(skips) == {"group_without_kind", "group_spec_mismatch", "unknown_group_removed", "bad_group"}
    assert all(e["worker"] == "w1" and e["engine"] == "vllm" for e in skips.values())
