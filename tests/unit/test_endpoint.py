"""Where each instance serves: the heartbeat's optional ``endpoint`` parsed, through the wire, the
publisher and the registry, and malformed ones dropped and counted. Through the gRPC API
(ListInstances, Score): tests/integration/test_endpoint.py."""

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
from kvindex.wire.endpoint import BadEndpoint, endpoint_from_url, parse_endpoint

MODEL = "llama-test"
BS = 4


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.0.0.7:8000", ("10.0.0.7", 8000)),
        ("vllm-0.vllm.default.svc.cluster.local:8000", ("vllm-0.vllm.default.svc.cluster.local", 8000)),
        ("localhost:1", ("localhost", 1)),
        ("[fd00::7]:65535", ("fd00::7", 65535)),
    ],
)
def test_valid_endpoints(text: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoint(text) == parsed


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("10.0.0.7", "not 'host:port'"),
        ("http://10.0.0.7:8000", "not a DNS name"),
        ("10.0.0.7:8000/v1", "port"),
        ("10.0.0.7:0", "1-65535"),
        ("10.0.0.7:65536", "1-65535"),
        ("10.0.0.7:+80", "port"),
        ("999.1.1.1:80", "not a DNS name or IPv4"),
        ("bad_host:80", "not a DNS name"),
        ("-bad.example:80", "not a DNS name"),
        ("fd00::7:80", "not a DNS name"),
        ("[fd00::zz]:80", "not an IPv6 address"),
        ("[fd00::7]80", "[addr]:port"),
        ("", "1-261 characters"),
        ("a" * 300 + ":80", "1-261 characters"),
        (8000, "must be a string"),
        (["h", 80], "must be a string"),
    ],
)
def test_malformed_endpoints_say_what_is_wrong(value: Any, says: str) -> None:
    with pytest.raises(BadEndpoint, match=says.replace("[", r"\[").replace("(", r"\(")):
        parse_endpoint(value)


def test_endpoint_from_metrics_url() -> None:
    assert endpoint_from_url("http://10.1.2.3:8000/metrics") == "10.1.2.3:8000"
    assert endpoint_from_url("https://engine.example/metrics") == "engine.example:443"
    assert endpoint_from_url("http://[fd00::1]:9000/metrics") == "[fd00::1]:9000"
    with pytest.raises(BadEndpoint):
        endpoint_from_url("http:///metrics")


def heartbeat(worker: str = "w1", **extra: Any) -> bytes:
    return encode_heartbeat(
        worker=worker,
        model=MODEL,
        epoch=1,
        seq=0,
        ts=0.0,
        block_size=BS,
        load={"running": 2},
        capacity={"gpu": 10},
        digest={},
        **extra,
    )


def test_heartbeat_without_endpoint_still_decodes() -> None:
    report = decode_heartbeat(heartbeat())  # an old worker: wire v1 without the field
    assert report.endpoint is None and report.endpoint_error is None
    assert decode_heartbeat(heartbeat(endpoint="10.0.0.7:8000")).endpoint == "10.0.0.7:8000"


@pytest.mark.parametrize("bad", ["10.0.0.7", 8000, {"host": "x"}, "x" * 1000, "h:99999"])
def test_malformed_endpoint_is_dropped_counted_and_logged_heartbeat_kept(bad: Any) -> None:
    consumer = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    assert consumer.on_heartbeat("kvindex.status.w1", heartbeat(endpoint="10.0.0.7:8000"))
    assert consumer.registry.endpoint("w1/0") == "10.0.0.7:8000"
    with structlog.testing.capture_logs() as logs:
        assert consumer.on_heartbeat("kvindex.status.w1", heartbeat(endpoint=bad))  # applied, not rejected
    state = consumer.registry.get(("w1", 0))
    assert state is not None and state.load.running == 2 and state.last_heartbeat_at is not None
    # An address that cannot be used is not routed to (nor the one announced before it).
    assert state.endpoint is None and consumer.registry.at_endpoint("10.0.0.7:8000") == []
    assert consumer.counters.rejects == {E.BAD_ENDPOINT: 1}
    assert consumer.counters.rejects_by_worker == {"w1": 1}
    (rejected,) = [e for e in logs if e["event"] == "message_rejected"]
    assert rejected["worker"] == "w1" and rejected["reason"] == E.BAD_ENDPOINT and rejected["error"]


def test_registry_endpoint_lookups_follow_moves_and_forgetting() -> None:
    consumer = build_consumer(InvertedIndex(), Registry(), sequencer=Sequencer(), counters=IngestCounters())
    reg = consumer.registry
    for worker, rank, endpoint in [("w1", 0, "a:1"), ("w2", 0, "b:2"), ("w2", 1, "b:2")]:
        hb = msgpack.unpackb(heartbeat(worker, endpoint=endpoint))
        hb["dp_rank"] = rank
        assert consumer.on_heartbeat(f"kvindex.status.{worker}", msgpack.packb(hb))
    assert reg.endpoint("w1/0") == "a:1" and reg.endpoint(("w2", 1)) == "b:2"
    assert reg.endpoint("w9/0") is None and reg.endpoint("w1") is None
    assert sorted(s.instance_id for s in reg.at_endpoint("b:2")) == ["w2/0", "w2/1"]
    consumer.on_heartbeat("kvindex.status.w1", heartbeat("w1", endpoint="a:9"))  # moved
    assert reg.at_endpoint("a:1") == [] and [s.instance_id for s in reg.at_endpoint("a:9")] == ["w1/0"]
    consumer.forget(("w2", 0))
    assert [s.instance_id for s in reg.at_endpoint("b:2")] == ["w2/1"]
    consumer.on_heartbeat("kvindex.status.w1", heartbeat("w1"))  # no longer announced
    assert reg.endpoint("w1/0") is None and reg.at_endpoint("a:9") == []


def test_publisher_refuses_a_malformed_endpoint() -> None:
    from workers_shim.publisher import WorkerLog

    with pytest.raises(ValueError, match="port"):
        WorkerLog(worker="w1", model=MODEL, block_size=BS, endpoint="10.0.0.7:http")
    log = WorkerLog(worker="w1", model=MODEL, block_size=BS, endpoint="10.0.0.7:8000")
    assert msgpack.unpackb(log.heartbeat_payload())["endpoint"] == "10.0.0.7:8000"
    assert "endpoint" not in msgpack.unpackb(
        WorkerLog(worker="w2", model=MODEL, block_size=BS).heartbeat_payload()
    )
