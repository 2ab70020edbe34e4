"""Real vLLM 0.32.0 bytes (kvtools/data/vllm_capture) through the real bridge.

The fake engine sends the captured frames byte for byte (live messages on its PUB socket, the captured
DEALER answers on its ROUTER socket); the expected index state comes from the prompts the capture's
README lists, keyed independently with :func:`kvindex.keys.block_keys`, and the operations read off the
capture's decoded.txt (which blocks of which prompt each event stores or evicts).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import FakeEngine, WireTap, lookup, read_capture, running_bridge, settle

MODEL = "tiny-llama"
BS = 32  # the capture's block size
SYS = list(range(100, 164))
PROMPTS = {
    "A": SYS + list(range(200, 240)),
    "C300": SYS + list(range(300, 340)),
    "C400": SYS + list(range(400, 440)),
    **{f"D{i}": list(range(500 + 7 * i, 600 + 7 * i)) for i in range(4)},
    **{f"E{i}": list(range(600 + 5 * i, 700 + 5 * i)) for i in range(4)},
}
KEYS = {name: block_keys(tokens, BS, MODEL) for name, tokens in PROMPTS.items()}

# Per live batch: ("S", prompt, first block, end block) stores, ("R", prompt, block) evictions, ("C",).
_EVICTIONS_R1 = [
    ("R", "A", 2),
    ("R", "C300", 2),
    ("S", "E1", 0, 3),
    ("R", "C400", 2),
    ("R", "A", 1),
    ("R", "A", 0),
    ("R", "D0", 2),
    ("S", "E2", 0, 3),
    ("R", "D0", 1),
    ("R", "D0", 0),
    ("R", "D1", 2),
    ("R", "D1", 1),
    ("S", "E3", 0, 3),
]
OPS: dict[str, list[list[tuple[Any, ...]]]] = {
    "r1_sha256_int": [
        [("S", "A", 0, 3)],
        [("S", "C300", 2, 3)],
        [("S", "C400", 2, 3)],
        [("S", "D0", 0, 3)],
        [("S", "D1", 0, 3), ("S", "D2", 0, 3), ("S", "D3", 0, 3)],
        [("S", "E0", 0, 3)],
        _EVICTIONS_R1,
        [("C",), ("S", "A", 0, 3)],
    ],
    # Same requests, other step boundaries, 32-byte sha256_cbor digests as hashes.
    "r2_sha256cbor_bytes": [
        [("S", "A", 0, 3)],
        [("S", "C300", 2, 3), ("S", "C400", 2, 3)],
        [("S", "D0", 0, 3), ("S", "D1", 0, 3)],
        [("S", "D2", 0, 3), ("S", "D3", 0, 3)],
        [("S", "E0", 0, 3), *_EVICTIONS_R1[:3]],
        _EVICTIONS_R1[3:],
        [("C",), ("S", "A", 0, 3)],
    ],
    "r4_serve_sha256_int": [[("S", "A", 0, 3)], [("S", "C300", 2, 3)]],
}


class Model:
    """The expected index state: blocks held, as (prompt, block index) -> key."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.stored: set[int] = set()
        self.removed: set[int] = set()

    def apply(self, ops: list[tuple[Any, ...]]) -> None:
        for op in ops:
            if op[0] == "S":
                keys = KEYS[op[1]][op[2] : op[3]]
                self.held.update(keys)
                self.stored.update(keys)
            elif op[0] == "R":
                key = KEYS[op[1]][op[2]]
                self.held.discard(key)
                self.removed.add(key)
            else:
                self.held.clear()

    def matches(self) -> dict[str, int]:
        out = {}
        for name, keys in KEYS.items():
            n = 0
            while n < len(keys) and keys[n] in self.held:
                n += 1
            out[name] = n
        return out


async def index_matches(stub: pb_grpc.KvIndexStub) -> dict[str, int]:
    out = {}
    for name, tokens in PROMPTS.items():
        (match,) = (await lookup(stub, MODEL, token_ids=tokens)).values()
        assert match[1][1:] == (0, 0, 0)  # GPU only
        out[name] = match[0]
    return out


def live_messages(name: str) -> list[list[bytes]]:
    return [m for m in read_capture(name) if len(m) == 3 and m[0] == b"kv-events"][: len(OPS[name])]


def replay_answer(name: str, start: int) -> list[list[bytes]]:
    """The captured frames a DEALER received for a replay from ``start`` (delimiter included)."""
    out: list[list[bytes]] = []
    expected = start
    for m in read_capture(name):
        if len(m) != 4 or m[0] != b"":
            continue
        if m[2] == b"\xff" * 8:
            if out:
                out.append(m)
                return out
            continue
        seq = int.from_bytes(m[2], "big")
        if seq == expected and (out or seq == start):
            out.append(m)
            expected += 1
        else:
            out = []
            expected = start
    raise AssertionError(f"no captured replay answer from {start} in {name}")


