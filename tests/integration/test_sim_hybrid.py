"""A hybrid-attention simulated fleet (what ``kvshim sim --kv-groups`` runs) over a real nats-server into
a real kvindex service, asked over gRPC: every Lookup before a request is the hit the engine then finds
(the index's rule over the events agrees with the engine's truth), ListInstances shows the layout and
the state exact. The engine alone: tests/unit/test_sim_hybrid.py."""

from __future__ import annotations

import asyncio
import random

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.schema import TIER_BY_NAME
from tests.conftest import wait_until
from workers_shim.sim import Completion, EngineConfig, SimRequest, TimeModel
from workers_shim.sim.fleet import SimFleet, run_fleet

MODEL = "gemma-sim"
BS = 32
TM = TimeModel(a_ms=1.0, b_ms_per_token=0.005, d_ms_per_decode_seq=2.0)


async def settled(service: IndexService, fleet: SimFleet) -> None:
    await fleet.flush()

    def applied() -> bool:
        for p in fleet.publishers.values():
            s = service.registry.get((p.worker, 0))
            if s is None or s.last_seq < p.seq:
                return False
        return True

    await wait_until(applied, what="batches applied")


async def test_hybrid_fleet_lookups_are_the_engines_hits(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    # Issue 33's tiny Gemma 3 (window 64, block 32), 64 (block, group) pairs each: groups lose
    # blocks to eviction at different times.
    cfg = EngineConfig(gpu_blocks=64, time=TM, block_size=BS, kv_groups="gemma3-tiny", max_batched_tokens=512)
    firsts: dict[str, Completion] = {}
    finished: set[str] = set()

    def done(worker: str, c: Completion) -> None:
        if c.kind == "first_token":
            firsts[c.request.id] = c
        else:
            finished.add(c.request.id)

    fleet = await run_fleet(
        nats_server.url,
        2,
        cfg,
        model=MODEL,
        heartbeat_interval=0.05,
        on_completion=done,
    )
    async with fleet:
        workers = list(fleet.engines)
        await wait_until(
            lambda: all(
                (s := service.registry.get((w, 0))) is not None and s.groups_announced for w in workers
            ),
            what="layouts announced",
        )
        reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
        assert {(i.instance_id, i.state, i.kv_groups) for i in reply.instances} == {
            (f"{w}/0", "exact", "3x sliding_window(64) + full_attention") for w in workers
        }

        async def send(worker: str, tokens: list[int], n: int) -> tuple[int, int]:
            """(what the index says of ``worker`` for the prompt, what the engine then found)."""
            await settled(service, fleet)
            reply = await stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=tokens))
            said = {m.instance_id: m.matched_blocks * BS for m in reply.matches}.get(f"{worker}/0", 0)
            rid = f"r{n}"
            await fleet.submit(worker, SimRequest(rid, block_keys(tokens, BS, MODEL), len(tokens), 3))
            # Finished: its decode steps allocate no more (no eviction between a Lookup and the next
            # request's admission).
            await wait_until(lambda: rid in finished, what=f"{rid} finished")
            return said, firsts[rid].reported_cached_tokens

        # Issue 33's sequence on one worker: 0, 224, 0 (the full-attention group alone would say
        # 192), then 192 at the junction the engine kept.
        a = list(range(10, 250))
        seq = [a, a, a[:192] + [600 + t for t in range(48)], a[:192] + [700 + t for t in range(40)]]
        assert [await send(workers[0], t, i) for i, t in enumerate(seq)] == [
            (0, 0),
            (224, 224),
            (0, 0),
            (192, 192),
        ]
        # Prompts sharing prefixes, diverging anywhere, on either worker, with evictions.
        rng = random.Random(5)
        stems = [[rng.randrange(1000) for _ in range(rng.randrange(100, 280))] for _ in range(6)]
        pairs = []
        for n in range(10, 40):
            stem = rng.choice(stems)
            tokens = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(1000) for _ in range(20)]
            pairs.append(await send(rng.choice(workers), tokens, n))
        assert [p for p in pairs if p[0] != p[1]] == []
        assert sum(1 for said, _ in pairs if said) >= 5
        assert sum(e.stats.gpu_evictions for e in fleet.engines.values()) > 0

        # The index holds each engine's (block, group) pairs as group keys.
        await settled(service, fleet)
        for w in workers:
            assert set(service.index.keys_of((w, 0), TIER_BY_NAME["gpu"])) == fleet.holds(w, "gpu")
        # Events lost on the way, then the worker's resync (a snapshot request's first step): the
        # index is the engine's again.
        fleet.drop_events(workers[1], 30.0)
        await send(workers[1], stems[0] + [1, 2, 3], 99)
        assert fleet.dropped_events(workers[1]) > 0
        fleet.drop_events(workers[1], 0.0)
        await fleet.resync(workers[1])
        await settled(service, fleet)
        assert set(service.index.keys_of((workers[1], 0), TIER_BY_NAME["gpu"])) == fleet.holds(
            workers[1], "gpu"
        )
        reply = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
        assert {i.state for i in reply.instances} == {"exact"}
        await asyncio.sleep(0)
