"""Worker-side publisher: engines and bridges report stored/removed/cleared blocks per tier; this
library numbers, batches and publishes them on NATS and sends heartbeats (docs/wire.md).

It keeps the worker's block set per tier, so that it
- publishes only real changes (engines re-announce blocks on prefix hits; offload connectors repeat),
- maintains the per-tier ``[count, xor]`` digest the index uses to detect drift,
- can answer snapshot requests later (reconciliation).

Sealing a batch and building a heartbeat happen in one synchronous step, so the digest in a
heartbeat always describes exactly the batches up to the heartbeat's ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import structlog
from nats.aio.client import Client

from kvindex.config.nats import NatsSettings
from kvindex.config.nats import connect as nats_connect
from kvindex.keys import group_mask
from kvindex.lifecycle import bounded, close_nats, finish
from kvindex.wire import reconcile
from kvindex.wire.codec import encode_batch, encode_heartbeat
from kvindex.wire.endpoint import check_endpoint
from kvindex.wire.role import check_group, check_role
from kvindex.wire.schema import TIER_NAMES
from kvindex.wire.subjects import Subjects, valid_worker_id

LoadFn = Callable[[], Mapping[str, float]]


class WorkerLog:
    """The transport-free core: block sets and digests, numbering, batching, heartbeats, snapshots.

    Synchronous, so that the routing simulation drives the very code real workers publish with;
    ``Publisher`` adds the NATS transport (timers, publishing, request/reply responders).
    """

    def __init__(
        self,
        *,
        worker: str,
        model: str,
        block_size: int,
        dp_rank: int = 0,
        subject_prefix: str = "kvindex",
        epoch: int | None = None,
        max_batch_keys: int = 4096,
        max_batch_events: int = 1024,
        history: int = 1024,
        snapshot_reuse: float = 0.05,
        capacity: Mapping[str, int] | None = None,
        load_fn: LoadFn | None = None,
        clock: Callable[[], float] = time.time,
        endpoint: str | None = None,
        events: bool = True,
        role: str | None = None,
        pd_group: str | None = None,
    ) -> None:
        if not valid_worker_id(worker):
            raise ValueError(f"worker id {worker!r} must match [A-Za-z0-9_-]{{1,128}}")
        if endpoint is not None:
            check_endpoint(endpoint)  # BadEndpoint (a ValueError) names what is wrong
        if role is not None:
            check_role(role)  # BadRole (a ValueError) too
        if pd_group is not None:
            check_group(pd_group)
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.worker = worker
        self.model = model
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.subjects = Subjects(subject_prefix)
        # Microseconds since the Unix epoch: differs on every start and usually increases.
        self.epoch = epoch if epoch is not None else time.time_ns() // 1000
        self.seq = 0
        self.max_batch_keys = max_batch_keys
        self.max_batch_events = max_batch_events
        self.capacity: dict[str, int] = dict(capacity or {})
        self.load: dict[str, float] = {}
        self.load_fn = load_fn
        # "host:port" where routers send this worker's requests, announced in every heartbeat.
        self.endpoint = endpoint
        # False: an engine without KV events; heartbeats say so and the index predicts its cache.
        self.events = events
        # Under prefill/decode disaggregation: "prefill", "decode" or "both", and the KV-transfer
        # group; None leaves the field out of heartbeats (the index then reads "both", no group).
        self.role = role
        self.pd_group = pd_group
        # A hybrid-attention engine's KV-cache groups, announced in heartbeats (docs/wire.md §8):
        # one map per group, in group order ({"kind", "block_size", "window", "chunk"}); None: one
        # full-attention cache (the field is left out).
        self.groups: list[dict[str, Any]] | None = None
        self._prefill_samples: list[tuple[int, int, float]] = []
        self.clock = clock
        self.blocks: dict[str, set[int]] = {t: set() for t in TIER_NAMES}
        self._xor: dict[str, int] = dict.fromkeys(TIER_NAMES, 0)
        # Sealed batches kept for replay requests: (seq, encoded bytes), seqs contiguous.
        self.history: deque[tuple[int, bytes]] = deque(maxlen=history)
        # Snapshot requests arriving within this many seconds of the last one, with no change since,
        # get the same answer: many index replicas asking at once cost the worker one snapshot.
        self.snapshot_reuse = snapshot_reuse
        self._last_snapshot: tuple[float, int, list[bytes]] | None = None
        self.snapshots_built = 0
        self._pending: list[dict[str, Any]] = []
        self._pending_keys = 0
        self._events_subject = self.subjects.events(worker)
        self._heartbeat_subject = self.subjects.heartbeat(worker)
        self._closed = False

    def _queued(self, full: bool) -> None:
        """Called after each queued event; ``full`` when a batch's worth is pending."""

    def _sealed(self) -> None:
        """Called when pending events have been sealed into batches."""

    # -- block changes (call from the event loop thread) --------------------------------------

    def stored(
        self, keys: Iterable[int], tier: str = "gpu", parent: int | None = None, group: int = 0
    ) -> int:
        """The worker now holds ``keys`` (a chain, in order) on ``tier`` in KV-cache ``group``
        (hybrid-attention models, docs/wire.md §8; 0 otherwise); returns how many were new."""
        held = self.blocks[self._tier(tier)]
        mask = group_mask(group)
        if mask:
            # Blocks, digests and snapshots are over group keys; events carry the plain keys.
            pairs = [(k, k ^ mask) for k in keys]
            fresh = [(k, gk) for k, gk in pairs if gk not in held]
            new, gnew = [k for k, _ in fresh], [gk for _, gk in fresh]
        else:
            new = gnew = [k for k in keys if k not in held]
        if not new:
            return 0
        held.update(gnew)
        self._fold_xor(tier, gnew)
        for start in range(0, len(new), self.max_batch_keys):
            chunk = new[start : start + self.max_batch_keys]
            event: dict[str, Any] = {"type": "stored", "tier": tier, "keys": chunk, "parent": parent}
            if group:
                event["group"] = group
            self._queue(event, len(chunk))
            parent = chunk[-1]
        return len(new)

    def _fold_xor(self, tier: str, keys: list[int]) -> None:
        # Adding and removing a key are the same XOR, which keeps the digest O(1) to maintain.
        x = self._xor[tier]
        for k in keys:
            x ^= k
        self._xor[tier] = x

    def removed(self, keys: Iterable[int], tier: str = "gpu", group: int = 0) -> int:
        """The worker no longer holds ``keys`` on ``tier`` in KV-cache ``group``; returns how many
        it held."""
        held = self.blocks[self._tier(tier)]
        mask = group_mask(group)
        if mask:
            pairs = [(k, k ^ mask) for k in keys]
            present = [(k, gk) for k, gk in pairs if gk in held]
            gone, ggone = [k for k, _ in present], [gk for _, gk in present]
        else:
            gone = ggone = [k for k in keys if k in held]
        if not gone:
            return 0
        held.difference_update(ggone)
        self._fold_xor(tier, ggone)
        for start in range(0, len(gone), self.max_batch_keys):
            chunk = gone[start : start + self.max_batch_keys]
            event: dict[str, Any] = {"type": "removed", "tier": tier, "keys": chunk}
            if group:
                event["group"] = group
            self._queue(event, len(chunk))
        return len(gone)

    def cleared(self, tier: str | None = None) -> int:
        """The worker dropped every block on ``tier`` (every tier when None)."""
        tiers = TIER_NAMES if tier is None else (self._tier(tier),)
        dropped = 0
        for t in tiers:
            dropped += len(self.blocks[t])
            self.blocks[t] = set()
            self._xor[t] = 0
        self._queue({"type": "cleared", "tier": tier}, 0)
        return dropped

    def set_load(
        self,
        *,
        running: int = 0,
        waiting: int = 0,
        waiting_prefill_tokens: int = 0,
        kv_usage: float = 0.0,
        **extra: float,
    ) -> None:
        self.load = {
            "running": running,
            "waiting": waiting,
            "waiting_prefill_tokens": waiting_prefill_tokens,
            "kv_usage": kv_usage,
            **extra,
        }

    def prefill_sample(self, prompt_tokens: int, cached_tokens: int, ms: float) -> None:
        """Report one measured prefill (sent with the next heartbeat; the index calibrates its
        time model from them). At most 1024 are kept between heartbeats."""
        if len(self._prefill_samples) < 1024:
            self._prefill_samples.append((int(prompt_tokens), int(cached_tokens), float(ms)))

    def digest(self, tier: str) -> tuple[int, int]:
        return (len(self.blocks[tier]), self._xor[tier])

    # -- batching and publishing --------------------------------------------------------------

    def _tier(self, tier: str) -> str:
        if tier not in self.blocks:
            raise ValueError(f"tier must be one of {list(TIER_NAMES)}, got {tier!r}")
        return tier

    def _queue(self, event: dict[str, Any], n_keys: int) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        self._pending.append(event)
        self._pending_keys += n_keys
        self._queued(self._pending_keys >= self.max_batch_keys or len(self._pending) >= self.max_batch_events)

    def seal(self) -> list[tuple[str, bytes]]:
        """Turn pending events into numbered batches (synchronously) ready to publish."""
        out: list[tuple[str, bytes]] = []
        pending, self._pending = self._pending, []
        self._pending_keys = 0
        self._sealed()
        batch: list[dict[str, Any]] = []
        keys = 0
        for event in pending:
            n = len(event.get("keys", ()))
            if batch and (keys + n > self.max_batch_keys or len(batch) >= self.max_batch_events):
                out.append(self._encode(batch))
                batch, keys = [], 0
            batch.append(event)
            keys += n
        if batch:
            out.append(self._encode(batch))
        return out

    def _encode(self, events: list[dict[str, Any]]) -> tuple[str, bytes]:
        self.seq += 1
        data = encode_batch(
            worker=self.worker,
            model=self.model,
            epoch=self.epoch,
            seq=self.seq,
            ts=self.clock(),
            block_size=self.block_size,
            dp_rank=self.dp_rank,
            events=events,
        )
        self.history.append((self.seq, data))
        return (self._events_subject, data)

    def heartbeat_payload(self) -> bytes:
        load = dict(self.load_fn()) if self.load_fn is not None else self.load
        samples, self._prefill_samples = self._prefill_samples, []
        extra: dict[str, Any] = {"prefill": [list(s) for s in samples]} if samples else {}
        if self.endpoint is not None:
            extra["endpoint"] = self.endpoint
        if not self.events:
            extra["events"] = False
        if self.role is not None:
            extra["role"] = self.role
        if self.pd_group is not None:
            extra["pd_group"] = self.pd_group
        if self.groups is not None:
            extra["groups"] = self.groups
        return encode_heartbeat(
            worker=self.worker,
            model=self.model,
            epoch=self.epoch,
            seq=self.seq,
            ts=self.clock(),
            block_size=self.block_size,
            dp_rank=self.dp_rank,
            load=load,
            capacity=self.capacity,
            digest={t: self.digest(t) for t in TIER_NAMES if self.blocks[t] or t in self.capacity},
            **extra,
        )

    def replay_messages(self, data: bytes) -> list[bytes] | None:
        """The answer to a replay request (docs/wire.md §6), or None when it is not for this rank."""
        req = reconcile.decode_replay_request(data)
        if req.dp_rank != self.dp_rank:
            return None  # another rank of this worker answers
        oldest = self.history[0][0] if self.history else self.seq + 1
        batches: list[bytes] = []
        if req.epoch != self.epoch:
            status: reconcile.ReplayStatus = reconcile.REPLAY_WRONG_EPOCH
        elif req.from_seq < oldest and req.from_seq <= req.to_seq:
            status = reconcile.REPLAY_TOO_OLD
        else:
            status = reconcile.REPLAY_OK
            first = max(req.from_seq, oldest) - oldest
            last = min(req.to_seq, self.seq) - oldest
            batches = [self.history[i][1] for i in range(first, last + 1)]
        return list(
            reconcile.replay_replies(
                self.worker, self.dp_rank, self.epoch, status, batches, self.max_payload, oldest
            )
        )

    @property
    def max_payload(self) -> int:
        return 1024 * 1024

    def heartbeat_messages(self) -> list[tuple[str, bytes]]:
        """Pending batches, then a heartbeat consistent with them (one synchronous step)."""
        messages = self.seal()
        messages.append((self._heartbeat_subject, self.heartbeat_payload()))
        return messages

    def snapshot_messages(self) -> tuple[list[tuple[str, bytes]], list[bytes]]:
        """Seal pending events and cut a snapshot consistent with the resulting seq (synchronously).

        Returns the sealed batches (to publish first) and the snapshot's answer messages.
        """
        sealed = self.seal()
        now = time.monotonic()
        cached = self._last_snapshot
        if cached is not None and cached[1] == self.seq and now - cached[0] <= self.snapshot_reuse:
            return sealed, cached[2]
        tiers = {t: list(keys) for t, keys in self.blocks.items() if keys}
        parts = list(
            reconcile.snapshot_parts(
                self.worker, self.dp_rank, self.epoch, self.seq, tiers, self.nc.max_payload
            )
        )
        self._last_snapshot = (now, self.seq, parts)
        self.snapshots_built += 1
        return sealed, parts


