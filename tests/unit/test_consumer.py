"""Consumer: wire bytes in, index state out; bad input is rejected whole, counted, and changes nothing."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.ingest.consumer import Consumer
from kvindex.observability.counters import IngestCounters
from kvindex.sequencer.cursor import Sequencer, Verdict, decide
from kvindex.wire import WireError, codec, decode_batch, encode_batch, encode_heartbeat
from kvindex.wire import errors as E
from kvindex.wire.codec import Limits
from tests.unit.test_wire import wire_batches


def make() -> Consumer:
    return build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        limits=Limits(max_events=100, max_keys=1000),
    )


def ev_batch(seq: int, events: list[dict], worker: str = "w1", epoch: int = 1, **kw: Any) -> bytes:
    fields: dict[str, Any] = {"model": "m", "block_size": 4, "ts": 0.0, "dp_rank": 0}
    fields.update(kw)
    return encode_batch(worker=worker, epoch=epoch, seq=seq, events=events, **fields)


def stored(*keys: int, tier: str = "gpu") -> dict:
    return {"type": "stored", "tier": tier, "keys": list(keys), "parent": None}


def snapshot(c: Consumer) -> Any:
    ix = c.index
    return (
        ix.stats(),
        {i: ix.block_counts(i) for i in ix.instances()},
        {i: ix.digest(i, 0) for i in ix.instances()},
    )


def test_apply_in_order_and_drop_duplicates() -> None:
    c = make()
    assert c.on_events("kvindex.events.w1", ev_batch(1, [stored(1, 2, 3)]))
    assert c.on_events("kvindex.events.w1", ev_batch(2, [{"type": "removed", "tier": "gpu", "keys": [3]}]))
    assert not c.on_events("kvindex.events.w1", ev_batch(2, [stored(9)]))  # duplicate seq: ignored
    assert c.index.block_counts(("w1", 0)) == (2, 0, 0, 0)
    assert c.counters.duplicates == 1 and c.counters.batches_applied == 2


def test_gap_detected_counted_and_applied() -> None:
    c = make()
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(1)]))
    c.on_events("kvindex.events.w1", ev_batch(5, [stored(2)]))
    state = c.registry.get(("w1", 0))
    assert c.counters.gaps == 1 and c.counters.missing_batches == 3
    assert state is not None and state.gaps == 1 and state.last_seq == 5


def test_restart_drops_old_blocks() -> None:
    c = make()
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(1, 2)], epoch=1))
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(7)], epoch=2))
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [7]
    assert c.counters.restarts == 1
    # A late batch of the old epoch must not resurrect anything.
    assert not c.on_events("kvindex.events.w1", ev_batch(2, [stored(1)], epoch=1))
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [7]


def test_restart_during_a_repair_reports_the_new_history_as_synced() -> None:
    # Found by the real-vLLM run: a repair of the old epoch left ListInstances saying "replay" or
    # "snapshot" after the worker restarted, although the new epoch applied from seq 1.
    class Pending:  # a repair transport whose answers never come
        def __init__(self) -> None:
            self.asked: list[str] = []

        def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
            self.asked.append("replay")

        def request_snapshot(self, instance: Any, cause: str) -> None:
            self.asked.append("snapshot")

    pending = Pending()
    c = build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=lambda _machine: pending,
    )
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(1)], epoch=1))
    c.on_events("kvindex.events.w1", ev_batch(3, [stored(2)], epoch=1))  # gap: a repair starts
    assert pending.asked == ["replay"]
    state = c.registry.get(("w1", 0))
    assert state is not None and state.repair.sync == "replay"
    assert c.on_events("kvindex.events.w1", ev_batch(1, [stored(7)], epoch=2))
    assert state.repair.sync == "synced"
    assert c.sequencer.cursor(("w1", 0)).repairing is None  # type: ignore[union-attr]
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [7]


def test_heartbeat_with_new_epoch_clears_and_tail_loss_is_a_gap() -> None:
    c = make()
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(1)], epoch=1))
    st = {"model": "m", "block_size": 4, "ts": 0.0, "load": {}, "capacity": {"gpu": 10}, "digest": {}}
    assert c.on_heartbeat("kvindex.status.w1", encode_heartbeat(worker="w1", epoch=1, seq=3, **st))
    assert c.counters.gaps == 1 and c.counters.missing_batches == 2
    assert c.on_heartbeat("kvindex.status.w1", encode_heartbeat(worker="w1", epoch=9, seq=0, **st))
    assert c.index.block_counts(("w1", 0)) == (0, 0, 0, 0) and c.counters.restarts == 1


BAD: list[tuple[str, str, bytes, str]] = [
    ("garbage", "kvindex.events.w1", b"\x93\x01", E.MALFORMED),
    ("not a map", "kvindex.events.w1", msgpack.packb([1]), E.NOT_A_MAP),
    ("subject mismatch", "kvindex.events.w2", ev_batch(2, [stored(5)]), E.SUBJECT_MISMATCH),
    ("bad subject", "kvindex.events.a b", ev_batch(2, [stored(5)]), E.BAD_SUBJECT),
    ("wrong types", "kvindex.events.w1", ev_batch(2, [stored(5)], block_size="4"), E.BAD_TYPE),
    ("oversize", "kvindex.events.w1", ev_batch(2, [stored(*range(1001))]), E.OVERSIZE),
    (
        "block size of model",
        "kvindex.events.w9",
        ev_batch(1, [stored(5)], worker="w9", block_size=8),
        E.BLOCK_SIZE_MISMATCH,
    ),
    ("model in same epoch", "kvindex.events.w1", ev_batch(2, [stored(5)], model="other"), E.MODEL_MISMATCH),
    ("bad event in good batch", "kvindex.events.w1", ev_batch(2, [stored(5), {"type": "x"}]), E.BAD_VALUE),
]


@pytest.mark.parametrize(("name", "subject", "payload", "reason"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_rejected_counted_and_harmless(
    name: str, subject: str, payload: bytes, reason: str
) -> None:
    c = make()
    assert c.on_events("kvindex.events.w1", ev_batch(1, [stored(1, 2)]))
    before = snapshot(c)
    assert c.on_events(subject, payload) is False
    assert snapshot(c) == before
    assert c.counters.rejects[reason] == 1
    # The consumer keeps going: the next good batch applies.
    assert c.on_events("kvindex.events.w1", ev_batch(2, [stored(3)]))
    assert c.index.block_counts(("w1", 0)) == (3, 0, 0, 0)


def test_bad_heartbeat_rejected() -> None:
    c = make()
    assert not c.on_heartbeat("kvindex.status.w1", msgpack.packb({"v": 1, "worker": "w1"}))
    assert c.counters.rejects[E.MISSING_FIELD] == 1
    assert c.counters.rejects_by_worker["w1"] == 1
    assert len(c.registry) == 0


def test_worker_restarting_with_other_model_is_reregistered() -> None:
    c = make()
    c.on_events("kvindex.events.w1", ev_batch(1, [stored(1)], epoch=1))
    assert c.on_events("kvindex.events.w1", ev_batch(1, [stored(2)], epoch=2, model="m2", block_size=16))
    state = c.registry.get(("w1", 0))
    assert state is not None and state.model == "m2" and state.block_size == 16
    assert c.index.model_of(("w1", 0)) == "m2"
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [2]


def test_mixed_event_order_within_a_batch_is_respected() -> None:
    c = make()
    removed = {"type": "removed", "tier": "gpu", "keys": [1]}
    events = [stored(1, 2), stored(3), removed, stored(1), stored(4, tier="cpu"), stored(5, tier="cpu")]
    assert c.on_events("kvindex.events.w1", ev_batch(1, events))
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [1, 2, 3]
    assert sorted(c.index.keys_of(("w1", 0), 1)) == [4, 5]
    assert c.counters.events_applied == [5, 1, 0]
    events = [stored(9), {"type": "cleared", "tier": "gpu"}, stored(8), removed]
    assert c.on_events("kvindex.events.w1", ev_batch(2, events))
    assert sorted(c.index.keys_of(("w1", 0), 0)) == [8]


class _Silent:
    """A repair scheduler that is never answered: repairs stay in flight until given up."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def request_replay(self, instance: Any, epoch: int, first: int, last: int) -> None:
        pass

    def request_snapshot(self, instance: Any, cause: str) -> None:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["w1", "w2"]),
            st.integers(1, 3),
            st.integers(1, 9),
            st.sampled_from(["good", "good", "good", "bad", "give_up"]),
        ),
        min_size=1,
        max_size=40,
    ),
    st.booleans(),
)
def test_a_batch_is_applied_at_once_exactly_when_the_sequencer_says_apply(
    stream: list[tuple[str, int, int, str]], silent: bool
) -> None:
    # on_events applies a batch in order before asking decide() (the common case first): over random
    # histories (duplicates, gaps and the repairs they start, held batches, restarts, stale epochs,
    # rejects), what it does must be what decide() says of the cursor as it was.
    c = build_consumer(
        InvertedIndex(),
        Registry(),
        sequencer=Sequencer(),
        counters=IngestCounters(),
        repair=_Silent if silent else None,  # repairs in flight, or holes accepted at once
    )
    for worker, epoch, seq, what in stream:
        key = (worker, 0)
        if what == "give_up":
            if c.sequencer.cursor(key) is not None:
                c.repairs.give_up(key)
            continue
        cursor = c.sequencer.cursor(key)
        verdict = decide(cursor, epoch, seq)
        before = (c.counters.batches_applied, c.counters.duplicates, c.counters.stale_epochs)
        good = what == "good"
        payload = ev_batch(seq, [stored(seq, epoch)], worker=worker, epoch=epoch) if good else b"\xc1"
        applied = c.on_events(f"kvindex.events.{worker}", payload)
        after = (c.counters.batches_applied, c.counters.duplicates, c.counters.stale_epochs)
        if not good:
            assert not applied and after == before
        elif verdict is Verdict.APPLY:
            assert applied and after == (before[0] + 1, before[1], before[2])
            assert cursor is not None and cursor.applied == seq
        elif verdict is Verdict.DUPLICATE:
            assert not applied and after == (before[0], before[1] + 1, before[2])
        elif verdict is Verdict.STALE_EPOCH:
            assert not applied and after == (before[0], before[1], before[2] + 1)
        elif verdict in (Verdict.BUFFER, Verdict.GAP):  # held (the repair machine may apply it)
            assert not applied
        else:  # a new history: applied when it starts at 1
            assert applied == (seq == 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(wire_batches(), st.sampled_from(["w1", "w-2_X", "a b"]), st.booleans()), max_size=8)
)
def test_the_consumer_decodes_as_decode_batch(messages: list[tuple[bytes, str, bool]]) -> None:
    # on_events decodes a batch of a worker id seen valid inline (codec.batch_fast_path): whatever the
    # payload and subject, it rejects for the reason decode_batch gives, and accepts what it accepts.
    c = make()
    for payload, subject_worker, forget_ids in messages:
        if forget_ids:
            codec._valid_workers.clear()
        try:
            decode_batch(payload, subject_worker, c.limits)
            expected = None
        except WireError as exc:
            expected = exc.reason
        if forget_ids:  # the consumer then meets the id unseen
            codec._valid_workers.clear()
        before = dict(c.counters.rejects)
        c.on_events(f"kvindex.events.{subject_worker}", payload)
        delta = {r: n - before.get(r, 0) for r, n in c.counters.rejects.items() if n != before.get(r, 0)}
        if expected is None:
            assert delta == {}
        elif expected == E.SUBJECT_MISMATCH and subject_worker == "a b":
            assert delta == {E.BAD_SUBJECT: 1}
        else:
            assert delta == {expected: 1}
