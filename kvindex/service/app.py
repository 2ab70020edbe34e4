"""The index service: NATS ingestion, the index, the gRPC API and metrics, on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import start_http_server

from kvindex.api import listen
from kvindex.api.server import GrpcServer
from kvindex.api.servicer import KvIndexServicer
from kvindex.capture.recorder import (
    CaptureConfig,
    PinnableClock,
    Recorder,
    RecordingServicer,
    service_meta,
)
from kvindex.config.nats import NatsSettings
from kvindex.core import CoreConfig, build_core
from kvindex.fleet.liveness import LivenessConfig, sweep_next
from kvindex.ingest.limits import IngestLimits
from kvindex.ingest.nats_source import JetStreamConfig, NatsSource
from kvindex.instance import InstanceKey
from kvindex.lifecycle import Stop, bounded
from kvindex.observability.counters import Metrics
from kvindex.observability.fleet import FleetCollector
from kvindex.observability.hits import HitCollector
from kvindex.observability.outcomes import OutcomeCollector
from kvindex.observability.tokenize import TokenizeCollector
from kvindex.repair.machine import RepairMachine
from kvindex.repair.nats_repair import NatsRepairer, RepairConfig
from kvindex.route.envoy import ExtProcServer
from kvindex.route.ext_proc import EndpointPicker
from kvindex.route.pd import PdConfig
from kvindex.routing_sync.metrics import SyncCollector
from kvindex.routing_sync.nats_link import NatsRoutingLink
from kvindex.routing_sync.sync import RoutingSync, SyncConfig
from kvindex.scoring.admission import AdmissionConfig
from kvindex.scoring.costs import cost_parameters
from kvindex.scoring.objectives import ObjectiveDefaults
from kvindex.scoring.ranker import RankerConfig
from kvindex.security import ServerSecurity
from kvindex.service.calibration_store import CalibrationStore
from kvindex.service.gc_policy import GcConfig, GcPolicy
from kvindex.service.natsd import EmbeddedNats
from kvindex.service.readiness import Readiness, ReadinessConfig
from kvindex.shards.front import FrontServicer, MirrorIndex, ShardCollector, ShardFront
from kvindex.shards.layout import ShardSpec, partition_subjects
from kvindex.shards.shard import ShardResponder
from kvindex.tokenize import DEFAULT_CACHE_BYTES, DEFAULT_CALL_BYTES, DEFAULT_MAX_TEXT_CHARS, Tokenizers
from kvindex.wire.schema import GPU
from kvindex.wire.subjects import Subjects


@dataclass
class ServiceConfig:
    # URL(s) (comma-separated: a cluster), or NatsSettings with credentials and TLS
    # (kvindex/config/nats.py). None: start an embedded nats-server.
    nats_url: str | NatsSettings | None = None
    # Where the embedded nats-server listens (nats_url None): loopback by default, so only workers on
    # this machine reach it; 0.0.0.0 for workers elsewhere. Port 0: any free port.
    embedded_nats_host: str = "127.0.0.1"
    embedded_nats_port: int = 0
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 50051  # 0: any free port
    subject_prefix: str = "kvindex"
    metrics_port: int | None = None  # None: no HTTP metrics endpoint; 0: any free port
    metrics_host: str = "0.0.0.0"
    repair: RepairConfig = field(default_factory=RepairConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # stale / forgotten instances
    jetstream: JetStreamConfig | None = None  # None: core NATS (default)
    ranker: RankerConfig = field(default_factory=RankerConfig)
    # Per ranking policy, overrides of its published defaults (``serve --policy-option``).
    policy_options: dict[str, dict[str, Any]] | None = None
    capture: CaptureConfig | None = None  # tee what the consumer sees into an event log
    limits: IngestLimits = field(default_factory=IngestLimits)
    grpc_security: ServerSecurity | None = None  # TLS / mutual TLS / token; None: plaintext, open
    # Instances without KV events, listed by the operator: (worker id, "host:port"); their caches are
    # predicted from routing decisions (kvindex/scoring/approximate.py).
    static_instances: list[tuple[str, str]] = field(default_factory=list)
    static_model: str = ""
    static_block_size: int = 16
    static_capacity: int = 0  # GPU blocks per static instance; 0: the router's predicted_capacity
    ext_proc_port: int | None = None  # Envoy ext_proc endpoint picker; None: off, 0: any free port
    ext_proc_host: str = "0.0.0.0"
    ext_proc_policy: str = ""  # ranking policy of the picker; "": the router's default (ttft)
    # The picker's admission: TTFT objectives, priorities, queue (kvindex/scoring/admission.py).
    ext_proc_admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    ext_proc_objectives: ObjectiveDefaults = field(default_factory=ObjectiveDefaults)
    ext_proc_pd: PdConfig | None = None  # disaggregated prefill/decode picks (x-prefiller-host-port)
    # The OpenAI routing proxy in this process (serve --route-port): a kvindex.route.proxy.RouteConfig
    # whose Score, Commit and Release are calls on this servicer; None: off.
    route: Any = None
    # Text prompts: model -> tokenizer directory (serve --tokenizer MODEL=DIR), and the cache's bytes.
    tokenizers: dict[str, str] = field(default_factory=dict)
    tokenize_cache_bytes: int = DEFAULT_CACHE_BYTES
    tokenize_call_bytes: int = DEFAULT_CALL_BYTES  # the most one prompt adds to that cache
    tokenize_max_chars: int = DEFAULT_MAX_TEXT_CHARS  # longer prompt texts are refused
    readiness: ReadinessConfig = field(default_factory=ReadinessConfig)
    shutdown_grace: float = 5.0  # in-flight RPCs get this long once stopping (s)
    routing_sync: SyncConfig = field(default_factory=SyncConfig)  # replicas sharing routing state
    # Index shards (docs/shards.md): this process is shard I of N (its partition of the workers), or
    # the front of N shards (ranks over their answers; no events of its own). Neither: unsharded.
    shard: ShardSpec | None = None
    shards: int = 0
    shard_timeout: float = 0.5  # a front's wait for each shard's answer (s)
    gc: GcConfig = field(default_factory=GcConfig)  # periodic gc.freeze (kvindex/service/gc_policy.py)


# Closing NATS (2 s), the capture file, the calibration save (1 s) and the embedded nats-server (1 s)
# after the RPC grace: the time a stop may take beyond ``shutdown_grace``.
CLEANUP_BUDGET = 4.0


def _capture_meta(config: ServiceConfig) -> dict[str, Any]:
    """The settings a ``serve --capture`` log records, as plain values for the recorder."""
    r, live = config.repair, config.liveness
    return service_meta(
        config.subject_prefix,
        jetstream=config.jetstream is not None,
        repair={  # (the liveness timings too: logs have always kept them here)
            "stale_after": live.stale_after,
            "forget_after": live.forget_after,
            "reconcile_interval": r.reconcile_interval,
            "reconcile_rate": r.reconcile_rate,
            "replay_timeout": r.replay_timeout,
            "snapshot_timeout": r.snapshot_timeout,
        },
        router={  # (the capture header keeps its key: logs written before)
            "default_policy": config.ranker.default_policy,
            "seed": config.ranker.seed,
            "pick": config.ranker.pick,
            "temperature": config.ranker.temperature,
            "warmup": config.ranker.warmup,
            "costs": cost_parameters(config.ranker.costs),
        },
        limits=dataclasses.asdict(config.limits),
    )


def _shares_routing(config: ServiceConfig) -> bool:
    """Replicas share their routing decisions (docs/deploy.md#replicas); by default only with an
    external NATS: nothing else can reach an embedded server's replica. A shard ranks nothing: its
    front shares the routing state."""
    sync = config.routing_sync
    return config.shard is None and bool(sync.enabled or (sync.enabled is None and config.nats_url))


class IndexService:
    def __init__(self, config: ServiceConfig, log: Any = None) -> None:
        self.config = config
        self.log = log or structlog.get_logger("kvindex")
        self.subjects = Subjects(config.subject_prefix)
        # Capturing: routing calls run with the clock pinned at their start, as their records say.
        clock = PinnableClock() if config.capture is not None else time.monotonic
        # The recorder first: the repairer the core is built with records through it.
        self.recorder: Recorder | None = None
        if config.capture is not None:
            self.recorder = Recorder.open(config.capture, _capture_meta(config), clock)
        sync = config.routing_sync
        shared = _shares_routing(config)
        # A shard's consumer reads its partition; repairs and replicas use the fleet's subjects.
        consumed = self.subjects if config.shard is None else partition_subjects(self.subjects, config.shard)
        self.mirror = MirrorIndex() if config.shards else None
        self.core = build_core(
            CoreConfig(
                clock=clock,
                subjects=consumed,
                index=self.mirror,
                ingest_limits=config.limits,
                repair=self._make_repairer,
                ranker=config.ranker,
                policy_options=config.policy_options,
                # Predicted against actual (docs/feedback.md): a degradation asks for a snapshot at
                # once (rate-limited in the router; scheduled, never run inside the consumer's own
                # call that changed the state).
                on_degraded=self._reconcile_degraded,
                observer=(lambda ranker: RoutingSync(ranker, sync)) if shared else None,
            )
        )
        core = self.core
        self.index, self.registry, self.counters = core.index, core.registry, core.counters
        self.consumer, self.calibrator, self.ranker = core.consumer, core.calibrator, core.ranker
        assert isinstance(core.repair, NatsRepairer)
        self.repairer: NatsRepairer = core.repair
        self.metrics = Metrics(self.counters, self._gauges)
        # Loaded before anything starts: a bad tokenizer directory fails `serve` at once, clearly.
        self.tokenizers = Tokenizers.from_dirs(
            config.tokenizers,
            config.tokenize_cache_bytes,
            config.tokenize_call_bytes,
            config.tokenize_max_chars,
        )
        self.calibration = CalibrationStore(
            self.calibrator, replicas=config.jetstream.replicas if config.jetstream else 1
        )
        self._register_collectors()
        args = (self.index, self.registry, self.counters, self.metrics, self.ranker, self.tokenizers)
        self.servicer = (
            KvIndexServicer(*args) if self.recorder is None else RecordingServicer(self.recorder, *args)
        )
        self.front: ShardFront | None = None
        self.shard: ShardResponder | None = None
        self._shard_parts(args)
        self.grpc = GrpcServer(
            self.servicer, config.grpc_host, config.grpc_port, config.grpc_security, ready=False
        )
        self.ext_proc = self._ext_proc_server()
        self.route: Any = None  # the RouteProxy of config.route, made in start() (on the loop)
        self.readiness = Readiness(self.registry, self.consumer.sequencer, config.readiness)
        self._readiness_task: asyncio.Task[None] | None = None
        # Collections that do not traverse the fleet's state (kvindex/service/gc_policy.py).
        self.gc_policy = GcPolicy(config.gc, self.log)
        self._gc_task: asyncio.Task[None] | None = None
        self._readiness_changed = asyncio.Event()  # the NATS connection dropped or came back
        self._liveness_task: asyncio.Task[None] | None = None
        self.routing_sync: RoutingSync | None = None
        self.routing_link: NatsRoutingLink | None = None
        if shared:
            assert isinstance(self.ranker.observer, RoutingSync)
            self.routing_sync = self.ranker.observer
            self.routing_link = NatsRoutingLink(self.routing_sync, self.subjects)
            self.metrics.registry.register(SyncCollector(self.routing_sync))
        self.natsd: EmbeddedNats | None = None
        self.source: NatsSource | None = None
        # The servers for logs and callers, secrets redacted (the settings themselves stay private).
        self.nats_url = NatsSettings.coerce(config.nats_url).redacted_servers() if config.nats_url else ""
        self.metrics_port: int | None = None
        self._metrics_server: Any = None

    def _register_collectors(self) -> None:
        """The scrape-time collectors over the ranker's outcomes and the fleet."""
        register = self.metrics.registry.register
        register(TokenizeCollector(self.tokenizers))
        register(OutcomeCollector(self.ranker.outcomes, self._instance_states))
        register(HitCollector(self.ranker.outcomes))
        register(
            FleetCollector(
                self.registry, self.index, self.calibrator, lambda: self.grpc.ready, self._nats_connected
            )
        )

    def _shard_parts(self, args: tuple[Any, ...]) -> None:
        """A front's servicer and fan-out, or a shard's responder (docs/shards.md); neither for one
        index alone."""
        config, core = self.config, self.core
        if self.mirror is not None:
            self.servicer = FrontServicer(*args)
            self.front = ShardFront(
                self.subjects,
                config.shards,
                self.mirror,
                self.registry,
                self.calibrator,
                core.rankers,
                timeout=config.shard_timeout,
            )
            self.servicer.bind(self.front)
            self.metrics.registry.register(ShardCollector(self.front))
        elif config.shard is not None:
            self.shard = ShardResponder(
                config.shard,
                self.subjects,
                self.index,
                self.registry,
                self.consumer,
                self.ready,
                reconcile=lambda key: self.repairer.reconcile_now(key, "degraded"),
            )

    def _ext_proc_server(self) -> ExtProcServer | None:
        """The Envoy endpoint picker over this servicer, if asked for (--ext-proc-port)."""
        config = self.config
        if config.ext_proc_port is None:
            return None
        picker = EndpointPicker(
            self.servicer,
            policy=config.ext_proc_policy,
            log=self.log,
            pd=config.ext_proc_pd,
            admission=config.ext_proc_admission,
            objectives=config.ext_proc_objectives,
        )
        return ExtProcServer(
            picker, config.ext_proc_host, config.ext_proc_port, config.grpc_security, ready=False
        )

    def _make_repairer(self, machine: RepairMachine) -> NatsRepairer:
        """The consumer's repair scheduler (CoreConfig.repair): replays and snapshots over NATS."""
        limits = self.config.limits
        return NatsRepairer(
            machine, self.subjects, limits.limits_of, self.config.repair, recorder=self.recorder
        )

    def _reconcile_degraded(self, instance: InstanceKey) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not serving (a test driving the router alone)
        if self.front is not None:  # its shard asks the worker (kvindex/shards)
            loop.call_soon(self.front.request_reconcile, instance)
        else:
            loop.call_soon(self.repairer.reconcile_now, instance, "degraded")

    def _nats_connected(self) -> bool:
        source = self.source
        return source is not None and source.nc is not None and source.nc.is_connected

    def _instance_states(self) -> dict[str, list[str]]:
        """State name -> instance ids (for the metrics)."""
        out: dict[str, list[str]] = {}
        for state in self.registry.all():
            if not state.is_pool:
                out.setdefault(self.ranker.state_of(state)[0], []).append(state.instance_id)
        return out

    def _register_static(self) -> None:
        """The --instance list: routable at once, approximate, never aged out by heartbeats."""
        cfg = self.config
        for worker, endpoint in cfg.static_instances:
            key = (worker, 0)
            self.index.add_instance(key, cfg.static_model)
            state = self.registry.add(key, cfg.static_model, cfg.static_block_size)
            state.approximate = state.static = True
            if cfg.static_capacity:
                state.capacity = {GPU: cfg.static_capacity}
            self.registry.set_endpoint(state, endpoint)
            self.log.info("static_instance", worker=worker, endpoint=endpoint, model=cfg.static_model)

    def _gauges(self) -> dict[str, Any]:
        s = self.index.stats()
        return {
            "instances": len(self.registry),
            "models": len(self.registry.models()),
            "distinct_blocks": s.distinct_blocks,
            "entries": s.entries,
        }

    async def start(self) -> None:
        nats_settings = await self._nats_settings()
        # Serving before NATS is reached: liveness answers (and readiness says "starting") while the
        # connection is retried, so an orchestrator does not restart a process that only waits.
        await self.grpc.start()
        if self.ext_proc is not None:
            await self.ext_proc.start()  # not ready: its readiness follows the service's
        if self.config.route is not None:
            await self._start_route(self.config.route)
        # Subscribe first, then repair: batches arriving while an instance resynchronises are held.
        self.source = NatsSource(
            self.consumer,
            nats_settings,
            on_reconnect=self.repairer.on_reconnect,
            jetstream=self.config.jetstream,
            tap=self.recorder.message if self.recorder is not None else None,
            on_connection_change=self._readiness_changed.set,
        )
        self._register_static()
        if self.recorder is not None:
            self.recorder.start(self.consumer)
        if self.front is not None:
            # A front consumes nothing: its connection carries the shard queries (and the replicas'
            # routing sync, the calibration store), with the same settings as any other.
            await self.source.connect()
            assert self.source.nc is not None
            await self.front.start(self.source.nc)
        else:
            await self.source.start()
            assert self.source.nc is not None
            self.repairer.start(self.source.nc)
            self._liveness_task = asyncio.create_task(self._sweep_liveness(), name="kvindex-liveness")
        if self.shard is not None:
            await self.shard.start(self.source.nc)
        await self.calibration.start(self.source.nc)
        if self.routing_link is not None:
            await self.routing_link.start(self.source.nc)
        if self.recorder is not None:
            self.recorder.calibration(self.calibrator)
        self.readiness.start(time.monotonic())
        self._readiness_task = asyncio.create_task(self._track_readiness(), name="kvindex-readiness")
        self._gc_task = asyncio.create_task(self.gc_policy.run(), name="kvindex-gc")
        metrics_bound = self._start_metrics()
        self._warn_if_exposed()
        self.log.info(
            "kvindex_serving",
            grpc=self.grpc.bound,  # as bound: 0.0.0.0 is every interface
            metrics=metrics_bound,
            grpc_security=self.grpc.security.mode,
            nats=self.nats_url,
            nats_auth=nats_settings.auth,
            nats_tls=nats_settings.tls,
            subject_prefix=self.config.subject_prefix,
            metrics_port=self.metrics_port,
            ext_proc=self.ext_proc.bound if self.ext_proc is not None else None,
            route=listen.address(self.config.route.host, self.route.port) if self.route is not None else None,
            routing_sync=self.routing_sync.replica_id if self.routing_sync is not None else None,
        )

    async def _nats_settings(self) -> NatsSettings:
        """The NATS to connect to: the configured one, or an embedded server started here."""
        if not self.config.nats_url:
            # JetStream on: the calibration bucket lives there (and the optional event stream).
            cfg = self.config
            self.natsd = EmbeddedNats(cfg.embedded_nats_port, cfg.embedded_nats_host, jetstream=True)
            await self.natsd.start()
            self.nats_url = self.natsd.url
            local = listen.is_loopback(cfg.embedded_nats_host)
            self.log.info(
                "embedded_nats_started",
                url=self.nats_url,  # for this machine
                listen=listen.address(cfg.embedded_nats_host, self.natsd.port),
                workers_url=self.natsd.workers_url,  # what kvshim --nats / Publisher.connect take
                reachable_from="this machine only (--embedded-nats-listen 0.0.0.0:4222 for workers "
                "elsewhere, or an external nats-server)"
                if local
                else "other machines too",
            )
            return NatsSettings.from_url(self.natsd.url)
        return NatsSettings.coerce(self.config.nats_url)

    def _start_metrics(self) -> str | None:
        """The Prometheus endpoint, if asked for (--metrics-port): where it listens."""
        if self.config.metrics_port is not None:
            host = self.config.metrics_host
            try:
                server, _thread = start_http_server(
                    self.config.metrics_port, addr=host, registry=self.metrics.registry
                )
            except OSError as exc:
                where = listen.address(host, self.config.metrics_port)
                raise listen.ListenError("metrics", where, exc.strerror or str(exc)) from None
            self._metrics_server = server
            self.metrics_port = server.server_port
            return listen.address(host, self.metrics_port)
        return None

    async def _start_route(self, cfg: Any) -> None:
        # Imported here: aiohttp comes with the route extra, which a plain index does not need.
        from kvindex.client.local import LocalKvIndexClient
        from kvindex.route.proxy import RouteProxy

        client = LocalKvIndexClient(
            self.servicer,
            timeout=cfg.score_timeout,
            fallback_blocks=cfg.fallback_blocks,
            refresh_interval=cfg.refresh_interval,
        )
        self.route = RouteProxy(cfg, client=client)
        try:
            await self.route.start()
        except OSError as exc:
            self.route = None
            where = listen.address(cfg.host, cfg.port)
            raise listen.ListenError("route", where, exc.strerror or str(exc)) from None

    def _warn_if_exposed(self) -> None:
        """One warning naming every listener other machines can reach without TLS or without
        authentication: the start log says where it listens, this says what that means."""
        exposed = []
        for server in (self.grpc, self.ext_proc):
            if server is None or listen.is_loopback(server.host):
                continue
            sec = server.security
            # A token without TLS has its own warning (auth_token_without_tls, kvindex/security/server.py).
            if sec.token or (sec.tls is not None and sec.tls.client_ca):
                continue
            missing = "no TLS, no token" if sec.tls is None else "no token or client certificate"
            exposed.append(f"{server.what} {server.bound} ({missing})")
        if self.natsd is not None and not listen.is_loopback(self.natsd.host):
            where = listen.address(self.natsd.host, self.natsd.port)
            exposed.append(f"embedded NATS {where} (no TLS, no authentication: anyone can publish events)")
        route = None if self.route is None else listen.route_exposure(self.config.route.host, self.route.port)
        if route is not None:
            exposed.append(route)
        listen.warn_unprotected(
            self.log,
            exposed,
            fix="bind 127.0.0.1 (--grpc-host), or --tls-cert/--tls-key with --auth-token-file or "
            "--tls-client-ca (docs/deploy.md); for remote workers an external nats-server with "
            "auth and TLS (--nats)" + (f"; {listen.ROUTE_FIX} (--route-host)" if route else ""),
        )

    def ready(self) -> tuple[bool, str]:
        source = self.source
        connected = source is not None and source.nc is not None and source.nc.is_connected
        if self.front is not None:
            if self.readiness.stopping:
                return False, "stopping"
            return self.front.ready() if connected else (False, "NATS not connected")
        caught_up = source is None or source.caught_up
        return self.readiness.evaluate(time.monotonic(), connected, caught_up)

    async def _track_readiness(self) -> None:
        while True:
            ready, reason = self.ready()
            if ready != self.grpc.ready:
                await self.grpc.set_ready(ready)
                if self.ext_proc is not None:
                    await self.ext_proc.set_ready(ready)
                self.log.info("readiness_changed", ready=ready, reason=reason)
            cfg = self.readiness.config
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._readiness_changed.wait(), cfg.settled_tick if self.readiness.synced else cfg.tick
                )
            self._readiness_changed.clear()

    async def _sweep_liveness(self) -> None:
        """Stale instances stop being ranked, long-silent ones are forgotten (kvindex/fleet/liveness.py).
        A sweep runs only when one can find something (``sweep_next``'s deadline), so a healthy
        8,192-instance fleet is swept every few seconds, not at every tick."""
        cfg = self.config.liveness
        consumer, registry = self.consumer, self.registry
        next_sweep = float("-inf")
        # While NATS is down the index hears no heartbeat: that silence is its own, so nothing is
        # marked stale (routers keep ranking the fleet as last known instead of answering "no
        # instance"), and after the reconnect instances age from then on.
        heard_since, deaf = float("-inf"), False
        while True:
            await asyncio.sleep(cfg.tick)
            try:
                now = registry.clock()
                if not self._nats_connected():
                    deaf = True
                    continue
                if deaf:
                    heard_since, deaf, next_sweep = now, False, float("-inf")
                if now < next_sweep:
                    continue
                stale, forget, next_sweep = sweep_next(
                    registry.all(), now, cfg.stale_after, cfg.forget_after, heard_since
                )
                rec = self.recorder  # each decision recorded just before it is carried out (kvindex/capture)
                for state in stale:
                    if rec is not None:
                        rec.timer("mark_stale", state.key)
                    consumer.mark_stale(state)
                for key in forget:
                    if rec is not None:
                        rec.timer("forget", key)
                    consumer.forget(key)
                    self.repairer.forget(key)
            except Exception as exc:  # keep sweeping whatever one sweep ran into
                self.log.error("liveness_failed", error=str(exc), error_type=type(exc).__name__)

    async def stop(self, grace: float | None = None) -> None:
        """Not ready at once; in-flight RPCs get ``grace`` (default: the configured shutdown grace);
        then NATS, the capture file and the embedded nats-server are closed, each step bounded, so
        the whole stop takes at most ``grace`` + CLEANUP_BUDGET whatever state NATS is in."""
        grace = self.config.shutdown_grace if grace is None else grace
        self.readiness.stopping = True
        if self._readiness_task is not None:
            self._readiness_task.cancel()
            self._readiness_task = None
        # Both ports at once: readiness off on each, then their in-flight calls share the grace.
        servers = [self.grpc.stop(grace)]
        if self.ext_proc is not None:
            servers.append(self.ext_proc.stop(grace))
        if self.route is not None:  # its in-flight requests finish, then release here (in-process)
            servers.append(self.route.stop())
        await asyncio.gather(*servers)
        if self._liveness_task is not None:
            self._liveness_task.cancel()
            self._liveness_task = None
        if self.front is not None:
            await self.front.stop()
        if self.shard is not None:
            await bounded(self.shard.stop(), 0.5, "shard_stop", self.log)
        if self._gc_task is not None:
            self._gc_task.cancel()
            self._gc_task = None
            self.gc_policy.stop()
        await bounded(self.repairer.stop(), 0.5, "repair_stop", self.log)
        await bounded(self.calibration.stop(), 1.0, "calibration_save", self.log)
        if self.routing_link is not None:
            await bounded(self.routing_link.stop(), 0.5, "routing_sync_stop", self.log)
        if self.source is not None:
            await self.source.stop()
        if self.recorder is not None:
            await bounded(self.recorder.stop(), 1.0, "capture_close", self.log)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        if self.natsd is not None:
            await self.natsd.stop(timeout=1.0)
        self.log.info("kvindex_stopped")

    async def __aenter__(self) -> IndexService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve_until_stopped(
    service: IndexService,
    stop: Stop,
    on_start_failed: Callable[[Exception], int | None] | None = None,
) -> int:
    """Start (a stop request meanwhile cancels the start), serve until asked to stop, stop cleanly.

    A start that fails goes to ``on_start_failed`` before anything is stopped, so its error is the
    first thing said (not after ``kvindex_stopped``); its return value is the exit code (None:
    re-raise). Returns 0 otherwise."""
    try:
        try:
            await stop.run_or_stop(service.start())
        except Exception as exc:
            code = on_start_failed(exc) if on_start_failed is not None else None
            if code is None:
                raise
            return code
        await stop.wait()  # at once if the stop came during the start
        return 0
    finally:
        await service.stop()
