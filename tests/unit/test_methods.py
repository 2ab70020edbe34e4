"""The method table (kvindex/api/methods.py) is the proto's service: every rpc has one entry with its
messages and streaming, the servicer a handler of the same name, and the in-process and blocking
clients reach any unary method through ``call``."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from google.protobuf.message_factory import GetMessageClass

from kvindex.api.errors import BadRequest
from kvindex.api.methods import COMMIT, LABELS, METHODS, RELEASE, method
from kvindex.api.servicer import KvIndexServicer
from kvindex.capture.recorder import RecordingServicer
from kvindex.client.local import LocalKvIndexClient
from kvindex.core import build_core
from kvindex.observability.counters import Metrics
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KvIndex"]


def test_the_table_is_the_proto_service() -> None:
    assert list(METHODS) == sorted(METHODS, key=list(METHODS).index)  # (a dict: one entry per name)
    assert set(METHODS) == {m.name for m in SERVICE.methods}
    for rpc in SERVICE.methods:
        entry = METHODS[rpc.name]
        assert entry.request is GetMessageClass(rpc.input_type), rpc.name
        assert entry.response is GetMessageClass(rpc.output_type), rpc.name
        assert entry.streaming == (rpc.client_streaming or rpc.server_streaming), rpc.name
        # A method that changes routing state says when it did (the capture records only then).
        assert (entry.changes in (COMMIT, RELEASE)) == (entry.changed is not None), rpc.name


def test_every_method_has_a_handler_on_the_servicer() -> None:
    for name in METHODS:
        handler = getattr(KvIndexServicer, name, None)
        assert (handler is not None and inspect.iscoroutinefunction(handler)) or inspect.isasyncgenfunction(
            handler
        ), name


def test_latency_labels_are_the_unary_calls() -> None:
    # The label values of kvindex_rpc_latency_seconds{method}, as they have always been.
    assert LABELS == ("Score", "Lookup", "ListInstances", "Stats", "Commit", "Release", "Explain")
    core = build_core()
    metrics = Metrics(core.counters, dict)
    servicer = KvIndexServicer(core.index, core.registry, core.counters, metrics, core.ranker, Tokenizers())
    asyncio.run(servicer.Stats(pb.StatsRequest(), None))  # type: ignore[arg-type]
    counts = {
        s.labels["method"]: s.value
        for family in metrics.rpc_latency.collect()
        for s in family.samples
        if s.name.endswith("_count")
    }
    assert list(counts) == list(LABELS)  # every child made up front, in this order
    assert counts["Stats"] == 1 and sum(counts.values()) == 1


def test_unknown_method_is_named() -> None:
    with pytest.raises(ValueError, match="no method 'Scores'"):
        method("Scores")


def _servicer() -> KvIndexServicer:
    core = build_core()
    return KvIndexServicer(core.index, core.registry, core.counters, None, core.ranker, Tokenizers())


def test_call_reaches_any_unary_method_in_process() -> None:
    async def run() -> None:
        client = LocalKvIndexClient(_servicer(), refresh_interval=0)
        stats = await client.call("Stats")
        assert isinstance(stats, pb.StatsResponse) and stats.instances == 0
        listed = await client.call("ListInstances", pb.ListInstancesRequest(model="m"))
        assert list(listed.instances) == []
        # Lookup's servicer answers with the response's bytes (kvindex/api/lookup.py): still a message here.
        looked = await client.call("Lookup", pb.LookupRequest(model="m", block_keys=[1, 2]))
        assert isinstance(looked, pb.LookupResponse) and list(looked.block_keys) == [1, 2]
        with pytest.raises(BadRequest, match="request_id is required"):
            await client.call("Release", phase="finished")
        with pytest.raises(ValueError, match="is a stream"):
            await client.call("ScoreStream")
        with pytest.raises(TypeError, match="either a request or its fields"):
            await client.call("Stats", pb.StatsRequest(), model="m")
        await client.close()

    asyncio.run(run())


def test_recording_servicer_records_what_changed_routing_state() -> None:
    class Recorded:
        def __init__(self) -> None:
            self.routes: list[tuple[str, bytes, str, float | None]] = []
            self.clock = lambda: 7.0

        def route(self, method: str, request: bytes, instance: str = "", mono: float | None = None) -> None:
            self.routes.append((method, request, instance, mono))

    core = build_core()
    core.index.add_instance(("w", 0), "m")
    core.registry.add(("w", 0), "m", 16)
    recorder = Recorded()
    servicer = RecordingServicer(
        recorder, core.index, core.registry, core.counters, None, core.ranker, Tokenizers()
    )  # type: ignore[arg-type]

    def run(coro):  # type: ignore[no-untyped-def]
        return asyncio.run(coro)

    assert not run(servicer.Release(pb.ReleaseRequest(request_id="r", phase="finished"), None)).found
    assert recorder.routes == []  # nothing changed: nothing recorded
    score = pb.ScoreRequest(model="m", block_keys=[1, 2], request_id="r", commit=True)
    assert run(servicer.Score(score, None)).committed_instance_id == "w/0"
    commit = pb.CommitRequest(request_id="r", instance_id="w/0", model="m", block_keys=[1])
    assert run(servicer.Commit(commit, None)).committed
    assert run(servicer.Release(pb.ReleaseRequest(request_id="r", phase="finished"), None)).found
    assert [(m, i, t) for m, _, i, t in recorder.routes] == [
        ("Score", "w/0", 7.0),  # the Score's ranking time
        ("Commit", "w/0", None),
        ("Release", "", None),
    ]
    recorded = pb.ScoreRequest.FromString(recorder.routes[0][1])
    assert list(recorded.block_keys) == [1, 2] and recorded.pick == "best"
