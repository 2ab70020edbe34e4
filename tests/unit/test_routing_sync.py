"""Routing sync between index replicas, transport-free: two routers over one fleet, their
RoutingSync messages handed across by the test (tests/integration/test_routing_sync_e2e.py does it
over NATS)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvindex.routing_sync.messages import (
    MAX_KEYS,
    MAX_OPS,
    CommitOp,
    ReleaseOp,
    RoutingMessage,
    decode,
    encode,
)
from kvindex.routing_sync.sync import RoutingSync, SyncConfig, check_replica_id, default_replica_id
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import CostConfig
from kvindex.scoring.home import home_block
from kvindex.scoring.ranker import Ranker, build_ranker
from kvindex.wire.errors import (
    BAD_TYPE,
    BAD_VALUE,
    MALFORMED,
    MISSING_FIELD,
    NOT_A_MAP,
    SUBJECT_MISMATCH,
    TOO_DEEP,
    UNSUPPORTED_VERSION,
    WireError,
)
from kvindex.wire.schema import GPU
from tests.unit.test_scoring import BS, MODEL, Clock, fleet, prompt, request


class Pair:
    """Two replicas (routers with their own routing state) over the same index and registry, as two
    index processes fed by the same NATS subjects are."""

    def __init__(self, n: int = 8, sync: bool = True) -> None:
        self.sync = sync
        self.wall = Clock()

        def syncing(replica: str) -> Any:  # the routers' observers (not attached without sync)
            return lambda router: RoutingSync(router, SyncConfig(replica_id=replica), wall=self.wall)

        self.a, self.index, self.registry, self.clock = fleet(n, observer=syncing("a") if sync else None)
        self.b = build_ranker(
            self.index,
            self.registry,
            Calibrator.of(CostConfig()),
            clock=self.clock,
            observer=syncing("b") if sync else None,
        )
        self.sa = self.a.observer if sync else syncing("a")(self.a)
        self.sb = self.b.observer if sync else syncing("b")(self.b)

    def deliver(self) -> int:
        """Hand every queued message to the other replica (and back to its sender, as NATS echoes)."""
        n = 0
        for src, name in ((self.sa, "a"), (self.sb, "b")):
            while (taken := src.take()) is not None:
                payload, _ = taken
                for dst in (self.sa, self.sb):
                    n += dst.receive(name, payload)
        return n


def test_commit_on_one_replica_is_seen_by_the_other() -> None:
    pair = Pair()
    keys = prompt(200, seed=1)
    res = pair.a.score(request(keys, rid="r1"), commit=True)
    home = res.committed.key
    assert len(pair.b.ledger) == 0
    assert pair.deliver() == 1  # applied by b; a ignored its own echo
    (entry,) = pair.b.ledger.of(home)
    mine = pair.a.ledger._entries["r1"]
    assert (entry.request_id, entry.model, entry.prompt_tokens, entry.miss_tokens) == (
        "r1",
        MODEL,
        mine.prompt_tokens,
        mine.miss_tokens,
    )
    # Speculative keys: b sees the prompt's blocks on a's choice before any stored event.
    assert pair.b.speculative.extend(home, keys, 0) == len(keys)
    # The ttft policy's heat for the prefix counts a's decision.
    key = keys[home_block(len(keys), BS, pair.b.policies["ttft"].home_tokens)]
    assert pair.b.policies["ttft"]._heat(key, pair.clock()) == pytest.approx(1.0)
    # A sibling asked of b is placed as a would place it, seeing the prefix on a's choice.
    sibling_keys = keys[:150] + prompt(50, seed=2)
    on_a = pair.a.score(request(sibling_keys))
    sibling = pair.b.score(request(sibling_keys, rid="r2"), commit=True)
    assert sibling.committed.key == on_a.choices[0].candidate.state.key
    seen = {c.candidate.state.key: c.candidate.blocks for c in sibling.choices}
    assert seen[home] == 150
    pair.deliver()
    assert len(pair.a.ledger) == len(pair.b.ledger) == 2
    assert pair.sa.published == {"commit": 1} and pair.sa.applied == {"commit": 1}
    assert pair.sb.published == {"commit": 1} and pair.sb.applied == {"commit": 1}


def test_release_through_either_replica_releases_on_both() -> None:
    pair = Pair()
    pair.a.score(request(prompt(40, seed=3), rid="r1"), commit=True)
    pair.deliver()
    assert pair.b.release("r1", "prefill")  # b holds it through the sync
    pair.deliver()
    assert pair.a.ledger._entries["r1"].prefill_done
    assert pair.a.release("r1", "finished")
    pair.deliver()
    assert len(pair.a.ledger) == len(pair.b.ledger) == 0
    assert pair.sb.applied == {"commit": 1, "release": 1}


def test_a_release_that_overtakes_its_commit_wins() -> None:
    """A router commits through a and releases through b before b heard of the commit (two senders'
    messages are not ordered): the late commit must not hold an entry for 300 s."""
    pair = Pair()
    keys = prompt(40, seed=4)
    res = pair.a.score(request(keys, rid="r1"), commit=True)
    commit_msg, _ = pair.sa.take()
    assert not pair.b.release("r1", "finished")  # not known on b yet, but a is told
    release_msg, _ = pair.sb.take()
    pair.sa.receive("b", release_msg)
    pair.sb.receive("a", commit_msg)
    assert len(pair.a.ledger) == len(pair.b.ledger) == 0
    assert pair.sb.dropped["finished_before_commit"] == 1
    assert pair.b.speculative.extend(res.committed.key, keys, 0) == len(keys)  # still on its way there
    # Only its prefill released first: the late commit enters, already marked prefill done.
    pair.a.score(request(prompt(40, seed=5), rid="r2"), commit=True)
    commit_msg, _ = pair.sa.take()
    pair.b.release("r2", "prefill")
    pair.sb.take()
    pair.sb.receive("a", commit_msg)
    assert pair.b.ledger._entries["r2"].prefill_done


def test_an_entry_moved_by_its_replica_moves_on_the_others() -> None:
    """The ext_proc picker releases an entry and commits the same request id on the instance that
    actually served it: the others must follow, not take the new commit for a late one."""
    pair = Pair()
    keys = prompt(40, seed=13)
    pair.a.score(request(keys, rid="m1"), commit=True)
    pair.deliver()
    pair.a.release("m1", "finished")
    assert pair.a.commit(request(keys, rid="m1"), ("w6", 0))
    pair.deliver()
    assert [e.instance for e in pair.b.ledger._entries.values()] == [("w6", 0)]
    assert not pair.sb.dropped


def test_predicted_caches_of_engines_without_events_follow_the_other_replicas_decisions() -> None:
    """Approximate mode: an instance publishing no KV events has its cache predicted from routing
    decisions, so every replica must predict from every replica's decisions."""
    a, index_a, registry_a, clock = fleet(4, observer=lambda r: RoutingSync(r, SyncConfig(replica_id="a")))
    b, index_b, registry_b, _ = fleet(4, clock)  # separate indexes, as in two processes
    for registry in (registry_a, registry_b):
        registry.get(("w2", 0)).approximate = True
    sa, sb = a.observer, RoutingSync(b, SyncConfig(replica_id="b"))
    keys = prompt(30, seed=14)
    assert a.commit(request(keys, rid="p1"), ("w2", 0))
    assert set(index_a.keys_of(("w2", 0), GPU)) == set(keys)
    sb.receive("a", sa.take()[0])
    assert set(index_b.keys_of(("w2", 0), GPU)) == set(keys)
    assert index_b.match(MODEL, keys)[("w2", 0)].length == len(keys)


