"""serve --capture under faults, then replay: the same consumer code rebuilds exactly the live state."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import nats
import pytest

from kvindex.capture import records as R
from kvindex.capture.digest import state_digest
from kvindex.capture.format import LogReader
from kvindex.capture.recorder import CaptureConfig
from kvindex.capture.replay import Driver, replay
from kvindex.capture.serve import serve_replayed
from kvindex.cli import main
from kvindex.fleet.liveness import LivenessConfig
from kvindex.ingest.nats_source import JetStreamConfig
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import FaultyPublisher
from tests.conftest import converged, index_view, wait_until

FAST = RepairConfig(
    replay_timeout=0.5,
    snapshot_timeout=1.0,
    reconcile_interval=0.4,
    tick=0.05,
)
LIVENESS = LivenessConfig(stale_after=0.5, forget_after=30, tick=0.05)
TOKENS = list(range(64))
KEYS = block_keys(TOKENS, 4, "m")


async def _worker(url: str, worker: str, **kwargs: object) -> FaultyPublisher:
    nc = await nats.connect(url)
    kwargs.setdefault("model", "m")
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("heartbeat_interval", 0.1)
    pub = FaultyPublisher(nc, worker=worker, **kwargs)  # type: ignore[arg-type]
    pub._owns_nc = True
    await pub.start()
    return pub


@pytest.fixture
async def captured(nats_server: EmbeddedNats, tmp_path: Path) -> tuple[Path, IndexService]:
    """A service that captured gaps repaired by replay, a replay too old (snapshot), a restart, a
    stale worker, periodic checks, and committed/released requests; stopped, with its final state."""
    path = tmp_path / "live.kvlog"
    svc = IndexService(
        ServiceConfig(
            nats_url=nats_server.url,
            grpc_host="127.0.0.1",
            grpc_port=0,
            repair=FAST,
            liveness=LIVENESS,
            capture=CaptureConfig(str(path), check_interval=0.3),
        )
    )
    await svc.start()
    w1 = await _worker(nats_server.url, "w1")
    w2 = await _worker(nats_server.url, "w2", history=2, dp_rank=1)
    try:
        w1.stored(KEYS[:8])
        w2.stored(KEYS[:4], tier="cpu")
        await converged(svc, w1, w2)
        w1.faults.only_seqs = {2}  # lost: the next batch reveals the gap, a replay repairs it
        w1.stored(KEYS[8:10])
        await w1.flush()
        w1.faults.only_seqs.clear()
        w1.stored(KEYS[10:12])
        w2.faults.only_seqs = {2, 3, 4, 5}  # more than its history: replay too_old -> snapshot
        for k in KEYS[4:8]:
            w2.stored([k], tier="cpu")
            await w2.flush()
        w2.faults.only_seqs.clear()
        w2.removed(KEYS[:2], tier="cpu")
        await converged(svc, w1, w2)
        async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            for i in range(3):
                req = pb.ScoreRequest(
                    model="m", token_ids=TOKENS, commit=True, request_id=f"r{i}", explain=i == 1
                )
                assert (await stub.Score(req)).committed_instance_id
            assert (await stub.Release(pb.ReleaseRequest(request_id="r0", phase="finished"))).found
        await w1.close()  # restart with its cache kept: new epoch
        w1 = await _worker(nats_server.url, "w1")
        w1.stored(KEYS[:6])
        w2.faults.partitioned = True  # silent: marked stale
        await wait_until(lambda: svc.registry.get(("w2", 1)).stale, 3, "w2 stale")  # type: ignore[union-attr]
        await converged(svc, w1)
        assert svc.counters.snapshots_requested["periodic"] >= 1
    finally:
        await w1.close()
        w2.faults.quiet()
        await w2.close()
        await svc.stop()
    c = svc.counters
    assert c.gaps >= 2 and c.replays_ok >= 1 and c.replays_failed["too_old"] >= 1
    assert c.snapshots_applied >= 2 and c.restarts >= 1 and c.stale_marked >= 1
    return path, svc


async def test_replay_reproduces_the_live_service_exactly(captured: tuple[Path, IndexService]) -> None:
    path, live = captured
    kinds = {record[0] for _, _, record in LogReader(path)}
    assert {R.MSG, R.REPLAY_REPLY, R.SNAPSHOT, R.TIMER, R.CHECK, R.ROUTE, R.CLOSE, R.FLAGS} <= kinds
    result = replay(str(path))
    r = result.replayer
    assert result.error is None and r.closed == "stopped"
    assert r.digest() == state_digest(live.consumer)
    # Not only the digest: every instance's blocks per tier, cursors and health are the live ones.
    assert sorted(s.key for s in r.registry.all()) == sorted(s.key for s in live.registry.all())
    for state in live.registry.all():
        mine = r.registry.get(state.key)
        assert mine is not None
        assert index_view(r.index, state.key) == index_view(live.index, state.key)
        assert (mine.epoch, mine.last_seq, mine.stale, mine.repair.sync) == (
            state.epoch,
            state.last_seq,
            state.stale,
            state.repair.sync,
        )
        assert mine.last_heartbeat_at == pytest.approx(state.last_heartbeat_at, abs=0.05)  # type: ignore[arg-type]
    # Every live-state checkpoint along the way matched too.
    assert r.checks_ok >= 2 and not r.divergences
    # The repairs were the live ones, answer for answer.
    for name in ("gaps", "replays_ok", "snapshots_applied", "restarts", "stale_marked", "batches_applied"):
        assert getattr(r.counters, name) == getattr(live.counters, name), name
    assert r.counters.replays_failed == live.counters.replays_failed
    assert r.counters.snapshots_requested == live.counters.snapshots_requested
    # Routing state: two requests still in flight, on the instances the live service chose.
    for key in (("w1", 0), ("w2", 1)):
        assert {e.request_id for e in r.ranker.ledger.of(key)} == {
            e.request_id for e in live.ranker.ledger.of(key)
        }
    assert len(r.ranker.ledger) == len(live.ranker.ledger) == 2
    # Deterministic: a second replay gives the same digest.
    assert replay(str(path)).replayer.digest() == r.digest()


async def test_until_request_query_and_serve(
    captured: tuple[Path, IndexService], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, live = captured
    records = [rec for _, _, rec in LogReader(path)]
    first_route = next(rec for rec in records if rec[0] == R.ROUTE)
    # As of just before the first commit: no request in flight yet, w2 still fresh.
    res = Driver(str(path), until=first_route[2] - 1e-6).run()
    assert res.stopped_at_until and len(res.replayer.ranker.ledger) == 0
    assert not res.replayer.registry.get(("w2", 1)).stale  # type: ignore[union-attr]
    assert res.replayer.clock() == pytest.approx(first_route[1], abs=1e-3)
    # "Why did r1 go where it went": its ranking recomputed at the moment it was committed.
    res = Driver(str(path), request="r1").run()
    watched = res.replayer.watched
    assert watched is not None and watched.response is not None
    ranked = watched.response.ranked
    assert ranked[0].instance_id == watched.request["committed_live"] and ranked[0].explain
    # On w1: 12 blocks in the index, 4 more expected from r0's commit (speculative keys, replayed too).
    (w1,) = [x for x in ranked if x.instance_id == "w1/0"]
    assert w1.matched.gpu == 12 and w1.matched_blocks == 16
    assert len(res.replayer.ranker.ledger) == 2  # r0 committed, r1 applied after its ranking

    # The command: timeline, summary, digest, and a query as of a moment when w2 was stale.
    stale_at = next(m.wall for m in replay(str(path)).replayer.moments if m.what == "stale")
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps({"model": "m", "block_keys": KEYS[:8], "top_k": 3}))
    report = tmp_path / "report.json"
    argv = ["replay", str(path), "--plain", "--query", str(prompt), "--report", str(report)]
    assert main([*argv, "--until", str(stale_at)]) == 0  # records up to and including that moment
    out = capsys.readouterr().out
    for what in ("joined", "gap", "replay?", "snapshot", "in sync", "epoch", "stale"):
        assert f" {what} " in out, what
    assert "stopped at" in out and "STALE" in out
    rep = json.loads(report.read_text())
    (query,) = rep["queries"]
    assert [x["instance_id"] for x in query["response"]["ranked"]] == ["w1/0"]  # w2 stale: not ranked
    assert query["response"]["ranked"][0]["explain"]
    assert main([*argv, "--request", "r2"]) == 0
    where = next(
        k for k in (("w1", 0), ("w2", 1)) if any(e.request_id == "r2" for e in live.ranker.ledger.of(k))
    )
    assert f"the live service committed it to {where[0]}/{where[1]}" in capsys.readouterr().out
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"state digest: {state_digest(live.consumer)}" in out and "0 diverged" in out

    # The gRPC API on the replayed (final) state.
    r = replay(str(path)).replayer
    server = await serve_replayed(r, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            listed = (await stub.ListInstances(pb.ListInstancesRequest())).instances
            assert {(i.instance_id, i.stale, i.blocks.gpu, i.blocks.cpu) for i in listed} == {
                (s.instance_id, s.stale, *live.index.block_counts(s.key)[:2]) for s in live.registry.all()
            }
            ranked = (await stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS, explain=True))).ranked
            # w2 heartbeated again before it closed: ranked, with no prefix of the prompt.
            assert {x.instance_id: x.matched.gpu for x in ranked} == {"w1/0": 6, "w2/1": 0}
            assert all(x.explain for x in ranked)
            stats = await stub.Stats(pb.StatsRequest())
            assert stats.gaps == live.counters.gaps and stats.instances_stale == 0
    finally:
        await server.stop()


async def test_jetstream_rebuild_replays_with_its_heartbeat_mode(tmp_path: Path) -> None:
    """An index restarted in JetStream mode rebuilds from the stream while heartbeats arrive ahead of
    it (they start no repair until it is caught up): the log records that mode and its changes."""
    server = EmbeddedNats(jetstream=True)
    await server.start()
    pub = await _worker(server.url, "js")
    path = tmp_path / "js.kvlog"
    config = ServiceConfig(
        nats_url=server.url,
        grpc_host="127.0.0.1",
        grpc_port=0,
        repair=RepairConfig(replay_timeout=0.5, snapshot_timeout=1.0, reconcile_interval=0, tick=0.05),
        jetstream=JetStreamConfig(),
    )
    try:
        first = IndexService(config)
        await first.start()
        for k in range(0, 16, 4):
            pub.stored(KEYS[k : k + 4])
            await pub.flush()
        await converged(first, pub)
        await first.stop()
        config.capture = CaptureConfig(str(path))
        second = IndexService(config)  # rebuilds from the stream's four batches
        await second.start()
        pub.removed(KEYS[:3])
        await converged(second, pub)
        await second.stop()
    finally:
        await pub.close()
        await server.stop()
    flags = [rec[3] for _, _, rec in LogReader(path) if rec[0] == R.FLAGS]
    assert flags[0] == {"heartbeat_repairs": False, "status_in_order": False}
    assert flags[-1] == {"heartbeat_repairs": True, "status_in_order": False}
    r = replay(str(path)).replayer
    assert r.digest() == state_digest(second.consumer) and r.checks_ok >= 1 and not r.divergences
    assert sum(r.counters.snapshots_requested.values()) == 0
    assert r.counters.batches_applied == second.counters.batches_applied == pub.seq == 5
