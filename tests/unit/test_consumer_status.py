"""Heartbeats through the consumer's steady-state path (codec.peek_heartbeat, decode_heartbeat_into):
a heartbeat that repeats the previous one's maps reuses their decoded objects, and must still do
everything a fully decoded one does."""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

import msgpack
import pytest

from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.observability.counters import IngestCounters
from kvindex.sequencer.cursor import Sequencer
from kvindex.wire import encode_batch, encode_heartbeat
from kvindex.wire import errors as E

SUBJECT = "kvindex.status.w1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Recorder:
    """A repair transport that records what is asked and never answers."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, str]] = []

    def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
        self.asked.append((instance, f"replay {epoch} {first}-{last}"))

    def request_snapshot(self, instance: Any, cause: str) -> None:
        self.asked.append((instance, f"snapshot {cause}"))


def make(repair: Any = None, prefill_samples: Any = None) -> Consumer:
    return build_consumer(
        InvertedIndex(),
        Registry(clock=Clock()),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=None if repair is None else lambda _machine: repair,
        prefill_samples=prefill_samples,
    )


def heartbeat(worker: str = "w1", **kw: Any) -> bytes:
    fields_: dict[str, Any] = {
        "model": "m",
        "epoch": 1,
        "seq": 0,
        "ts": 1.0,
        "block_size": 4,
        "load": {"running": 1, "waiting": 2, "waiting_prefill_tokens": 30, "kv_usage": 0.5},
        "capacity": {"gpu": 100},
        "digest": {"gpu": (0, 0)},
    }
    fields_.update(kw)
    return encode_heartbeat(worker=worker, **fields_)


def batch(seq: int, *keys: int, worker: str = "w1", epoch: int = 1) -> bytes:
    events = [{"type": "stored", "tier": "gpu", "keys": list(keys), "parent": None}]
    return encode_batch(worker=worker, model="m", epoch=epoch, seq=seq, ts=0.0, block_size=4, events=events)


def xor(*keys: int) -> int:
    out = 0
    for k in keys:
        out ^= k
    return out


def test_equal_heartbeat_refreshes_liveness_and_reuses_the_decoded_maps() -> None:
    c = make()
    changed = c.registry.watch()
    assert c.on_heartbeat(SUBJECT, heartbeat(ts=1.0))
    state = c.registry.get(("w1", 0))
    assert state is not None
    load, capacity, at = state.load, state.capacity, state.last_heartbeat_at
    changed.clear()
    assert c.on_heartbeat(SUBJECT, heartbeat(ts=2.0))
    assert state.last_heartbeat_at is not None and at is not None and state.last_heartbeat_at > at
    assert state.heartbeat.ts == 2.0
    # Nothing new was built for what did not change, and the row is still marked changed.
    assert state.load is load and state.capacity is capacity
    assert changed == {("w1", 0)}
    assert c.counters.heartbeats_received == 2 and not c.counters.rejects


def test_heartbeat_equal_but_for_its_load_updates_the_load() -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat())
    state = c.registry.get(("w1", 0))
    assert state is not None
    capacity = state.capacity
    assert c.on_heartbeat(SUBJECT, heartbeat(load={"running": 7, "waiting_prefill_tokens": 5, "extra": 2}))
    assert (state.load.running, state.load.waiting, state.load.waiting_prefill_tokens) == (7, 0, 5)
    assert state.load.kv_usage == 0.0 and state.load.extra == {"extra": 2.0}
    assert state.capacity is capacity
    # Back to no load at all: the defaults, not the previous values.
    assert c.on_heartbeat(SUBJECT, heartbeat(load={}))
    assert state.load.running == 0 and state.load.extra == {}
    raw = msgpack.unpackb(heartbeat())
    del raw["load"]
    assert c.on_heartbeat(SUBJECT, msgpack.packb(raw))
    assert state.load.running == 0 and state.load.waiting_prefill_tokens == 0


@pytest.mark.parametrize(
    ("load", "reason", "where"),
    [
        ({"running": 1.5}, E.BAD_TYPE, "$.load.running"),
        ({"running": -1}, E.BAD_VALUE, "$.load.running"),
        ({"kv_usage": 2.0}, E.BAD_VALUE, "$.load.kv_usage"),
        ({"running": "x"}, E.BAD_TYPE, "$.load.running"),
    ],
)
def test_malformed_load_after_steady_heartbeats_is_rejected_with_the_worker(
    load: dict, reason: str, where: str
) -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat())
    assert c.on_heartbeat(SUBJECT, heartbeat(ts=2.0))
    state = c.registry.get(("w1", 0))
    assert state is not None
    before = (state.load, state.last_heartbeat_at, state.heartbeat.ts)
    assert not c.on_heartbeat(SUBJECT, heartbeat(ts=3.0, load=load))
    assert c.counters.rejects == {reason: 1} and c.counters.rejects_by_worker == {"w1": 1}
    assert (state.load, state.last_heartbeat_at, state.heartbeat.ts) == before
    # The next good heartbeat is taken again.
    assert c.on_heartbeat(SUBJECT, heartbeat(ts=4.0))
    assert state.heartbeat.ts == 4.0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"capacity": {"gpu": -1}}, E.BAD_VALUE),
        ({"capacity": {"xpu": 1}}, E.BAD_VALUE),
        ({"digest": {"gpu": [1]}}, E.BAD_VALUE),
        ({"digest": {"gpu": "x"}}, E.BAD_TYPE),
        ({"seq": -1}, E.BAD_VALUE),
        ({"block_size": 0}, E.BAD_VALUE),
        ({"v": 2}, E.UNSUPPORTED_VERSION),
        ({"prefill": [[1, 2]]}, E.BAD_VALUE),
    ],
)
def test_malformed_fields_after_steady_heartbeats_are_rejected(change: dict, reason: str) -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat())
    assert c.on_heartbeat(SUBJECT, heartbeat(ts=2.0))
    raw = msgpack.unpackb(heartbeat(ts=3.0), strict_map_key=False)
    raw.update(change)
    assert not c.on_heartbeat(SUBJECT, msgpack.packb(raw))
    assert c.counters.rejects == {reason: 1} and c.counters.rejects_by_worker == {"w1": 1}


def test_subject_checks_hold_for_known_instances() -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat())
    # Another worker's subject for w1's heartbeat, a subject that is no worker id, another prefix.
    assert not c.on_heartbeat("kvindex.status.w2", heartbeat())
    assert not c.on_heartbeat("kvindex.status.a b", heartbeat())
    assert not c.on_heartbeat("other.status.w1", heartbeat())
    assert c.counters.rejects == {E.SUBJECT_MISMATCH: 1, E.BAD_SUBJECT: 2}
    assert c.counters.rejects_by_worker == {"w2": 1}


def test_changed_endpoint_is_parsed_and_validated_each_time() -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat(endpoint="a:1"))
    assert c.on_heartbeat(SUBJECT, heartbeat(endpoint="a:1", ts=2.0))
    assert c.registry.endpoint("w1/0") == "a:1"
    assert c.on_heartbeat(SUBJECT, heartbeat(endpoint="b:2"))
    assert c.registry.endpoint("w1/0") == "b:2" and c.registry.at_endpoint("a:1") == []
    # A bad one is dropped (and counted) at every heartbeat that carries it, not only the first.
    for _ in range(3):
        assert c.on_heartbeat(SUBJECT, heartbeat(endpoint="no port"))
        assert c.registry.endpoint("w1/0") is None
    assert c.counters.rejects == {E.BAD_ENDPOINT: 3} and c.counters.rejects_by_worker == {"w1": 3}
    assert c.on_heartbeat(SUBJECT, heartbeat(endpoint=8000))
    assert c.counters.rejects == {E.BAD_ENDPOINT: 4}
    assert c.on_heartbeat(SUBJECT, heartbeat(endpoint="b:2"))
    assert c.registry.endpoint("w1/0") == "b:2"
    assert c.on_heartbeat(SUBJECT, heartbeat())  # withdrawn
    assert c.registry.endpoint("w1/0") is None and c.counters.rejects == {E.BAD_ENDPOINT: 4}


def test_drift_after_equal_heartbeats_is_detected() -> None:
    rec = Recorder()
    c = make(rec)
    assert c.on_events("kvindex.events.w1", batch(1, 5, 6))
    good = {"gpu": (2, xor(5, 6))}
    for ts in (1.0, 2.0, 3.0):
        assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest=good, ts=ts))
    assert rec.asked == [] and c.counters.drift_detected == 0
    # The index loses track behind the consumer's back: the same heartbeat now shows drift.
    c.index.store(("w1", 0), 0, [9])
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest=good, ts=4.0))
    assert c.counters.drift_detected == 1 and rec.asked == [(("w1", 0), "snapshot drift")]


def test_digest_that_changes_while_seq_stays_brings_a_snapshot() -> None:
    rec = Recorder()
    c = make(rec)
    assert c.on_events("kvindex.events.w1", batch(1, 5, 6))
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest={"gpu": (2, xor(5, 6))}))
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest={"gpu": (2, xor(5, 6))}, ts=2.0))
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest={"gpu": (2, xor(5, 7))}, ts=3.0))
    assert c.counters.drift_detected == 1 and rec.asked == [(("w1", 0), "snapshot drift")]


def test_a_digest_found_equal_is_checked_again_after_the_index_changes() -> None:
    rec = Recorder()
    c = make(rec)
    assert c.on_events("kvindex.events.w1", batch(1, 5))
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=1, digest={"gpu": (1, 5)}))
    assert c.on_events("kvindex.events.w1", batch(2, 6))
    # The old digest is stale now; the new one matches.
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=2, digest={"gpu": (2, xor(5, 6))}))
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=2, digest={"gpu": (2, xor(5, 6))}, ts=2.0))
    assert c.counters.drift_detected == 0
    # A removal and a store that bring the index back to the same digest: still equal.
    c.index.remove(("w1", 0), 0, [6])
    c.index.store(("w1", 0), 0, [6])
    assert c.on_heartbeat(SUBJECT, heartbeat(seq=2, digest={"gpu": (2, xor(5, 6))}, ts=3.0))
    assert c.counters.drift_detected == 0 and rec.asked == []


def test_payloads_that_are_not_bytes_take_the_full_decoder() -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat())
    assert c.on_heartbeat(SUBJECT, bytearray(heartbeat(load={"running": 4})))
    state = c.registry.get(("w1", 0))
    assert state is not None and state.load.running == 4 and state.heartbeat.memo is None
    assert c.on_heartbeat(SUBJECT, memoryview(heartbeat(load={"running": 5})))
    assert state.load.running == 5
    assert c.on_heartbeat(SUBJECT, heartbeat(load={"running": 6}))
    assert state.load.running == 6 and state.heartbeat.memo is not None


def test_digest_version_moves_with_every_change_and_never_repeats() -> None:
    ix = InvertedIndex()
    key = ("w1", 0)
    assert ix.digest_version(key) == 0
    seen = set()

    def moved() -> None:
        v = ix.digest_version(key)
        assert v not in seen
        seen.add(v)

    ix.add_instance(key, "m")
    moved()
    ix.store(key, 0, [1, 2])
    moved()
    ix.remove(key, 1, [1])  # nothing removed: the digests are the same, so may the version be
    assert ix.digest_version(key) in seen
    ix.remove(key, 0, [1])
    moved()
    from kvindex.wire.schema import Stored

    ix.apply(key, [Stored(tier="cpu", keys=[3])])
    moved()
    ix.clear(key)
    moved()
    ix.drop_instance(key)
    assert ix.digest_version(key) == 0
    ix.add_instance(key, "m")
    moved()
    assert ix.digest_equals(key, [0, 0, 0, 0], [0, 0, 0, 0])
    ix.store(key, 2, [7])
    assert ix.digest_equals(key, [0, 0, 1, 0], [0, 0, 7, 0])
    assert not ix.digest_equals(key, [0, 0, 1, 0], [0, 0, 6, 0])
    assert ix.digest_equals(("nobody", 0), [0, 0, 0, 0], [0, 0, 0, 0])
    assert not ix.digest_equals(("nobody", 0), [1, 0, 0, 0], [0, 0, 0, 0])


def test_block_size_of_a_model_is_checked_against_the_other_instances() -> None:
    c = make()
    assert c.on_heartbeat(SUBJECT, heartbeat(block_size=4))
    # Alone, an instance may restart with another block size...
    assert c.on_heartbeat(SUBJECT, heartbeat(block_size=8, epoch=2))
    assert c.on_heartbeat("kvindex.status.w2", heartbeat("w2", block_size=8))
    # ...but not once the model has others, whichever comes first in the model.
    assert not c.on_heartbeat(SUBJECT, heartbeat(block_size=16, epoch=3))
    assert not c.on_heartbeat("kvindex.status.w2", heartbeat("w2", block_size=16, epoch=2))
    assert c.counters.rejects == {E.BLOCK_SIZE_MISMATCH: 2}


# -- the steady-state path against the full decoder, over random heartbeat sequences ------------

LOADS: list[Any] = [
    {"running": 1, "waiting": 2},
    {"running": 1, "waiting": 2},
    {"running": 3, "kv_usage": 0.25, "other": 1.5},
    {},
    None,
    {"running": 1.5},
    {"kv_usage": 3.0},
]
CAPACITIES: list[Any] = [
    {"gpu": 100},
    {"gpu": 100},
    {"gpu": 100, "cpu": 50},
    {},
    None,
    {"shared": 10},
    {"gpu": -1},
]
ENDPOINTS: list[Any] = [None, "a:1", "a:1", "b:2", "bad", 8000, [1]]


def _heartbeat(rng: random.Random, index: InvertedIndex, last: dict[str, dict]) -> tuple[str, Any]:
    worker = rng.choice(["w1", "w1", "w2"])
    previous = last.get(worker)
    if previous is not None and rng.random() < 0.6:  # mostly a repeat, as workers send them
        msg = dict(previous, ts=rng.random())
        if rng.random() < 0.3:
            msg["load"] = rng.choice([x for x in LOADS if x is not None])
        if rng.random() < 0.2:
            msg["seq"] = rng.choice([0, 1, 2, 3])
        msg.pop("prefill", None)
        return f"kvindex.status.{worker}", msgpack.packb(msg)
    key = (worker, 0)
    honest = {
        tier: index.digest(key, t)
        for t, tier in enumerate(("gpu", "cpu", "disk", "shared"))
        if index.digest(key, t)[0]
    }
    msg: dict[str, Any] = {
        "v": 1 if rng.random() > 0.02 else 2,
        "worker": worker,
        "model": "m" if rng.random() > 0.05 else "m2",
        "epoch": rng.choice([1, 1, 1, 2]),
        "seq": rng.choice([0, 1, 2, 3]),
        "ts": rng.random(),
        "block_size": 4 if rng.random() > 0.05 else 8,
        "dp_rank": 0,
    }
    for name, choices in (("load", LOADS), ("capacity", CAPACITIES), ("endpoint", ENDPOINTS)):
        value = rng.choice(choices)
        if value is not None:
            msg[name] = value
    r = rng.random()
    if r < 0.6:
        msg["digest"] = {t: list(d) for t, d in honest.items()}
    elif r < 0.8:
        msg["digest"] = {"gpu": [1, 12345]}
    elif r < 0.9:
        msg["digest"] = {"gpu": [1]}
    if rng.random() < 0.1:
        msg["prefill"] = [[100, 50, 1.5]]
    if rng.random() < 0.1:
        msg["events"] = False
    subject = f"kvindex.status.{worker}" if rng.random() > 0.03 else "kvindex.status.w3"
    if rng.random() < 0.02:
        return subject, b"\x93\x01"
    last[worker] = msg
    return subject, msgpack.packb(msg)


def _view(c: Consumer, samples: list[Any]) -> Any:
    states = {}
    for s in c.registry.all():
        states[s.key] = {
            f.name: getattr(s, f.name) for f in fields(s) if f.name not in ("heartbeat", "_watchers")
        }
        states[s.key]["heartbeat"] = (s.heartbeat.ts, s.heartbeat.digest, s.heartbeat.seq)  # (not its memo)
    cursors = {
        k: (cur.epoch, cur.applied, cur.repairing, cur.target, cur.behind, cur.rounds, cur.cause)
        for k, cur in c.sequencer.cursors().items()
    }
    counters = {f.name: getattr(c.counters, f.name) for f in fields(c.counters) if f.name != "lag"}
    digests = {i: [c.index.digest(i, t) for t in range(4)] for i in c.index.instances()}
    return states, cursors, counters, digests, list(samples)


@pytest.mark.parametrize("seed", range(40))
def test_steady_path_matches_the_full_decoder(seed: int) -> None:
    rng = random.Random(seed)
    fast_samples: list[Any] = []
    full_samples: list[Any] = []
    fast = make(Recorder(), lambda model, s, instance: fast_samples.append((model, s, instance)))
    full = make(Recorder(), lambda model, s, instance: full_samples.append((model, s, instance)))
    seqs = {"w1": 0, "w2": 0}
    last: dict[str, dict] = {}
    for _ in range(400):
        if rng.random() < 0.15:
            worker = rng.choice(["w1", "w2"])
            seqs[worker] += 1
            payload = batch(seqs[worker], rng.randrange(1, 50), worker=worker)
            assert fast.on_events(f"kvindex.events.{worker}", payload) == full.on_events(
                f"kvindex.events.{worker}", payload
            )
            continue
        if rng.random() < 0.03:  # the index drifts
            for c in (fast, full):
                if c.index.has_instance(("w1", 0)):
                    c.index.store(("w1", 0), 0, [999])
            continue
        subject, payload = _heartbeat(rng, fast.index, last)
        # A bytearray takes the full decoder every time (no memory kept), so ``full`` is the reference.
        assert fast.on_heartbeat(subject, payload) == full.on_heartbeat(subject, bytearray(payload))
        assert _view(fast, fast_samples) == _view(full, full_samples)
        assert fast.repairs.scheduler.asked == full.repairs.scheduler.asked  # type: ignore[attr-defined]
    # The sequences exercised both paths.
    assert any(s.heartbeat.memo is not None for s in fast.registry.all())


def test_load_decoding_matches_decode_heartbeat() -> None:
    from kvindex.wire import decode_heartbeat
    from kvindex.wire.codec import load_of

    rng = random.Random(3)
    names = ["running", "waiting", "waiting_prefill_tokens", "kv_usage", "other"]
    values: list[Any] = [
        0,
        1,
        7,
        2**64 - 1,
        -1,
        0.0,
        0.5,
        1.0,
        1.5,
        -0.0,
        float("nan"),
        float("inf"),
        True,
        "x",
        None,
    ]
    loads: list[Any] = [[], {}, 3]
    for _ in range(2000):
        loads.append({rng.choice(names): rng.choice(values) for _ in range(rng.randrange(1, 5))})
    loads.append(b"\x82\xa7running\x01\xa7running\x02")  # a duplicate key: the last one counts
    for load in loads:
        raw = load if isinstance(load, bytes) else msgpack.packb(load)
        empty = heartbeat(load={})
        assert empty.count(b"\xa4load\x80") == 1
        try:
            expected = decode_heartbeat(empty.replace(b"\xa4load\x80", b"\xa4load" + raw)).load
        except Exception:
            expected = None
        assert repr(load_of(raw)) == repr(expected), load  # (repr: nan equals itself there)


# -- the router's columns, kept at heartbeats ---------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_fleet_tables_rows_equal_row_values_through_heartbeats(seed: int) -> None:
    """FleetTables.refresh computes rows inline and rewrites only the heartbeat time of a row whose
    heartbeat changed nothing else: every row must still be row_values of its instance."""
    import numpy as np

    from kvindex.scoring.fleet_table import _BOOL_COLS, _FLOAT_COLS, FleetTables, row_values
    from kvindex.scoring.ledger import Ledger

    rng = random.Random(seed)
    clock = Clock()
    c = build_consumer(
        InvertedIndex(), Registry(clock=clock), sequencer=Sequencer(), counters=IngestCounters()
    )
    ledger = Ledger(clock)
    tables = FleetTables(c.registry, ledger)
    workers = [f"w{i}" for i in range(40)]
    loads = [{"running": 1}, {"running": 2, "waiting_prefill_tokens": 50}, {}, {"kv_usage": 0.5}]
    capacities = [{"gpu": 10}, {"gpu": 10}, {}, {"shared": 5}]
    chosen = {w: (rng.choice(loads), rng.choice(capacities)) for w in workers}
    requests = 0
    for _ in range(1500):
        r = rng.random()
        w = rng.choice(workers)
        if r < 0.6:
            if rng.random() < 0.1:
                chosen[w] = (rng.choice(loads), rng.choice(capacities))
            load, capacity = chosen[w]
            c.on_heartbeat(f"kvindex.status.{w}", heartbeat(w, load=load, capacity=capacity, ts=rng.random()))
        elif r < 0.7:
            requests += 1
            ledger.commit(f"r{requests}", (w, 0), "m", 100, rng.randrange(0, 100))
        elif r < 0.78 and requests:
            ledger.release(f"r{rng.randrange(1, requests + 1)}", rng.choice(["prefill", "finished"]))
        elif r < 0.82:
            state = c.registry.get((w, 0))
            if state is not None:
                c.mark_stale(state)
        elif r < 0.84:
            if c.registry.get((w, 0)) is not None:
                c.forget((w, 0))
        elif r < 0.86:
            c.on_events(
                f"kvindex.events.{w}", batch(1, rng.randrange(1, 50), worker=w, epoch=rng.randrange(1, 9))
            )
        if rng.random() < 0.3:
            table = tables.get("m")
            if table is None:
                continue
            assert table.n == c.registry.count("m")
            for i, state in enumerate(table.states):
                expected = row_values(state, ledger)
                got = [getattr(table, name)[i] for name in (*_FLOAT_COLS, *_BOOL_COLS)]
                assert got == [np.float64(v) if n < len(_FLOAT_COLS) else v for n, v in enumerate(expected)]


def test_fleet_tables_follow_an_instance_forgotten_and_back_between_refreshes() -> None:
    from kvindex.scoring.fleet_table import FleetTables
    from kvindex.scoring.ledger import Ledger

    clock = Clock()
    c = build_consumer(
        InvertedIndex(), Registry(clock=clock), sequencer=Sequencer(), counters=IngestCounters()
    )
    tables = FleetTables(c.registry, Ledger(clock))
    assert c.on_heartbeat(SUBJECT, heartbeat(load={"running": 1}))
    old = c.registry.get(("w1", 0))
    assert old is not None
    c.mark_stale(old)
    table = tables.get("m")
    assert table is not None and table.states == [old] and not table.routable[0]
    c.forget(("w1", 0))
    assert c.on_heartbeat(SUBJECT, heartbeat(load={"running": 5}))  # back before any ranking refreshed
    new = c.registry.get(("w1", 0))
    table = tables.get("m")
    assert table is not None and new is not old
    # The rankings read the instance's state through its row: the new one, not the forgotten one.
    assert table.states == [new] and table.routable[0] and table.running_now[0] == 5


# -- repeated heartbeats (consumer._Repeat) --------------------------------------------------------


def _repeat_setup():
    from kvindex.core import build_consumer
    from kvindex.fleet.registry import Registry
    from kvindex.index import InvertedIndex
    from kvindex.wire.codec import encode_batch, encode_heartbeat

    c = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())

    def hb(ts: float, seq: int = 0, running: int = 1, digest=(0, 0)) -> bytes:
        return encode_heartbeat(
            worker="w1",
            model="m",
            epoch=1,
            seq=seq,
            ts=ts,
            block_size=16,
            load={"running": running, "waiting": 0},
            capacity={"gpu": 1000},
            digest={"gpu": digest},
            endpoint="10.0.0.1:8000",
        )

    def batch(seq: int, keys: list[int]) -> bytes:
        ev = [{"type": "stored", "tier": "gpu", "keys": keys, "parent": None}]
        return encode_batch(worker="w1", model="m", epoch=1, seq=seq, ts=1.0, block_size=16, events=ev)

    return c, hb, batch


def test_a_repeated_heartbeat_only_refreshes_liveness() -> None:
    c, hb, _ = _repeat_setup()
    subject = "kvindex.status.w1"
    for t in (1.0, 2.0, 3.0):  # join; digest found equal; then remembered as a repeat
        assert c.on_heartbeat(subject, hb(t))
    assert subject in c.heartbeats._repeats
    state = c.registry.get(("w1", 0))
    assert state is not None
    before = state.last_heartbeat_at
    assert c.on_heartbeat(subject, hb(4.5))
    assert state.heartbeat.ts == 4.5 and state.last_heartbeat_at >= before
    assert c.counters.heartbeats_received == 4


def test_a_repeat_is_dropped_when_anything_moves() -> None:
    c, hb, batch = _repeat_setup()
    subject = "kvindex.status.w1"
    for t in (1.0, 2.0, 3.0):
        c.on_heartbeat(subject, hb(t))
    state = c.registry.get(("w1", 0))
    # Another load (a busy worker): the short path still, with the new load.
    assert c.on_heartbeat(subject, hb(4.0, running=5))
    assert state.load.running == 5 and subject in c.heartbeats._repeats
    for t in (5.0, 6.0):
        c.on_heartbeat(subject, hb(t, running=5))
    assert subject in c.heartbeats._repeats
    # A batch moves the cursor and the index: the same heartbeat again is checked in full, and a
    # heartbeat whose digest no longer matches the index brings a snapshot.
    assert c.on_events("kvindex.events.w1", batch(1, [11, 12]))
    c.on_heartbeat(subject, hb(7.0, running=5))  # seq 0 < applied 1: an old heartbeat, nothing to do
    assert subject not in c.heartbeats._repeats
    drift = c.counters.drift_detected
    c.on_heartbeat(subject, hb(8.0, seq=1, running=5, digest=(2, 11 ^ 12)))
    c.on_heartbeat(subject, hb(9.0, seq=1, running=5, digest=(2, 11 ^ 12)))
    c.on_heartbeat(subject, hb(10.0, seq=1, running=5, digest=(2, 11 ^ 12)))
    assert c.counters.drift_detected == drift and subject in c.heartbeats._repeats
    # The index loses a block behind the worker's back (drift): the repeat must not hide it.
    c.index.clear(("w1", 0))
    c.on_heartbeat(subject, hb(11.0, seq=1, running=5, digest=(2, 11 ^ 12)))
    assert c.counters.drift_detected == drift + 1


def test_a_stale_or_forgotten_instance_takes_the_full_path() -> None:
    c, hb, _ = _repeat_setup()
    subject = "kvindex.status.w1"
    for t in (1.0, 2.0, 3.0):
        c.on_heartbeat(subject, hb(t))
    state = c.registry.get(("w1", 0))
    c.mark_stale(state)
    c.on_heartbeat(subject, hb(4.0))
    assert not state.stale  # alive again, as the full path says
    for t in (5.0, 6.0):
        c.on_heartbeat(subject, hb(t))
    assert subject in c.heartbeats._repeats
    c.forget(("w1", 0))
    assert subject not in c.heartbeats._repeats
    assert c.on_heartbeat(subject, hb(7.0))
    assert c.registry.get(("w1", 0)) is not state  # back as a new instance


def test_a_look_alike_of_the_ts_field_is_not_taken_for_it() -> None:
    """The short path finds the real ts and load fields or none at all, never bytes inside a string
    that look like them."""
    import msgpack

    from kvindex.fleet.registry import Registry
    from kvindex.ingest.heartbeats import _Repeat
    from kvindex.sequencer.cursor import Cursor
    from kvindex.wire.codec import encode_heartbeat, load_of

    state = Registry().add(("w1", 0), "m", 16)
    look_alike = "m\u00a2ts\u02c9abcdef\u00a4load"  # UTF-8: ... a2 74 73 cb <8 bytes> a4 6c 6f 61 64
    assert b"\xa2ts\xcb" in look_alike.encode() and b"\xa4load" in look_alike.encode()

    def heartbeat(ts: float, running: int) -> bytes:
        return encode_heartbeat(
            worker="w1", model=look_alike, epoch=1, seq=0, ts=ts, block_size=16,
            load={"running": running}, capacity={}, digest={},
        )  # fmt: skip

    # Our encoder (ts and load last): the real fields are found, whatever the model says.
    first = heartbeat(1.0, 1)
    repeat = _Repeat.of(first, 1.0, load_of(msgpack.packb({"running": 1})), state, Cursor(1), 0)
    assert repeat is not None
    assert repeat.tail_of(heartbeat(2.5, 7)) == (2.5, msgpack.packb({"running": 7}))
    # Another encoder, with a look-alike after the real fields: not taken (no short path).
    other = msgpack.packb(
        {
            "v": 1, "worker": "w1", "model": "m", "epoch": 1, "seq": 0, "ts": 1.0, "block_size": 16,
            "load": {"running": 1}, "endpoint": look_alike,
        }
    )  # fmt: skip
    assert _Repeat.of(other, 1.0, load_of(msgpack.packb({"running": 1})), state, Cursor(1), 0) is None


def test_a_busy_worker_s_loads_are_applied_and_a_bad_one_rejected() -> None:
    from kvindex.wire.codec import encode_heartbeat

    c, hb, _ = _repeat_setup()
    subject = "kvindex.status.w1"
    for t in (1.0, 2.0, 3.0):
        c.on_heartbeat(subject, hb(t))
    assert subject in c.heartbeats._repeats
    state = c.registry.get(("w1", 0))
    for i, running in enumerate([7, 9, 9, 0, 31]):
        assert c.on_heartbeat(subject, hb(4.0 + i, running=running))
        assert state.load.running == running and state.heartbeat.ts == 4.0 + i
    assert subject in c.heartbeats._repeats
    # A load decode_heartbeat refuses: the full path says so (counted, with the worker id), nothing
    # is applied, and the short path is gone.
    bad = encode_heartbeat(
        worker="w1",
        model="m",
        epoch=1,
        seq=0,
        ts=10.0,
        block_size=16,
        load={"running": 1, "waiting": 0, "kv_usage": 2.0},
        capacity={"gpu": 1000},
        digest={"gpu": (0, 0)},
        endpoint="10.0.0.1:8000",
    )
    before = sum(c.counters.rejects.values())
    assert not c.on_heartbeat(subject, bad)
    assert sum(c.counters.rejects.values()) == before + 1
    assert state.load.running == 31 and subject not in c.heartbeats._repeats
