"""The shard side: answers a front's match queries from this process's index and registry.

A shard is an ordinary index (``serve --shard I/N``) whose consumer reads its partition of the fleet
(kvindex/shards/layout.py) and whose repairs go to its own workers. This module adds the query
endpoint: the match of a prompt on the shard's instances, and the instances whose state changed
since the version the front last applied (versions count the shard's answers that carried changes;
a short log of them lets several fronts, each at its own version, be answered).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from kvindex.fleet.registry import InstanceState, Registry
from kvindex.index.base import KvBlockIndex
from kvindex.ingest.consumer import Consumer
from kvindex.instance import InstanceKey
from kvindex.shards.layout import MATCH_QUEUE, ShardSpec, match_subject, partition_of
from kvindex.shards.messages import Answer, Query, encode_state, query_decoder
from kvindex.wire.errors import BAD_SUBJECT, WireError
from kvindex.wire.subjects import Subjects

# Versions kept for fronts that are behind: a front further behind (or new) gets every state.
LOG_VERSIONS = 4096
MAX_OWNED_CACHE = 1 << 20  # workers whose shard is remembered (beyond: computed per message, ~1 us)

_encoder = msgspec.msgpack.Encoder()


class ShardResponder:
    def __init__(
        self,
        spec: ShardSpec,
        fleet: Subjects,
        index: KvBlockIndex,
        registry: Registry,
        consumer: Consumer,
        ready: Callable[[], tuple[bool, str]],
        reconcile: Callable[[InstanceKey], None] | None = None,
        log: Any = None,
    ) -> None:
        """``reconcile``: asks an instance's worker for a snapshot (the front found it degraded)."""
        self.spec = spec
        self.subject = match_subject(fleet, spec.count, spec.index)
        self.index = index
        self.registry = registry
        self.consumer = consumer
        self.ready = ready
        self.reconcile = reconcile
        self.log = log or structlog.get_logger("kvindex.shard")
        self.replica = secrets.token_hex(6)
        self.version = 0
        # (version, instances changed, prefill samples) per answer that carried changes.
        self._log: deque[tuple[int, set[InstanceKey], list[Any]]] = deque(maxlen=LOG_VERSIONS)
        self._changed = registry.watch()  # load, heartbeat time, staleness, capacity, add/remove
        self._samples: list[Any] = []
        self._reconciles: dict[InstanceKey, int] = {}  # per instance, while it is registered
        # Instances without a reported capacity: whether they are pools follows per-batch fields the
        # registry does not watch, so they are sent with every version (normally there are none).
        self._recheck: set[InstanceKey] = set()
        self.queries = 0
        self._sub: Any = None
        # Repair-state changes (the consumer tells its ranker) and heartbeat prefill samples (the
        # calibration) are not registry fields: tee them into the next version.
        sync_changed, samples = consumer.repairs.on_sync_change, consumer.heartbeats.prefill_samples

        def on_sync_change(state: InstanceState, reconciled: bool = False) -> None:
            self._changed.add(state.key)
            if reconciled:
                self._reconciles[state.key] = self._reconciles.get(state.key, 0) + 1
            if sync_changed is not None:
                sync_changed(state, reconciled)

        def on_samples(model: str, rows: list[tuple[int, int, float]], instance: str) -> None:
            self._samples.append((model, instance, list(rows)))
            if samples is not None:
                samples(model, rows, instance)

        consumer.repairs.on_sync_change = on_sync_change
        consumer.heartbeats.prefill_samples = on_samples
        self._guard(consumer)

    def _guard(self, consumer: Consumer) -> None:
        """Refuse the messages of workers this shard does not own. The server's mapping sends each
        worker's subjects to its partition, but a worker allowed to publish on the partitioned
        subjects (per-worker permissions are checked on them: docs/shards.md) could publish on
        another partition's, and two shards would then both report it."""
        spec = self.spec
        owned: dict[str, bool] = {}  # worker -> ours (computed once per worker)
        on_events, on_heartbeat = consumer.on_events, consumer.on_heartbeat

        def ours(subject: str) -> bool:
            worker = subject.rpartition(".")[2]
            mine = owned.get(worker)
            if mine is None:
                mine = spec.owns(worker)
                if len(owned) < MAX_OWNED_CACHE:
                    owned[worker] = mine
            if not mine:
                other = partition_of(worker, spec.count)
                consumer.rejects.reject(
                    worker,
                    subject,
                    WireError(
                        BAD_SUBJECT, f"worker {worker!r} is shard {other}/{spec.count}'s, not {spec}'s"
                    ),
                )
            return mine

        def events(subject: str, payload: bytes) -> bool:
            return ours(subject) and on_events(subject, payload)

        def heartbeat(subject: str, payload: bytes) -> bool:
            return ours(subject) and on_heartbeat(subject, payload)

        consumer.on_events = events  # type: ignore[method-assign]
        consumer.on_heartbeat = heartbeat

    async def start(self, nc: Any) -> None:
        self._sub = await nc.subscribe(self.subject, queue=MATCH_QUEUE, cb=self._on_query)
        self.log.info("shard_answering", subject=self.subject, shard=str(self.spec), replica=self.replica)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a closed connection: nothing left to unsubscribe
                self.log.info("shard_unsubscribe_failed", error=str(exc))

    async def _on_query(self, msg: Any) -> None:
        try:
            query = query_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.log.warning("shard_bad_query", error=str(exc))
            return  # the front times out and says so; nothing here to answer with
        await msg.respond(self.answer(query))

    def answer(self, query: Query) -> bytes:
        """The encoded answer to ``query`` (pure with respect to NATS: tests call it directly)."""
        self.queries += 1
        if self.reconcile is not None:
            for w, r in query.reconcile:
                if self.registry.get((w, r)) is not None:
                    self.reconcile((w, r))
        self._advance()
        now = self.registry.clock()
        get, counts, rec = self.registry.get, self.index.block_counts, self._reconciles.get
        states: list[list[Any]] = []
        removed: list[tuple[str, int]] = []
        samples: list[Any] = []
        oldest = self._log[0][0] if self._log else self.version + 1
        full = query.replica != self.replica or query.since < oldest - 1 or query.since > self.version
        if full:
            states = [encode_state(s, now, counts(s.key), rec(s.key, 0)) for s in self.registry.all()]
        elif query.since < self.version:
            keys: set[InstanceKey] = set()
            for version, changed, rows in self._log:
                if version > query.since:
                    keys |= changed
                    samples.extend(rows)
            for key in keys:
                state = get(key)
                if state is None:
                    removed.append(key)
                    self._reconciles.pop(key, None)
                else:
                    states.append(encode_state(state, now, counts(key), rec(key, 0)))
        matches: list[tuple[str, int, int, int, int, int, int]] = []
        if query.model and query.keys:
            instances = None if query.instances is None else [(w, r) for w, r in query.instances]
            found = self.index.match(query.model, query.keys, instances, query.limit)
            matches = [(k[0], k[1], m[0], m[1][0], m[1][1], m[1][2], m[1][3]) for k, m in found.items()]
        ready, reason = self.ready()
        return _encoder.encode(
            Answer(
                self.replica,
                self.version,
                full,
                states,
                removed,
                matches,
                samples,
                ready,
                reason,
                len(self.registry),
                self.consumer.counters.batches_applied,
            )
        )

    def _advance(self) -> None:
        """Close the changes since the last answer into a new version (if there are any)."""
        changed = self._changed
        recheck = self._recheck
        if not changed and not self._samples and not recheck:
            return
        keys = set(changed) | recheck
        changed.clear()
        get = self.registry.get
        for key in keys:
            state = get(key)
            if state is not None and not state.capacity and not state.static:
                recheck.add(key)
            else:
                recheck.discard(key)
        self.version += 1
        self._log.append((self.version, keys, self._samples))
        self._samples = []
