"""The bridge run loop: engine ZMQ events -> translated block keys -> the project's publisher.

One :class:`Bridge` per engine process. It owns one NATS connection, one :class:`Rank` (publisher +
translator) per data-parallel rank, one :class:`Link` per engine endpoint (vLLM and SGLang open one
per rank, at port + rank), and an optional load scraper.

Engine sequence numbers, per link (``applied``: last batch applied; ``live``: last seq seen live):

- ``s <= live``: the engine's counter went back, so the engine restarted: new publisher epoch for
  the link's ranks and fresh maps, then continue as if nothing was applied;
- ``s <= applied``: already applied from a replay, dropped;
- ``s == applied + 1``: applied;
- ``s > applied + 1``: a gap: replay ``applied+1 …``; if the replay cannot fill the hole (no replay
  socket, timeout, the buffer no longer holds it): resync, i.e. new epoch, fresh maps, and whatever
  the replay buffer still has.

Before answering an index's snapshot request the link asks the replay socket for anything after
``applied`` (``check_engine``): a live batch lost on its way here would otherwise show only when the
engine publishes the next one, and an index that found the worker's blocks wrong (its outcome
reports, docs/feedback.md) asks for a snapshot to get exactly those.

At start the link subscribes first and then replays from seq 0, so a shim started beside a running
engine learns the blocks (and hash translations) the engine published before. A store whose parent
(or a token-less block) is unknown mid-stream makes the link replay from 0 into a scratch translator
and learn the translations it was missing; if that cannot help, the event is skipped and counted.
Rebuilds back off exponentially (1 s … 60 s) while they leave events unresolved.

The block size comes from ``--block-size`` or, without it, from the engine's own events or /metrics
(:mod:`.blocksize`): the ranks' publishers start only once it is known, and the first keyed store of
each engine life is checked against it; a conflict stops the bridge (:attr:`Bridge.failure`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kvindex.config.nats import NatsSettings
from kvindex.config.nats import connect as nats_connect
from kvindex.lifecycle import close_nats, finish
from kvindex.wire.endpoint import check_endpoint, endpoint_from_url
from workers_shim.bridges import blocksize
from workers_shim.bridges.blocksize import BlockSizeConflict
from workers_shim.bridges.engines import ENGINES, EngineProfile
from workers_shim.bridges.load import LoadReader, PrefillSampler, scrape
from workers_shim.bridges.native import DecodeError, Decoder
from workers_shim.bridges.stats import BridgeStats
from workers_shim.bridges.stream import EventStream, FrameError, ReplayClient, offset_endpoint, parse_live
from workers_shim.bridges.translate import NullSink, Sink, Translator
from workers_shim.publisher import Publisher


@dataclass
class BridgeConfig:
    engine: str
    zmq: str
    worker_id: str
    model: str
    replay: str | None = None
    topic: str = ""
    metrics_url: str | None = None
    nats_url: str | NatsSettings = "nats://127.0.0.1:4222"  # URL(s), or NatsSettings (auth, TLS)
    dp_ranks: tuple[int, ...] = (0,)
    # Each rank on its own endpoint at port + rank (vLLM, SGLang); False: the endpoints are used as
    # given (one rank), or, with one_endpoint, all ranks arrive on one socket, told apart by the batch.
    port_offset: bool = True
    one_endpoint: bool = False
    block_size: int | None = None  # None: learned from the engine's events or /metrics
    # "host:port" routers send this worker's requests to; default: the host and port of metrics_url.
    endpoint: str | None = None
    # Prefill/decode disaggregation, announced in heartbeats: "prefill", "decode" or "both" (None:
    # not announced, which the index reads as both), and the KV-transfer group.
    role: str | None = None
    pd_group: str | None = None
    subject_prefix: str = "kvindex"
    capacity: dict[str, int] = field(default_factory=dict)
    media: dict[str, str] = field(default_factory=dict)  # medium -> tier overrides
    # None: every KV-cache group (hybrid models), each published as itself; N: group N alone, as
    # group 0 (approximate for a hybrid model).
    kv_group: int | None = None
    # Tokens per chunk of chunked local attention (Llama 4): in no event, so the operator says.
    attention_chunk: int | None = None
    set_tiers: tuple[str, ...] = ()  # tiers where repeated stores re-announce instead of counting
    replay_timeout: float = 2.0
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    heartbeat_interval: float = 0.5
    rebuild_min_interval: float = 1.0
    rebuild_max_interval: float = 60.0
    stats_log_interval: float = 60.0

    @property
    def profile(self) -> EngineProfile:
        return ENGINES[self.engine]

    @property
    def effective_endpoint(self) -> str | None:
        """``endpoint``, else the host and port of ``metrics_url`` (engines serve both on one server)."""
        if self.endpoint is not None:
            return check_endpoint(self.endpoint)
        return endpoint_from_url(self.metrics_url) if self.metrics_url else None


class _QuietLog:
    """Logger for scratch translators replaying history: their skips were logged when first seen."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class Rank:
    """One data-parallel rank: its publisher (wire epoch, seq, block sets) and its hash -> key map."""

    def __init__(self, bridge: Bridge, dp_rank: int) -> None:
        self.bridge = bridge
        self.dp_rank = dp_rank
        self.publisher: Publisher | None = None
        self.translator: Translator | None = None

    def _publisher(self, epoch: int | None) -> Publisher:
        cfg = self.bridge.config
        assert self.bridge.block_size is not None, "publishers start once the block size is known"
        publisher = Publisher(
            self.bridge.nc,
            worker=cfg.worker_id,
            model=cfg.model,
            endpoint=self.bridge.endpoint,
            role=cfg.role,
            pd_group=cfg.pd_group,
            block_size=self.bridge.block_size,
            dp_rank=self.dp_rank,
            subject_prefix=cfg.subject_prefix,
            epoch=epoch,
            heartbeat_interval=cfg.heartbeat_interval,
            capacity=dict(self.bridge.capacity.get(self.dp_rank, cfg.capacity)),
        )
        publisher.before_snapshot = self.bridge.check_engines
        return publisher

    async def start(self) -> None:
        self.publisher = self._publisher(None)
        await self.publisher.start()
        self.translator = self.bridge.new_translator(self.publisher, self.dp_rank)

    async def new_epoch(self, reason: str) -> None:
        """Start a new wire epoch: the index drops everything this rank published and starts over."""
        old = self.publisher
        if old is None:
            return  # not started yet (block size unknown): nothing was published
        await old.close()
        epoch = max(time.time_ns() // 1000, old.epoch + 1)
        self.publisher = self._publisher(epoch)
        self.publisher.load = dict(old.load)
        translator = self.bridge.new_translator(self.publisher, self.dp_rank)
        if reason != "engine_restart" and self.translator is not None:
            # The same engine: its KV-cache groups stay announced from the first heartbeat on.
            translator.inherit(self.translator)
        await self.publisher.start()
        self.translator = translator
        self.bridge.log.warning(
            "kv_new_epoch", dp_rank=self.dp_rank, reason=reason, old_epoch=old.epoch, epoch=epoch
        )

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()


class Link:
    """One engine endpoint: the live stream, its replay socket, and the ranks it carries."""

    def __init__(
        self, bridge: Bridge, endpoint: str, replay: str | None, ranks: dict[int, Rank], route: bool
    ) -> None:
        self.bridge = bridge
        self.ranks = ranks
        self.default_rank = next(iter(ranks))
        self.route = route  # route events by the batch's rank (one endpoint for every rank)
        self.stream = EventStream(bridge.ctx, endpoint, bridge.config.topic)
        self.replay = ReplayClient(bridge.ctx, replay, bridge.config.replay_timeout) if replay else None
        self.live: int | None = None  # last seq received live
        self.applied = -1  # last seq applied (live or replayed)
        self.applied_any = False  # anything applied since the last epoch change of these ranks
        self.rebuild_at = 0.0
        self.rebuild_backoff = bridge.config.rebuild_min_interval
        self.log = bridge.log.bind(endpoint=self.stream.endpoint)
        # Live batches and a snapshot's check of the replay buffer apply one at a time.
        self.lock = asyncio.Lock()

    # -- routing and applying -------------------------------------------------------------------

    def _rank(self, batch_rank: int | None, event_rank: int | None) -> Rank | None:
        if not self.route:
            return self.ranks[self.default_rank]
        rank = event_rank if event_rank is not None else batch_rank
        return self.ranks.get(self.default_rank if rank is None else rank)

    def _check_rank(self, batch_rank: int | None) -> None:
        """One rank per endpoint: the batch's rank field should name it (it is informational)."""
        if not self.route and batch_rank is not None and batch_rank != self.default_rank:
            self.bridge.stats.add("batches", "dp_rank_mismatch")
            self.bridge.stats.throttled(
                "dp_rank_mismatch",
                "warning",
                "kv_dp_rank_mismatch",
                expected=self.default_rank,
                got=batch_rank,
            )

    async def apply(
        self, seq: int, payload: bytes, recover: bool, translators: dict[int, Translator] | None = None
    ) -> None:
        """Apply one engine batch to ``translators`` (by rank; default the ranks' own); may rebuild
        maps (``recover``). Raises BlockSizeConflict when the engine's block size is not ours."""
        stats = self.bridge.stats
        try:
            batch = self.bridge.decoder.decode(payload)
        except DecodeError as exc:
            stats.add("batches", "garbage")
            stats.garbage(exc.reason, seq=seq, detail=exc.detail[:200])
            self._applied(seq)
            return
        await self.bridge.check_block_size(batch.events)
        if not self.bridge.ranks_started:
            # No keyed store yet, so nothing here can be keyed either (removals and clears of blocks
            # never published, token-less placeholders): consumed, counted.
            stats.add("batches", "before_block_size")
            self._applied(seq)
            return
        if translators is None:
            translators = self._translators()
        self._check_rank(batch.dp_rank)
        events = batch.events
        self._prepare(batch, translators)
        i = 0
        while i < len(events):
            ev = events[i]
            rank = self._rank(batch.dp_rank, ev.dp_rank)
            if rank is None:
                stats.skip("unexpected_dp_rank", dp_rank=batch.dp_rank)
                i += 1
                continue
            translator = translators[rank.dp_rank]
            if translator.apply(ev, recover=recover and self._may_rebuild()):
                i += 1
                continue
            await self.rebuild()
            recover = False  # retry the event with what was learned; skip it if still unknown
        stats.add("batches", "applied")
        self._applied(seq)

    def _prepare(self, batch: Any, translators: dict[int, Translator]) -> None:
        """Each translator learns its share of the batch's complete stores first (a hybrid model's
        sparse groups are stored before the group that lists every block)."""
        if not self.route:
            translators[self.default_rank].prepare(batch.events)
            return
        by_rank: dict[int, list[Any]] = {}
        for ev in batch.events:
            rank = self._rank(batch.dp_rank, ev.dp_rank)
            if rank is not None:
                by_rank.setdefault(rank.dp_rank, []).append(ev)
        for r, events in by_rank.items():
            if r in translators:
                translators[r].prepare(events)

    def _applied(self, seq: int) -> None:
        self.applied = seq
        self.applied_any = True

    def _translators(self) -> dict[int, Translator]:
        out = {}
        for r, rank in self.ranks.items():
            assert rank.translator is not None
            out[r] = rank.translator
        return out

    async def _apply_replayed(self, batches: Iterable[tuple[int, bytes]], recover: bool) -> None:
        for seq, payload in batches:
            if seq <= self.applied:
                continue
            self.bridge.stats.add("frames", "replay")
            await self.apply(seq, payload, recover)

    # -- recovery -------------------------------------------------------------------------------

    def _may_rebuild(self) -> bool:
        return self.replay is not None and time.monotonic() >= self.rebuild_at

    async def rebuild(self) -> None:
        """Replay the engine's whole buffer into scratch maps and learn the translations we lack."""
        stats, cfg = self.bridge.stats, self.bridge.config
        assert self.replay is not None
        stats.add("recovery", "rebuild")
        result = await self.replay.request(0)
        self._count_replay(result.error, result.layouts, result.bad_frames)
        scratch = BridgeStats(log=_QuietLog())
        fresh = {r: self.bridge.new_translator(NullSink(), r, scratch) for r in self.ranks}
        for seq, payload in result.batches:
            scratch.add("frames", "replay")
            await self.apply_scratch(seq, payload, fresh)
        learned = 0
        for r, translator in fresh.items():
            mine = self.ranks[r].translator
            assert mine is not None
            learned += mine.learn_from(translator)
        unresolved = scratch.get("skipped", "unknown_parent") + scratch.get(
            "skipped", "unknown_tokenless_block"
        )
        truncated = result.first not in (None, 0)
        if result.error or truncated or unresolved:
            self.rebuild_backoff = min(self.rebuild_backoff * 2, cfg.rebuild_max_interval)
        else:
            self.rebuild_backoff = cfg.rebuild_min_interval
        self.rebuild_at = time.monotonic() + self.rebuild_backoff
        self.log.warning(
            "kv_map_rebuilt",
            batches=len(result.batches),
            first_seq=result.first,
            complete=result.complete,
            error=result.error,
            learned=learned,
            next_in_s=self.rebuild_backoff,
        )

    async def apply_scratch(self, seq: int, payload: bytes, translators: dict[int, Translator]) -> None:
        try:
            batch = self.bridge.decoder.decode(payload)
        except DecodeError:
            return
        self._prepare(batch, translators)
        for ev in batch.events:
            rank = self._rank(batch.dp_rank, ev.dp_rank)
            if rank is not None:
                translators[rank.dp_rank].apply(ev, recover=False)

    def _count_replay(self, error: str | None, layouts: set[int], bad_frames: int) -> None:
        stats = self.bridge.stats
        stats.add("recovery", "replay" if error is None else f"replay_{error}")
        for layout in layouts:
            stats.add("frames", f"replay_{layout}frame")
        if bad_frames:
            stats.garbage("bad_replay_frame", count=bad_frames)

    async def bootstrap(self) -> None:
        """At start: everything the engine's replay buffer holds, so a mid-stream start loses nothing."""
        if self.replay is None:
            return
        result = await self.replay.request(0)
        self._count_replay(result.error, result.layouts, result.bad_frames)
        if result.error is not None and not result.batches:
            self.log.warning("kv_replay_unavailable", at="start", error=result.error)
            return
        if result.first not in (None, 0):
            self.bridge.stats.add("recovery", "history_truncated")
            self.log.warning("kv_history_truncated", first_seq=result.first)
        await self._apply_replayed(result.batches, recover=False)
        self.log.info("kv_bootstrapped", batches=len(result.batches), applied=self.applied)

    async def resync(self, reason: str) -> None:
        """Lost events that cannot be recovered: new epoch, fresh maps, whatever the buffer still has."""
        stats = self.bridge.stats
        stats.add("recovery", f"resync_{reason}")
        self.log.warning("kv_resync", reason=reason, applied=self.applied, live=self.live)
        for rank in self.ranks.values():
            await rank.new_epoch(reason)
        self.applied = -1
        self.applied_any = False
        if self.replay is not None:
            result = await self.replay.request(0)
            self._count_replay(result.error, result.layouts, result.bad_frames)
            if result.first not in (None, 0):
                stats.add("recovery", "history_truncated")
            await self._apply_replayed(result.batches, recover=False)

    async def catch_up(self, seq: int) -> None:
        """Fill the hole ``applied+1 … seq-1`` from the replay socket, or resync."""
        stats = self.bridge.stats
        start = self.applied + 1
        if not self.applied_any and self.replay is None:
            stats.add("recovery", "joined_mid_stream")
            self.log.warning("kv_joined_mid_stream", first_seq=seq)
            return
        stats.add("recovery", "gap")
        self.log.warning("kv_engine_gap", missing_from=start, missing_to=seq - 1)
        if self.replay is None:
            await self.resync("gap_without_replay")
            return
        result = await self.replay.request(start)
        self._count_replay(result.error, result.layouts, result.bad_frames)
        seqs = [s for s, _ in result.batches]
        contiguous = all(b == a + 1 for a, b in itertools.pairwise(seqs))
        if seqs and seqs[0] == start and seqs[-1] >= seq - 1 and contiguous:
            await self._apply_replayed(result.batches, recover=True)
            return
        if not self.applied_any:
            # Nothing of this engine life applied yet: the buffer's oldest batches are all there is.
            if seqs:
                stats.add("recovery", "history_truncated")
                self.log.warning("kv_history_truncated", first_seq=seqs[0])
            await self._apply_replayed(result.batches, recover=False)
            return
        await self.resync("gap_unrecoverable" if result.error is None else "replay_unavailable")

    async def check_engine(self) -> None:
        """Apply what the engine's replay buffer holds after ``applied`` (before a snapshot answer)."""
        if self.replay is None or not self.applied_any:
            return
        async with self.lock:
            start = self.applied + 1
            result = await self.replay.request(start)
            self._count_replay(result.error, result.layouts, result.bad_frames)
            newer = [(s, p) for s, p in result.batches if s >= start]
            if not newer:
                return
            self.bridge.stats.add("recovery", "snapshot_check")
            self.log.warning("kv_missed_batches", first=newer[0][0], last=newer[-1][0], found_by="snapshot")
            seqs = [s for s, _ in newer]
            if seqs[0] == start and all(b == a + 1 for a, b in itertools.pairwise(seqs)):
                await self._apply_replayed(newer, recover=True)
            else:
                await self.catch_up(seqs[-1] + 1)  # the buffer lost some too: replay or resync

    async def engine_restarted(self, seq: int) -> None:
        self.bridge.stats.add("recovery", "engine_restart")
        self.log.warning("kv_engine_restart", seq=seq, last_seq=self.live)
        self.bridge.block_size_checked = False  # a new engine life may run with another block size
        for rank in self.ranks.values():
            await rank.new_epoch("engine_restart")
        self.applied = -1
        self.applied_any = False
        self.live = None

    # -- the live loop --------------------------------------------------------------------------

    async def on_live(self, seq: int, payload: bytes) -> None:
        stats = self.bridge.stats
        if self.live is not None and seq <= self.live:
            await self.engine_restarted(seq)
        self.live = seq
        if seq <= self.applied:
            stats.add("batches", "duplicate")
            return
        if seq > self.applied + 1:
            await self.catch_up(seq)
            if seq <= self.applied:
                return
            if seq > self.applied + 1:
                stats.add("recovery", "gap_accepted")
        await self.apply(seq, payload, True)

    async def run(self, ready: asyncio.Event | None = None) -> None:
        stats = self.bridge.stats
        try:
            await self.bootstrap()
        except BlockSizeConflict:
            return  # the bridge has failed (Bridge.failure); nothing more to do here
        except Exception as exc:  # the engine may come later; the live loop still runs
            self.log.exception("kv_bootstrap_failed", error=str(exc))
        finally:
            if ready is not None:
                ready.set()
        while True:
            frames = await self.stream.recv(None)
            if frames is None:
                continue
            stats.add("frames", "live")
            try:
                _topic, seq, payload = parse_live(frames)
            except FrameError as exc:
                stats.garbage(exc.reason, frames=len(frames))
                continue
            try:
                async with self.lock:
                    await self.on_live(seq, payload)
            except BlockSizeConflict:
                return
            except Exception as exc:  # a bug on one batch must not stop the bridge
                stats.garbage("internal_error", seq=seq)
                self.log.exception("kv_batch_failed", seq=seq, error=str(exc))
                self.applied = max(self.applied, seq)

    def close(self) -> None:
        self.stream.close()


class Bridge:
    """Runs one engine's bridge: ``await bridge.start()`` … ``await bridge.stop()``."""

    def __init__(self, config: BridgeConfig, *, nc: Any = None, stats: BridgeStats | None = None) -> None:
        if config.engine not in ENGINES:
            raise ValueError(f"unknown engine {config.engine!r}; one of {sorted(ENGINES)}")
        self.config = config
        self.endpoint = config.effective_endpoint  # validated first: a bad one fails before any socket
        self.log = structlog.get_logger("workers_shim.bridges").bind(
            engine=config.engine, worker=config.worker_id
        )
        self.stats = stats or BridgeStats(log=self.log)
        self.decoder = Decoder({**config.profile.media, **{k.upper(): v for k, v in config.media.items()}})
        self.nc = nc
        self._owns_nc = nc is None
        self.ctx: zmq.asyncio.Context = zmq.asyncio.Context()
        self.ranks: dict[int, Rank] = {}
        self.links: list[Link] = []
        self.capacity: dict[int, dict[str, int]] = {}
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._closing = False  # stop() is closing our NATS connection: its errors are expected
        # Tokens per block and who said so; None until the engine tells (no --block-size).
        self.block_size: int | None = config.block_size
        self.block_size_source = "--block-size" if config.block_size else ""
        self.block_size_checked = False  # the engine's events confirmed it (this engine life)
        self.ranks_started = False
        self._ranks_lock = asyncio.Lock()
        # A fatal error (block size conflict): the bridge stops doing anything and says why.
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()

    def new_translator(self, sink: Sink, dp_rank: int, stats: BridgeStats | None = None) -> Translator:
        cfg = self.config
        assert self.block_size is not None
        return Translator(
            cfg.model,
            self.block_size,
            sink,
            stats or self.stats,
            kv_group=cfg.kv_group,
            attention_chunk=cfg.attention_chunk,
            set_tiers=cfg.set_tiers,
            context={"dp_rank": dp_rank},
        )

    async def start(self) -> None:
        cfg = self.config
        if self.nc is None:

            async def on_error(exc: Exception) -> None:
                closing = self._closing  # our own stop: expected, info
                say = self.log.info if closing else self.log.warning
                say("nats_error", error=str(exc), error_type=type(exc).__name__, closing=closing)

            self.nc = await nats_connect(
                cfg.nats_url,
                name=f"kvshim-{cfg.worker_id}",
                max_reconnect_attempts=-1,
                error_cb=on_error,
            )
        for r in cfg.dp_ranks:
            self.ranks[r] = Rank(self, r)
        if self.block_size is not None:
            await self.start_ranks()
        if cfg.one_endpoint or (len(cfg.dp_ranks) == 1 and not cfg.port_offset):
            self.links.append(Link(self, cfg.zmq, cfg.replay, dict(self.ranks), route=cfg.one_endpoint))
        else:
            for r in cfg.dp_ranks:
                endpoint = offset_endpoint(cfg.zmq, r) if cfg.port_offset else cfg.zmq
                replay = cfg.replay and (offset_endpoint(cfg.replay, r) if cfg.port_offset else cfg.replay)
                self.links.append(Link(self, endpoint, replay, {r: self.ranks[r]}, route=False))
        events = [asyncio.Event() for _ in self.links]
        for link, ready in zip(self.links, events, strict=True):
            self._tasks.append(
                asyncio.create_task(link.run(ready), name=f"kvshim-link-{link.stream.endpoint}")
            )
        if cfg.metrics_url:
            self._tasks.append(asyncio.create_task(self._load_loop(), name="kvshim-load"))
        if cfg.stats_log_interval > 0:
            self._tasks.append(asyncio.create_task(self._stats_loop(), name="kvshim-stats"))
        await asyncio.gather(*(e.wait() for e in events))
        if self.failure is not None:  # found at start, in the engine's replayed history
            await self.stop()
            raise self.failure
        self.ready.set()
        self.log.info(
            "kvshim_started",
            model=cfg.model,
            block_size=self.block_size or "auto (from the engine's events)",
            dp_ranks=list(cfg.dp_ranks),
            endpoints=[link.stream.endpoint for link in self.links],
            replay=cfg.replay,
            serving_endpoint=self.endpoint,
            nats=NatsSettings.coerce(cfg.nats_url).describe(),
        )

    # -- block size -----------------------------------------------------------------------------

    async def check_engines(self) -> None:
        """Before a snapshot answer: every link takes what its engine published and we missed."""
        for link in self.links:
            await link.check_engine()

    async def start_ranks(self) -> None:
        """Start every rank's publisher (first heartbeat included): the block size is known."""
        async with self._ranks_lock:  # several links may learn it at once
            if self.ranks_started:
                return
            for rank in self.ranks.values():
                await rank.start()
            self.ranks_started = True

    async def check_block_size(self, events: list[Any]) -> None:
        """Learn the block size from a batch's keyed stores, or check it; BlockSizeConflict if wrong."""
        if self.failure is not None:
            raise self.failure
        if self.block_size_checked:
            return
        cfg = self.config
        seen = blocksize.evidence(events, cfg.kv_group)
        if not seen:
            return
        partial = cfg.profile.partial_blocks
        if self.block_size is None:
            self.block_size = blocksize.learn(seen, partial)
            self.block_size_source = "the engine's earlier KV events"
            self.log.info("kv_block_size_learned", block_size=self.block_size, source="events")
        else:
            bad = blocksize.conflict(seen, self.block_size, partial)
            if bad is not None:
                raise self.fail(BlockSizeConflict(bad, self.block_size, self.block_size_source))
        self.block_size_checked = blocksize.confirms(seen, self.block_size)
        await self.start_ranks()

    def fail(self, exc: BaseException) -> BaseException:
        """Record a fatal error (the first one) and wake whoever runs the bridge."""
        if self.failure is None:
            self.failure = exc
            self.log.error("kvshim_fatal", error=str(exc), error_type=type(exc).__name__)
            self.failed.set()
        return exc

    async def run(self) -> None:
        """Start, then run until :meth:`stop`; raises the failure if the bridge fails."""
        await self.start()
        stopped = asyncio.ensure_future(self._stopped.wait())
        failed = asyncio.ensure_future(self.failed.wait())
        try:
            await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            failed.cancel()
        if self.failure is not None:
            if not self._stopped.is_set():
                await self.stop()
            raise self.failure

    async def stop(self) -> None:
        if self._stopped.is_set():  # a failed start stops the bridge, and its runner stops it again
            return
        await finish(self._tasks, 1.0)  # repeated cancellation: one can be lost (kvindex/lifecycle)
        self._tasks = []
        for link in self.links:
            link.close()
        # Each rank's goodbye is bounded (workers_shim/publisher.py); in parallel, so a bridge of
        # many ranks stops as fast as one, whatever state NATS is in.
        await asyncio.gather(*(rank.close() for rank in self.ranks.values()), return_exceptions=True)
        if self._owns_nc:
            self._closing = True
            await close_nats(self.nc, 2.0, log=self.log)
        self.ctx.destroy(linger=0)
        self.log.info("kvshim_stopped", stats=self.stats.snapshot())
        self._stopped.set()

    # -- load -----------------------------------------------------------------------------------

    async def _load_loop(self) -> None:
        cfg = self.config
        assert cfg.metrics_url is not None
        reader = LoadReader(cfg.profile)
        sampler = PrefillSampler(reader)  # the engine's prefill times, for the index's calibration
        wanted = cfg.profile.sample_names()
        while True:
            try:
                samples = await scrape(cfg.metrics_url, cfg.scrape_timeout, wanted)
            except Exception as exc:
                self.stats.add("load", "error")
                self.stats.throttled(
                    "load_error", "warning", "kv_load_scrape_failed", url=cfg.metrics_url, error=str(exc)
                )
            else:
                self.stats.add("load", "ok")
                await self._learn_block_size_from_metrics(reader, samples)
                if self.ranks_started:
                    for rank in self.ranks.values():
                        self._apply_load(reader, samples, rank)
                        prefill = sampler.sample(samples, rank.dp_rank)
                        if prefill is not None and rank.publisher is not None:
                            rank.publisher.prefill_sample(*prefill)
                            self.stats.add("prefill", "sample")
            await asyncio.sleep(cfg.scrape_interval)

    async def _learn_block_size_from_metrics(self, reader: LoadReader, samples: Any) -> None:
        """vLLM's cache_config_info names the block size: heartbeats need not wait for an event."""
        if self.block_size is not None or self.failure is not None:
            return
        info = reader.cache_info(samples, next(iter(self.ranks)))
        if info.block_size:
            self.block_size = info.block_size
            self.block_size_source = "the engine's /metrics (cache_config_info)"
            self.log.info("kv_block_size_learned", block_size=self.block_size, source="metrics")
            await self.start_ranks()

    def _apply_load(self, reader: LoadReader, samples: Any, rank: Rank) -> None:
        cfg = self.config
        load = reader.load(samples, rank.dp_rank)
        publisher = rank.publisher
        assert publisher is not None
        publisher.set_load(
            running=load.running,
            waiting=load.waiting,
            waiting_prefill_tokens=load.waiting_prefill_tokens,
            kv_usage=load.kv_usage,
        )
        info = reader.cache_info(samples, rank.dp_rank)
        if info.block_size is not None and info.block_size != self.block_size:
            self.stats.add("load", "block_size_mismatch")
            self.stats.throttled(
                "engine_block_size",
                "error",
                "kv_block_size_mismatch",
                engine_block_size=info.block_size,
                block_size=self.block_size,
                source="metrics",
                dp_rank=rank.dp_rank,
            )
        if not cfg.capacity and (info.gpu_blocks or info.cpu_blocks):
            capacity = self.capacity.setdefault(rank.dp_rank, {})
            if info.gpu_blocks:
                capacity["gpu"] = info.gpu_blocks
            if info.cpu_blocks:
                capacity["cpu"] = info.cpu_blocks
            publisher.capacity.update(capacity)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_log_interval)
            self.log.info("kvshim_stats", **self.stats.snapshot())
