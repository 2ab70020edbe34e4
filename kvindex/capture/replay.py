"""Replay: rebuild the index from an event log by running the service's own Consumer and Ranker.

Nothing here re-implements ingestion. Records are handed to the very methods the live service
called, in the same order, with the registry's clock set to the record's time:

- ``msg`` -> ``Consumer.on_events`` / ``on_heartbeat`` (decode, sequence, apply, decide repairs);
- ``replay_reply`` / ``replay_failed`` / ``snapshot`` -> the repair machine's ``on_replay`` /
  ``on_replay_failed`` / ``on_snapshot`` (the answers the live repairer got, byte for byte);
- ``timer`` -> ``Consumer.mark_stale`` / ``forget``, the machine's ``reconcile`` / ``give_up`` (the
  live timers' decisions);
- ``route`` -> ``Ranker.commit`` / ``release`` (the live routing state changes).

The consumer's repair requests go to ``LoggedRepair``, which does nothing: the answers are further
down the log. A log from ``kvindex capture`` has no answers, so it is replayed with ``NoRepair``
(holes counted and accepted) and liveness is simulated with the service's own sweep.

Time is virtual: ``VirtualClock`` returns the current record's ``mono``, so first-seen and
heartbeat times, heartbeat ages, repair durations and ledger ages are those of the live service.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from kvindex.api.errors import BadRequest
from kvindex.api.methods import METHODS, RELEASE
from kvindex.api.servicer import KvIndexServicer, release_report
from kvindex.capture import records as R
from kvindex.capture.digest import state_digest
from kvindex.capture.format import LogError, LogReader
from kvindex.core import CoreConfig, build_core
from kvindex.fleet.liveness import LivenessConfig, sweep
from kvindex.fleet.registry import instance_id
from kvindex.ingest.limits import limits_from_meta
from kvindex.instance import InstanceKey
from kvindex.repair.machine import SNAPSHOT
from kvindex.scoring.base import DECODE_ROLE, RouteRequest, prompt_length
from kvindex.scoring.costs import cost_config_of
from kvindex.scoring.ranker import RankerConfig
from kvindex.tokenize import Tokenizers
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.schema import TIER_NAMES
from kvindex.wire.subjects import EVENTS, HEARTBEAT, Subjects

log = structlog.get_logger("kvindex.replay")


class VirtualClock:
    """The registry's (and so the router's) clock during a replay: the time of the record being
    applied, or of ``--until``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class LoggedRepair:
    """RepairScheduler for logs with recorded answers: requests are only counted, the answers
    follow in the log."""

    def __init__(self) -> None:
        self.replays = 0
        self.snapshots = 0

    def request_replay(self, instance: InstanceKey, epoch: int, first: int, last: int) -> None:
        self.replays += 1

    def request_snapshot(self, instance: InstanceKey, cause: str) -> None:
        self.snapshots += 1


# -- timeline ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Moment:
    wall: float
    since_start: float
    instance: str
    what: str
    text: str
    notable: bool
    offset: str  # "segment:byte offset" of the record that caused it
    repeat: bool = False  # same instance and kind as one less than REPEAT_WINDOW ago

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall": self.wall,
            "since_start": round(self.since_start, 6),
            "instance": self.instance,
            "what": self.what,
            "text": self.text,
            "notable": self.notable,
            "offset": self.offset,
            "repeat": self.repeat,
        }


# Symptoms that recur while one cause lasts (a hole accepted without repair drifts on every
# heartbeat): the same kind for the same instance within REPEAT_WINDOW seconds (log time) of the last
# one is a repeat, shown by --timeline all only. Gaps, epochs, snapshots, stale... always show.
REPEAT_WINDOW = 10.0
REPEATING = frozenset({"drift", "snapshot?", "replay?", "hole kept", "rejected", "overflow", "snapshot!"})


