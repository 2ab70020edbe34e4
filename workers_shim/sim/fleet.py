"""A fleet of simulated engines in real time, each publishing through a real Publisher on NATS.

Virtual time is wall time x ``speed`` since the fleet started. One asyncio task advances every engine
to the current virtual time, sleeps until the earliest next step end (or until a request arrives),
and repeats. Block events go out through each worker's Publisher as the engine changes state; its
heartbeats carry ``engine.load()`` (running, waiting, waiting_prefill_tokens, kv_usage, plus
decoding/prefilling), the capacity per tier and the digest. The prefill samples are handed to the
Publisher's ``prefill_sample()`` when it has one, and always kept in ``SimFleet.prefill_samples``.
A shared pool, if configured, is one more publisher (``{worker_prefix}-pool``, capacity "shared").

Fault hook: ``drop_events(worker, seconds)`` loses a worker's block events between its engine and its
publisher for a while, silently (no sequence gap, the worker's own digest agrees): only the
engine's answers show it. A snapshot request makes the publisher first take the engine's blocks as
they are (``resync``), as a bridge asks its engine's replay buffer, so the index's reconciliation
repairs the loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from kvindex.config.nats import NatsSettings
from kvindex.lifecycle import finish
from kvindex.wire.endpoint import format_endpoint, parse_endpoint
from workers_shim.publisher import Publisher
from workers_shim.sim.engine import Completion, EngineConfig, EngineLoad, SimEngine, SimRequest
from workers_shim.sim.hybrid import HybridSimEngine, layout_wire, new_engine
from workers_shim.sim.tiers import SharedPool

__all__ = ["SimFleet", "run_fleet"]

log = structlog.get_logger("workers_shim.sim.fleet")


class _LossySink:
    """The engine -> publisher path of one worker, which a fault can cut for a while."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.drop_until = 0.0
        self.dropped = 0

    def _dropping(self) -> bool:
        if time.monotonic() < self.drop_until:
            self.dropped += 1
            return True
        return False

    def stored(self, keys: list[int], tier: str = "gpu", parent: int | None = None, group: int = 0) -> int:
        return 0 if self._dropping() else self.publisher.stored(keys, tier, parent, group)

    def removed(self, keys: list[int], tier: str = "gpu", group: int = 0) -> int:
        return 0 if self._dropping() else self.publisher.removed(keys, tier, group)

    def cleared(self, tier: str | None = None) -> int:
        return 0 if self._dropping() else self.publisher.cleared(tier)