def test_ledger_bounds_and_ttl_apply_to_shared_entries() -> None:
    pair = Pair()
    pair.b.ledger.max_entries = 3
    for i in range(5):
        pair.a.score(request(prompt(20, seed=10 + i), rid=f"r{i}"), commit=True)
    pair.deliver()
    assert len(pair.b.ledger) == 3
    pair.clock.t += pair.b.ledger.ttl + 1
    pair.b.ledger.expire()
    assert len(pair.b.ledger) == 0


def test_queue_is_bounded_messages_split_and_long_prompts_cut() -> None:
    pair = Pair()
    pair.sa.config.max_pending_ops = 5
    for i in range(8):
        pair.a.release(f"x{i}", "finished")
    assert pair.sa.pending() == 5 and pair.sa.dropped["backlog"] == 3
    while pair.sa.take():
        pass
    # Messages stay under the size limit: each big commit goes in its own message.
    pair.sa.max_message_bytes = 64 * 1024
    for i in range(3):
        pair.a.score(request(prompt(5000, seed=20 + i), rid=f"big{i}"), commit=True)
    sizes = []
    while (taken := pair.sa.take()) is not None:
        sizes.append(taken[1])
        pair.sb.receive("a", taken[0])
    assert sizes == [1, 1, 1] and len(pair.b.ledger) == 3
    # A prompt longer than MAX_KEYS blocks is shared with its first MAX_KEYS keys.
    keys = prompt(MAX_KEYS + 10, seed=30)
    res = pair.a.score(request(keys, rid="huge"), commit=True)
    pair.sb.receive("a", pair.sa.take()[0])
    assert pair.sa.truncated == 1
    assert pair.b.speculative.extend(res.committed.key, keys, 0) == MAX_KEYS


