"""Index shards' pure parts (kvindex/shards): the partition, the flags, a shard's versioned answers
and the front's registry mirror (the end-to-end equality with one index is
tests/integration/test_shards.py, on a real nats-server)."""

from __future__ import annotations

import asyncio

import pytest

from kvindex.cli import main
from kvindex.core import Core, CoreConfig, build_core
from kvindex.index.base import InstanceMatch
from kvindex.shards.front import MirrorIndex, ShardFront
from kvindex.shards.layout import ShardSpec, nats_mappings, partition_of, partition_subjects
from kvindex.shards.messages import Answer, Query, answer_decoder, query_decoder, query_encoder
from kvindex.shards.shard import ShardResponder
from kvindex.wire.schema import GPU, Load
from kvindex.wire.subjects import Subjects


def test_partition_is_fnv1a_modulo_n_and_specs_are_checked() -> None:
    # FNV-1a 32 of "w1" is 0x10473805 (odd): partition 1 of 2; nats-server computes the same
    # (tests/integration/test_shards.py checks where the server delivers).
    assert partition_of("w1", 2) == 0x10473805 % 2 == 1
    counts = [0, 0, 0, 0]
    for i in range(4000):
        counts[partition_of(f"worker-{i}", 4)] += 1
    assert min(counts) > 800  # spread over every shard
    assert ShardSpec.parse("1/2") == ShardSpec(1, 2) and str(ShardSpec(1, 2)) == "1/2"
    for bad, why in (("2/2", "index"), ("0/1", "count"), ("x", "I/N"), ("1/2/3", "I/N")):
        with pytest.raises(ValueError, match=why):
            ShardSpec.parse(bad)
    assert partition_subjects(Subjects("kv.a"), ShardSpec(1, 3)).prefix == "kv.a.part.3.1"
    conf = nats_mappings(Subjects("kv"), 3)
    assert '"kv.events.*": "kv.part.3.{{partition(3,1)}}.events.{{wildcard(1)}}"' in conf
    assert '"kv.status.*": "kv.part.3.{{partition(3,1)}}.status.{{wildcard(1)}}"' in conf