class SimFleet:
    def __init__(
        self,
        engines: Mapping[str, SimEngine],
        publishers: Mapping[str, Publisher],
        *,
        speed: float = 1.0,
        pool: SharedPool | None = None,
        pool_publisher: Publisher | None = None,
        on_completion: Callable[[str, Completion], None] | None = None,
        samples_kept: int = 4096,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engines = dict(engines)
        self.publishers = dict(publishers)
        self.pool = pool
        self.pool_publisher = pool_publisher
        self.speed = speed
        self.on_completion = on_completion
        self.prefill_samples: dict[str, deque[tuple[int, int, float]]] = {
            name: deque(maxlen=samples_kept) for name in self.engines
        }
        self.completed = 0
        self.first_tokens = 0
        self.sinks: dict[str, _LossySink] = {}  # the fault hook's (workers started by run_fleet)
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- time ---------------------------------------------------------------------------------

    def vnow(self) -> float:
        """Current virtual time (seconds since the fleet started, x speed)."""
        return (time.monotonic() - self._t0) * self.speed

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-fleet")

    async def _run(self) -> None:
        while True:
            self._sync_all()
            nxt = None
            for e in self.engines.values():
                t = e.next_time()
                if t is not None and (nxt is None or t < nxt):
                    nxt = t
            timeout = None if nxt is None else max(0.0, (nxt - self.vnow()) / self.speed)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _sync(self, name: str) -> None:
        engine = self.engines[name]
        done = engine.advance(max(self.vnow(), engine.now))
        for c in done:
            if c.kind == "first_token":
                self.first_tokens += 1
            else:
                self.completed += 1
            if self.on_completion is not None:
                try:
                    self.on_completion(name, c)
                except Exception as exc:  # a driver's bug must not stop the fleet
                    log.warning("on_completion_failed", worker=name, error=str(exc))

    def _sync_all(self) -> None:
        for name in self.engines:
            self._sync(name)

    # -- driver API ---------------------------------------------------------------------------

    async def submit(self, worker: str, req: SimRequest) -> None:
        """Send ``req`` to ``worker`` now; its ``arrival`` becomes the current virtual time."""
        if self._closed:
            raise RuntimeError("fleet is closed")
        self._sync(worker)
        engine = self.engines[worker]
        now = max(self.vnow(), engine.now)
        engine.submit(dataclasses.replace(req, arrival=now), now)
        self._wake.set()

    def drop_events(self, worker: str, seconds: float) -> None:
        """Lose ``worker``'s block events for ``seconds`` (a fault: see the module's doc)."""
        self.sinks[worker].drop_until = time.monotonic() + seconds

    def dropped_events(self, worker: str) -> int:
        sink = self.sinks.get(worker)
        return 0 if sink is None else sink.dropped

    async def resync(self, worker: str) -> None:
        """Make ``worker``'s publisher hold exactly its engine's blocks (publishing the difference)."""
        self._sync(worker)
        engine = self.engines[worker]
        pub = self.publishers[worker]
        if isinstance(engine, HybridSimEngine):
            # The publisher keeps group keys, which do not say their group: when they differ from
            # the engine's, it drops them all and takes every group's blocks again.
            if pub.blocks["gpu"] != engine.holds("gpu"):
                pub.cleared("gpu")
                for g, keys in enumerate(engine.holds_groups()):
                    if keys:
                        pub.stored(list(keys), "gpu", group=g)
            await pub.flush()
            return
        for tier in ("gpu", "cpu", "disk"):
            truth = engine.holds(tier)
            held = pub.blocks[tier]
            extra = list(held - truth)
            missing = list(truth - held)
            if extra:
                pub.removed(extra, tier)
            if missing:
                pub.stored(missing, tier)
        await pub.flush()

    def holds(self, worker: str, tier: str = "gpu") -> set[int]:
        """Ground truth of a worker's blocks on ``tier`` (``holds("pool", "shared")``: the pool's)."""
        if tier == "shared":
            return self.pool.holds() if self.pool is not None else set()
        return self.engines[worker].holds(tier)

    def load(self, worker: str) -> EngineLoad:
        """The worker's load now (prefill samples are not drained: see ``prefill_samples``)."""
        self._sync(worker)
        return self.engines[worker].load(drain=False)

    def _heartbeat_load(self, name: str) -> dict[str, float]:
        """Publisher ``load_fn``: bring the engine to now, pass on its prefill samples, report its load.
        Once the fleet is closing the engine stays where it is: its publisher takes no more events, and
        the goodbye heartbeat reports the load as of the last step."""
        if not self._closed:
            self._sync(name)
        load = self.engines[name].load(drain=True)
        if load.prefill_samples:
            self.prefill_samples[name].extend(load.prefill_samples)
            add = getattr(self.publishers.get(name), "prefill_sample", None)
            if add is not None:
                for prompt, cached, ms in load.prefill_samples:
                    add(prompt, cached, ms)
        return load.wire()

    async def flush(self) -> None:
        """Publish every pending event batch now."""
        for pub in self._all_publishers():
            await pub.flush()

    def _all_publishers(self) -> list[Publisher]:
        pubs = list(self.publishers.values())
        if self.pool_publisher is not None:
            pubs.append(self.pool_publisher)
        return pubs

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            # Not cancel-and-await: the engine loop's wait_for can lose a cancellation when a wake-up
            # arrives at the same moment (Python 3.11), and the close would then wait for ever.
            await finish([self._task], 1.0)
        # In parallel: each close is bounded (publisher.py), so a fleet stops as fast as one worker.
        await asyncio.gather(*(pub.close() for pub in self._all_publishers()), return_exceptions=True)

    async def __aenter__(self) -> SimFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def run_fleet(
    nats_url: str | NatsSettings,
    n_workers: int,
    engine_cfg: EngineConfig,
    *,
    model: str = "sim-model",
    speed: float = 1.0,
    pool_blocks: int = 0,
    subject_prefix: str = "kvindex",
    worker_prefix: str = "sim",
    heartbeat_interval: float = 0.5,
    on_completion: Callable[[str, Completion], None] | None = None,
    publisher_kwargs: Mapping[str, Any] | None = None,
    endpoint_base: str | None = None,
) -> SimFleet:
    """Start ``n_workers`` engines (``{worker_prefix}-0`` …) in real time, each with its own Publisher
    connected to ``nats_url``, and a shared pool of ``pool_blocks`` blocks if > 0. Returns the running
    fleet: route requests with ``await fleet.submit(worker, req)``, stop with ``await fleet.close()``
    (or ``async with``). With ``endpoint_base`` ``HOST:PORT``, worker i announces the fake endpoint
    ``HOST:PORT+i``."""
    if endpoint_base is not None:
        host, port = parse_endpoint(endpoint_base)
        if port + n_workers - 1 > 65535:
            raise ValueError(f"endpoint_base {endpoint_base!r}: no room for {n_workers} ports")
    if n_workers <= 0:
        raise ValueError("n_workers must be positive")
    extra = dict(publisher_kwargs or {})
    common: dict[str, Any] = {
        "model": model,
        "block_size": engine_cfg.block_size,
        "subject_prefix": subject_prefix,
        "heartbeat_interval": heartbeat_interval,
        **extra,
    }
    names = [f"{worker_prefix}-{i}" for i in range(n_workers)]
    groups = None
    if engine_cfg.layout() is not None:
        if pool_blocks > 0:
            raise ValueError("a hybrid fleet (kv_groups) has no shared pool")
        groups = layout_wire(engine_cfg)
    pool: SharedPool | None = None
    pool_pub: Publisher | None = None
    pubs: dict[str, Publisher] = {}
    fleet: SimFleet | None = None
    try:
        if pool_blocks > 0:
            pool_pub = await Publisher.connect(
                nats_url, worker=f"{worker_prefix}-pool", capacity={"shared": pool_blocks}, **common
            )
            pool = SharedPool(pool_blocks, pool_pub, name=f"{worker_prefix}-pool")
        fleet = SimFleet({}, {}, speed=speed, pool=pool, pool_publisher=pool_pub, on_completion=on_completion)
        for name in names:
            engine = new_engine(name, engine_cfg, None, pool)
            fleet.engines[name] = engine
            fleet.prefill_samples[name] = deque(maxlen=4096)
            pub = await Publisher.connect(
                nats_url,
                worker=name,
                # Fake addresses: nothing listens there; routers and proxies see where each would be.
                endpoint=None if endpoint_base is None else format_endpoint(host, port + len(pubs)),
                capacity=engine_cfg.capacity(),
                load_fn=lambda n=name: fleet._heartbeat_load(n),  # type: ignore[union-attr]
                **common,
            )
            pub.groups = groups  # a hybrid engine's KV-cache groups, in every heartbeat
            sink = _LossySink(pub)
            engine.attach(sink)
            pub.before_snapshot = lambda n=name: fleet.resync(n)  # type: ignore[union-attr]
            fleet.sinks[name] = sink
            pubs[name] = pub
            fleet.publishers[name] = pub
    except BaseException:
        for pub in [*pubs.values(), *([pool_pub] if pool_pub is not None else [])]:
            with contextlib.suppress(Exception):
                await pub.close()
        raise
    fleet.start()
    log.info(
        "sim_fleet_started",
        workers=n_workers,
        model=model,
        speed=speed,
        gpu_blocks=engine_cfg.gpu_blocks,
        cpu_blocks=engine_cfg.cpu_blocks,
        disk_blocks=engine_cfg.disk_blocks,
        pool_blocks=pool_blocks,
        profile=engine_cfg.time.name,
        kv_groups=None if groups is None else engine_cfg.layout().describe(),  # type: ignore[union-attr]
    )
    return fleet
