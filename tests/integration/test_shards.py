"""Index shards over a real nats-server (docs/shards.md): the server partitions the workers with a
subject mapping, two shard processes each index their partition, a front ranks over their answers,
and every Score equals the one an unsharded index makes over the same fleet."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import nats
import pytest
from prometheus_client import generate_latest

from kvindex.config.nats import NatsSettings
from kvindex.keys import block_keys
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.outcomes import OutcomeConfig
from kvindex.scoring.ranker import RankerConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.shards.layout import ShardSpec, nats_mappings, partition_of
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvindex.wire.codec import encode_heartbeat
from kvindex.wire.subjects import Subjects
from kvtools.testing.natsauth import make_tls_files
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MODEL = "shard-model"
BS = 4
WORKERS = [f"w{i}" for i in range(8)]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


@pytest.fixture
async def mapped_nats(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_mappings(Subjects("kvindex"), 2))
    server = EmbeddedNats(config=conf)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def start(config: ServiceConfig) -> IndexService:
    svc = IndexService(config)
    await svc.start()
    return svc


def config(url: str | NatsSettings, **kwargs: object) -> ServiceConfig:
    # A reported queue is not drained with the heartbeat's age: the two deployments hear each
    # heartbeat a few ms apart, and estimates that follow the clock would differ by that much.
    # Reports never make an instance degraded here: that asks its worker for a snapshot, which each
    # deployment gets at its own moment (test_a_degraded_instance_is_snapshotted_by_its_shard).
    ranker = RankerConfig(
        costs=CostConfig(drain_reported_queue=False), outcomes=OutcomeConfig(threshold=1_000_000)
    )
    cfg = ServiceConfig(nats_url=url, grpc_host="127.0.0.1", grpc_port=0, ranker=ranker)
    for name, value in kwargs.items():
        setattr(cfg, name, value)
    return cfg


async def test_two_shards_score_as_one_index(mapped_nats: EmbeddedNats) -> None:
    url = mapped_nats.url
    # The same fleet twice: each worker publishes the same events under the mapped prefix (the
    # sharded deployment) and under an unmapped one (the unsharded index).
    assert {partition_of(w, 2) for w in WORKERS} == {0, 1}
    single = await start(config(url, subject_prefix="plain"))
    shards = [await start(config(url, shard=ShardSpec(i, 2))) for i in range(2)]
    front = await start(config(url, shards=2))
    services = [single, *shards, front]
    pubs: list[Publisher] = []
    try:
        for prefix in ("plain", "kvindex"):
            for i, w in enumerate(WORKERS):
                nc = await nats.connect(url)
                pub = Publisher(
                    nc,
                    worker=w,
                    model=MODEL,
                    block_size=BS,
                    subject_prefix=prefix,
                    capacity={"gpu": 10_000},
                    heartbeat_interval=0.2,
                )
                pub._owns_nc = True
                await pub.start()
                pub.set_load(running=i % 3, waiting=(i * 7) % 5, waiting_prefill_tokens=100 * i)
                pubs.append(pub)
        shared = tokens(12 * BS, seed=99)
        for pub in pubs:
            i = WORKERS.index(pub.worker)
            # Worker i holds the shared system prompt's first i+2 blocks, and a prompt of its own.
            keys = block_keys(shared, BS, MODEL)
            pub.stored(keys[: i + 2])
            pub.stored(block_keys(tokens(6 * BS, seed=i), BS, MODEL), tier="cpu" if i % 2 else "gpu")
            await pub.flush()
            await pub.heartbeat()
        for i, shard in enumerate(shards):  # the server's partition is the one partition_of computes
            want = {(w, 0) for w in WORKERS if partition_of(w, 2) == i}
            await wait_until(lambda shard=shard, want=want: {s.key for s in shard.registry.all()} == want)
        await wait_until(lambda: len(single.registry) == len(WORKERS))
        await wait_until(lambda: front.ready()[0] and len(front.registry) == len(WORKERS))
        await asyncio.sleep(0.5)  # every index has heard its instances' latest heartbeats

        async with (
            grpc.aio.insecure_channel(single.grpc.address) as a,
            grpc.aio.insecure_channel(front.grpc.address) as b,
        ):
            one, sharded = pb_grpc.KvIndexStub(a), pb_grpc.KvIndexStub(b)
            prompts = [shared[: n * BS] + tokens(3 * BS, seed=n) for n in range(1, 12)]
            prompts += [tokens(6 * BS, seed=i) + tokens(2 * BS, seed=50 + i) for i in range(len(WORKERS))]
            for n, prompt in enumerate(prompts):
                for policy in ("", "cache_aware"):
                    # Committed (speculative keys, the ledger and policies' memory change the next
                    # rankings the same way on both), then released: an in-flight entry's wait
                    # drains with time, and the two calls are not at the same instant.
                    req = pb.ScoreRequest(
                        model=MODEL, token_ids=prompt, request_id=f"r{n}{policy}", commit=True, policy=policy
                    )
                    x, y = await one.Score(req), await sharded.Score(req)
                    assert [r.instance_id for r in x.ranked] == [r.instance_id for r in y.ranked]
                    assert [(r.matched_blocks, r.matched.gpu, r.matched.cpu) for r in x.ranked] == [
                        (r.matched_blocks, r.matched.gpu, r.matched.cpu) for r in y.ranked
                    ]
                    assert x.committed_instance_id == y.committed_instance_id
                    parts = [(r.est_ttft_ms, r.wait_ms, r.prefill_ms, r.fetch_ms) for r in y.ranked]
                    assert [(r.est_ttft_ms, r.wait_ms, r.prefill_ms, r.fetch_ms) for r in x.ranked] == [
                        pytest.approx(p, rel=1e-9) for p in parts
                    ]
                    assert [r.load.waiting for r in x.ranked] == [r.load.waiting for r in y.ranked]
                    # With the engine's report (ttft policy): compared with what the instance holds
                    # now, which the front asks its shard for.
                    done = pb.ReleaseRequest(request_id=req.request_id, phase="finished")
                    if not policy:
                        done.cached_tokens, done.prompt_tokens = 2 * BS, len(prompt)
                    rx, ry = await one.Release(done), await sharded.Release(done)
                    assert rx.found and ry.found and rx.report == ry.report
                    assert single.ranker.outcomes.outcomes == front.ranker.outcomes.outcomes
                lookup = pb.LookupRequest(model=MODEL, token_ids=prompt)
                lx, ly = await one.Lookup(lookup), await sharded.Lookup(lookup)
                assert [(m.instance_id, m.matched_blocks) for m in lx.matches] == [
                    (m.instance_id, m.matched_blocks) for m in ly.matches
                ]
            assert front.mirror is not None and front.mirror.unfetched == 0
            metrics = generate_latest(front.metrics.registry).decode()
            for i in range(2):
                assert f'kvindex_shard_up{{shard="{i}/2"}} 1.0' in metrics
                owned = sum(1 for w in WORKERS if partition_of(w, 2) == i)
                assert f'kvindex_shard_instances{{shard="{i}/2"}} {float(owned)}' in metrics

            # A shard down: the front is not ready and ranks the other shard's instances only.
            await shards[1].stop()
            services.remove(shards[1])
            reply = await sharded.Score(pb.ScoreRequest(model=MODEL, token_ids=prompts[3]))
            alive = {f"{w}/0" for w in WORKERS if partition_of(w, 2) == 0}
            assert {r.instance_id for r in reply.ranked} == alive
            assert not front.ready()[0] and "shard 1/2" in front.ready()[1]
            assert 'kvindex_shard_up{shard="1/2"} 0.0' in generate_latest(front.metrics.registry).decode()
            # It comes back (a new process): every state afresh, the whole fleet ranked again.
            shards[1] = await start(config(url, shard=ShardSpec(1, 2)))
            services.append(shards[1])
            await wait_until(lambda: front.ready()[0], timeout=10)
            reply = await sharded.Score(pb.ScoreRequest(model=MODEL, token_ids=prompts[3]))
            assert {r.instance_id for r in reply.ranked} == {f"{w}/0" for w in WORKERS}
    finally:
        for pub in pubs:
            await pub.close()
        for svc in services:
            await svc.stop()


async def test_a_degraded_instance_is_snapshotted_by_its_shard(mapped_nats: EmbeddedNats) -> None:
    """Engine reports that disagree with the index make the front's ranker find an instance
    degraded; the front asks the instance's shard, which asks the worker for a snapshot, and the
    front learns the blocks were reconciled (its outcome evidence starts over, as in one index)."""
    url = mapped_nats.url
    services = [
        await start(ServiceConfig(nats_url=url, grpc_host="127.0.0.1", grpc_port=0, shard=ShardSpec(i, 2)))
        for i in range(2)
    ]
    front = await start(ServiceConfig(nats_url=url, grpc_host="127.0.0.1", grpc_port=0, shards=2))
    services.append(front)
    pub = None
    try:
        pub = await Publisher.connect(url, worker="w1", model=MODEL, block_size=BS, heartbeat_interval=0.2)
        prompt = tokens(8 * BS, seed=11)
        pub.stored(block_keys(prompt, BS, MODEL))
        await pub.flush()
        await wait_until(lambda: front.ready()[0] and len(front.registry) == 1)
        key, shard = ("w1", 0), services[partition_of("w1", 2)]
        async with grpc.aio.insecure_channel(front.grpc.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            for n in range(2):  # the index says 8 blocks are cached; the engine says none were
                req = pb.ScoreRequest(model=MODEL, token_ids=prompt, request_id=f"d{n}", commit=True)
                assert (await stub.Score(req)).ranked[0].matched_blocks == 8
                report = pb.ReleaseRequest(request_id=f"d{n}", phase="finished", cached_tokens=0)
                report.prompt_tokens = len(prompt)
                assert (await stub.Release(report)).report == "applied"
        await wait_until(
            lambda: shard.counters.snapshots_requested["degraded"] == 1, what="the shard's snapshot"
        )
        outcomes = front.ranker.outcomes.instances[key]
        await wait_until(lambda: outcomes.repaired_at > float("-inf"), what="the front told of the repair")
        assert not outcomes.recent and front.front is not None
    finally:
        if pub is not None:
            await pub.close()
        for svc in services:
            await svc.stop()


async def test_shards_on_secured_nats_with_two_front_replicas(tmp_path: Path) -> None:
    """TLS and a password on the shard traffic as on the rest (kvindex/config/nats.py), and two
    fronts sharing their routing decisions (routing sync) as unsharded replicas do."""
    tls = make_tls_files(tmp_path)
    conf = tmp_path / "secure.conf"
    conf.write_text(
        f'tls {{ cert_file: "{tls.server_cert}", key_file: "{tls.server_key}" }}\n'
        'authorization { user: alice, password: "s3cret-pw" }\n' + nats_mappings(Subjects("kvindex"), 2)
    )
    server = EmbeddedNats(config=conf, scheme="tls")
    await server.start()
    settings = NatsSettings(servers=(server.url,), tls_ca=str(tls.ca), user="alice", password="s3cret-pw")
    services = [await start(config(settings, shard=ShardSpec(i, 2))) for i in range(2)]
    fronts = [await start(config(settings, shards=2)) for _ in range(2)]
    services += fronts
    pubs = []
    try:
        prompt = tokens(8 * BS, seed=7)
        for w in WORKERS[:4]:
            pub = await Publisher.connect(
                settings, worker=w, model=MODEL, block_size=BS, heartbeat_interval=0.2
            )
            pubs.append(pub)
            if w == "w3":
                pub.stored(block_keys(prompt, BS, MODEL)[:5])
            await pub.flush()
            await pub.heartbeat()
        for front in fronts:
            await wait_until(lambda front=front: front.ready()[0] and len(front.registry) == 4)
        async with grpc.aio.insecure_channel(fronts[0].grpc.address) as channel:
            reply = await pb_grpc.KvIndexStub(channel).Score(
                pb.ScoreRequest(model=MODEL, token_ids=prompt, request_id="sync-1", commit=True)
            )
        assert reply.ranked[0].instance_id == "w3/0" and reply.ranked[0].matched_blocks == 5
        assert reply.committed_instance_id == "w3/0"
        # The other front learns the commit (its ledger holds the request in flight there).
        other = fronts[1].ranker.decisions.ledger
        await wait_until(lambda: other.get("sync-1") is not None, what="the commit synced")
        assert other.get("sync-1").instance == ("w3", 0)
    finally:
        for pub in pubs:
            await pub.close()
        for svc in services:
            await svc.stop()
        await server.stop()


async def test_shards_under_the_shipped_per_worker_authorization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/nats/nats-server.conf with the mapping appended: a worker publishes on its own subjects
    only (checked before the mapping), its shard reads them, the front queries the shards as the
    index user and the shards answer on its inbox."""
    shipped = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats-server.conf"
    conf = tmp_path / "nats.conf"
    conf.write_text(shipped.read_text() + nats_mappings(Subjects("kvindex"), 2))
    for user in ("index", "capture", "node-1", "node-2"):
        monkeypatch.setenv(f"KVINDEX_{user.upper().replace('-', '_')}_PASSWORD", f"{user}-pw")
    server = EmbeddedNats(config=conf)
    await server.start()

    def as_user(user: str) -> NatsSettings:
        return NatsSettings(servers=(server.url,), user=user, password=f"{user}-pw")

    services = [await start(config(as_user("index"), shard=ShardSpec(i, 2))) for i in range(2)]
    front = await start(config(as_user("index"), shards=2))
    services.append(front)
    pubs = []
    try:
        assert {partition_of(w, 2) for w in ("node-1", "node-2")} == {0, 1}
        prompt = tokens(6 * BS, seed=3)
        for w in ("node-1", "node-2"):
            pub = await Publisher.connect(
                as_user(w), worker=w, model=MODEL, block_size=BS, heartbeat_interval=0.2
            )
            pubs.append(pub)
            pub.stored(block_keys(prompt, BS, MODEL)[: 2 if w == "node-1" else 4])
            await pub.flush()
        await wait_until(lambda: front.ready()[0] and len(front.registry) == 2)
        async with grpc.aio.insecure_channel(front.grpc.address) as channel:
            reply = await pb_grpc.KvIndexStub(channel).Score(pb.ScoreRequest(model=MODEL, token_ids=prompt))
        assert [(r.instance_id, r.matched_blocks) for r in reply.ranked] == [("node-2/0", 4), ("node-1/0", 2)]
        # node-1 publishing as node-2 (on the subject before the mapping) is refused by the server.
        rogue = await nats.connect(server.url, user="node-1", password="node-1-pw")
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        rogue._error_cb = on_error
        await rogue.publish("kvindex.events.node-2", b"forged")
        await rogue.flush()
        await wait_until(lambda: any("ermissions" in str(e) for e in errors), what="the violation")
        # Its own partitioned subjects are allowed, on any partition: the wrong shard refuses it.
        other = 1 - partition_of("node-1", 2)
        beat = encode_heartbeat(
            worker="node-1",
            model=MODEL,
            epoch=1,
            seq=0,
            ts=0.0,
            block_size=BS,
            load={},
            capacity={},
            digest={},
        )
        await rogue.publish(f"kvindex.part.2.{other}.status.node-1", beat)
        await rogue.flush()
        counters = services[other].counters
        await wait_until(lambda: counters.rejects_by_worker["node-1"] == 1, what="the wrong shard's refusal")
        assert counters.rejects["bad_subject"] == 1 and services[other].registry.get(("node-1", 0)) is None
        await rogue.close()
    finally:
        for pub in pubs:
            await pub.close()
        for svc in services:
            await svc.stop()
        await server.stop()
