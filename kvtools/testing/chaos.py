"""Randomized fault schedules against a real nats-server and a real index service.

One schedule: a few workers (one a shared-pool publisher, one with two data-parallel ranks) store,
remove and clear blocks while faults hit them: dropped, duplicated, delayed (reordered) batches and
heartbeats; workers killed and restarted with their cache lost or kept; workers partitioned; the
nats-server restarted; the index restarted. Then the faults stop and the schedule measures how long
the index takes to equal, per instance and per tier, exactly what every worker holds.

Deterministic in what it injects for a seed (timing on a shared machine is not).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import nats

from kvindex.fleet.liveness import LivenessConfig
from kvindex.lifecycle import close_nats
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvtools.testing.faults import Faults, FaultyPublisher

MODEL = "chaos-model"


@dataclass
class ChaosConfig:
    workers: int = 3  # engines; one more publisher is a shared pool, one engine has two ranks
    steps: int = 40
    step_interval: float = 0.01
    reconcile_interval: float = 1.0
    max_drop: float = 0.2
    max_dup: float = 0.1
    max_delay: float = 0.15
    p_worker_restart: float = 0.5  # chance per schedule of each kind of process fault
    p_partition: float = 0.4
    p_nats_restart: float = 0.2
    p_index_restart: float = 0.2


@dataclass
class ScheduleResult:
    seed: int
    injected: Counter[str] = field(default_factory=Counter)
    converge_seconds: float = float("nan")
    converged: bool = False
    mismatches: list[str] = field(default_factory=list)
    repairs: Counter[str] = field(default_factory=Counter)


class _Worker:
    """One publisher identity that survives restarts (same worker id, new epoch each time)."""

    def __init__(
        self, name: str, dp_rank: int, pool: bool, url: str, rng: random.Random, cfg: ChaosConfig
    ) -> None:
        self.name = name
        self.dp_rank = dp_rank
        self.pool = pool
        self.url = url
        self.rng = rng
        self.faults = Faults(
            drop=rng.uniform(0, cfg.max_drop),
            dup=rng.uniform(0, cfg.max_dup),
            delay=rng.uniform(0, cfg.max_delay),
            rng=random.Random(rng.random()),
        )
        self.pub: FaultyPublisher | None = None

    async def start(self, keep: dict[str, set[int]] | None = None) -> None:
        nc = await nats.connect(
            self.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, error_cb=_ignore, name=self.name
        )
        capacity = {"shared": 1_000_000} if self.pool else {"gpu": 10_000, "cpu": 10_000, "disk": 10_000}
        pub = FaultyPublisher(
            nc,
            worker=self.name,
            dp_rank=self.dp_rank,
            model=MODEL,
            block_size=16,
            heartbeat_interval=0.1,
            flush_interval=0.003,
            capacity=capacity,
            faults=self.faults,
            history=64,
        )
        pub._owns_nc = True
        await pub.start()
        for tier, keys in (keep or {}).items():
            pub.stored(sorted(keys), tier=tier)
        self.pub = pub

    async def crash(self) -> dict[str, set[int]]:
        """Die without a goodbye; returns what the worker held (for a restart that keeps its cache)."""
        pub, self.pub = self.pub, None
        assert pub is not None
        held = {t: set(keys) for t, keys in pub.blocks.items() if keys}
        for task in pub._tasks:
            task.cancel()
        pub._closed = True
        # Bounded and never raising: the connection may already be gone (a NATS restart or a
        # network fault of the same schedule), and nats-py's close() then raised ConnectionResetError.
        await close_nats(pub.nc, drain=False)
        return held

    def act(self) -> None:
        pub = self.pub
        if pub is None:
            return
        rng = self.rng
        r = rng.random()
        tiers = ("shared",) if self.pool else ("gpu", "gpu", "gpu", "cpu", "disk")
        if r < 0.6:
            pub.stored([rng.getrandbits(64) for _ in range(rng.randint(1, 6))], tier=rng.choice(tiers))
        elif r < 0.95:
            tier = rng.choice(tiers)
            held = list(pub.blocks[tier])
            if held:
                pub.removed(rng.sample(held, min(len(held), rng.randint(1, 4))), tier=tier)
        else:
            pub.cleared(rng.choice((None, *tiers)))


async def _ignore(exc: Exception) -> None:
    """Connection errors during a nats-server restart are the point of the exercise."""


def _view(svc: IndexService, instance: tuple[str, int]) -> dict[int, set[int]]:
    return {t: keys for t in range(4) if (keys := set(svc.index.keys_of(instance, t)))}


def _differences(svc: IndexService, workers: list[_Worker]) -> list[str]:
    out = []
    extra = set(svc.index.instances()) - {(w.name, w.dp_rank) for w in workers}
    if extra:
        out.append(f"instances no worker has: {sorted(extra)}")
    for w in workers:
        pub = w.pub
        if pub is None:
            continue
        key = (w.name, w.dp_rank)
        cursor = svc.consumer.sequencer.cursor(key)
        truth = pub.truth()
        view = _view(svc, key)
        if view != truth:
            detail = {
                t: (
                    len(truth.get(t, set()) - view.get(t, set())),
                    len(view.get(t, set()) - truth.get(t, set())),
                )
                for t in set(truth) | set(view)
            }
            out.append(f"{key}: (missing, extra) per tier {detail}")
        elif cursor is None or cursor.repairing is not None or cursor.applied != pub.seq:
            state = (
                "unknown"
                if cursor is None
                else f"{cursor.repairing or 'synced'} at {cursor.applied}/{pub.seq}"
            )
            out.append(f"{key}: blocks equal but {state}")
    return out


async def run_schedule(seed: int, cfg: ChaosConfig | None = None) -> ScheduleResult:
    cfg = cfg or ChaosConfig()
    rng = random.Random(seed)
    result = ScheduleResult(seed)
    repair = RepairConfig(
        replay_timeout=0.3,
        snapshot_timeout=0.5,
        reconcile_interval=cfg.reconcile_interval,
        tick=0.05,
        max_backoff=0.3,
    )
    natsd = EmbeddedNats()
    await natsd.start()
    liveness = LivenessConfig(stale_after=2.0, forget_after=60.0, tick=0.05)
    svc_config = ServiceConfig(
        nats_url=natsd.url, grpc_host="127.0.0.1", grpc_port=0, repair=repair, liveness=liveness
    )
    svc = IndexService(svc_config)
    await svc.start()
    workers = [
        _Worker(f"w{i}", 0, False, natsd.url, random.Random(rng.random()), cfg) for i in range(cfg.workers)
    ]
    workers.append(_Worker("w0", 1, False, natsd.url, random.Random(rng.random()), cfg))  # a second rank
    workers.append(_Worker("pool", 0, True, natsd.url, random.Random(rng.random()), cfg))
    try:
        for w in workers:
            await w.start()
        plan = _plan(rng, cfg, len(workers))
        restarting: set[int] = set()
        for step in range(cfg.steps):
            for kind, target in plan.get(step, ()):
                svc = await _inject(kind, target, workers, natsd, svc, svc_config, rng, result, restarting)
            for w in workers:
                w.act()
            await asyncio.sleep(cfg.step_interval)
        # Faults stop: every worker is up, reachable and well-behaved from here on.
        for w in workers:
            w.faults.quiet()
            if w.pub is None:
                await w.start()
            else:
                await w.pub.flush()
        for w in workers:
            result.injected.update(w.faults.injected)
        started = time.monotonic()
        deadline = started + 2 * cfg.reconcile_interval
        while True:
            diff = _differences(svc, workers)
            if not diff:
                result.converged = True
                result.converge_seconds = time.monotonic() - started
                break
            if time.monotonic() > deadline:
                result.mismatches = diff
                result.converge_seconds = time.monotonic() - started
                break
            await asyncio.sleep(0.01)
        c = svc.counters
        result.repairs.update(
            gaps=c.gaps,
            replays_ok=c.replays_ok,
            snapshots=sum(c.snapshots_requested.values()),
            drift=c.drift_detected,
            restarts_seen=c.restarts,
        )
    finally:
        for w in workers:
            if w.pub is not None:
                w.faults.quiet()
                await w.pub.close()
        await svc.stop()
        await natsd.stop()
    return result


def _plan(rng: random.Random, cfg: ChaosConfig, n_workers: int) -> dict[int, list[tuple[str, Any]]]:
    plan: dict[int, list[tuple[str, Any]]] = {}

    def at(kind: str, target: Any) -> None:
        plan.setdefault(rng.randrange(2, max(3, cfg.steps - 5)), []).append((kind, target))

    if rng.random() < cfg.p_worker_restart:
        at(rng.choice(("restart_lost", "restart_kept")), rng.randrange(n_workers))
    if rng.random() < cfg.p_partition:
        at("partition", (rng.randrange(n_workers), rng.randint(3, 15)))
    if rng.random() < cfg.p_nats_restart:
        at("nats_restart", None)
    if rng.random() < cfg.p_index_restart:
        at("index_restart", None)
    return plan


async def _inject(
    kind: str,
    target: Any,
    workers: list[_Worker],
    natsd: EmbeddedNats,
    svc: IndexService,
    svc_config: ServiceConfig,
    rng: random.Random,
    result: ScheduleResult,
    restarting: set[int],
) -> IndexService:
    result.injected[kind] += 1
    if kind in ("restart_lost", "restart_kept"):
        w = workers[target]
        if w.pub is not None:
            held = await w.crash()
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            await w.start(held if kind == "restart_kept" else None)
    elif kind == "partition":
        index, steps = target
        w = workers[index]
        w.faults.partitioned = True

        async def heal() -> None:
            await asyncio.sleep(steps * 0.01)
            w.faults.partitioned = False

        asyncio.get_running_loop().create_task(heal())
    elif kind == "nats_restart":
        await natsd.stop(cleanup=False)
        await asyncio.sleep(rng.uniform(0.02, 0.1))
        await natsd.start()
    elif kind == "index_restart":
        await svc.stop()
        svc = IndexService(svc_config)
        await svc.start()
    return svc


def summarize(results: list[ScheduleResult]) -> str:
    """A plain-text summary table of a batch of schedules."""
    injected: Counter[str] = Counter()
    repairs: Counter[str] = Counter()
    for r in results:
        injected.update(r.injected)
        repairs.update(r.repairs)
    times = [r.converge_seconds for r in results if r.converged]
    failed = [r for r in results if not r.converged]
    lines = [
        f"schedules run: {len(results)}, converged: {len(results) - len(failed)}, mismatches: {len(failed)}",
        "faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(injected.items())),
        "repairs: " + ", ".join(f"{k} {v}" for k, v in sorted(repairs.items())),
    ]
    if times:
        lines.append(
            f"convergence after faults stop: mean {sum(times) / len(times) * 1000:.0f} ms, "
            f"max {max(times) * 1000:.0f} ms"
        )
    for r in failed[:5]:
        lines.append(f"seed {r.seed}: " + "; ".join(r.mismatches[:3]))
    return "\n".join(lines)
