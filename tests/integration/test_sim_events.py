"""Events from simulated engines through a real publisher, nats-server and index: the index equals
the engines' ground truth. In process: tests/unit/test_sim_events.py."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

from kvindex.service.app import IndexService
from kvindex.wire.schema import TIER_BY_NAME
from tests.conftest import wait_until
from tests.unit.test_sim_events import engines_with_sinks, workload
from workers_shim.publisher import Publisher
from workers_shim.sim import (
    MirrorSink,
    run_until_idle,
)

MakePub = Callable[..., Awaitable[Publisher]]


async def test_real_publisher_and_index_equal_holds(service: IndexService, make_publisher: MakePub) -> None:
    """Engines publish through the real Publisher to a real nats-server and kvindex service; after the
    run, the index's blocks per instance and tier are exactly the engines' (and the pool's)."""
    model = "sim-model"
    rng = random.Random(11)
    pool_pub = await make_publisher(worker="pool", model=model, block_size=4, capacity={"shared": 60})
    engines, _, pool = engines_with_sinks(MirrorSink())
    pool.sink = pool_pub
    pubs = []
    for e in engines:
        pub = await make_publisher(worker=e.name, model=model, block_size=4, capacity=e.cfg.capacity())
        e.attach(pub)
        pubs.append(pub)
    reqs = workload(rng, 300, 4)
    run_until_idle(engines, reqs, route=lambda r, t: rng.choice(engines))
    all_pubs = [*pubs, pool_pub]
    for p in all_pubs:
        await p.flush()

    def applied() -> bool:
        for p in all_pubs:
            st = service.registry.get((p.worker, 0))
            if st is None or st.last_seq < p.seq:
                return False
        return True

    await wait_until(applied, what="every batch applied")
    index = service.index
    for e in engines:
        for tier in ("gpu", "cpu", "disk"):
            assert set(index.keys_of((e.name, 0), TIER_BY_NAME[tier])) == e.holds(tier), (e.name, tier)
    assert set(index.keys_of(("pool", 0), TIER_BY_NAME["shared"])) == pool.holds()
    assert pool.holds() and any(e.holds("cpu") for e in engines)
