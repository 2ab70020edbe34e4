"""Picking over real parts: Score over a gRPC socket with a softmax pick, and a capturing service
whose softmax picks (and a new instance's warm-up ramp) an offline replay re-derives exactly."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvindex.capture.recorder import CaptureConfig
from kvindex.capture.replay import Driver
from kvindex.cli import main
from kvindex.scoring.pick import seed_for, uniform
from kvindex.scoring.ranker import RankerConfig
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.test_ext_proc import BS as EXT_BS
from tests.integration.test_ext_proc import MODEL as EXT_MODEL
from tests.integration.test_ext_proc import Envoy, destination
from tests.integration.test_ext_proc import fleet as ext_fleet
from tests.integration.test_ext_proc import tokens as ext_tokens
from tests.integration.test_route import BS as ROUTE_BS
from tests.integration.test_route import MODEL as ROUTE_MODEL
from tests.integration.test_route import start_fleet
from tests.integration.test_scoring_e2e import BS, MODEL, MakePub, tokens


async def _busy_fleet(make_publisher: MakePub, n: int, interval: float = 0.2) -> list:
    pubs = []
    for i in range(n):
        p = await make_publisher(
            worker=f"w{i}", model=MODEL, block_size=BS, capacity={"gpu": 1000}, heartbeat_interval=interval
        )
        # Queues 20-80 % of a prompt's work apart: estimates close enough for a softmax to spread.
        p.set_load(running=2, waiting=1, waiting_prefill_tokens=300 + 150 * i)
        await p.heartbeat()
        pubs.append(p)
    return pubs


async def test_score_softmax_over_grpc(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await _busy_fleet(make_publisher, 4, interval=30.0)  # one heartbeat: loads stay as set
    await wait_until(lambda: len(service.registry) == 4)
    prompt = tokens(24 * BS, seed=3)
    picked: Counter[str] = Counter()
    expected: Counter[str] = Counter()
    n = 200
    for i in range(n):
        reply = await stub.Score(
            pb.ScoreRequest(
                model=MODEL, token_ids=prompt, pick="softmax", temperature=0.5, request_id=f"s{i}", top_k=4
            )
        )
        assert reply.pick == "softmax" and reply.temperature == 0.5 and len(reply.ranked) == 4
        probabilities = [r.pick_probability for r in reply.ranked]
        assert sum(probabilities) == pytest.approx(1.0)
        # The reported draw is the documented function of the documented seed.
        assert reply.pick_seed == seed_for(0, f"s{i}") and reply.pick_draw == uniform(reply.pick_seed)
        # The picked (first) instance is where the cumulative probability in rank order passes u.
        order = [*range(1, reply.picked_rank + 1), 0, *range(reply.picked_rank + 1, 4)]
        in_rank_order = [probabilities[j] for j in order]
        acc = 0.0
        for j, p in enumerate(in_rank_order):
            acc += p
            if reply.pick_draw < acc:
                assert j == reply.picked_rank
                break
        picked[reply.ranked[0].instance_id] += 1
        for r in reply.ranked:
            expected[r.instance_id] += r.pick_probability / n
    # Spread over the instances, the shortest queue the likeliest, as often as the probabilities say.
    assert len(picked) >= 3 and expected.most_common(1)[0][0] == "w0/0", (picked, expected)
    for instance, p in expected.items():
        assert abs(picked[instance] / n - p) < 0.12, (picked, expected)
    # The same request id picks the same instance again; temperature 0 and "best" pick the first.
    again = await stub.Score(
        pb.ScoreRequest(
            model=MODEL, token_ids=prompt, pick="softmax", temperature=0.5, request_id="s7", top_k=4
        )
    )
    first = await stub.Score(
        pb.ScoreRequest(model=MODEL, token_ids=prompt, pick="softmax", temperature=0.5, request_id="s7")
    )
    assert again.ranked[0].instance_id == first.ranked[0].instance_id
    best = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=prompt, request_id="s7"))
    cold = await stub.Score(
        pb.ScoreRequest(model=MODEL, token_ids=prompt, pick="softmax", temperature=0.0, request_id="s7")
    )
    assert best.pick == "best" and best.pick_seed == 0 and cold.pick_seed == 0
    assert cold.ranked[0].instance_id == best.ranked[0].instance_id == "w0/0"
    # An explicit seed decides instead of the request id.
    seeded = [
        (
            await stub.Score(
                pb.ScoreRequest(
                    model=MODEL, token_ids=prompt, pick="softmax", temperature=0.5, pick_seed=s, top_k=4
                )
            )
        ).pick_seed
        for s in (11, 11, 12)
    ]
    assert seeded == [11, 11, 12]
    # Bad options: INVALID_ARGUMENT naming the field.
    for bad, words in (
        (pb.ScoreRequest(model=MODEL, token_ids=prompt, pick="random"), "pick must be"),
        (pb.ScoreRequest(model=MODEL, token_ids=prompt, pick="softmax", temperature=-1), "temperature"),
        (pb.ScoreRequest(model=MODEL, token_ids=prompt, pick="best", temperature=0.3), "temperature"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (err.value.details() or "")


async def test_capture_then_replay_rederives_every_pick(
    make_service, make_publisher: MakePub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """softmax picks at the server's default temperature, with a new instance warming up: the
    replay re-ranks every recorded Score with the recorded pick and seed and lands on the same
    instance each time."""
    path = tmp_path / "picks.kvlog"
    svc = await make_service(
        capture=CaptureConfig(str(path), check_interval=0.3),
        ranker=RankerConfig(pick="softmax", temperature=0.5, warmup=30.0),
    )
    pubs = await _busy_fleet(make_publisher, 3)
    await wait_until(lambda: len(svc.registry) == 3)
    rng = random.Random(5)
    prompts = [tokens(16 * BS, seed=s) for s in range(6)]
    live: dict[str, str] = {}
    async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        for i in range(60):
            if i == 20:  # an instance joins mid-run: ramped in over 30 s
                pubs.append(await _busy_fleet_one(make_publisher, "late"))
                await wait_until(lambda: len(svc.registry) == 4)
            reply = await stub.Score(
                pb.ScoreRequest(
                    model=MODEL, token_ids=rng.choice(prompts), commit=True, request_id=f"r{i}", top_k=4
                )
            )
            assert reply.pick == "softmax" and reply.committed_instance_id == reply.ranked[0].instance_id
            live[f"r{i}"] = reply.committed_instance_id
            if i % 3 == 0:
                await stub.Release(pb.ReleaseRequest(request_id=f"r{i}", phase="finished"))
    assert len(set(live.values())) >= 3, live  # the softmax spread the picks
    await svc.stop()
    driver = Driver(str(path))
    driver.replayer.check_picks = True
    result = driver.run()
    r = result.replayer
    assert result.error is None and not r.exceptions and not r.divergences
    assert r.picks_checked == 60 and r.picks_same == 60, r.pick_differences
    # A query on the replayed state takes the pick options too.
    asked = r.query(
        {"model": MODEL, "token_ids": prompts[0], "pick": "softmax", "temperature": 2.0, "pick_seed": 7}
    )
    assert asked.response is not None and asked.response.pick_seed == 7, asked.error
    # The CLI says so too.
    assert main(["replay", str(path), "--check-picks", "--timeline", "none", "--plain"]) == 0
    assert "picks re-derived: 60, same as live 60, differ 0" in capsys.readouterr().out


async def _busy_fleet_one(make_publisher: MakePub, worker: str):
    p = await make_publisher(
        worker=worker, model=MODEL, block_size=BS, capacity={"gpu": 1000}, heartbeat_interval=0.2
    )
    p.set_load(running=0, waiting=0, waiting_prefill_tokens=0)
    await p.heartbeat()
    return p


async def test_route_proxy_with_pick_softmax(service: IndexService, make_publisher: MakePub) -> None:
    """``kvindex route --pick softmax``: the proxy asks the index for a softmax pick among its top-k;
    cold prompts (every engine as fast) spread over the engines, and a request id decides alike."""
    fleet = await start_fleet(service, make_publisher, pick="softmax", temperature=0.5)
    asked: list[tuple[str, float]] = []  # the options of every Score the proxy sent
    pick_options = service.servicer.pick_options

    def observed(request: pb.ScoreRequest) -> object:
        asked.append((request.pick, request.temperature))
        return pick_options(request)

    service.servicer.pick_options = observed  # type: ignore[method-assign]
    try:
        served: Counter[str] = Counter()
        rng = random.Random(9)
        for i in range(30):
            prompt = [rng.randrange(50_000) for _ in range(8 * ROUTE_BS)]
            body = {"model": ROUTE_MODEL, "prompt": prompt, "max_tokens": 2}
            async with await fleet.post(body, headers={"x-request-id": f"p{i}"}) as resp:
                assert resp.status == 200 and resp.headers["x-kvindex-decision"] == "index"
                served[resp.headers["x-kvindex-instance"]] += 1
                await resp.read()
        # (A best pick spreads distinct cold prompts too, over their rendezvous homes: what shows the
        # softmax is the draw, checked below: one request id, one instance, the index's own pick.)
        assert len(served) == 3, served
        await wait_until(lambda: fleet.ledger() == 0, what="ledger released")
        prompt = [rng.randrange(50_000) for _ in range(8 * ROUTE_BS)]
        picks = set()
        for _ in range(3):
            async with await fleet.post(
                {"model": ROUTE_MODEL, "prompt": prompt, "max_tokens": 2}, headers={"x-request-id": "same"}
            ) as resp:
                picks.add(resp.headers["x-kvindex-instance"])
                await resp.read()
            await wait_until(lambda: fleet.ledger() == 0, what="ledger released")
        assert len(picks) == 1
        assert asked == [("softmax", 0.5)] * 33
        # The proxy passed the options: the index's pick for that request, asked directly, agrees.
        reply = service.servicer.score_request(
            pb.ScoreRequest(
                model=ROUTE_MODEL,
                token_ids=prompt,
                pick="softmax",
                temperature=0.5,
                request_id="same",
                top_k=3,
            )
        )
        assert reply.pick == "softmax" and reply.pick_seed == seed_for(0, "same")
        assert reply.ranked[0].instance_id in picks
    finally:
        await fleet.http.close()
        await fleet.proxy.stop()
        for e in fleet.engines.values():
            await e.close()


async def test_ext_proc_picker_uses_the_servers_softmax(make_service, make_publisher: MakePub) -> None:
    """``kvindex serve --pick softmax --ext-proc-port``: the Envoy picker's destination is the
    softmax draw (seeded by the x-request-id header), the ranked fallbacks after it."""
    svc = await make_service(
        ext_proc_port=0, ext_proc_host="127.0.0.1", ranker=RankerConfig(pick="softmax", temperature=0.5)
    )
    await ext_fleet(make_publisher, svc)
    answers: list[pb.ScoreResponse] = []
    score_request = svc.servicer.score_request

    def observed(request: pb.ScoreRequest) -> pb.ScoreResponse:
        answers.append(score_request(request))
        return answers[-1]

    svc.servicer.score_request = observed  # type: ignore[method-assign]
    assert svc.ext_proc is not None
    first: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(svc.ext_proc.address) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for i in range(12):
            envoy = Envoy(stub)
            body = {"model": EXT_MODEL, "prompt": ext_tokens(12 * EXT_BS, seed=100 + i), "max_tokens": 4}
            pick, _ = await envoy.request(body)
            header, _meta = destination(pick, "request_headers")
            reply = answers[-1]
            assert reply.pick == "softmax" and reply.pick_seed == seed_for(0, reply.request_id)
            assert sum(r.pick_probability for r in reply.ranked) == pytest.approx(1.0)
            assert header.split(",")[0] == reply.ranked[0].endpoint
            first[header.split(",")[0]] += 1
            await envoy.response(header.split(",")[0], [b"x"])
            await envoy.close()
    assert len(first) >= 2 and len(svc.ranker.ledger) == 0
