"""The front: one ranker over the answers of N shards (``serve --shards N``, docs/shards.md).

Before a Score (or a Lookup, or a Release with a report) runs, the front asks every shard, at once,
for the prompt's match on its instances and for the instance states that changed since the last
answer it applied; it writes those states into its own registry (the same ``InstanceState`` fields
the shard's heartbeats and batches wrote) and hands the merged match to the ranker through
``MirrorIndex``. The ranker, ledger, speculative keys, policies, pick and routing sync are the
unsharded service's own, so the ranking is the one an unsharded index would make.

A shard that does not answer in time is named in the metrics and its instances are left out of the
ranking (marked stale here) until it answers again, when it sends every state afresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.api.errors import BadRequest
from kvindex.api.servicer import KvIndexServicer, release_report
from kvindex.fleet.registry import Registry
from kvindex.index.base import NO_MATCH, Applied, Differ, IndexStats, InstanceMatch
from kvindex.index.hybrid import GroupLayout, hit_limit
from kvindex.index.inverted import InvertedIndex
from kvindex.instance import InstanceKey
from kvindex.scoring.calibration import Calibrator
from kvindex.shards.layout import match_subject, partition_of
from kvindex.shards.messages import Answer, Query, answer_decoder, apply_state, query_encoder
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.subjects import Subjects


class MirrorIndex:
    """The front's KvBlockIndex: matches are the shards' answers to the current request (set by
    ``ShardFront.fetch`` just before the ranker runs), merged with the blocks predicted here for
    instances without KV events (static or heartbeat-only ones: their predictions are made by this
    front's commits, so they live here). Per-instance block counts are the shards' last report."""

    def __init__(self) -> None:
        self.local = InvertedIndex()  # predicted caches (kvindex/scoring/approximate.py)
        self.blocks: dict[InstanceKey, tuple[int, int, int, int]] = {}
        self._models: dict[InstanceKey, str] = {}
        self._predicted: set[InstanceKey] = set()  # instances with predicted blocks here
        self._answer: tuple[str, list[int], int | None, dict[InstanceKey, InstanceMatch]] | None = None
        self.unfetched = 0  # matches asked without a shard answer for them (answered from local only)

    # -- the prefetched answer --------------------------------------------------------------

    def set_answer(
        self, model: str, keys: list[int], limit: int | None, matches: dict[InstanceKey, InstanceMatch]
    ) -> None:
        self._answer = (model, keys, limit, matches)

    def match(
        self,
        model: str,
        keys: list[int],
        instances: Iterable[InstanceKey] | None = None,
        limit: int | None = None,
        # (the request's: the answer is for exactly these keys)
        reach: dict[InstanceKey, int] | None = None,
    ) -> dict[InstanceKey, InstanceMatch]:
        # ``reach`` (a hybrid model's full-attention prefix beyond the hit, docs/scoring.md "Reach")
        # is not carried by the shards' answers: through a front, hybrid models rank on the exact hit
        # alone (docs/shards.md, limits).
        answer = self._answer
        if (
            answer is not None
            and answer[0] == model
            and answer[2] == limit
            and (answer[1] is keys or answer[1] == keys)
        ):
            found = answer[3]
        else:
            self.unfetched += 1
            found = {}
        wanted = None if instances is None else set(instances)
        out = dict(found) if wanted is None else {k: m for k, m in found.items() if k in wanted}
        if self._predicted:
            for key, m in self.local.match(model, keys, wanted, limit).items():
                if m.length > out.get(key, NO_MATCH).length:
                    out[key] = m
        return out

    # -- instances (the front's registry mirrors the shards') -------------------------------

    def add_instance(self, instance: InstanceKey, model: str) -> None:
        self._models[instance] = model

    def drop_instance(self, instance: InstanceKey) -> int:
        self._models.pop(instance, None)
        self.blocks.pop(instance, None)
        if instance not in self._predicted:
            return 0
        self._predicted.discard(instance)
        return self.local.drop_instance(instance)

    def has_instance(self, instance: InstanceKey) -> bool:
        return instance in self._models

    def model_of(self, instance: InstanceKey) -> str | None:
        return self._models.get(instance)

    def _local(self, instance: InstanceKey) -> bool:
        model = self._models.get(instance)
        if model is None:
            return False
        if instance not in self._predicted:
            self.local.add_instance(instance, model)
            self._predicted.add(instance)
        return True

    def store(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        return self.local.store(instance, tier, keys) if self._local(instance) else 0

    def remove(self, instance: InstanceKey, tier: int, keys: Iterable[int]) -> int:
        return self.local.remove(instance, tier, keys) if self.local.has_instance(instance) else 0

    def clear(self, instance: InstanceKey, tier: int | None = None) -> int:
        return self.local.clear(instance, tier) if self.local.has_instance(instance) else 0

    def apply(self, instance: InstanceKey, events: Sequence[Any]) -> Applied:
        raise NotImplementedError("a shard front applies no batches (its shards do)")

    def apply_within(
        self, instance: InstanceKey, events: Sequence[Any], bound: int, limits: Sequence[int]
    ) -> Applied | None:
        return self.apply(instance, events)

    def set_layout(self, model: str, layout: GroupLayout) -> None:
        pass  # hybrid layouts live in the shards (docs/shards.md: not combined yet)

    def layout_of(self, model: str) -> GroupLayout | None:
        return None

    def block_counts(self, instance: InstanceKey) -> tuple[int, int, int, int]:
        return self.blocks.get(instance, (0, 0, 0, 0))

    def digest(self, instance: InstanceKey, tier: int) -> tuple[int, int]:
        return (0, 0)

    def digest_version(self, instance: InstanceKey) -> int:
        return 0

    def digest_equals(self, instance: InstanceKey, counts: list[int], xors: list[int]) -> bool:
        return False

    def diff(self, instance: InstanceKey, tier: int, keys: list[int]) -> tuple[list[int], list[int]]:
        raise NotImplementedError("a shard front repairs nothing (its shards do)")

    def differ(self, instance: InstanceKey, tier: int, keys: list[int]) -> Differ:
        raise NotImplementedError("a shard front repairs nothing (its shards do)")

    def keys_of(self, instance: InstanceKey, tier: int) -> Iterator[int]:
        return iter(())

    def stats(self) -> IndexStats:
        entries = [0, 0, 0, 0]
        for counts in self.blocks.values():
            for t in range(4):
                entries[t] += counts[t]
        return IndexStats(len(set(self._models.values())), len(self._models), (0, 0, 0, 0), tuple(entries))  # type: ignore[arg-type]


class ShardHealth:
    """What the front knows of one shard (its metrics: kvindex_shard_*)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.replica = ""  # the shard process whose versions ``since`` counts
        self.since = 0
        self.up = False  # answered the last query
        self.ready = False
        self.reason = "no answer yet"
        self.last_answer: float | None = None  # monotonic time of the last answer
        self.rtt = 0.0  # the last query's round trip (s)
        self.instances = 0
        self.batches = 0
        self.queries = 0
        self.failures = 0
        self.owned: set[InstanceKey] = set()


class ShardFront:
    def __init__(
        self,
        fleet: Subjects,
        count: int,
        index: MirrorIndex,
        registry: Registry,
        calibrator: Calibrator,
        rankers: Sequence[Any],
        timeout: float = 0.5,
        refresh: float = 0.5,
        log: Any = None,
    ) -> None:
        self.count = count
        self.subjects = [match_subject(fleet, count, i) for i in range(count)]
        self.index = index
        self.registry = registry
        self.calibrator = calibrator
        self.rankers = rankers
        self.timeout = timeout
        self.refresh = refresh  # states-only queries while no request comes (readiness, metrics)
        self.log = log or structlog.get_logger("kvindex.front")
        self.shards = [ShardHealth(i) for i in range(count)]
        self.fanout_seconds = 0.0  # the last fan-out's wall time
        self.nc: Any = None
        self._task: asyncio.Task[None] | None = None
        self._pending_tasks: set[asyncio.Task[Any]] = set()
        self._last_fetch = float("-inf")
        self._reconciles: dict[InstanceKey, int] = {}  # the shards' count, as last applied
        self._to_reconcile: dict[int, set[InstanceKey]] = {}  # per shard, sent with its next query
        self._reconcile_task: asyncio.Task[None] | None = None

    async def start(self, nc: Any) -> None:
        self.nc = nc
        await self.fetch("", [], None, None)
        self._task = asyncio.create_task(self._refresh_loop(), name="kvindex-shard-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for task in list(self._pending_tasks):
            task.cancel()

    def ready(self) -> tuple[bool, str]:
        """Ready when every shard is (answering, and ready by its own readiness)."""
        for s in self.shards:
            if not s.up:
                return False, f"shard {s.index}/{self.count} not answering ({s.reason})"
            if not s.ready:
                return False, f"shard {s.index}/{self.count} not ready: {s.reason}"
        return True, "ready"

    def request_reconcile(self, instance: InstanceKey) -> None:
        """The ranker found ``instance`` degraded: its shard asks the worker for a snapshot (sent at
        once, with a states-only query)."""
        state = self.registry.get(instance)
        if state is not None and state.repair.sync != "synced":
            # Queued or under repair on its shard, which reconciles it anyway (the unsharded
            # repairer drops these too). Asked anyway, it arrived after that snapshot had applied
            # and took another: a cold start's queued instances, degraded, cost 10-40 % more snapshots.
            return
        self._to_reconcile.setdefault(partition_of(instance[0], self.count), set()).add(instance)
        # One query on its way at a time: those asked meanwhile go with the next (a cold start
        # finds hundreds degraded at once, and a query per instance buried the busy shards).
        if self.nc is not None and self._reconcile_task is None:
            task = asyncio.get_running_loop().create_task(self._send_reconciles())
            self._reconcile_task = task
            self._pending_tasks.add(task)
            task.add_done_callback(self._pending_tasks.discard)

    async def _send_reconciles(self) -> None:
        try:
            while self._to_reconcile:
                await self.fetch("", [], None, None)
        finally:
            self._reconcile_task = None

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh)
            if time.monotonic() - self._last_fetch >= self.refresh:
                try:
                    await self.fetch("", [], None, None)
                except Exception as exc:  # keep refreshing whatever one round ran into
                    self.log.error("shard_refresh_failed", error=str(exc), error_type=type(exc).__name__)

    async def fetch(
        self,
        model: str,
        keys: list[int],
        instances: list[InstanceKey] | None,
        limit: int | None,
    ) -> dict[InstanceKey, InstanceMatch]:
        """Ask the shards (those owning ``instances``, or all), apply their states, and make the
        merged match the answer ``MirrorIndex.match`` gives for (model, keys, limit)."""
        started = time.monotonic()
        self._last_fetch = started
        if instances is None:
            targets = list(range(self.count))
            restrict: list[list[tuple[str, int]] | None] = [None] * self.count
        else:
            per: dict[int, list[tuple[str, int]]] = {}
            for key in instances:
                per.setdefault(partition_of(key[0], self.count), []).append(key)
            targets = sorted(per)
            restrict = [per.get(i) for i in range(self.count)]
        replies = await asyncio.gather(
            *(self._ask(i, model, keys, restrict[i], limit) for i in targets), return_exceptions=True
        )
        now = time.monotonic()
        merged: dict[InstanceKey, InstanceMatch] = {}
        for i, reply in zip(targets, replies, strict=True):
            health = self.shards[i]
            health.queries += 1
            if isinstance(reply, BaseException):
                self._down(health, reply)
                continue
            answer, rtt = reply
            health.rtt = rtt
            self._apply(health, answer, now)
            for w, r, length, t0, t1, t2, t3 in answer.matches:
                merged[(w, r)] = InstanceMatch(length, (t0, t1, t2, t3))
        self.fanout_seconds = time.monotonic() - started
        if model:
            self.index.set_answer(model, keys, limit, merged)
        return merged

    async def _ask(
        self, i: int, model: str, keys: list[int], instances: list[tuple[str, int]] | None, limit: int | None
    ) -> tuple[Answer, float]:
        health = self.shards[i]
        todo = self._to_reconcile.pop(i, None)
        query = Query(model, keys, instances, limit, health.since, health.replica, sorted(todo or ()))
        t0 = time.monotonic()
        msg = await self.nc.request(self.subjects[i], query_encoder.encode(query), timeout=self.timeout)
        return answer_decoder.decode(msg.data), time.monotonic() - t0

    def _down(self, health: ShardHealth, exc: BaseException) -> None:
        health.failures += 1
        reason = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
        if health.up or health.last_answer is None:
            self.log.warning("shard_not_answering", shard=health.index, shards=self.count, error=reason)
        health.up, health.reason = False, reason
        # Its instances are not ranked until it answers again, then with every state afresh.
        health.replica, health.since = "", 0
        get = self.registry.get
        for key in health.owned:
            state = get(key)
            if state is not None and not state.stale:
                state.stale = True

    def _apply(self, health: ShardHealth, answer: Answer, now: float) -> None:
        if not health.up:
            self.log.info("shard_answering", shard=health.index, shards=self.count, replica=answer.replica)
        health.up, health.ready, health.reason = True, answer.ready, answer.reason
        health.last_answer, health.instances, health.batches = now, answer.instances, answer.batches
        if answer.replica == health.replica and answer.version < health.since:
            return  # overtaken by a later answer already applied (concurrent requests): older states
        health.replica, health.since = answer.replica, answer.version
        registry, index = self.registry, self.index
        listed: set[InstanceKey] = set()
        for row in answer.states:
            key: InstanceKey = (row[0], row[1])
            listed.add(key)
            state = registry.get(key)
            if state is None or state.model != row[2] or state.block_size != row[3]:
                if state is not None:
                    self._forget(key)
                state = registry.add(key, row[2], row[3])
                index.add_instance(key, row[2])
            before = (state.repair.sync, state.repair.failed)
            apply_state(state, row, now)
            registry.set_endpoint(state, row[15])
            index.blocks[key] = (row[20][0], row[20][1], row[20][2], row[20][3])
            # Told as the shard's consumer told its ranker: a change of repair state, or blocks made
            # equal to the worker's (a snapshot, a restart) however briefly the repair lasted.
            reconciled = row[21] != self._reconciles.get(key, 0)
            self._reconciles[key] = row[21]
            if reconciled or (state.repair.sync, state.repair.failed) != before:
                for ranker in self.rankers:
                    ranker.sync_changed(state, reconciled)
        gone: list[InstanceKey] = [(w, r) for w, r in answer.removed]
        if answer.full:
            gone += [k for k in health.owned if k not in listed]
        for key in gone:
            self._forget(key)
        health.owned -= set(gone)
        health.owned |= listed
        for model, instance, rows in answer.samples:
            self.calibrator.add(model, rows, instance)

    def _forget(self, key: InstanceKey) -> None:
        self._reconciles.pop(key, None)
        if self.registry.remove(key) is not None:
            self.index.drop_instance(key)
            for ranker in self.rankers:
                ranker.forget(key)


class FrontServicer(KvIndexServicer):
    """The gRPC service of a front: each call that reads the index asks the shards first."""

    front: ShardFront
    # The prompt the last prefetch resolved, with its request (reused by the call it was made for).
    _resolved: tuple[Any, Any] | None = None

    def bind(self, front: ShardFront) -> None:
        self.front = front

    async def _prefetch(self, request: Any, candidates: bool = True) -> None:
        if request.model and not self.registry.block_size(request.model):
            # A model whose first instances joined since the last refresh: its block size (the
            # prompt's keys) comes with their states.
            await self.front.fetch("", [], None, None)
        try:
            prompt = self.resolve(request)
        except BadRequest:
            return  # the call itself reports it
        if not prompt.keys:
            return
        limit: int | None = hit_limit(prompt.tokens)
        if isinstance(request, pb.LookupRequest) and not (request.token_ids or prompt.token_ids is not None):
            limit = None
        await self.front.fetch(request.model, prompt.keys, None, limit)
        self._resolved = (request, prompt)

    def resolve(self, request: Any) -> Any:
        # The prompt resolved by the prefetch (the same request object): its keys are the ones the
        # shards answered for, and tokenizing twice would cost as much as the rest of a Score.
        cached = getattr(self, "_resolved", None)
        if cached is not None and cached[0] is request:
            return cached[1]
        return super().resolve(request)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        await self._prefetch(request)
        try:
            return await super().Score(request, context)
        finally:
            self._resolved = None

    async def ScoreStream(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async def fetched() -> Any:
            async for request in requests:
                if isinstance(request, pb.ScoreRequest):
                    await self._prefetch(request)
                yield request

        try:
            async for response in super().ScoreStream(fetched(), context):
                yield response
        finally:
            self._resolved = None

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse | bytes:
        await self._prefetch(request)
        try:
            return await super().Lookup(request, context)
        finally:
            self._resolved = None

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> Any:
        # A report is compared with what the instance holds now: its shard is asked for that.
        report = release_report(request)
        wanted = request.request_id and report is not None and not report.empty()
        entry = self.ranker.decisions.ledger.get(request.request_id) if wanted else None
        p = None if entry is None else entry.prediction
        if p is not None and p.keys:
            await self.front.fetch(p.model, p.keys, [p.instance], hit_limit(p.prompt_tokens))
        return await super().Release(request, context)


class ShardCollector(Collector):
    """kvindex_shard_* (a front's view of each shard)."""

    def __init__(self, front: ShardFront) -> None:
        self.front = front

    def collect(self) -> Iterator[Any]:
        now = time.monotonic()
        front = self.front

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvindex_shard_{name}", doc, labels=["shard"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvindex_shard_{name}", doc, labels=["shard"])

        up = gauge("up", "1 if the shard answered the front's last query")
        ready = gauge("ready", "1 if the shard reports itself ready")
        instances = gauge("instances", "Instances the shard owns")
        lag = gauge(
            "answer_age_seconds", "Seconds since the shard's last answer (its lag, seen from the front)"
        )
        rtt = gauge("rtt_seconds", "Round trip of the last query to the shard")
        batches = counter("batches", "Event batches the shard has applied (as it last reported)")
        failures = counter("failures", "Queries the shard did not answer in time")
        queries = counter("queries", "Queries sent to the shard")
        for s in front.shards:
            label = [f"{s.index}/{front.count}"]
            up.add_metric(label, float(s.up))
            ready.add_metric(label, float(s.ready))
            instances.add_metric(label, s.instances)
            lag.add_metric(label, -1.0 if s.last_answer is None else now - s.last_answer)
            rtt.add_metric(label, s.rtt)
            batches.add_metric(label, s.batches)
            failures.add_metric(label, s.failures)
            queries.add_metric(label, s.queries)
        fanout = GaugeMetricFamily(
            "kvindex_shard_fanout_seconds", "Wall time of the last fan-out to the shards"
        )
        fanout.add_metric([], front.fanout_seconds)
        yield from (up, ready, instances, lag, rtt, batches, failures, queries, fanout)