class Publisher(WorkerLog):
    """A WorkerLog publishing on NATS: batches flushed after ``flush_interval`` (or when full),
    heartbeats every ``heartbeat_interval``, and the replay and snapshot responders."""

    def __init__(
        self,
        nc: Client,
        *,
        flush_interval: float = 0.005,
        heartbeat_interval: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.nc = nc
        self.flush_interval = flush_interval
        self.heartbeat_interval = heartbeat_interval
        self._dirty = asyncio.Event()
        self._full = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self.snapshots_served = 0
        self.replays_served = 0
        # Awaited before a snapshot is answered (bounded by ``before_snapshot_timeout``): a bridge
        # asks its engine for events it may have missed, so that an index that found this worker's
        # blocks wrong (docs/feedback.md) gets the engine's truth, not the same loss again.
        self.before_snapshot: Callable[[], Awaitable[None]] | None = None
        self.before_snapshot_timeout = 2.0
        self.log = structlog.get_logger("workers_shim.publisher").bind(
            worker=self.worker, dp_rank=self.dp_rank
        )

    @classmethod
    async def connect(cls, nats_settings: NatsSettings | str | Sequence[str], **kwargs: Any) -> Publisher:
        """Connect to NATS and start a publisher that owns the connection.

        ``nats_settings``: a URL, several (a cluster), or NatsSettings with credentials and TLS
        (kvindex/config/nats.py). Raises NatsConnectError when no server accepts the connection.
        """
        log = structlog.get_logger("workers_shim.publisher")
        pub: Publisher | None = None

        async def on_error(exc: Exception) -> None:
            closing = pub is not None and pub._closed  # our own close: expected, info
            say = log.info if closing else log.warning
            say("nats_error", error=str(exc), error_type=type(exc).__name__, closing=closing)

        nc = await nats_connect(
            nats_settings,
            name=f"kvshim-{kwargs.get('worker', '')}",
            max_reconnect_attempts=-1,
            error_cb=on_error,
        )
        pub = cls(nc, **kwargs)
        pub._owns_nc = True
        await pub.start()
        return pub

    _owns_nc = False

    def _queued(self, full: bool) -> None:
        self._dirty.set()
        if full:
            self._full.set()

    def _sealed(self) -> None:
        self._dirty.clear()
        self._full.clear()

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    # -- replay and snapshot responders ---------------------------------------------------------

    async def _on_replay(self, msg: Any) -> None:
        if not msg.reply:
            return
        try:
            answer = self.replay_messages(msg.data)
        except Exception as exc:
            self.log.warning("bad_replay_request", error=str(exc))
            return
        if answer is None:
            return
        self.replays_served += 1
        for part in answer:
            await self.nc.publish(msg.reply, part)

    async def _on_snapshot(self, msg: Any) -> None:
        try:
            req = reconcile.decode_snapshot_request(msg.data)
        except Exception as exc:
            self.log.warning("bad_snapshot_request", error=str(exc))
            return
        if req.dp_rank != self.dp_rank or not msg.reply:
            return
        if self.before_snapshot is not None:
            try:
                await asyncio.wait_for(self.before_snapshot(), self.before_snapshot_timeout)
            except Exception as exc:  # answer with what is known: the index must not wait in vain
                self.log.warning("before_snapshot_failed", error=str(exc), error_type=type(exc).__name__)
        sealed, parts = self.snapshot_messages()
        self.snapshots_served += 1
        await self._publish(sealed)
        for part in parts:
            await self.nc.publish(msg.reply, part)

    # -- publishing ---------------------------------------------------------------------------

    async def _publish(self, messages: list[tuple[str, bytes]]) -> None:
        for subject, data in messages:
            await self.nc.publish(subject, data)

    async def flush(self) -> None:
        """Publish everything pending now."""
        await self._publish(self.seal())

    async def heartbeat(self) -> None:
        """Publish pending batches and then a heartbeat consistent with them."""
        await self._publish(self.heartbeat_messages())

    async def start(self) -> None:
        worker = self.worker
        self._subs = [
            await self.nc.subscribe(self.subjects.replay(worker), cb=self._on_replay),
            await self.nc.subscribe(self.subjects.snapshot(worker), cb=self._on_snapshot),
        ]
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name=f"kvshim-flush-{self.worker}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"kvshim-heartbeat-{self.worker}"),
        ]
        await self.heartbeat()

    async def _flush_loop(self) -> None:
        while True:
            await self._dirty.wait()
            # Linger briefly so that events of one engine step share a batch, unless it is full.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.flush_interval)
            try:
                await self.flush()
            except Exception as exc:  # keep publishing after transient NATS errors
                self.log.warning("flush_failed", error=str(exc))
                await asyncio.sleep(self.flush_interval)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self.heartbeat()
            except Exception as exc:
                self.log.warning("heartbeat_failed", error=str(exc))

    async def close(self, timeout: float = 2.0) -> None:
        """Flush, send a last heartbeat and stop (closing the NATS connection if we opened it).

        Takes at most about ``timeout`` seconds whatever the connection's state: the goodbye is only
        attempted on a live connection and bounded, and the connection is closed the bounded way
        (kvindex/lifecycle: a reconnect loop left running would keep the owner from exiting).
        """
        if self._closed:
            return
        # Not cancel-and-await: the flush loop's wait_for can lose a cancellation (Python 3.11).
        await finish(self._tasks, timeout / 4)
        self._tasks = []
        self._closed = True
        if not self.nc.is_closed:
            # On a shared connection the next epoch's publisher answers these subjects from now on.
            await bounded(self._unsubscribe(), timeout / 4, "unsubscribe", self.log)
            if self.nc.is_connected:
                await bounded(self._goodbye(), timeout / 4, "final_heartbeat", self.log)
            else:  # reconnecting: the index will notice the silence
                self.log.warning("final_heartbeat_skipped", reason="nats not connected")
        if self._owns_nc:
            await close_nats(self.nc, timeout / 2, log=self.log)

    async def _unsubscribe(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _goodbye(self) -> None:
        await self.heartbeat()
        await self.nc.flush(timeout=2)

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