def _fmt_event(event: str, kw: dict[str, Any], replayer: Replayer) -> tuple[str, str, bool] | None:
    """(what, text, notable) for a consumer log event, None for events the timeline ignores."""
    if event == "instance_joined":
        state = replayer.registry.get((kw["worker"], kw["dp_rank"]))
        epoch = state.epoch if state is not None else "?"
        return "joined", f"model {kw['model']!r}, block size {kw['block_size']}, epoch {epoch}", True
    if event == "sequence_gap":
        return (
            "gap",
            f"seq {kw['missing_from']}..{kw['missing_to']} missing ({kw['missing']} batches, {kw['why']})",
            True,
        )
    if event == "worker_restarted":
        return (
            "epoch",
            f"restart: epoch {kw['old_epoch']} -> {kw['new_epoch']}, {kw['dropped_blocks']} blocks dropped"
            f" ({kw['why']})",
            True,
        )
    if event == "repair_replay":
        return "replay?", f"replay of seq {kw['first']}..{kw['last']} requested ({kw['cause']})", True
    if event == "repair_snapshot":
        cause = kw["cause"]
        return "snapshot?", f"snapshot requested ({cause})", cause != "periodic"
    if event == "snapshot_diff":
        return "snapshot", f"snapshot at seq {kw['seq']} changed +{kw['added']} -{kw['removed']} blocks", True
    if event == "repaired":
        cursor = replayer.consumer.sequencer.cursor((kw["worker"], kw["dp_rank"]))
        routine = cursor is not None and cursor.cause == "periodic"  # a check, not a repair
        return "in sync", f"in sync at seq {kw['applied']} after {kw['seconds']}s", not routine
    if event == "repair_deferred":
        return "hole kept", f"hole accepted after {kw['rounds']} repair rounds", True
    if event == "digest_drift":
        return "drift", f"heartbeat digest differs from the index at seq {kw['seq']}", True
    if event == "instance_stale":
        return "stale", "no heartbeat: not ranked", True
    if event == "instance_alive_again":
        return "alive", "heartbeat again: ranked", True
    if event == "instance_forgotten":
        return "forgotten", f"silent too long: {kw['dropped_blocks']} blocks dropped", True
    if event == "message_rejected":
        return "rejected", f"{kw['reason']}: {kw.get('error', '')}", True
    if event == "repair_buffer_overflow":
        return "overflow", "repair buffer full: held batches dropped", True
    return None


class TimelineLog:
    """Stands in for the consumer's structlog logger: its log events become timeline moments."""

    def __init__(self, replayer: Replayer) -> None:
        self._r = replayer

    def _event(self, event: str, **kw: Any) -> None:
        formatted = _fmt_event(event, kw, self._r)
        if formatted is None:
            return
        what, text, notable = formatted
        worker, rank = kw.get("worker"), kw.get("dp_rank")
        inst = f"{worker}/{rank}" if worker is not None and rank is not None else str(worker or "")
        self._r.moment(inst, what, text, notable)

    info = warning = error = debug = _event

    def bind(self, **_: Any) -> TimelineLog:
        return self


# -- the replayer --------------------------------------------------------------------------------


@dataclass
class Divergence:
    offset: str
    live: str
    replayed: str


@dataclass
class PickDifference:
    offset: str
    request_id: str
    live: str
    replayed: str


@dataclass
class QueryResult:
    name: str
    request: dict[str, Any]
    response: pb.ScoreResponse | None
    error: str = ""
    # The ranking explained (the Explain RPC's answer: per instance its state and the rest of its
    # estimate, and why the first won); ``response`` is its ranking.
    explanation: pb.ExplainResponse | None = None


