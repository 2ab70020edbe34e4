"""The core: the parts that turn worker events into rankings, assembled in one place.

Registry, index, sequencer, consumer, calibration and ranker (with its ledger, speculative keys and
outcomes) are built and connected by ``build_core`` only; the ingest path under the consumer
(rejects, layouts, applier, repair machine, instances, heartbeats) by ``build_consumer``, bottom up,
each stage handed what it calls and none holding what calls it (kvindex/ingest/README.md). The
service, the replay of an event log (kvindex/capture/replay.py), the routing simulation and the
benchmarks all call it, so they run one assembly: what differs between them is data in
``CoreConfig`` (the clock, the index's tables, the repair scheduler, the consumer's logger, the
ranker's settings), never the wiring.

Every hook is passed to the constructor of the part that calls it, and no part builds a dependency
of its own when none is given (a missing one is an error). Where two parts answer each other (the
repair machine and the scheduler that runs its requests; a ranker and the replica sync it tells its
decisions), the first takes a maker of the second and calls it with itself when it is built: no
attribute is set from outside after construction.

- the consumer's heartbeat prefill samples go to the calibration (``Calibrator.add``);
- an instance the consumer forgets is forgotten by every ranker (speculative keys, predicted cache,
  outcome evidence, degraded set);
- a change of an instance's repair state is told to every ranker (its degraded instances follow);
- an instance the outcomes find degraded goes to ``CoreConfig.on_degraded`` (the service asks for a
  snapshot; the replay and the simulation pass none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import KvBlockIndex
from kvindex.index.inverted import InvertedIndex
from kvindex.ingest.applier import Applier
from kvindex.ingest.consumer import Consumer
from kvindex.ingest.heartbeats import Heartbeats
from kvindex.ingest.instances import Instances
from kvindex.ingest.layouts import Layouts
from kvindex.ingest.limits import DEFAULT_INGEST_LIMITS, IngestLimits
from kvindex.ingest.rejects import Rejects
from kvindex.instance import InstanceKey
from kvindex.observability.counters import IngestCounters
from kvindex.repair.machine import IngestState, MakeScheduler, RepairMachine, RepairScheduler
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.ranker import Ranker, RankerConfig, RoutingObserver, build_ranker
from kvindex.sequencer.cursor import Sequencer
from kvindex.wire.codec import DEFAULT_LIMITS, Limits
from kvindex.wire.subjects import Subjects


@dataclass
class CoreConfig:
    # The registry's and the rankers' clock: monotonic seconds live, a pinnable one when capturing,
    # the record's time in a replay, virtual time in the simulation.
    clock: Callable[[], float] = time.monotonic
    subjects: Subjects = field(default_factory=Subjects)
    # InvertedIndex's table module: None is its default (native when built); benchmarks pass the
    # pure-Python twin to measure the fallback.
    index_tables: Any = None
    # The index itself, instead of a new InvertedIndex (a shard front's MirrorIndex, kvindex/shards).
    index: Any = None
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    # Makes the scheduler that runs the consumer's replays and snapshots, for its repair machine
    # (the service's NatsRepairer, the simulation's, the replay's LoggedRepair). None: holes are
    # counted and accepted (NoRepair).
    repair: MakeScheduler | None = None
    consumer_log: Any = None  # the consumer's logger; None: structlog's (replay: its timeline)
    ranker: RankerConfig = field(default_factory=RankerConfig)
    # Independent rankers over the one index (the simulation's unsynchronised routers): ranker r is
    # seeded ``ranker.seed + r``; each has its own ledger, speculative keys and policy memory.
    rankers: int = 1
    policy_options: dict[str, dict[str, Any]] | None = None  # per policy, overrides of its defaults
    # Told when outcomes find an instance degraded (the service schedules a snapshot of it).
    on_degraded: Callable[[InstanceKey], None] | None = None
    # Makes the ranker's observer, told every decision (the service's replica sync, which applies
    # the other replicas' decisions to that ranker). None: a lone replica. One ranker only.
    observer: Callable[[Ranker], RoutingObserver] | None = None


@dataclass
class Core:
    index: InvertedIndex
    registry: Registry
    sequencer: Sequencer
    counters: IngestCounters
    consumer: Consumer
    calibrator: Calibrator
    rankers: list[Ranker]
    repair: RepairScheduler  # the one CoreConfig.repair made (NoRepair without one)

    @property
    def ranker(self) -> Ranker:
        """The first (usually the only) ranker."""
        return self.rankers[0]


def build_core(config: CoreConfig | None = None) -> Core:
    config = config or CoreConfig()
    index = config.index if config.index is not None else InvertedIndex(config.index_tables)
    registry = Registry(config.clock)
    sequencer = Sequencer()
    counters = IngestCounters()
    calibrator = Calibrator.of(config.ranker.costs)
    if config.observer is not None and config.rankers > 1:
        raise ValueError("an observer (routing sync) is made for one ranker, not for several")
    rankers = [
        build_ranker(
            index,
            registry,
            calibrator,
            config.ranker if r == 0 else _reseeded(config.ranker, r),
            policy_options=config.policy_options,
            on_degraded=config.on_degraded,
            observer=config.observer,
        )
        for r in range(max(1, config.rankers))
    ]
    if len(rankers) == 1:
        on_forget: Callable[[InstanceKey], Any] = rankers[0].forget
        on_sync_change: Callable[[InstanceState, bool], Any] = rankers[0].sync_changed
    else:
        on_forget, on_sync_change = _each_forget(rankers), _each_sync_changed(rankers)
    consumer = build_consumer(
        index,
        registry,
        subjects=config.subjects,
        sequencer=sequencer,
        counters=counters,
        repair=config.repair,
        ingest_limits=config.ingest_limits,
        log=config.consumer_log,
        prefill_samples=calibrator.add,
        on_forget=on_forget,
        on_sync_change=on_sync_change,
    )
    return Core(
        index, registry, sequencer, counters, consumer, calibrator, rankers, consumer.repairs.scheduler
    )


def build_consumer(
    index: KvBlockIndex,
    registry: Registry,
    *,
    sequencer: Sequencer,
    counters: IngestCounters,
    subjects: Subjects | None = None,
    limits: Limits = DEFAULT_LIMITS,
    repair: MakeScheduler | None = None,
    ingest_limits: IngestLimits = DEFAULT_INGEST_LIMITS,
    log: Any = None,
    prefill_samples: Callable[[str, list[tuple[int, int, float]], str], Any] | None = None,
    on_forget: Callable[[InstanceKey], Any] | None = None,
    on_sync_change: Callable[[InstanceState, bool], Any] | None = None,
) -> Consumer:
    """The ingest path, built bottom up so that each stage is handed what it calls and none holds
    what calls it: rejects (counting and logging refusals) and layouts, the applier (batches and
    snapshots into the index within the limits), the repair machine over the applier, instances on
    first contact, the heartbeats over the machine, and the consumer over all of them
    (kvindex/ingest/README.md). Offline tools, tests and benchmarks build a consumer alone with it.

    ``limits`` bound what the wire decoder accepts, ``ingest_limits`` what the fleet can make the
    index hold; ``repair`` makes the machine's scheduler (None: ``NoRepair``, holes accepted);
    ``prefill_samples`` gets the heartbeats' prefill samples (the calibration), ``on_forget`` an
    instance forgotten or whose predicted blocks give way to its events, ``on_sync_change`` a change
    of an instance's repair state (the rankers)."""
    subjects = subjects or Subjects()
    log = log or structlog.get_logger("kvindex.ingest")
    shared = IngestState(index, registry, sequencer, counters, log)
    rejects = Rejects(counters, log)
    layouts = Layouts(index, registry, log, rejects)
    applier = Applier(shared, ingest_limits, rejects, layouts)
    repairs = RepairMachine(
        shared,
        limits=ingest_limits,
        wire_limits=limits,
        applier=applier,
        rejecter=rejects,
        on_sync_change=on_sync_change,
        scheduler=repair,
    )
    instances = Instances(shared, ingest_limits)
    heartbeats = Heartbeats(
        shared,
        subjects=subjects,
        instances=instances,
        rejects=rejects,
        limits=ingest_limits,
        layouts=layouts,
        repairs=repairs,
        prefill_samples=prefill_samples,
        on_forget=on_forget,
    )
    return Consumer(
        shared,
        subjects=subjects,
        limits=limits,
        instances=instances,
        applier=applier,
        rejects=rejects,
        repairs=repairs,
        heartbeats=heartbeats,
        on_forget=on_forget,
    )


def _reseeded(config: RankerConfig, r: int) -> RankerConfig:
    return replace(config, seed=config.seed + r)


def _each_forget(rankers: list[Ranker]) -> Callable[[InstanceKey], None]:
    def forget(instance: InstanceKey) -> None:
        for ranker in rankers:
            ranker.forget(instance)

    return forget


def _each_sync_changed(rankers: list[Ranker]) -> Callable[[InstanceState, bool], None]:
    def sync_changed(state: InstanceState, reconciled: bool = False) -> None:
        for ranker in rankers:
            ranker.sync_changed(state, reconciled)

    return sync_changed
