"""Routing state shared between index replicas: what this replica decides goes out, what the others
decide comes in and is applied as if decided here.

Transport-free (kvindex/routing_sync/nats_link.py moves the bytes), so tests and benchmarks can
drive two routers through it directly.

- Out: the router tells ``committed``/``released`` (it is the router's ``observer``). Ops queue up
  (bounded) and ``take`` packs them into messages in decision order; the link publishes them as soon
  as the event loop is free, so a burst coalesces into few messages without a timer.
- In: ``receive`` decodes strictly and applies each op with the local router's own structures and
  limits: a commit enters the in-flight ledger (same TTL and size cap as local ones), adds the
  prompt's speculative keys (the sender's TTL) and runs the policy's ``on_commit`` (the prefix heat
  of ``ttft``, the trees of ``cache_aware``, ...); a release releases. Nothing received is published
  again.
- Releases may overtake the commit they refer to (a router may commit through one replica and
  release through another, and messages of two senders are not ordered): releases are remembered
  for a while (bounded), and a commit arriving after its request finished does not enter the ledger.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import time
from bisect import bisect_left
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from kvindex.routing_sync.messages import (
    MAX_KEYS,
    MAX_OPS,
    MAX_REQUEST_ID,
    MAX_SPEC_TTL,
    SYNC_VERSION,
    CommitOp,
    Op,
    ReleaseOp,
    RoutingMessage,
    decode,
    encode,
    header,
    op_size,
)
from kvindex.scoring.base import DECODE_ROLE, PREFILL_ROLE, Candidate, Policy, RouteRequest
from kvindex.scoring.ledger import FINISHED, PREFILL
from kvindex.scoring.ranker import Ranker
from kvindex.wire.errors import WireError
from kvindex.wire.subjects import WORKER_ID_RE

DELAY_BUCKETS = (
    0.00005,
    0.0001,
    0.0002,
    0.0003,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


@dataclass
class SyncConfig:
    enabled: bool | None = None  # None: on with an external NATS (serve --nats), off with the embedded one
    replica_id: str = ""  # "": default_replica_id()
    max_pending_ops: int = 100_000  # queued for publishing (NATS slow or away); beyond: dropped, counted
    max_message_bytes: int = 512 * 1024  # also at most half the server's max_payload
    release_memory: float = 600.0  # seconds a release is remembered for a commit that arrives late
    max_releases: int = 200_000
    max_peers: int = 1024


_made = itertools.count(1)
_last_epoch = 0


def _new_epoch() -> int:
    """Unix time in µs, distinct for every RoutingSync of this process."""
    global _last_epoch
    _last_epoch = max(time.time_ns() // 1000, _last_epoch + 1)
    return _last_epoch


def default_replica_id() -> str:
    """hostname-pid, reduced to the subject-token alphabet (a pod name in Kubernetes); a second
    service in the same process (tests, benchmarks) gets hostname-pid-2, and so on."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()).strip("-")[:100] or "kvindex"
    n = next(_made)
    return f"{host}-{os.getpid()}" + (f"-{n}" if n > 1 else "")


def check_replica_id(replica_id: str) -> str:
    if not WORKER_ID_RE.fullmatch(replica_id):
        raise ValueError(
            f"replica id {replica_id!r} must match [A-Za-z0-9_-]{{1,128}} (a NATS subject token)"
        )
    return replica_id