def test_shard_flags_that_cannot_work_exit_2_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in (
        (["serve", "--shard", "0/2", "--shards", "2", "--nats", "nats://h:4222"], "--shard and --shards"),
        (["serve", "--shard", "0/2"], "--shard needs --nats"),
        (["serve", "--shards", "2", "--nats", "nats://h:4222", "--jetstream"], "--shards with --jetstream"),
    ):
        assert main(argv) == 2
        assert says in capsys.readouterr().err
    for argv in (["serve", "--shard", "2/2"], ["serve", "--shards", "1"], ["shard-mappings", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert main(["shard-mappings", "2", "--subject-prefix", "fleet"]) == 0
    assert capsys.readouterr().out == nats_mappings(Subjects("fleet"), 2)


def _shard() -> tuple[ShardResponder, Core]:
    core = build_core()
    responder = ShardResponder(
        ShardSpec(0, 2), Subjects(), core.index, core.registry, core.consumer, lambda: (True, "ready")
    )
    return responder, core


def _ask(
    responder: ShardResponder, since: int, replica: str, model: str = "", keys: list[int] | None = None
) -> Answer:
    """A query through its encoding, as NATS carries it."""
    data = query_encoder.encode(Query(model, keys or [], None, None, since, replica))
    return answer_decoder.decode(responder.answer(query_decoder.decode(data)))


def test_a_shard_answers_the_changes_since_the_version_each_front_saw() -> None:
    responder, core = _shard()
    registry, index = core.registry, core.index
    for w in ("a", "b"):
        index.add_instance((w, 0), "m")
        state = registry.add((w, 0), "m", 16)
        state.capacity = {GPU: 100}
        state.last_heartbeat_at = registry.clock()
    index.store(("a", 0), GPU, [1, 2, 3])
    index.store(("b", 0), GPU, [1])
    first = _ask(responder, 0, "")
    assert first.full and {tuple(r[:2]) for r in first.states} == {("a", 0), ("b", 0)}
    # Nothing changed: nothing sent; the match of a prompt on the shard's instances.
    again = _ask(responder, first.version, first.replica, "m", [1, 2, 3, 4])
    assert not again.full and again.states == [] and again.removed == []
    assert sorted(again.matches) == [("a", 0, 3, 3, 0, 0, 0), ("b", 0, 1, 1, 0, 0, 0)]
    # A heartbeat's load on one instance, another removed: only those, to a front at that version.
    registry.get(("a", 0)).load = Load(running=3)
    registry.remove(("b", 0))
    delta = _ask(responder, again.version, again.replica)
    assert [r[:2] for r in delta.states] == [["a", 0]] and delta.states[0][6][0] == 3
    assert delta.removed == [("b", 0)]
    # A second front still at the first version gets both changes; another process's version: all.
    behind = _ask(responder, first.version, first.replica)
    assert [r[:2] for r in behind.states] == [["a", 0]] and behind.removed == [("b", 0)]
    assert _ask(responder, delta.version, "another-replica").full


def test_the_front_mirrors_states_and_matches_from_answers() -> None:
    responder, shard_core = _shard()
    sreg, sidx = shard_core.registry, shard_core.index
    sidx.add_instance(("a", 0), "m")
    st = sreg.add(("a", 0), "m", 16)
    st.capacity = {GPU: 100}
    st.load = Load(running=2, waiting=1)
    st.last_heartbeat_at = sreg.clock()
    sidx.store(("a", 0), GPU, [7, 8])
    mirror = MirrorIndex()
    front_core = build_core(CoreConfig(index=mirror))
    front = ShardFront(Subjects(), 2, mirror, front_core.registry, front_core.calibrator, front_core.rankers)
    answer = _ask(responder, 0, "", "m", [7, 8, 9])
    front._apply(front.shards[0], answer, front_core.registry.clock())
    mirror.set_answer("m", [7, 8, 9], None, {("a", 0): InstanceMatch(2, (2, 0, 0, 0))})
    copy = front_core.registry.get(("a", 0))
    assert copy is not None and copy.load == Load(running=2, waiting=1) and copy.capacity == {GPU: 100}
    assert mirror.block_counts(("a", 0)) == (2, 0, 0, 0)
    assert mirror.match("m", [7, 8, 9]) == {("a", 0): InstanceMatch(2, (2, 0, 0, 0))}
    assert mirror.match("m", [7, 8]) == {} and mirror.unfetched == 1  # not what the shards answered
    # Removed on the shard: gone from the front's registry and index with the next answer.
    sreg.remove(("a", 0))
    front._apply(front.shards[0], _ask(responder, answer.version, answer.replica), 0.0)
    assert front_core.registry.get(("a", 0)) is None and not mirror.has_instance(("a", 0))


async def test_the_front_sends_many_reconcile_requests_in_one_query_per_shard() -> None:
    """Issue 34: a front started with shards in a cold start found hundreds of instances degraded
    (holes accepted) and sent one query per instance at once: 445 queries to each busy shard, each
    answered with every state afresh, and the shards' starts collapsed. Reconciles asked while one
    is on its way go with the next query."""
    asked: list[tuple[str, list]] = []
    release = asyncio.Event()

    class Connection:
        async def request(self, subject: str, payload: bytes, timeout: float) -> object:
            asked.append((subject, query_decoder.decode(payload).reconcile))
            await release.wait()
            raise TimeoutError("nats: timeout")  # (the shard is busy: its answer comes too late)

    mirror = MirrorIndex()
    core = build_core(CoreConfig(index=mirror))
    front = ShardFront(Subjects(), 2, mirror, core.registry, core.calibrator, core.rankers)
    front.nc = Connection()
    workers = [f"w{i}" for i in range(100)]
    for w in workers[:50]:
        front.request_reconcile((w, 0))
    for _ in range(20):  # the first query to each shard is on its way
        await asyncio.sleep(0)
    for w in workers[50:]:
        front.request_reconcile((w, 0))
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(asked) == 2  # one query to each shard, not one per instance
    release.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(asked) == 4  # then one more each, with the instances asked meanwhile
    sent = {w for _, todo in asked for w, _ in todo}
    assert sent == set(workers)
    assert all(
        partition_of(w, 2) == int(subject.rsplit(".", 1)[1]) for subject, todo in asked for w, _ in todo
    )
    await front.stop()


async def test_the_front_asks_no_snapshot_of_an_instance_its_shard_is_repairing() -> None:
    """Issue 34: queued instances (holes accepted, so degraded) were asked for a snapshot by the
    front; the request reached the shard after the queued snapshot had applied and took another
    one (10-40 % more snapshots in a cold start). The unsharded repairer drops these."""
    asked: list[list] = []

    class Connection:
        async def request(self, subject: str, payload: bytes, timeout: float) -> object:
            asked.append(query_decoder.decode(payload).reconcile)
            raise TimeoutError("nats: timeout")

    mirror = MirrorIndex()
    core = build_core(CoreConfig(index=mirror))
    front = ShardFront(Subjects(), 2, mirror, core.registry, core.calibrator, core.rankers)
    front.nc = Connection()
    for worker, sync in (("q", "queued"), ("s", "snapshot"), ("ok", "synced")):
        core.registry.add((worker, 0), "m", 16).repair.sync = sync
        front.request_reconcile((worker, 0))
    for _ in range(20):
        await asyncio.sleep(0)
    assert [w for todo in asked for w, _ in todo] == ["ok"]
    await front.stop()
