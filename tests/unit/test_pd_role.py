"""What each instance does under prefill/decode disaggregation: the heartbeat's optional ``role`` and
``pd_group`` from the publisher through the wire (both decode paths and the repeated-heartbeat
path) and the registry; absent means ``both``; malformed ones are dropped and counted.
ListInstances over gRPC: tests/integration/test_pd_role.py."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import structlog

from kvindex.core import build_consumer
from kvindex.fleet.registry import Registry
from kvindex.index import InvertedIndex
from kvindex.observability.counters import IngestCounters
from kvindex.sequencer.cursor import Sequencer
from kvindex.wire import encode_heartbeat
from kvindex.wire import errors as E
from kvindex.wire.codec import decode_heartbeat
from kvindex.wire.role import BadRole, check_group, check_role
from workers_shim.publisher import WorkerLog

MODEL = "llama-test"
SUBJECT = "kvindex.status.w1"


def heartbeat(worker: str = "w1", ts: float = 1.0, **extra: Any) -> bytes:
    return encode_heartbeat(
        worker=worker, model=MODEL, epoch=1, seq=0, ts=ts, block_size=4,
        load={"running": 2}, capacity={"gpu": 10}, digest={}, **extra,
    )  # fmt: skip


def test_role_and_group_parsers() -> None:
    assert [check_role(r) for r in ("prefill", "decode", "both")] == ["prefill", "decode", "both"]
    for bad in ("Prefill", "encode", "", 1, None):
        with pytest.raises(BadRole, match="role must be one of prefill, decode, both"):
            check_role(bad)
    assert check_group("rack-7.a_b") == "rack-7.a_b"
    for bad in ("", "a b", "x" * 129, 3):
        with pytest.raises(BadRole, match="pd_group must match"):
            check_group(bad)


def test_heartbeat_without_role_is_both() -> None:
    report = decode_heartbeat(heartbeat())  # every worker that predates the field
    assert (report.role, report.pd_group, report.role_error) == ("both", None, None)
    report = decode_heartbeat(heartbeat(role="prefill", pd_group="rack-1"))
    assert (report.role, report.pd_group, report.role_error) == ("prefill", "rack-1", None)


@pytest.mark.parametrize("bad", [{"role": "encode"}, {"role": 7}, {"pd_group": "a b"}, {"pd_group": [1]}])
def test_malformed_role_is_dropped_counted_and_logged_heartbeat_kept(bad: dict[str, Any]) -> None:
    consumer = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    assert consumer.on_heartbeat(SUBJECT, heartbeat(role="decode", pd_group="g1"))
    state = consumer.registry.get(("w1", 0))
    assert state is not None and (state.role, state.pd_group) == ("decode", "g1")
    with structlog.testing.capture_logs() as logs:
        assert consumer.on_heartbeat(SUBJECT, heartbeat(ts=2.0, **{"role": "decode", **bad}))  # applied
    # Neither half of the role is trusted: the instance serves whole requests, as one that says nothing.
    assert (state.role, state.pd_group) == ("both", None) and state.heartbeat.ts == 2.0
    assert consumer.counters.rejects == {E.BAD_ROLE: 1}
    (rejected,) = [e for e in logs if e["event"] == "message_rejected"]
    assert rejected["worker"] == "w1" and rejected["reason"] == E.BAD_ROLE and "must" in rejected["error"]


def test_role_changes_take_every_decode_path() -> None:
    """Full decode, the steady-state peek path (maps reused) and the repeated-bytes path all keep the
    role right, and a change of role leaves the repeated-bytes path (its head bytes differ)."""
    consumer = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    reg = consumer.registry
    assert consumer.on_heartbeat(SUBJECT, heartbeat(ts=1.0, role="prefill"))  # full decode
    state = reg.get(("w1", 0))
    assert state is not None and state.role == "prefill"
    for ts in (2.0, 3.0, 4.0):  # peek path, then the repeated-bytes path
        assert consumer.on_heartbeat(SUBJECT, heartbeat(ts=ts, role="prefill"))
        assert state.role == "prefill" and state.heartbeat.ts == ts
    assert consumer.heartbeats._repeats, "a steady heartbeat takes the repeated-bytes path"
    assert consumer.on_heartbeat(SUBJECT, heartbeat(ts=5.0, role="decode", pd_group="g2"))
    assert (state.role, state.pd_group) == ("decode", "g2")
    assert consumer.on_heartbeat(SUBJECT, heartbeat(ts=6.0))  # the field withdrawn: back to both
    assert (state.role, state.pd_group, state.heartbeat.ts) == ("both", None, 6.0)
    assert not consumer.counters.rejects


def test_publisher_announces_role_only_when_given() -> None:
    with pytest.raises(ValueError, match="role must be"):
        WorkerLog(worker="w1", model=MODEL, block_size=4, role="prefiller")
    with pytest.raises(ValueError, match="pd_group must"):
        WorkerLog(worker="w1", model=MODEL, block_size=4, pd_group="no spaces")
    log = WorkerLog(worker="w1", model=MODEL, block_size=4, role="decode", pd_group="r1")
    hb = msgpack.unpackb(log.heartbeat_payload())
    assert (hb["role"], hb["pd_group"]) == ("decode", "r1")
    # ts and load stay last (the index's repeated-heartbeat path relies on it).
    assert list(hb)[-2:] == ["ts", "load"]
    assert "role" not in msgpack.unpackb(
        WorkerLog(worker="w2", model=MODEL, block_size=4).heartbeat_payload()
    )
