"""A real-time simulated fleet against a real nats-server and kvindex service."""

from __future__ import annotations

from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.wire.schema import TIER_BY_NAME
from tests.conftest import wait_until
from workers_shim.sim import Completion, EngineConfig, SimRequest, TimeModel
from workers_shim.sim.fleet import run_fleet

# Decode steps of ~6 ms: a 100-token answer lasts ~0.6 s of virtual (= wall) time.
TM = TimeModel(a_ms=1.0, b_ms_per_token=0.01, d_ms_per_decode_seq=5.0)


async def test_fleet_publishes_blocks_and_load(nats_server: EmbeddedNats, service: IndexService) -> None:
    cfg = EngineConfig(
        gpu_blocks=40, cpu_blocks=20, time=TM, block_size=4, max_batched_tokens=64, max_running=8
    )
    done: list[tuple[str, Completion]] = []
    fleet = await run_fleet(
        nats_server.url,
        2,
        cfg,
        model="sim-model",
        speed=1.0,
        pool_blocks=30,
        heartbeat_interval=0.05,
        on_completion=lambda w, c: done.append((w, c)),
        endpoint_base="10.9.0.1:8000",
    )
    async with fleet:
        workers = list(fleet.engines)
        assert workers == ["sim-0", "sim-1"]
        # Fake endpoints, one port per worker; the pool (never routed to) announces none.
        await wait_until(lambda: service.registry.endpoint("sim-1/0") == "10.9.0.1:8001", what="endpoints")
        assert service.registry.endpoint("sim-0/0") == "10.9.0.1:8000"
        assert service.registry.endpoint("sim-pool/0") is None
        # A long decode keeps sim-0 busy through ~12 heartbeats.
        await fleet.submit("sim-0", SimRequest("long", [1, 2, 3], 13, 100))
        await wait_until(
            lambda: (st := service.registry.get(("sim-0", 0))) is not None and st.load.running == 1,
            what="sim-0 reports a running request",
        )
        st = service.registry.get(("sim-0", 0))
        assert st is not None and st.capacity == {0: 40, 1: 20}
        assert 0 < st.load.kv_usage < 1 and st.load.extra.get("decoding") == 1
        # Prefixes shared across workers: sim-1 loads sim-0's blocks from the pool.
        for i in range(12):
            keys = [1, 2, 3, *range(100 + 10 * i, 100 + 10 * i + 5)]
            await fleet.submit(workers[i % 2], SimRequest(f"r{i}", keys, 4 * len(keys) + 1, 5))
        await wait_until(lambda: sum(c.finished for _, c in done) == 13, what="all requests finished")
        assert any(c.cached_tokens["shared"] for w, c in done if w == "sim-1")
        first = {c.request.id: c for _, c in done if c.kind == "first_token"}
        assert first["long"].ttft > 0 and first["r0"].request.arrival > 0
        # The index equals the engines' and the pool's ground truth.
        await fleet.flush()
        pubs = [*fleet.publishers.values(), fleet.pool_publisher]

        def applied() -> bool:
            for p in pubs:
                s = service.registry.get((p.worker, 0))  # type: ignore[union-attr]
                if s is None or s.last_seq < p.seq:  # type: ignore[union-attr]
                    return False
            return True

        await wait_until(applied, what="batches applied")
        for w in workers:
            for tier in ("gpu", "cpu"):
                assert set(service.index.keys_of((w, 0), TIER_BY_NAME[tier])) == fleet.holds(w, tier)
        assert set(service.index.keys_of(("sim-pool", 0), TIER_BY_NAME["shared"])) == fleet.holds(
            "", "shared"
        )
        assert fleet.holds("", "shared")
        await wait_until(
            lambda: all(fleet.prefill_samples[w] for w in workers), what="prefill samples collected"
        )
        await wait_until(
            lambda: all(service.registry.get((w, 0)).load.running == 0 for w in workers),  # type: ignore[union-attr]
            what="idle load reported",
        )
        assert fleet.load("sim-0").running == 0
