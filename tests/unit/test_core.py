"""One core assembly (kvindex/core.py): the service, the replay of an event log and the routing
simulation each build their registry, index, consumer, calibration and routers with ``build_core``,
so the same parts are connected by the same hooks in all three; only what CoreConfig says differs."""

from __future__ import annotations

from benchmarks.routing_sim import Cluster, Simulation
from kvindex.capture import records as R
from kvindex.capture.replay import LoggedRepair, Replayer
from kvindex.core import Core, CoreConfig, build_core
from kvindex.scoring.ranker import RankerConfig
from kvindex.service.app import IndexService, ServiceConfig

KEY = ("w0", 0)


def assert_assembled(core: Core) -> None:
    """The parts share one index, registry, clock and calibration, and every hook is connected."""
    consumer, router = core.consumer, core.ranker
    assert consumer.index is core.index and consumer.registry is core.registry
    assert consumer.sequencer is core.sequencer and consumer.counters is core.counters
    assert consumer.heartbeats.prefill_samples == core.calibrator.add
    for r in core.rankers:
        assert r.index is core.index and r.registry is core.registry
        assert r.calibrator is core.calibrator and r.clock is core.registry.clock
    if len(core.rankers) == 1:
        assert consumer.on_forget == consumer.heartbeats.on_forget == router.forget
        assert consumer.repairs.on_sync_change == router.sync_changed
    # Functionally too: an instance the consumer forgets is forgotten by every router.
    for r in core.rankers:
        r.speculative.add(KEY, [1, 2, 3])
    consumer.forget(KEY)
    assert all(KEY not in r.speculative.instances() for r in core.rankers)


def test_service_replay_and_simulation_build_the_same_core() -> None:
    service = IndexService(ServiceConfig(nats_url="nats://unused", grpc_host="127.0.0.1", grpc_port=0))
    replayer = Replayer({"source": R.SOURCE_SERVE})
    cluster = Cluster(2, {"profile": "llama3-8b-h100", "block_size": 16}, routers=3)
    sim = Simulation("ttft", [], cluster, seed=7)
    for core in (service.core, replayer.core, sim.core):
        assert_assembled(core)
    # The parts each user reads are the core's.
    assert (service.consumer, service.ranker, service.index) == (
        service.core.consumer,
        service.core.ranker,
        service.core.index,
    )
    assert (replayer.consumer, replayer.ranker) == (replayer.core.consumer, replayer.core.ranker)
    assert (sim.consumer, sim.rankers) == (sim.core.consumer, sim.core.rankers)
    # What CoreConfig varies: who is told of degradations (the service schedules a snapshot; the
    # replay replays the live reconciliations from their records), the clock, the repair scheduler.
    assert service.ranker.outcomes.on_degraded == service._reconcile_degraded
    assert replayer.ranker.outcomes.on_degraded is None
    assert sim.ranker.outcomes.on_degraded is None
    assert replayer.registry.clock is replayer.clock and sim.registry.clock == sim.clock
    assert isinstance(replayer.consumer.repairs.scheduler, LoggedRepair)
    assert service.consumer.repairs.scheduler is service.repairer
    # The simulation's independent routers: seeded one apart, each its own routing state.
    assert [r.config.seed for r in sim.rankers] == [7, 8, 9]
    assert len({id(r.ledger) for r in sim.rankers}) == 3


def test_several_routers_are_each_told_of_repair_changes() -> None:
    core = build_core(CoreConfig(ranker=RankerConfig(seed=3), rankers=2))
    assert_assembled(core)
    state = core.registry.add(KEY, "m", 16)
    state.repair.failed = True  # a repair gave up: the instance is degraded everywhere
    core.consumer.repairs.on_sync_change(state, False)
    assert all(KEY in r.degraded for r in core.rankers)


def _held(obj: object) -> list[object]:
    """What ``obj`` holds: its attributes' values, the objects of bound methods among them, and what
    functions among them close over (slotted values, such as the limits, hold no stage)."""
    out: list[object] = []
    for value in getattr(obj, "__dict__", {}).values():
        out.append(getattr(value, "__self__", value))
        for cell in getattr(value, "__closure__", None) or ():
            out.append(cell.cell_contents)
    return out


def test_the_ingest_path_goes_one_way_down() -> None:
    """No stage of ingest or repair holds (as an attribute, a bound method or a closure) a stage that
    calls it: from the consumer down, the stages' holdings form no cycle. The scheduler made for the
    repair machine answers it, by design (kvindex/core.py), and is left out."""
    consumer = build_core().consumer
    scheduler = consumer.repairs.scheduler

    def is_stage(obj: object) -> bool:
        module = type(obj).__module__
        return obj is not scheduler and module.startswith(("kvindex.ingest.", "kvindex.repair."))

    stages: dict[int, object] = {id(consumer): consumer}
    edges: dict[int, set[int]] = {}
    todo = [consumer]
    while todo:
        obj = todo.pop()
        edges[id(obj)] = set()
        for held in _held(obj):
            if is_stage(held) and held is not obj:
                edges[id(obj)].add(id(held))
                if id(held) not in stages:
                    stages[id(held)] = held
                    todo.append(held)
    names = {k: type(v).__name__ for k, v in stages.items()}
    assert {"Heartbeats", "RepairMachine", "Applier", "Instances", "Rejects", "Layouts"} <= set(
        names.values()
    )
    done: set[int] = set()

    def walk(node: int, path: list[int]) -> None:
        assert node not in path, "a stage holds what calls it: " + " -> ".join(
            names[n] for n in [*path, node]
        )
        if node in done:
            return
        for nxt in edges[node]:
            walk(nxt, [*path, node])
        done.add(node)

    walk(id(consumer), [])