class DelayHistogram:
    """Seconds from a decision on another replica (the message's ``ts``) to applied here. Plain counts
    (no lock): bumped once per message. Sender and receiver clocks must agree for it to mean
    anything across hosts."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DELAY_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DELAY_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds


@dataclass
class _Peer:
    seq: int
    seen: float


class RoutingSync:
    def __init__(
        self,
        ranker: Ranker,
        config: SyncConfig | None = None,
        wall: Callable[[], float] = time.time,
        log: Any = None,
    ) -> None:
        self.ranker = ranker
        self.config = config or SyncConfig()
        self.replica_id = check_replica_id(self.config.replica_id or default_replica_id())
        self.epoch = _new_epoch()
        self.wall = wall
        self.log = log or structlog.get_logger("kvindex.routing_sync")
        self.max_message_bytes = self.config.max_message_bytes
        self.wake: Callable[[], None] | None = None  # set by the link: called when ops are queued
        self._seq = 0
        self._pending: deque[tuple[Op, float]] = deque()  # (op, wall time decided)
        # request id -> (phase, until, who released it: a sender's (replica, epoch), None for here)
        self._released: OrderedDict[str, tuple[str, float, tuple[str, int] | None]] = OrderedDict()
        self._peers: OrderedDict[tuple[str, int], _Peer] = OrderedDict()
        self._logged: dict[tuple[str, str], float] = {}
        # counters (read by the Prometheus collector)
        self.published: Counter[str] = Counter()  # ops by type
        self.messages_published = 0
        self.applied: Counter[str] = Counter()  # ops by type
        self.messages_applied = 0
        self.dropped: Counter[str] = Counter()  # ops (or messages, for "lost") by reason
        self.rejects: Counter[str] = Counter()  # messages by wire reason
        self.truncated = 0  # commits whose keys were cut to MAX_KEYS
        self.delay = DelayHistogram()

    # -- out: the router's observer -------------------------------------------------------------

    def committed(self, request: RouteRequest, candidate: Candidate, policy: Policy) -> None:
        self._released.pop(request.request_id, None)  # committed again after a release (moved)
        if len(request.request_id) > MAX_REQUEST_ID:
            self.dropped["request_id_too_long"] += 1
            return
        keys = request.keys
        if len(keys) > MAX_KEYS:  # a prefix of the chain is still a valid prefix to expect
            keys = keys[:MAX_KEYS]
            self.truncated += 1
        worker, dp_rank = candidate.state.key
        ttl = min(float(policy.speculative_ttl), MAX_SPEC_TTL)
        op = CommitOp(
            request.request_id,
            request.model,
            worker,
            dp_rank,
            request.block_size,
            request.prompt_tokens,
            0 if request.role == DECODE_ROLE else candidate.miss_tokens,  # as Ranker._commit
            policy.name,
            DECODE_ROLE if request.role == DECODE_ROLE else PREFILL_ROLE,
            ttl,
            list(keys),  # speculative keys, and what policies remember (ttft heat: the home block)
        )
        self._queue(op)

    def released(self, request_id: str, phase: str) -> None:
        self._remember_release(request_id, phase, None)
        if len(request_id) > MAX_REQUEST_ID:
            self.dropped["request_id_too_long"] += 1
            return
        self._queue(ReleaseOp(request_id, phase))  # type: ignore[arg-type]

    def _queue(self, op: Op) -> None:
        if len(self._pending) >= self.config.max_pending_ops:
            self.dropped["backlog"] += 1
            return
        self._pending.append((op, self.wall()))
        if self.wake is not None and len(self._pending) == 1:
            self.wake()

    def pending(self) -> int:
        return len(self._pending)

    def take(self) -> tuple[bytes, int] | None:
        """The next message to publish (as many queued ops as fit) and its op count; None when
        nothing is queued."""
        pending = self._pending
        if not pending:
            return None
        ops: list[Op] = []
        size = 100
        oldest = pending[0][1]
        while pending and len(ops) < MAX_OPS:
            op = pending[0][0]
            n = op_size(op)
            if ops and size + n > self.max_message_bytes:
                break
            pending.popleft()
            ops.append(op)
            size += n
        self._seq += 1
        payload = encode(RoutingMessage(SYNC_VERSION, self.replica_id, self.epoch, self._seq, oldest, ops))
        for op in ops:
            self.published["commit" if isinstance(op, CommitOp) else "release"] += 1
        self.messages_published += 1
        return payload, len(ops)

    def publish_failed(self, n_ops: int) -> None:
        """A message taken could not be published: its ops are lost (best effort), and the peers
        will see a hole in ``seq``."""
        self.dropped["publish_error"] += n_ops

    # -- in -------------------------------------------------------------------------------------

    def receive(self, subject_replica: str, payload: bytes) -> bool:
        """Apply another replica's message. False when it was our own echo or was rejected (counted,
        logged); nothing a message contains raises out of here."""
        try:
            head = header(payload)
            if head.replica == self.replica_id and head.epoch == self.epoch:
                return False  # our own message, already applied when decided
            msg = decode(payload, subject_replica)
        except WireError as exc:
            self.rejects[exc.reason] += 1
            self._log_once(subject_replica, exc.reason, "routing_sync_rejected", error=exc.message)
            return False
        if msg.replica == self.replica_id:
            self._log_once(msg.replica, "id", "routing_sync_replica_id_shared", epoch=msg.epoch)
        self._track(msg)
        for op in msg.ops:
            try:
                if isinstance(op, CommitOp):
                    self._apply_commit(op, (msg.replica, msg.epoch))
                else:
                    self._apply_release(op, (msg.replica, msg.epoch))
            except Exception as exc:  # a bug, not input: keep the rest of the message and the service
                self.dropped["apply_error"] += 1
                self._log_once(msg.replica, "apply", "routing_sync_apply_failed", error=repr(exc))
        self.messages_applied += 1
        self.delay.observe(max(0.0, self.wall() - msg.ts))
        return True

    def _apply_commit(self, op: CommitOp, sender: tuple[str, int]) -> None:
        ranker = self.ranker
        instance = (op.worker, op.dp_rank)
        request = RouteRequest(op.model, op.keys, op.prompt_tokens, op.block_size, op.id, op.role)
        gone = None
        if op.id:
            gone = self._released.get(op.id)
            if gone is not None and gone[2] == sender:
                # Released, then committed again by the same replica (an entry moved to the instance
                # that served): one sender's messages arrive in order, so this commit is the newer.
                del self._released[op.id]
                gone = None
            if gone is not None and gone[0] == FINISHED:
                self.dropped["finished_before_commit"] += 1  # its heat and keys still count
            else:
                work = ranker.prefill_work_ms(op.model, instance, op.miss_tokens, op.prompt_tokens)
                entry = ranker.ledger.commit(
                    op.id, instance, op.model, op.prompt_tokens, op.miss_tokens, work
                )
                if op.spec_ttl > 0 and op.keys:
                    entry.keys = op.keys
        if op.spec_ttl > 0 and op.keys:
            ranker.decisions.expect(instance, request, op.spec_ttl)
        if gone is not None:  # released here before the commit came: its keys are settled already
            if gone[0] == FINISHED:
                ranker.speculative.settle(instance, op.keys, ranker.clock() + ranker.config.speculative_grace)
            else:
                ranker.decisions.end(op.id, PREFILL)
        state = ranker.registry.get(instance)
        if state is not None and state.model == op.model:  # else only the ledger and keys above
            if state.approximate and op.keys:  # an engine without KV events: its cache is predicted
                ranker.predicted.on_commit(state, op.keys)
            policy = ranker.policies.get(op.policy)
            if policy is not None:
                (cand,) = ranker.candidates(request, [state], 0.0)
                policy.on_commit(request, cand, ranker.context)
        self.applied["commit"] += 1

    def _apply_release(self, op: ReleaseOp, sender: tuple[str, int]) -> None:
        self._remember_release(op.id, op.phase, sender)
        self.ranker.decisions.end(op.id, op.phase)
        self.applied["release"] += 1

    def _remember_release(self, request_id: str, phase: str, by: tuple[str, int] | None) -> None:
        released = self._released
        now = self.wall()
        if request_id in released:
            if released[request_id][0] == FINISHED:
                return
            del released[request_id]
        released[request_id] = (phase, now + self.config.release_memory, by)
        while released:
            first = next(iter(released.values()))
            if first[1] > now and len(released) <= self.config.max_releases:
                break
            released.popitem(last=False)

    def _track(self, msg: RoutingMessage) -> None:
        key = (msg.replica, msg.epoch)
        now = self.wall()
        peer = self._peers.get(key)
        if peer is None:
            self._peers[key] = _Peer(msg.seq, now)
            if len(self._peers) > self.config.max_peers:
                self._peers.popitem(last=False)
            self.log.info("routing_sync_peer", replica=msg.replica, epoch=msg.epoch)
            return
        if msg.seq > peer.seq + 1:
            self.dropped["lost"] += msg.seq - peer.seq - 1
        peer.seq = max(peer.seq, msg.seq)
        peer.seen = now
        self._peers.move_to_end(key)

    def peers(self, within: float = 60.0) -> int:
        """Other replicas heard from in the last ``within`` seconds."""
        now = self.wall()
        peers = list(self._peers.items())  # one C-level copy: scrapes run on another thread
        return len({r for (r, _), p in peers if now - p.seen <= within})

    def _log_once(self, replica: str, what: str, event: str, **fields: Any) -> None:
        """At most once a minute per (replica, what): a flood must not flood the logs."""
        now = time.monotonic()
        key = (replica, what)
        if now - self._logged.get(key, -1e9) < 60.0:
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[key] = now
        self.log.warning(event, replica=replica, **fields)
