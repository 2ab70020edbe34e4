"""An index that knows when it is wrong, end to end over NATS with simulated engines
(workers_shim/sim): a worker's block events are lost for a while, silently (no sequence gap, the
worker's own digest agrees), so only the engine's answers show it. Requests routed by the real gRPC
Score and reported with their release (the engine's cached tokens, vLLM's rule) make the instance
degraded within a few requests; the snapshot the degradation asks for takes the engine's blocks as
they are; the instance is exact again, and no request failed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvindex.client import AsyncKvIndexClient
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.scoring.outcomes import DEGRADED, EXACT, Outcome
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from tests.conftest import wait_until
from workers_shim.sim import Completion, EngineConfig, SimRequest, TimeModel
from workers_shim.sim.fleet import run_fleet

MODEL = "sim-feedback"
BS = 16
TM = TimeModel(a_ms=1.0, b_ms_per_token=0.01, d_ms_per_decode_seq=5.0)


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BS + 3)]


async def test_lost_events_degrade_then_a_snapshot_repairs(
    nats_server: EmbeddedNats, make_service: Callable[..., Awaitable[IndexService]]
) -> None:
    svc = await make_service(RepairConfig(reconcile_interval=0))
    # Speculative keys stand in for a committed prompt's blocks until its events arrive: they would
    # hide the loss for their TTL (10 s by default), so they last 0.2 s here.
    svc.ranker.policies["ttft"].speculative_ttl = 0.2
    cfg = EngineConfig(gpu_blocks=200, time=TM, block_size=BS, max_batched_tokens=512, max_running=8)
    loop = asyncio.get_running_loop()
    finished: dict[str, asyncio.Future[Completion]] = {}
    reports: list[tuple[str, str]] = []

    def on_completion(worker: str, c: Completion) -> None:
        if c.kind == "finished":
            finished[c.request.id].set_result(c)

    fleet = await run_fleet(
        nats_server.url, 2, cfg, model=MODEL, heartbeat_interval=0.1, on_completion=on_completion
    )
    outcomes: list[Outcome] = []
    svc.ranker.outcomes.subscribe(outcomes.append)
    states_when_asked: list[tuple[str, str]] = []
    ask = svc.ranker.outcomes.on_degraded
    assert ask is not None

    def asked(instance: tuple[str, int]) -> None:
        state = svc.registry.get(instance)
        assert state is not None
        states_when_asked.append(svc.ranker.state_of(state))
        ask(instance)

    svc.ranker.outcomes.on_degraded = asked
    async with fleet, AsyncKvIndexClient(svc.grpc.address, timeout=5, refresh_interval=0) as client:
        await wait_until(lambda: len(svc.registry.all()) == 2, what="both workers known")

        async def request(rid: str, tokens: list[int], only: str | None = None) -> Outcome:
            """Route, run on the simulated engine, release with the engine's report."""
            d = await client.score(
                MODEL, token_ids=tokens, commit=True, request_id=rid, candidates=[only] if only else None
            )
            assert d.committed, d
            worker = d.committed_instance_id.split("/")[0]
            finished[rid] = loop.create_future()
            await fleet.submit(worker, SimRequest(rid, block_keys(tokens, BS, MODEL), len(tokens), 2))
            c = await asyncio.wait_for(finished[rid], 10)
            cached = c.reported_cached_tokens  # vLLM's: the first admission's hit
            found, status = await client.release_reported(
                rid, "finished", cached_tokens=cached, ttft_ms=c.ttft * 1000, prompt_tokens=len(tokens)
            )
            assert found
            reports.append((rid, status))
            return outcomes[-1]

        # In sync: a prompt, then the same again once its speculative keys are gone: exact.
        first = await request("a1", prompt(1))
        home = first.prediction.instance
        where = f"{home[0]}/{home[1]}"
        await fleet.flush()
        await asyncio.sleep(0.3)
        again = await request("a2", prompt(1), only=where)
        assert again.outcome == EXACT and again.report.cached_tokens == 6 * BS
        # The worker's events are lost for a while: new prompts' blocks never reach the index.
        fleet.drop_events(home[0], 1.0)
        await request("b1", prompt(2), only=where)
        await request("c1", prompt(3), only=where)
        assert fleet.dropped_events(home[0]) > 0
        await asyncio.sleep(0.3)
        # The engine has them; the index says it has nothing: two unders make it degraded.
        b2 = await request("b2", prompt(2), only=where)
        assert b2.outcome == "under" and b2.error_tokens == 6 * BS
        c2 = await request("c2", prompt(3), only=where)
        assert c2.outcome == "under"
        assert states_when_asked and states_when_asked[0][0] == DEGRADED
        assert states_when_asked[0][1].startswith("outcomes 2/")
        # ... which asked for a snapshot at once; the worker answered with its engine's blocks.
        await wait_until(lambda: svc.counters.snapshots_requested["degraded"] >= 1, what="snapshot asked")
        state = svc.registry.get(home)
        assert state is not None
        await wait_until(lambda: svc.ranker.state_of(state)[0] == EXACT, what="exact again")
        assert svc.counters.snapshot_blocks_added >= 12  # prompts 2 and 3, 6 blocks each
        await asyncio.sleep(1.0)  # (the drop window is over too)
        d2 = await request("d2", prompt(2), only=where)
        assert d2.outcome == EXACT and d2.evidence and d2.prediction.event_blocks == 6
        listed = {i.instance_id: i for i in await client.list_instances(MODEL)}
        assert listed[where].state == EXACT and listed[where].outcomes_under == 2
    # No request failed: every one routed, served and its report applied.
    assert [s for _, s in reports] == ["applied"] * 7