def test_many_ops_pack_into_few_messages_and_holes_count_as_lost() -> None:
    pair = Pair()
    for i in range(MAX_OPS + 10):
        pair.a.release(f"x{i}", "finished")
    first, n1 = pair.sa.take()
    _second, n2 = pair.sa.take()
    assert (n1, n2) == (MAX_OPS, 10) and pair.sa.messages_published == 2
    pair.sb.receive("a", first)
    pair.a.release("y", "finished")
    pair.sb.receive("a", pair.sa.take()[0])  # the second never arrived: one message lost
    assert pair.sb.dropped["lost"] == 1 and len(pair.b.ledger) == 0
    assert pair.sb.peers() == 1


def test_without_sync_nothing_is_shared() -> None:
    pair = Pair(sync=False)
    pair.a.score(request(prompt(40, seed=6), rid="r1"), commit=True)
    assert pair.deliver() == 0 and len(pair.b.ledger) == 0


def _msg(**over: object) -> bytes:
    base = {
        "v": 1,
        "replica": "evil",
        "epoch": 1,
        "seq": 1,
        "ts": 0.0,
        "ops": [{"op": "release", "id": "r1", "phase": "finished"}],
    }
    base.update(over)
    return msgpack.packb(base)


def _commit_op(**over: object) -> dict[str, object]:
    """A well-formed commit op, with ``over`` changed."""
    op: dict[str, object] = {
        "op": "commit",
        "id": "r1",
        "model": MODEL,
        "worker": "w0",
        "dp_rank": 0,
        "block_size": BS,
        "prompt_tokens": 10,
        "miss_tokens": 1,
        "policy": "ttft",
    }
    op.update(over)
    return op


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1\xff", MALFORMED),
        (msgpack.packb([1, 2]), NOT_A_MAP),
        (msgpack.packb({"v": 1, "replica": "evil", "epoch": 1}), MISSING_FIELD),
        (_msg(seq="1"), BAD_TYPE),
        (_msg(seq=0), BAD_VALUE),
        (_msg(v=2), UNSUPPORTED_VERSION),
        (b"\x91" * 5000 + b"\x00", TOO_DEEP),  # nested beyond what the decoder follows
        (_msg(x="@").replace(msgpack.packb("@"), b"\x91" * 5000 + b"\x00"), TOO_DEEP),  # unknown field
        (_msg(replica="other"), SUBJECT_MISMATCH),
        (_msg(replica="a.b"), BAD_VALUE),
        (_msg(ops=[{"op": "evict", "id": "r1"}]), BAD_VALUE),
        (_msg(ops=[{"op": "release", "id": "r1", "phase": "done"}]), BAD_VALUE),
        (_msg(ops=[{"op": "release", "id": "", "phase": "finished"}]), BAD_VALUE),
        (_msg(ops=[{"op": "release", "id": "r1", "phase": "finished"}] * (MAX_OPS + 1)), BAD_VALUE),
        (
            _msg(
                ops=[
                    {"op": "release", "id": "r0", "phase": "finished"},
                    _commit_op(miss_tokens=-1),
                ]
            ),
            BAD_VALUE,
        ),
        (
            _msg(ops=[_commit_op(keys=list(range(MAX_KEYS + 1)))]),
            BAD_VALUE,
        ),
    ],
)
def test_malformed_messages_are_rejected_whole_and_counted(payload: bytes, reason: str) -> None:
    pair = Pair()
    pair.b.score(request(prompt(40, seed=7), rid="r1"), commit=True)  # a release for it would apply
    pair.b.score(request(prompt(40, seed=8), rid="r0"), commit=True)
    ledger = dict(pair.b.ledger._entries)
    with pytest.raises(WireError) as err:
        decode(payload, "evil")
    assert err.value.reason == reason
    assert not pair.sb.receive("evil", payload)
    assert pair.sb.rejects == {reason: 1}
    assert pair.b.ledger._entries == ledger  # nothing of a rejected message applied
    assert pair.sb.applied == {}