async def tapped(nats_url: str) -> WireTap:
    return await WireTap().start(nats_url, "w1")


def shim(nats: EmbeddedNats, eng: FakeEngine, block_size: int | None = BS) -> Any:
    return running_bridge(nats.url, eng, engine="vllm", worker_id="w1", model=MODEL, block_size=block_size)


@pytest.mark.parametrize("name", list(OPS))
async def test_live_capture_step_by_step(
    name: str, nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine().start()
    tap = await tapped(nats_server.url)
    model = Model()
    try:
        # As a new user runs it: no --block-size, the bridge takes 32 from the engine's events.
        async with shim(nats_server, engine, block_size=None) as bridge:
            assert bridge.ranks[0].publisher is None  # nothing announced before the size is known
            for frames, ops in zip(live_messages(name), OPS[name], strict=True):
                await engine.send_raw(frames)
                engine.seq = int.from_bytes(frames[1], "big") + 1
                model.apply(ops)
                await settle(bridge, service, [engine])
                assert await index_matches(stub) == model.matches()
            assert bridge.stats.snapshot().get("skipped", {}) == {}
            assert bridge.stats.snapshot().get("garbage", {}) == {}
            publisher = bridge.ranks[0].publisher
            assert publisher is not None
            await wait_until(lambda: len(tap.batches) >= publisher.seq, what="wire batches recorded")
        assert tap.keys("stored") == model.stored
        assert tap.keys("removed") == model.removed
        assert tap.cleared() == (["gpu", "cpu", "disk"] if name != "r4_serve_sha256_int" else [])
    finally:
        await tap.close()
        await engine.close()


@pytest.mark.parametrize("name", ["r1_sha256_int", "r2_sha256cbor_bytes"])
async def test_shim_started_after_the_engine_rebuilds_from_the_captured_replay(
    name: str, nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine().start()
    engine.canned[0] = replay_answer(name, 0)  # vLLM's own answer, byte for byte
    tap = await tapped(nats_server.url)
    model = Model()
    for ops in OPS[name]:
        model.apply(ops)
    try:
        async with shim(nats_server, engine, block_size=None) as bridge:
            assert bridge.block_size == BS  # learned from the replayed history, before publishing
            assert engine.replay_requests == [0]
            assert bridge.links[0].applied == len(OPS[name]) - 1
            assert bridge.stats.get("frames", "replay_3frame") == 1
            await settle(bridge, service)
            assert await index_matches(stub) == model.matches()
            publisher = bridge.ranks[0].publisher
            assert publisher is not None
            await wait_until(lambda: len(tap.batches) >= publisher.seq, what="wire batches recorded")
        assert tap.keys("stored") == model.stored
        assert tap.keys("removed") == model.removed
        assert tap.cleared() == ["gpu", "cpu", "disk"]
    finally:
        await tap.close()
        await engine.close()


async def test_gap_filled_by_the_captured_replay(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    name = "r1_sha256_int"
    engine = await FakeEngine().start()
    engine.canned[4] = replay_answer(name, 4)
    tap = await tapped(nats_server.url)
    model = Model()
    for ops in OPS[name]:
        model.apply(ops)
    live = live_messages(name)
    try:
        async with shim(nats_server, engine) as bridge:
            for frames in live[:4] + live[7:]:  # batches 4, 5 and 6 are lost on the way
                await engine.send_raw(frames)
            engine.seq = 8
            await settle(bridge, service, [engine])
            assert engine.replay_requests == [0, 4]
            assert bridge.stats.get("recovery", "gap") == 1
            assert await index_matches(stub) == model.matches()
            publisher = bridge.ranks[0].publisher
            assert publisher is not None
            await wait_until(lambda: len(tap.batches) >= publisher.seq, what="wire batches recorded")
        # Every store and eviction of the lost batches reached the wire, from the replay.
        assert tap.keys("stored") == model.stored
        assert tap.keys("removed") == model.removed
    finally:
        await tap.close()
        await engine.close()


async def test_real_vllm_bytes_against_the_old_default_block_size_stop_the_shim(
    nats_server: EmbeddedNats, service: IndexService
) -> None:
    """The field report: vLLM with --block-size 32, kvshim with 16. The shim used to skip every event
    while looking healthy; now the engine's first store stops it, naming both sizes."""
    from workers_shim.bridges.blocksize import BlockSizeConflict

    engine = await FakeEngine().start()
    tap = await tapped(nats_server.url)
    try:
        async with shim(nats_server, engine, block_size=16) as bridge:
            await engine.send_raw(live_messages("r4_serve_sha256_int")[0])
            await wait_until(bridge.failed.is_set, what="the bridge to stop")
            assert isinstance(bridge.failure, BlockSizeConflict)
            assert (bridge.failure.engine_size, bridge.failure.size) == (32, 16)
        assert tap.keys("stored") == set()
    finally:
        await tap.close()
        await engine.close()
