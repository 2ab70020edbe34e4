"""``kvindex route`` admitting, queueing and shedding requests by their TTFT objective against fake
engines announcing their load in real heartbeats to a real index (nats-server, gRPC over a socket).
The rule and the queue alone: tests/unit/test_admission.py; the picker's side:
tests/integration/test_ext_proc.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvindex.keys import block_keys
from kvindex.scoring.admission import (
    DEADLINE,
    OVER_OBJECTIVE,
    QUEUE_FULL,
    SATURATED,
    SHEDDABLE,
    TIMEOUT,
    UNATTAINABLE,
    AdmissionConfig,
)
from kvindex.scoring.objectives import Objective, ObjectiveDefaults
from kvindex.service.app import IndexService
from tests.conftest import wait_until
from tests.integration.test_ext_proc import MODEL as PICKER_MODEL
from tests.integration.test_ext_proc import Envoy, destination, tokens
from tests.integration.test_ext_proc import fleet as picker_fleet
from tests.integration.test_route import MODEL, PROMPT, Fleet, MakePub, sample, start_fleet
from workers_shim.publisher import Publisher


def count(m: dict, what: str, reason: str) -> float:
    """``kvindex_route_admission_{what}_total`` of the test model at priority 0."""
    return sample(m, f"kvindex_route_admission_{what}_total", model=MODEL, priority="0", reason=reason)


# -- the proxy ------------------------------------------------------------------------------------


# -- the ext_proc picker (over a real gRPC socket, driven as Envoy drives it) ----------------------


@pytest.fixture
async def slo_fleet(service: IndexService, make_publisher: MakePub) -> AsyncIterator[Fleet]:
    f = await start_fleet(service, make_publisher, admission=AdmissionConfig(max_queue=2, tick_s=0.02))
    try:
        yield f
    finally:
        await f.http.close()
        await f.proxy.stop()
        for e in f.engines.values():
            await e.close()


async def overload(fleet: Fleet, tokens: int) -> None:
    """Every engine reports ``tokens`` of prefill queued (~0.11 ms each before calibration)."""
    for p in fleet.pubs.values():
        p.set_load(waiting=tokens // 1000, waiting_prefill_tokens=tokens)
    await wait_until(
        lambda: all(s.load.waiting_prefill_tokens == tokens for s in fleet.service.registry.all()),
        what=f"every instance reporting {tokens} queued tokens",
    )


def body(prompt: list[int] = PROMPT) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2}


async def test_objective_met_when_the_fleet_has_room(slo_fleet: Fleet) -> None:
    async with await slo_fleet.post(body(), headers={"x-kvindex-ttft-slo-ms": "5000"}) as resp:
        assert resp.status == 200
        await resp.read()
    m = await slo_fleet.metrics()
    assert sample(m, "kvindex_route_slo_requests_total", model=MODEL, priority="0", result="met") == 1
    # Streams teach the correction: the fake engines answer far faster than the default model says.
    gate = slo_fleet.proxy.gate
    for _ in range(gate.correction.min_samples):
        async with await slo_fleet.post({**body(), "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
    assert gate.correction.factor(MODEL) < 1.0
    assert sum(v for (n, _), v in m.items() if n == "kvindex_route_admission_queued_total") == 0


async def test_malformed_objective_headers_400_naming_the_header_nothing_queued(slo_fleet: Fleet) -> None:
    for header, value in (("x-kvindex-ttft-slo-ms", "soon"), ("x-kvindex-priority", "urgent")):
        async with await slo_fleet.post(body(), headers={header: value}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == header and header in error["message"]
    assert all(not e.bodies for e in slo_fleet.engines.values())
    assert slo_fleet.ledger() == 0
    m = await slo_fleet.metrics()
    assert sample(m, "kvindex_route_requests_total", path="/v1/completions", code="400") == 2
    assert sum(v for (n, _), v in m.items() if n.startswith("kvindex_route_admission_queued")) == 0


async def test_unattainable_objective_is_shed_429_retry_after_commit_undone(slo_fleet: Fleet) -> None:
    await overload(slo_fleet, 30_000)
    # 1 ms: not even an idle engine prefills the prompt that fast (the model's fixed 25 ms alone).
    async with await slo_fleet.post(body(), headers={"x-kvindex-ttft-slo-ms": "1"}) as resp:
        assert resp.status == 429
        assert int(resp.headers["Retry-After"]) >= 3  # ~3.3 s of queue on the shortest
        assert (await resp.json())["error"]["code"] == UNATTAINABLE
    assert all(not e.bodies for e in slo_fleet.engines.values())
    await wait_until(lambda: slo_fleet.ledger() == 0, what="the Score's commit released")
    m = await slo_fleet.metrics()
    assert count(m, "shed", UNATTAINABLE) == 1
    assert sample(m, "kvindex_route_slo_requests_total", model=MODEL, priority="0", result="shed") == 1
    # A sheddable request (negative priority) is not held either.
    headers = {"x-kvindex-ttft-slo-ms": "1000", "x-kvindex-priority": "-1"}
    async with await slo_fleet.post(body(), headers=headers) as resp:
        assert resp.status == 429 and (await resp.json())["error"]["code"] == SHEDDABLE


async def test_queued_until_the_fleet_frees_then_served_queue_time_in_ttft(slo_fleet: Fleet) -> None:
    await overload(slo_fleet, 30_000)
    started = time.monotonic()
    post = asyncio.ensure_future(slo_fleet.post(body(), headers={"x-kvindex-ttft-slo-ms": "3000"}))
    await wait_until(lambda: len(slo_fleet.proxy.gate.queue) == 1, what="the request queued")
    await asyncio.sleep(0.3)
    assert not post.done() and all(not e.bodies for e in slo_fleet.engines.values())
    assert slo_fleet.ledger() == 0  # not counted against any instance while it waits
    await overload(slo_fleet, 0)
    async with await post as resp:
        assert resp.status == 200
        await resp.read()
    waited = time.monotonic() - started
    m = await slo_fleet.metrics()
    assert count(m, "queued", OVER_OBJECTIVE) == 1
    assert sample(m, "kvindex_route_admission_queue_wait_seconds_count", outcome="admitted") == 1
    assert 0.3 <= sample(m, "kvindex_route_admission_queue_wait_seconds_sum", outcome="admitted") <= waited
    # The TTFT measured includes the time queued: at least the 0.3 s held.
    assert sample(m, "kvindex_route_ttft_seconds_sum", stream="false") >= 0.3
    assert sample(m, "kvindex_route_slo_requests_total", model=MODEL, priority="0", result="met") == 1
    await wait_until(lambda: slo_fleet.ledger() == 0, what="ledger released")


async def test_the_explain_header_returns_the_decision_explained_with_admission(slo_fleet: Fleet) -> None:
    """``x-kvindex-explain: 1`` returns the index's explanation of the decision (the Explain RPC: it
    changes nothing) and what admission did, in the response header of that name; off by default."""
    async with await slo_fleet.post(body()) as resp:
        assert resp.status == 200 and "x-kvindex-explain" not in resp.headers
        await resp.read()
    # Released first (the proxy releases after the last byte; the client may read it before): a
    # request still in flight on w1 makes the next one spill to w2 (seen once in CI: 'spill+1').
    await wait_until(lambda: slo_fleet.ledger() == 0, what="the first request released")
    ask = {"x-kvindex-explain": "1"}
    async with await slo_fleet.post(body(), headers=ask) as resp:
        assert resp.status == 200
        served = resp.headers["x-kvindex-instance"]
        said = json.loads(resp.headers["x-kvindex-explain"])
        await resp.read()
    v = said["verdict"]
    assert (v["winner"], v["reason"], served) == ("w1/0", "cache", "w1/0")  # w1 holds 6 blocks, w2 2
    assert v["runner_up"] == said["ranked"][1]["instance"] and v["deciding_term"] == "prefill"
    first = said["ranked"][0]  # (the first request's blocks count speculatively: all but the last token)
    assert (
        first["instance"] == "w1/0"
        and first["matched_tokens"]["gpu"] == len(PROMPT) - 1
        and first["state"] == "exact"
    )
    assert first["est_ttft_ms"] == pytest.approx(
        first["wait_ms"] + first["prefill_ms"] + first["fetch_ms"], abs=0.01
    )
    assert said["admission"] == {
        "decision": "admitted", "why": "no objective", "held_ms": 0.0, "held_because": "", "pick": 0,
        "ttft_slo_ms": None, "priority": 0,
    }  # fmt: skip
    assert [len(e.bodies) for e in slo_fleet.engines.values()] == [2, 0, 0]  # explained, not sent
    await wait_until(lambda: slo_fleet.ledger() == 0, what="ledger released")
    # Held until the fleet frees: for how long and why.
    await overload(slo_fleet, 30_000)
    post = asyncio.ensure_future(slo_fleet.post(body(), headers={**ask, "x-kvindex-ttft-slo-ms": "3000"}))
    await wait_until(lambda: len(slo_fleet.proxy.gate.queue) == 1, what="the request queued")
    await asyncio.sleep(0.2)
    await overload(slo_fleet, 0)
    async with await post as resp:
        assert resp.status == 200
        held = json.loads(resp.headers["x-kvindex-explain"])["admission"]
        await resp.read()
    assert held["decision"] == "held" and held["held_because"] == OVER_OBJECTIVE and held["held_ms"] >= 200
    assert held["why"] == "within its objective" and held["ttft_slo_ms"] == 3000
    # Shed: why, with the ranking that made it so.
    await overload(slo_fleet, 30_000)
    async with await slo_fleet.post(body(), headers={**ask, "x-kvindex-ttft-slo-ms": "1"}) as resp:
        assert resp.status == 429
        shed = json.loads(resp.headers["x-kvindex-explain"])
    assert shed["admission"]["decision"] == "shed" and shed["admission"]["why"] == UNATTAINABLE
    assert all(r["wait_ms"] > 3000 for r in shed["ranked"]) and shed["verdict"]["winner"]
    await wait_until(lambda: slo_fleet.ledger() == 0, what="ledger released")


async def test_queued_request_shed_when_its_deadline_can_no_longer_be_met(slo_fleet: Fleet) -> None:
    await overload(slo_fleet, 30_000)
    started = time.monotonic()
    async with await slo_fleet.post(body(), headers={"x-kvindex-ttft-slo-ms": "400"}) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == DEADLINE
    # Shed once what is left of 400 ms is below its own prefill: not before, not long after.
    assert 0.2 <= time.monotonic() - started <= 1.5
    m = await slo_fleet.metrics()
    assert count(m, "shed", DEADLINE) == 1
    assert sample(m, "kvindex_route_admission_queue_wait_seconds_count", outcome="shed") == 1
    assert len(slo_fleet.proxy.gate.queue) == 0 and slo_fleet.ledger() == 0


async def test_full_queue_sheds_the_lowest_priority_and_serves_by_priority(slo_fleet: Fleet) -> None:
    await overload(slo_fleet, 300_000)  # ~33 s of queue: past the 20 s objective

    def send(prio: int) -> asyncio.Future[tuple[int, str]]:
        async def go() -> tuple[int, str]:
            headers = {"x-kvindex-ttft-slo-ms": "20000", "x-kvindex-priority": str(prio)}
            async with await slo_fleet.post(body(), headers=headers) as resp:
                text = await resp.text()
                return resp.status, (json.loads(text)["error"]["code"] if resp.status != 200 else "")

        return asyncio.ensure_future(go())

    low = send(0)
    await wait_until(lambda: len(slo_fleet.proxy.gate.queue) == 1, what="first queued")
    mid = send(1)
    await wait_until(lambda: len(slo_fleet.proxy.gate.queue) == 2, what="second queued")
    high = send(2)  # the queue holds 2: the lowest priority leaves
    assert await asyncio.wait_for(low, 5) == (429, QUEUE_FULL)
    assert [e.objective.priority for e in slo_fleet.proxy.gate.queue] == [2, 1]
    await overload(slo_fleet, 0)
    assert await asyncio.wait_for(high, 5) == (200, "")
    assert await asyncio.wait_for(mid, 5) == (200, "")
    m = await slo_fleet.metrics()
    assert count(m, "shed", QUEUE_FULL) == 1


async def test_queue_threshold_without_objective_times_out(
    service: IndexService, make_publisher: MakePub
) -> None:
    admission = AdmissionConfig(queue_threshold_ms=1000, max_wait_s=0.3, tick_s=0.02)
    f = await start_fleet(service, make_publisher, admission=admission)
    try:
        async with await f.post(body()) as resp:  # idle fleet: straight through
            assert resp.status == 200
        await overload(f, 30_000)
        async with await f.post(body()) as resp:
            assert resp.status == 429 and (await resp.json())["error"]["code"] == TIMEOUT
        m = await f.metrics()
        assert count(m, "queued", SATURATED) == 1
        # No objective: not part of the goodput counts.
        assert sum(v for (n, _), v in m.items() if n == "kvindex_route_slo_requests_total") == 0
    finally:
        await f.http.close()
        await f.proxy.stop()
        for e in f.engines.values():
            await e.close()


@pytest.fixture
async def slo_picker(
    make_service: Callable[..., Awaitable[IndexService]],
) -> AsyncIterator[tuple[IndexService, ep_grpc.ExternalProcessorStub]]:
    svc = await make_service(
        ext_proc_port=0,
        ext_proc_host="127.0.0.1",
        ext_proc_admission=AdmissionConfig(tick_s=0.02),
        ext_proc_objectives=ObjectiveDefaults.from_flags(objectives=["premium=5:3000", "batch=-1"]),
    )
    assert svc.ext_proc is not None
    async with grpc.aio.insecure_channel(svc.ext_proc.address) as channel:
        yield svc, ep_grpc.ExternalProcessorStub(channel)


async def picker_overload(pubs: list[Publisher], svc: IndexService, tokens: int) -> None:
    for p in pubs:
        p.set_load(waiting=tokens // 1000, waiting_prefill_tokens=tokens)
    await wait_until(
        lambda: all(s.load.waiting_prefill_tokens == tokens for s in svc.registry.all()),
        what=f"every instance reporting {tokens} queued tokens",
    )


def with_headers(envoy: Envoy, extra: dict[str, str]) -> None:
    """Add request headers to what ``envoy.request`` sends (the objective headers)."""
    send = envoy.send

    async def patched(*msgs: ep.ProcessingRequest) -> None:
        for m in msgs:
            if m.HasField("request_headers"):
                for k, v in extra.items():
                    m.request_headers.headers.headers.append(
                        core_pb2.HeaderValue(key=k, raw_value=v.encode())
                    )
        await send(*msgs)

    envoy.send = patched  # type: ignore[method-assign]


def picker_sample(svc: IndexService, name: str, **labels: str) -> float:
    assert svc.metrics is not None
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_picker_sheds_with_an_immediate_429_and_retry_after(
    slo_picker: tuple[IndexService, ep_grpc.ExternalProcessorStub], make_publisher: MakePub
) -> None:
    svc, stub = slo_picker
    pubs = await picker_fleet(make_publisher, svc)
    await picker_overload(pubs, svc, 30_000)
    envoy = Envoy(stub)
    with_headers(envoy, {"x-kvindex-ttft-slo-ms": "1"})
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": tokens(4 * 16, 1)})
    immediate = pick.immediate_response
    assert immediate.status.code == 429 and UNATTAINABLE in immediate.details
    got = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert int(got["retry-after"]) >= 3
    assert len(svc.ranker.ledger) == 0
    # A named objective whose priority is negative (GIE: sheddable) is shed rather than held.
    envoy = Envoy(stub)
    with_headers(envoy, {"x-gateway-inference-objective": "batch", "x-kvindex-ttft-slo-ms": "1000"})
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": tokens(4 * 16, 2)})
    assert pick.immediate_response.status.code == 429 and SHEDDABLE in pick.immediate_response.details
    labels = {"model": PICKER_MODEL, "priority": "-1", "reason": SHEDDABLE}
    assert picker_sample(svc, "kvindex_ext_proc_admission_shed_total", **labels) == 1
    # A malformed objective header: 400 naming it, nothing held.
    envoy = Envoy(stub)
    with_headers(envoy, {"x-kvindex-priority": "first"})
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": tokens(4 * 16, 3)})
    assert pick.immediate_response.status.code == 400
    assert "x-kvindex-priority" in pick.immediate_response.details
    assert len(svc.ext_proc.picker.gate.queue) == 0  # type: ignore[union-attr]


async def test_picker_explains_the_pick_on_request(
    slo_picker: tuple[IndexService, ep_grpc.ExternalProcessorStub], make_publisher: MakePub
) -> None:
    """``x-kvindex-explain: 1`` through Envoy: the picker adds the explanation to the response headers
    (a header mutation of its response-headers answer), and to a shed request's 429."""
    svc, stub = slo_picker
    pubs = await picker_fleet(make_publisher, svc)
    prompt = tokens(4 * 16, 5)
    pubs[1].stored(block_keys(prompt, 16, PICKER_MODEL))
    await pubs[1].flush()
    await wait_until(lambda: svc.index.block_counts(("w1", 0))[0] == 4, what="blocks indexed")
    ask = {"x-kvindex-explain": "1"}
    envoy = Envoy(stub)
    with_headers(envoy, ask)
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": prompt})
    assert destination(pick, "request_headers")[0].split(",")[0] == "10.0.0.2:8000"  # w1
    status = core_pb2.HeaderMap(headers=[core_pb2.HeaderValue(key=":status", raw_value=b"200")])
    await envoy.send(
        ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=status, end_of_stream=True))
    )
    answer = (await envoy.recv()).response_headers.response.header_mutation.set_headers
    said = json.loads(next(h.header.raw_value for h in answer if h.header.key == "x-kvindex-explain"))
    assert said["verdict"]["winner"] == "w1/0" and said["verdict"]["reason"] == "cache"
    assert said["admission"]["decision"] == "admitted" and said["ranked"][0]["state"] == "exact"
    await envoy.close()
    # Without the header, nothing is added.
    envoy = Envoy(stub)
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": prompt})
    await envoy.send(
        ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=status, end_of_stream=True))
    )
    assert not (await envoy.recv()).response_headers.response.header_mutation.set_headers
    await envoy.close()
    # Shed: the 429 says why.
    await picker_overload(pubs, svc, 30_000)
    envoy = Envoy(stub)
    with_headers(envoy, {**ask, "x-kvindex-ttft-slo-ms": "1"})
    pick, _ = await envoy.request({"model": PICKER_MODEL, "prompt": prompt})
    assert pick.immediate_response.status.code == 429
    got = {h.header.key: h.header.raw_value for h in pick.immediate_response.headers.set_headers}
    assert json.loads(got["x-kvindex-explain"])["admission"]["why"] == UNATTAINABLE
    await wait_until(lambda: len(svc.ranker.ledger) == 0, what="ledger empty")