def test_unknown_fields_are_ignored_and_encoding_round_trips() -> None:
    commit = CommitOp("r1", MODEL, "w0", 2, BS, 100, 60, "ttft", "prefill", 10.0, [1, 2, 3])
    msg = RoutingMessage(1, "a", 5, 1, 12.5, [commit, ReleaseOp("r0", "prefill")])
    assert decode(encode(msg), "a") == msg
    raw = msgpack.unpackb(encode(msg))
    raw["future"] = {"x": 1}
    raw["ops"][0]["future"] = 1
    assert decode(msgpack.packb(raw), "a") == msg


def test_replica_ids_follow_the_subject_rule() -> None:
    first, second = default_replica_id(), default_replica_id()
    assert check_replica_id(first) and check_replica_id(second) and first != second
    with pytest.raises(ValueError, match="replica id"):
        check_replica_id("a.b")
    with pytest.raises(ValueError, match="replica id"):
        RoutingSync(fleet(1)[0], SyncConfig(replica_id="x" * 129))


def test_a_replica_given_anothers_id_is_still_applied() -> None:
    """Two processes given the same --replica-id: told apart by their epochs (and logged)."""
    a, index, registry, clock = fleet(2, observer=lambda r: RoutingSync(r, SyncConfig(replica_id="same")))
    b = build_ranker(index, registry, Calibrator.of(CostConfig()), clock=clock)
    sa, sb = a.observer, RoutingSync(b, SyncConfig(replica_id="same"))
    sb.epoch = sa.epoch + 1
    a.score(request(prompt(20, seed=9), rid="r1"), commit=True)
    payload, _ = sa.take()
    assert not sa.receive("same", payload)  # its own echo
    assert sb.receive("same", payload) and len(b.ledger) == 1


def _burst(
    prefixes: int, per_prefix: int, prefix_blocks: int, suffix_blocks: int
) -> list[tuple[int, list[int]]]:
    heads = [prompt(prefix_blocks, seed=100 + p) for p in range(prefixes)]
    return [
        (p, heads[p] + prompt(suffix_blocks, seed=1000 + i * prefixes + p))
        for i in range(per_prefix)
        for p in range(prefixes)
    ]


def _copies(
    routers: list[Ranker], clock: Clock, requests: list[tuple[int, list[int]]], pair: Pair | None
) -> list[int]:
    placed: dict[int, set[tuple[str, int]]] = {}
    for i, (p, keys) in enumerate(requests):
        res = routers[i % len(routers)].score(request(keys, rid=f"q{i}"), commit=True)
        placed.setdefault(p, set()).add(res.committed.key)
        if pair is not None:
            pair.deliver()
        clock.t += 0.005
    return [len(placed[p]) for p in sorted(placed)]


@pytest.mark.parametrize("shape", [(4, 24, 256, 64), (4, 48, 128, 64), (3, 8, 256, 16)])
def test_a_burst_asked_alternately_is_placed_as_one_replica_places_it(
    shape: tuple[int, int, int, int],
) -> None:
    requests = _burst(*shape)
    one, _, _, clock = fleet(8)
    alone = _copies([one], clock, requests, None)
    apart = Pair(sync=False)
    unsynced = _copies([apart.a, apart.b], apart.clock, requests, None)
    together = Pair()
    synced = _copies([together.a, together.b], together.clock, requests, together)
    assert synced == alone
    assert sum(abs(u - a) for u, a in zip(unsynced, alone, strict=True)) >= 2, (alone, unsynced)


def test_request_role_and_policy_travel_with_the_commit() -> None:
    pair = Pair()
    pair.a.score(RouteRequest(MODEL, prompt(20, seed=11), 320, BS, "d1", "decode"), commit=True)
    pair.a.score(request(prompt(20, seed=12), rid="c1"), policy="cache_aware", commit=True)
    payload, _ = pair.sa.take()
    ops = decode(payload, "a").ops
    assert [(op.id, op.role, op.policy, op.spec_ttl > 0) for op in ops] == [
        ("d1", "decode", "decode", False),
        ("c1", "prefill", "cache_aware", False),
    ]
    pair.sb.receive("a", payload)
    trees = pair.b.policies["cache_aware"]._trees  # cache_aware's own memory follows a's decisions too
    assert sum(len(t) for t in trees.values()) == 20


def test_the_documented_example_decodes() -> None:
    """docs/wire.md §7's JSON example, as msgpack, is a valid message (the doc and the code agree)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text()
    section = text[text.index("## 7. Routing sync") :]
    example = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    msg = decode(msgpack.packb(example), example["replica"])
    commit, release = msg.ops
    assert isinstance(commit, CommitOp) and isinstance(release, ReleaseOp)
    assert (commit.worker, commit.spec_ttl, len(commit.keys), release.phase) == (
        "gpu-node-3",
        10.0,
        2,
        "finished",
    )