class Replayer:
    """The service's consumer, index, registry and router, driven by log records."""

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        on_moment: Callable[[Moment], None] | None = None,
        keep_moments: int = 100_000,
    ) -> None:
        self.meta = meta
        self.source = meta.get("source", R.SOURCE_CAPTURE)
        self.exact = self.source == R.SOURCE_SERVE
        self.prefix = meta.get("prefix", "kvindex")
        self.start_mono = float(meta.get("created_mono", 0.0))
        self.start_wall = float(meta.get("created_wall", 0.0))
        self.clock = VirtualClock(self.start_mono)
        self.wall = self.start_wall
        self.repair = logged = LoggedRepair() if self.exact else None
        router_meta = meta.get("router") or {}
        config = RankerConfig()
        config.default_policy = router_meta.get("default_policy", config.default_policy)
        config.seed = int(router_meta.get("seed", config.seed))
        config.pick = str(router_meta.get("pick", config.pick))
        config.temperature = float(router_meta.get("temperature", config.temperature))
        config.warmup = float(router_meta.get("warmup", config.warmup))
        config.costs = cost_config_of(router_meta.get("costs"))  # serve --cost, --no-calibration
        self.core = build_core(
            CoreConfig(
                clock=self.clock,
                subjects=Subjects(self.prefix),
                ingest_limits=limits_from_meta(meta.get("limits")),
                # The answers come from the log (applied to the consumer's machine), not from it.
                repair=None if logged is None else lambda _machine: logged,
                consumer_log=TimelineLog(self),
                ranker=config,
                # None: the reconciliations degraded instances asked for live are replayed from
                # their timer records.
                on_degraded=None,
            )
        )
        core = self.core
        self.index, self.registry, self.counters = core.index, core.registry, core.counters
        self.consumer, self.calibrator, self.ranker = core.consumer, core.calibrator, core.ranker
        # No tokenizer: recorded prompts are block keys.
        self.servicer = KvIndexServicer(
            self.index, self.registry, self.counters, None, self.ranker, Tokenizers()
        )
        repair = meta.get("repair") or {}
        defaults = LivenessConfig()  # what the service used unless the log says otherwise
        self.stale_after = float(repair.get("stale_after", defaults.stale_after))
        self.forget_after = float(repair.get("forget_after", defaults.forget_after))
        self._tick = defaults.tick
        self._next_sweep = self.start_mono
        self._events_head = f"{self.prefix}.{EVENTS}."
        self._heartbeat_head = f"{self.prefix}.{HEARTBEAT}."
        self.on_moment = on_moment
        self.keep_moments = keep_moments
        self.moments: list[Moment] = []
        self.moments_total = 0
        self.repeats = 0
        self._last_moment: dict[tuple[str, str], float] = {}
        self.records = 0
        self.by_kind: dict[str, int] = {}
        self.first_wall: float | None = None
        self.last_mono = self.start_mono
        self.checks_ok = 0
        self.divergences: list[Divergence] = []
        self.closed = ""
        self.unknown = 0
        self.exceptions: list[tuple[str, str, str]] = []  # (offset, error, traceback)
        self.where = ""
        self.watch_request = ""  # request id whose live ranking to reconstruct (see route())
        # Re-rank every recorded Score (with its recorded pick and seed) before applying its commit,
        # and compare the pick with the live one (``kvindex replay --check-picks``).
        self.check_picks = False
        self.picks_checked = 0
        self.picks_same = 0
        self.pick_differences: list[PickDifference] = []
        self.watched: QueryResult | None = None

    # -- time ---------------------------------------------------------------------------------

    def mono_at(self, wall: float) -> float:
        """The service's monotonic time at Unix time ``wall`` (from the last record's pair)."""
        return self.last_mono + (wall - self.wall)

    def advance_to(self, wall: float) -> None:
        """Move the clock to ``wall`` without a record (``--until`` between records)."""
        mono = self.mono_at(wall)
        if mono > self.clock.now:
            self.clock.now = mono
            self.wall = wall
            self.last_mono = mono
            if not self.exact:
                self._sweep(mono)

    def moment(self, instance: str, what: str, text: str, notable: bool = True) -> None:
        repeat = False
        if what in REPEATING:
            last = self._last_moment.get((instance, what))
            repeat = last is not None and self.wall - last < REPEAT_WINDOW
            self._last_moment[(instance, what)] = self.wall
        m = Moment(self.wall, self.wall - self.start_wall, instance, what, text, notable, self.where, repeat)
        self.moments_total += 1
        self.repeats += repeat
        if len(self.moments) < self.keep_moments:
            self.moments.append(m)
        if self.on_moment is not None:
            self.on_moment(m)

    # -- applying records -----------------------------------------------------------------------

    def apply(self, record: list[Any], where: str = "") -> None:
        kind = record[0]
        self.where = where
        self.records += 1
        name = R.NAMES.get(kind, f"kind{kind}")
        self.by_kind[name] = self.by_kind.get(name, 0) + 1
        if len(record) < 3:
            self.unknown += 1
            return
        mono, wall = float(record[1]), float(record[2])
        if not self.exact:
            self._sweep(mono)
        self.clock.now = mono
        self.last_mono = mono
        self.wall = wall
        if self.first_wall is None:
            self.first_wall = wall
        handler = self._handlers.get(kind)
        if handler is None:
            self.unknown += 1
            return
        try:
            handler(self, record)
        except Exception as exc:
            # Live, nats-py and the repairer log such an exception and carry on: so does the replay,
            # saying which record raised it (reproducing that is often why one replays).
            self.exceptions.append((where, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            self.moment("", "EXCEPTION", f"{type(exc).__name__}: {exc} (record {name} at {where})", True)

    def _msg(self, record: list[Any]) -> None:
        subject, payload = record[3], record[4]
        if subject.startswith(self._events_head):
            self.consumer.on_events(subject, payload)
        elif subject.startswith(self._heartbeat_head):
            self.consumer.on_heartbeat(subject, payload)

    def _replay_reply(self, record: list[Any]) -> None:
        worker, rank, epoch, status, payloads = record[3:8]
        if status != "ok":
            self.moment(f"{worker}/{rank}", "replay!", f"replay answered {status!r}", True)
        else:
            self.moment(f"{worker}/{rank}", "replay", f"replay answered with {len(payloads)} batches", False)
        self.consumer.repairs.on_replay((worker, rank), epoch, status, payloads)

    def _replay_failed(self, record: list[Any]) -> None:
        worker, rank, epoch, why = record[3:7]
        self.moment(f"{worker}/{rank}", "replay!", f"replay request failed: {why}", True)
        self.consumer.repairs.on_replay_failed((worker, rank), epoch, why)

    def _snapshot(self, record: list[Any]) -> None:
        worker, rank, epoch, seq, tiers = record[3:8]
        key = (worker, rank)
        snap = Snapshot(epoch, seq, {int(t): R.unpack_keys(b) for t, b in tiers.items()})
        cursor = self.consumer.sequencer.cursor(key)
        cause = cursor.cause if cursor is not None and cursor.repairing == SNAPSHOT else ""
        n = sum(len(k) for k in snap.tiers.values())
        self.moment(
            f"{worker}/{rank}",
            "snapshot",
            f"snapshot received: epoch {epoch} seq {seq}, {n} blocks ({cause or 'check'})",
            cause not in ("", "periodic"),
        )
        self.consumer.repairs.on_snapshot(key, snap)

    def _snapshot_failed(self, record: list[Any]) -> None:
        worker, rank, why = record[3:6]
        self.consumer.repairs.snapshot_failed((worker, rank), why)  # what NatsRepairer does before retrying
        self.moment(f"{worker}/{rank}", "snapshot!", f"snapshot request failed: {why} (retried)", True)

    def _timer(self, record: list[Any]) -> None:
        what, worker, rank, cause = record[3:7]
        key = (worker, rank)
        consumer = self.consumer
        if what == R.STALE:
            state = self.registry.get(key)
            if state is not None:
                consumer.mark_stale(state)
        elif what == R.FORGET:
            consumer.forget(key)
        elif what == R.RECONCILE:
            if cause != "periodic":
                self.moment(f"{worker}/{rank}", "reconcile", f"resynchronise ({cause})", True)
            consumer.repairs.reconcile(key, cause)
        elif what == R.GIVE_UP:
            consumer.repairs.give_up(key)
        else:
            self.unknown += 1

    def _flags(self, record: list[Any]) -> None:
        flags = record[3]
        self.consumer.set_heartbeat_order(
            drive_repairs=bool(flags.get("heartbeat_repairs", True)),
            in_order=bool(flags.get("status_in_order", True)),
        )

    def _check(self, record: list[Any]) -> None:
        live = record[3]
        mine = state_digest(self.consumer)
        if mine == live:
            self.checks_ok += 1
            return
        self.divergences.append(Divergence(self.where, live, mine))
        self.moment("", "DIVERGED", f"state digest {mine} but the live service had {live}", True)

    def _calibration(self, record: list[Any]) -> None:
        instances = record[4] if len(record) > 4 else {}  # (captures before per-instance fits: none)
        self.calibrator.load_snapshot({"models": record[3], "instances": instances})

    def _route(self, record: list[Any]) -> None:
        method, body, instance = record[3], record[4], record[5] if len(record) > 5 else ""
        recorded = METHODS[method]  # what the call changed, as kvindex/api/methods.py says
        req = recorded.request.FromString(body)
        if recorded.changes == RELEASE:
            self.ranker.release_reported(req.request_id, req.phase, release_report(req))
            return
        watched = self.watch_request and req.request_id == self.watch_request and self.watched is None
        if watched or (self.check_picks and method == "Score"):
            try:
                explained = self._explain_recorded(req, instance)
            except Exception as exc:  # the explanation must not cost the commit below
                explained = QueryResult(f"request {req.request_id}", {}, None, f"cannot re-rank: {exc!r}")
            if watched:
                self.watched = explained
            if self.check_picks and method == "Score":
                self._check_pick(req.request_id, instance, explained)
        worker, _, rank = instance.partition("/")
        try:
            block_size, keys = self.servicer.prompt_keys(req)
        except ValueError:
            return
        if not block_size or not rank.isdigit():
            return
        role = getattr(req, "role", "") or "prefill"
        route = RouteRequest(
            req.model, keys, prompt_length(req, block_size, keys), block_size, req.request_id, role
        )
        policy = "decode" if role == DECODE_ROLE else (getattr(req, "policy", "") or None)
        self.ranker.commit(route, (worker, int(rank)), policy)

    def _check_pick(self, request_id: str, instance: str, explained: QueryResult) -> None:
        """Whether the re-ranking, with the recorded pick and seed, picked the recorded instance."""
        response = explained.response
        picked = response.ranked[0].instance_id if response is not None and response.ranked else ""
        self.picks_checked += 1
        if picked == instance:
            self.picks_same += 1
            return
        self.pick_differences.append(PickDifference(self.where, request_id, instance, picked))
        self.moment(
            instance,
            "PICK",
            f"request {request_id}: re-ranked pick {picked or explained.error!r}, live {instance!r}",
            True,
        )

    def _explain_recorded(self, req: Any, instance: str) -> QueryResult:
        """The ranking the recorded request got, recomputed just before its commit."""
        fields = {
            f.name: v for f, v in req.ListFields() if f.name in pb.ScoreRequest.DESCRIPTOR.fields_by_name
        }
        for name in ("commit", "explain"):
            fields.pop(name, None)
        score = pb.ScoreRequest(**fields, explain=True)
        # Ranked as the live Score was (quiet=False: the policy's state moves on as it did live).
        result = self._score(score, f"request {req.request_id}", quiet=False)
        result.request["committed_live"] = instance
        return result

    _handlers: dict[int, Callable[[Replayer, list[Any]], None]] = {
        R.MSG: _msg,
        R.REPLAY_REPLY: _replay_reply,
        R.REPLAY_FAILED: _replay_failed,
        R.SNAPSHOT: _snapshot,
        R.SNAPSHOT_FAILED: _snapshot_failed,
        R.TIMER: _timer,
        R.FLAGS: _flags,
        R.CHECK: _check,
        R.CALIBRATION: _calibration,
        R.ROUTE: _route,
        R.CLOSE: lambda self, record: setattr(self, "closed", str(record[3])),
    }

    def _sweep(self, now: float) -> None:
        """Liveness for logs without recorded timers: the service's sweep, every tick of log time."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._tick
        stale, forget = sweep(self.registry.all(), now, self.stale_after, self.forget_after)
        for state in stale:
            self.consumer.mark_stale(state)
        for key in forget:
            self.consumer.forget(key)

    # -- queries --------------------------------------------------------------------------------

    def query(self, spec: dict[str, Any], name: str = "query") -> QueryResult:
        """Rank instances for a prompt as of now, with explain: ``spec`` has ``model`` and
        ``token_ids`` or ``block_keys``, optionally ``lora``, ``salt``, ``policy``, ``candidates``,
        ``top_k``, ``role``, ``prompt_tokens``, ``pick``, ``temperature``, ``pick_seed``."""
        allowed = {"model", "lora", "salt", "token_ids", "block_keys", "candidates", "top_k", "policy"}
        allowed |= {"role", "prompt_tokens", "pick", "temperature", "pick_seed"}
        unknown = sorted(set(spec) - allowed)
        if unknown:
            return QueryResult(name, spec, None, f"unknown field(s) {', '.join(unknown)}")
        try:
            request = pb.ScoreRequest(**spec, explain=True)
        except (TypeError, ValueError) as exc:
            return QueryResult(name, spec, None, f"bad query: {exc}")
        return self._score(request, name)

    def _score(self, request: pb.ScoreRequest, name: str, quiet: bool = True) -> QueryResult:
        """The ranking of ``request`` explained by the Explain RPC's own code (the servicer's
        ``explain_request``); ``quiet``: leaving the replayed router as it was."""
        from google.protobuf.json_format import MessageToDict

        spec = MessageToDict(request, preserving_proto_field_name=True)
        try:
            explanation = self.servicer.explain_request(request, quiet=quiet)
        except BadRequest as exc:
            return QueryResult(name, spec, None, str(exc))
        return QueryResult(name, spec, explanation.ranking, explanation=explanation)

    # -- results --------------------------------------------------------------------------------

    def digest(self) -> str:
        return state_digest(self.consumer)

    def summary(self) -> dict[str, Any]:
        now = self.clock()
        instances = []
        totals = [0, 0, 0, 0]
        for state in sorted(self.registry.all(), key=lambda s: (s.model, s.key)):
            blocks = self.index.block_counts(state.key)
            for t in range(4):
                totals[t] += blocks[t]
            cursor = self.consumer.sequencer.cursor(state.key)
            age = state.heartbeat_age(now)
            instances.append(
                {
                    "instance": state.instance_id,
                    "model": state.model,
                    "epoch": state.epoch,
                    "seq": cursor.applied if cursor is not None else state.last_seq,
                    "blocks": dict(zip(TIER_NAMES, blocks, strict=True)),
                    "sync": state.repair.sync,
                    "stale": state.stale,
                    "pool": state.is_pool,
                    "status_age_s": None if age is None else round(age, 3),
                    "gaps": state.gaps,
                    "restarts": state.restarts,
                    "held": len(cursor.buffer) if cursor is not None else 0,
                }
            )
        c = self.counters
        stats = self.index.stats()
        return {
            "source": self.source,
            "repairs": "recorded" if self.exact else "none (holes accepted, liveness simulated)",
            "records": self.records,
            "records_by_kind": dict(sorted(self.by_kind.items())),
            "from": self.first_wall,
            "to": self.wall,
            "instances": instances,
            "blocks": dict(zip(TIER_NAMES, totals, strict=True)),
            "distinct_blocks": dict(zip(TIER_NAMES, stats.distinct_blocks, strict=True)),
            "counters": {
                "batches_received": c.batches_received,
                "batches_applied": c.batches_applied,
                "duplicates": c.duplicates,
                "stale_epochs": c.stale_epochs,
                "gaps": c.gaps,
                "missing_batches": c.missing_batches,
                "restarts": c.restarts,
                "status_received": c.heartbeats_received,
                "rejects": dict(c.rejects),
                "replays_requested": c.replays_requested,
                "replays_ok": c.replays_ok,
                "replays_failed": dict(c.replays_failed),
                "snapshots_requested": dict(c.snapshots_requested),
                "snapshots_applied": c.snapshots_applied,
                "snapshots_failed": c.snapshots_failed,
                "drift_detected": c.drift_detected,
                "repairs_abandoned": c.repairs_abandoned,
                "stale_marked": c.stale_marked,
                "instances_forgotten": c.instances_forgotten,
            },
            "ledger": len(self.ranker.ledger),
            "checks": {"matched": self.checks_ok, "diverged": len(self.divergences)},
            "picks": {
                "checked": self.picks_checked,
                "same": self.picks_same,
                "differ": len(self.pick_differences),
            },
            "exceptions": [{"offset": o, "error": e} for o, e, _ in self.exceptions],
            "closed": self.closed,
            "digest": self.digest(),
        }


# -- driving a whole log -------------------------------------------------------------------------


@dataclass
class ReplayResult:
    replayer: Replayer
    reader: LogReader
    error: LogError | None = None
    stopped_at_until: bool = False
    queries: list[QueryResult] = field(default_factory=list)


class Driver:
    """Feeds a log's records to a Replayer up to ``until`` (Unix time), optionally paced."""

    def __init__(
        self,
        path: str,
        *,
        until: float | None = None,
        request: str = "",
        on_moment: Callable[[Moment], None] | None = None,
    ) -> None:
        self.reader = LogReader(path)
        self.replayer = Replayer(self.reader.meta, on_moment=on_moment)
        self.replayer.watch_request = request
        self.until = until
        self.request = request
        self.result = ReplayResult(self.replayer, self.reader)
        self._records = iter(self.reader)

    def step(self) -> float | None:
        """Apply the next record; its log time (mono), or None at the end (or at ``until``)."""
        r = self.replayer
        try:
            segment, offset, record = next(self._records)
        except StopIteration:
            self._finish()
            return None
        except LogError as exc:
            self.result.error = exc
            self._finish()
            return None
        if self.until is not None and len(record) > 2 and float(record[2]) > self.until:
            self.result.stopped_at_until = True
            self._finish()
            return None
        r.apply(record, f"{segment}:{offset}")
        if self.request and r.watched is not None:
            self.result.stopped_at_until = True
            self._finish()
            return None
        return r.last_mono

    def _finish(self) -> None:
        if self.until is not None and self.result.stopped_at_until:
            self.replayer.advance_to(self.until)
        self._records = iter(())

    def run(self, pace: float = 0.0, sleep: Callable[[float], Any] = time.sleep) -> ReplayResult:
        """Everything, as fast as possible (``pace`` 0) or ``pace`` times real time."""
        previous: float | None = None
        while (mono := self.step()) is not None:
            if pace > 0 and previous is not None and mono > previous:
                sleep((mono - previous) / pace)
            previous = mono
        return self.result


def replay(path: str, until: float | None = None) -> ReplayResult:
    """Replay a whole log (to ``until``) as fast as possible."""
    return Driver(path, until=until).run()


def instance_key(text: str) -> InstanceKey:
    worker, _, rank = text.partition("/")
    return (worker, int(rank or 0))


__all__ = [
    "Driver",
    "LoggedRepair",
    "Moment",
    "QueryResult",
    "ReplayResult",
    "Replayer",
    "VirtualClock",
    "instance_id",
    "instance_key",
    "replay",
]