async def test_picker_holds_the_request_until_an_instance_can_meet_its_objective(
    slo_picker: tuple[IndexService, ep_grpc.ExternalProcessorStub], make_publisher: MakePub
) -> None:
    svc, stub = slo_picker
    picker = svc.ext_proc.picker  # type: ignore[union-attr]
    pubs = await picker_fleet(make_publisher, svc)
    await picker_overload(pubs, svc, 60_000)  # ~6.6 s of queue everywhere: past the 3 s objective
    envoy = Envoy(stub)
    with_headers(envoy, {"x-gateway-inference-objective": "premium"})  # priority 5, 3000 ms
    body = {"model": PICKER_MODEL, "prompt": tokens(4 * 16, 4), "stream": True}
    request = asyncio.ensure_future(envoy.request(body))
    await wait_until(lambda: len(picker.gate.queue) == 1, what="the request held")
    (held,) = list(picker.gate.queue)
    assert held.objective == Objective(3000, 5)
    await asyncio.sleep(0.2)
    assert not request.done() and len(svc.ranker.ledger) == 0  # unanswered, counted nowhere
    await picker_overload(pubs, svc, 0)
    pick, echoed = await asyncio.wait_for(request, 5)
    header, meta = destination(pick, "request_headers")
    assert header == meta and echoed == json.dumps(body).encode()
    assert len(svc.ranker.ledger) == 1  # committed where it goes
    await envoy.response(header.split(",")[0], [b"data: x\n\n", b"data: [DONE]\n\n"])
    assert len(svc.ranker.ledger) == 0
    labels = {"model": PICKER_MODEL, "priority": "5"}
    assert picker_sample(svc, "kvindex_ext_proc_slo_requests_total", **labels, result="met") == 1
    assert picker_sample(svc, "kvindex_ext_proc_admission_queued_total", **labels, reason=OVER_OBJECTIVE) == 1
    assert picker_sample(svc, "kvindex_ext_proc_admission_queue_wait_seconds_count", outcome="admitted") == 1
    await envoy.close()
