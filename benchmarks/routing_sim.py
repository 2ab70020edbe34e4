"""Trace-driven routing simulation: every policy on identical arrivals, judged by TTFT.

    .venv/bin/python benchmarks/routing_sim.py mooncake            # preset 1 (3 load levels)
    .venv/bin/python benchmarks/routing_sim.py mooncake --quick    # a slice of the trace
    .venv/bin/python benchmarks/routing_sim.py global-pool         # preset 2: local vs shared pool
    .venv/bin/python benchmarks/routing_sim.py loadaware           # preset 3: production-stack
    .venv/bin/python benchmarks/routing_sim.py llmd                # preset 4: llm-d's workload
    .venv/bin/python benchmarks/routing_sim.py fleet256            # preset 5: Mooncake on 256 instances
    .venv/bin/python benchmarks/routing_sim.py pd                  # preset 6: disaggregated prefill/decode
    .venv/bin/python benchmarks/routing_sim.py hybrid              # preset 7: a hybrid-attention fleet
    .venv/bin/python benchmarks/routing_sim.py hybrid-llmd         # preset 7b: the same on llm-d's workload
    .venv/bin/python benchmarks/routing_sim.py demo --policies ttft,round_robin   # make run's fleet and load
    .venv/bin/python benchmarks/routing_sim.py mooncake --trace PATH --instances 16 --policies ttft,dynamo

Virtual time, discrete events. The code under test is the real one, in process: simulated engines
(workers_shim/sim) publish through the real worker-side core (WorkerLog) into real wire bytes, which
reach the real consumer and index after a propagation delay (optionally lost, then repaired by replay
and snapshot answered from the workers' own logs); heartbeats carry load and prefill samples to the
real calibration; every arrival is routed by the real Ranker with the policy under test, committed,
and released at first token and at the end. So index freshness, heartbeat age and the policies'
own state all matter, as they would in production.

Outputs per policy: TTFT mean/p50/p90/p99, SLO goodput, prefix hit rate, prefill GPU-seconds,
busiest/idlest running-request ratio, max replicas of hot prefixes; a CSV and PNG plots in
benchmarks/out/. Deterministic for a seed.

Admission (kvindex/scoring/admission.py): the policy ``ttft+admit`` is ``ttft`` with the router's
admission in front (the same rule and queue as ``kvindex route`` and the ext_proc picker, in virtual
time): each request has a TTFT objective (its trace row's ``ttft_slo_ms``, else ``--slo`` or the
preset's), and is served, held in the router's queue, or shed. A second table gives every policy's
SLO goodput counted over all arrivals (a shed request is a missed one).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import itertools
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvindex.cli import check_policy_options, parse_policy_option
from kvindex.core import CoreConfig, build_core
from kvindex.keys import block_keys
from kvindex.repair.machine import RepairMachine
from kvindex.scoring.admission import (
    ADMIT,
    DEADLINE,
    QUEUE_FULL,
    SHED,
    UNATTAINABLE,
    AdmissionConfig,
    AdmissionQueue,
    Correction,
    Estimate,
    QueueEntry,
    deadline_of,
    judge,
)
from kvindex.scoring.base import RouteRequest
from kvindex.scoring.home import home_block
from kvindex.scoring.objectives import Objective
from kvindex.scoring.policies import POLICY_NAMES
from kvindex.scoring.ranker import Ranker, RankerConfig
from kvindex.wire import reconcile
from kvindex.wire.reconcile import Snapshot
from kvindex.wire.schema import TIER_BY_NAME
from kvtools.data import mooncake_trace
from workers_shim.publisher import WorkerLog
from workers_shim.sim import EngineConfig, SharedPool, SimEngine, SimRequest
from workers_shim.sim.hybrid import HybridSimEngine, OneGroupSink, layout_wire, new_engine
from workers_shim.sim.trace import mooncake_requests

ROOT = Path(__file__).resolve().parents[1]
TRACE = mooncake_trace()
OUT = ROOT / "benchmarks" / "out"
MODEL = "sim-model"
ADMIT_SUFFIX = "+admit"  # a policy name with it: that policy with admission in front
DEFAULT_POLICIES = (*POLICY_NAMES, "ttft" + ADMIT_SUFFIX)


# -- workloads ----------------------------------------------------------------------------------------


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 128_000, n, dtype=np.uint32)


def shared_prefix_groups(
    *,
    groups: int,
    prefix_tokens: int,
    users: int,
    question_tokens: int,
    output_tokens: int,
    qps: float,
    requests: int,
    block_size: int,
    seed: int,
) -> list[SimRequest]:
    """llm-d's benchmark shape: groups of users sharing a long prefix, each asking new questions."""
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_tokens) for _ in range(groups)]
    prefix_keys = [block_keys(p, block_size, MODEL) for p in prefixes]
    contexts = {(g, u): _tokens(rng, block_size * 4) for g in range(groups) for u in range(users)}
    out = []
    t = 0.0
    for i in range(requests):
        t += rng.exponential(1 / qps)
        g, u = int(rng.integers(groups)), int(rng.integers(users))
        tail = np.concatenate([contexts[g, u], _tokens(rng, question_tokens)])
        keys = prefix_keys[g] + block_keys(tail, block_size, MODEL, parent=prefix_keys[g][-1])
        out.append(SimRequest(f"q{i}", keys, prefix_tokens + len(tail), output_tokens, t, meta=g))
    return out


def zipf_prefixes(
    *,
    prefixes: int,
    prefix_tokens: int,
    zipf: float,
    suffix_tokens: int,
    output_tokens: int,
    qps: float,
    requests: int,
    block_size: int,
    seed: int,
) -> list[SimRequest]:
    """vLLM production-stack's load-aware experiment: prompts over Zipf-popular shared prefixes."""
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, prefixes + 1) ** zipf
    weights /= weights.sum()
    keys_of = [block_keys(_tokens(rng, prefix_tokens), block_size, MODEL) for _ in range(prefixes)]
    out = []
    t = 0.0
    for i in range(requests):
        t += rng.exponential(1 / qps)
        p = int(rng.choice(prefixes, p=weights))
        keys = keys_of[p] + block_keys(_tokens(rng, suffix_tokens), block_size, MODEL, parent=keys_of[p][-1])
        out.append(SimRequest(f"z{i}", keys, prefix_tokens + suffix_tokens, output_tokens, t, meta=p))
    return out


def sessions(
    *,
    sessions: int,
    turns: int,
    system_tokens: int,
    turn_tokens: int,
    answer_tokens: int,
    think_s: float,
    qps: float,
    block_size: int,
    seed: int,
) -> list[SimRequest]:
    """Multi-turn chats: each turn's prompt is the whole conversation so far plus a new question."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_tokens)
    out = []
    start = 0.0
    for s in range(sessions):
        start += rng.exponential(1 / qps)
        history = system
        t = start
        for turn in range(turns):
            history = np.concatenate([history, _tokens(rng, turn_tokens)])
            keys = block_keys(history, block_size, MODEL)
            out.append(SimRequest(f"s{s}t{turn}", keys, len(history), answer_tokens, t, meta=s))
            history = np.concatenate([history, _tokens(rng, answer_tokens)])
            t += think_s * (0.5 + rng.random())
    out.sort(key=lambda r: r.arrival)
    return out


# -- the simulated deployment ----------------------------------------------------------------------------


@dataclass
class Cluster:
    instances: int
    engine: dict[str, Any]  # EngineConfig.from_profile(**engine)
    pool_blocks: int = 0  # a shared Mooncake-store-like pool (tier "shared"), 0: none
    delay_s: float = 0.005  # worker -> index propagation delay of event batches and heartbeats
    loss: float = 0.0  # probability that a batch is lost on the way (the index repairs it)
    heartbeat_s: float = 0.5
    slo_s: float = 5.0  # TTFT objective for goodput
    # Score's top_k: > 0 ranks only the holders and the best few others (pruned, forced on at every
    # fleet size here so that the tables check it); 0 ranks every instance (--top-k 0).
    top_k: int = 4
    slo_margin: float = 0.0  # admission (policies "...+admit"): admit within objective x (1 + margin)
    # The pick after the ranking (kvindex/scoring/pick.py) and the warm-up ramp of new instances.
    pick: str = "best"
    temperature: float = 0.0
    warmup: float = 0.0
    # The last ``join_count`` instances join the fleet at ``join_at`` s (silent and unknown before).
    join_count: int = 0
    join_at: float = 0.0
    # Independent routers (each its own ledger, speculative keys and policy memory; no routing sync),
    # the arrivals dealt to them in turn: what herding looks like with several unsynchronised routers.
    routers: int = 1
    # Prefill/decode disaggregation (the pd preset): each instance's announced role, in order
    # (empty: every instance serves whole requests).
    roles: tuple[str, ...] = ()
    # A hybrid-attention fleet (engine "kv_groups"): what the index is told. "all": every KV-cache
    # group's events and the layout (kvindex's rule); "full": the full-attention group's events
    # only, as one full-attention cache (an index that follows one group: false residency).
    index_groups: str = "all"


@dataclass
class RunResult:
    policy: str
    label: str
    requests: int
    ttft: dict[str, float]
    goodput: float
    hit_rate: float
    prefill_gpu_s: float
    load_ratio: float
    max_replicas: int
    repairs: dict[str, int]
    wall_s: float
    ttfts: list[float] = field(default_factory=list, repr=False)
    # Every policy: arrivals, those that met their own objective (shed ones did not), the arrivals'
    # time span; with admission: how many were shed and how many waited in the router's queue.
    arrivals: int = 0
    slo_met: int = 0
    span_s: float = 0.0
    shed: int = 0
    queued: int = 0
    shed_reasons: dict[str, int] = field(default_factory=dict)
    # With a join: the new instances' share of the arrivals and the TTFT, per window after it.
    join: list[dict[str, float]] = field(default_factory=list)
    # Preset-specific measurements (pd: time per output token, share served in two steps;
    # hybrid: the router's promised hits against the engines').
    extra: dict[str, float] = field(default_factory=dict)
    # (TTFT the index estimated for the instance chosen, measured TTFT) per request, seconds.
    predicted: list[tuple[float, float]] = field(default_factory=list, repr=False)


class _SimRepair:
    """Answers the consumer's replay and snapshot requests from the workers' own logs, after a
    round trip, exactly as workers do over NATS."""

    def __init__(self, sim: Simulation, machine: RepairMachine) -> None:
        self.sim = sim
        self.machine = machine  # whose requests these are: the answers go back to it

    def request_replay(self, instance: tuple[str, int], epoch: int, first: int, last: int) -> None:
        log = self.sim.logs[instance[0]]
        answer = log.replay_messages(reconcile.replay_request(instance[1], epoch, first, last)) or []
        replies = [reconcile.decode_replay_reply(a) for a in answer]

        def deliver() -> None:
            payloads = [b for r in replies for b in r.batches]
            self.machine.on_replay(instance, epoch, replies[-1].status if replies else "timeout", payloads)

        self.sim.later(2 * self.sim.cluster.delay_s, deliver)

    def request_snapshot(self, instance: tuple[str, int], cause: str) -> None:
        log = self.sim.logs[instance[0]]
        sealed, parts = log.snapshot_messages()
        for subject, data in sealed:
            self.sim.send(subject, data)
        decoded = [reconcile.decode_snapshot_part(p) for p in parts]
        snap = Snapshot(decoded[0].epoch, decoded[0].seq)
        for part in decoded:
            for tier, keys in part.tiers.items():
                snap.tiers.setdefault(TIER_BY_NAME[tier], []).extend(keys)
        self.sim.later(2 * self.sim.cluster.delay_s, lambda: self.machine.on_snapshot(instance, snap))


class Simulation:
    def __init__(
        self,
        policy: str,
        requests: list[SimRequest],
        cluster: Cluster,
        seed: int,
        policy_options: dict[str, dict] | None = None,
    ) -> None:
        self.policy = policy
        self.requests = requests
        self.cluster = cluster
        self.now = 0.0
        self.rng = random.Random(seed)
        base = policy.removesuffix(ADMIT_SUFFIX)
        self.admission: AdmissionConfig | None = None
        if base != policy:
            self.admission = AdmissionConfig(margin=cluster.slo_margin)
        self.queue = AdmissionQueue(self.admission.max_queue if self.admission else 1)
        self.held: dict[int, SimRequest] = {}  # queue entry seq -> request
        self.shed: Counter[str] = Counter()
        self.queued = 0
        self._ticking = False
        self.correction = Correction()  # as the proxy: measured / estimated TTFT of what it served
        self._estimated: dict[str, tuple[float, float]] = {}  # request id -> (estimate ms, decided at)
        self.estimate_s: dict[str, float] = {}  # request id -> the chosen instance's estimated TTFT (plots)
        # The service's core in virtual time (router r seeded seed + r).
        self.core = build_core(
            CoreConfig(
                clock=self.clock,
                repair=lambda machine: _SimRepair(self, machine),
                ranker=RankerConfig(
                    default_policy=base,
                    seed=seed,
                    prune_min_instances=0,
                    pick=cluster.pick,
                    temperature=cluster.temperature,
                    warmup=cluster.warmup,
                ),
                rankers=cluster.routers,
                policy_options=policy_options,
            )
        )
        core = self.core
        self.index, self.registry, self.consumer = core.index, core.registry, core.consumer
        self.calibrator, self.rankers, self.ranker = core.calibrator, core.rankers, core.ranker
        self.ranker_of: dict[str, Ranker] = {}
        cfg = EngineConfig.from_profile(**cluster.engine)
        self.block_size = cfg.block_size
        self.logs: dict[str, WorkerLog] = {}
        self.pool: SharedPool | None = None
        if cluster.pool_blocks:
            pool_log = self._log("pool", {"shared": cluster.pool_blocks})
            self.pool = SharedPool(cluster.pool_blocks, sink=pool_log)
        self.engines: dict[str, SimEngine] = {}
        layout = cfg.layout()
        # Hybrid fleets, per request: the index's answer for the instance chosen and what that
        # engine would reuse at that moment (tokens).
        self.promised: dict[str, tuple[int, int]] | None = {} if layout is not None else None
        for i in range(cluster.instances):
            name = f"sim{i}"
            log = self._log(name, cfg.capacity())
            sink: Any = log
            if layout is not None:
                if cluster.index_groups == "all":
                    log.groups = layout_wire(cfg)
                else:  # the full-attention group's blocks as if they were the model's only cache
                    sink = OneGroupSink(log, layout.primary)  # type: ignore[arg-type]
            self.engines[name] = new_engine(name, cfg, sink=sink, pool=self.pool)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self.completions: dict[str, Any] = {}
        self._running_samples: dict[str, list[int]] = {n: [] for n in self.engines}
        self._hot: Counter[int] = Counter()
        self.max_replicas = 0
        names = list(self.engines)
        self.late = set(names[len(names) - cluster.join_count :]) if cluster.join_count else set()
        self.joined = not self.late
        self.routed: dict[str, tuple[float, str]] = {}  # request -> (arrival, instance)

    def clock(self) -> float:
        return self.now

    def _log(self, name: str, capacity: dict[str, int]) -> WorkerLog:
        roles = self.cluster.roles
        i = int(name[3:]) if name.startswith("sim") and name[3:].isdigit() else -1
        log = WorkerLog(
            worker=name,
            model=MODEL,
            block_size=self.block_size_for(name),
            epoch=1,
            capacity=capacity,
            clock=self.clock,
            # PD: roles and (fake) endpoints in the heartbeats, as real workers announce them.
            role=roles[i] if 0 <= i < len(roles) else None,
            endpoint=f"10.0.0.{i + 1}:8000" if roles and i >= 0 else None,
        )
        self.logs[name] = log
        return log

    def block_size_for(self, name: str) -> int:
        return EngineConfig.from_profile(**self.cluster.engine).block_size

    # -- message passing --------------------------------------------------------------------------

    def later(self, delay: float, action: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._events, (self.now + delay, self._n, action))

    def send(self, subject: str, data: bytes) -> None:
        if ".events." in subject and self.cluster.loss and self.rng.random() < self.cluster.loss:
            return
        on = self.consumer.on_events if ".events." in subject else self.consumer.on_heartbeat
        self.later(self.cluster.delay_s, lambda: on(subject, data))

    def _flush(self) -> None:
        for log in self.logs.values():
            if log._pending:
                for subject, data in log.seal():
                    self.send(subject, data)

    def _join(self) -> None:
        """The late instances announce themselves (their first heartbeat): now routable."""
        self.joined = True
        for name in self.late:
            for subject, data in self.logs[name].heartbeat_messages():
                self.send(subject, data)

    def _heartbeat(self) -> None:
        for name, engine in self.engines.items():
            if not self.joined and name in self.late:
                continue
            load = engine.load()
            log = self.logs[name]
            log.set_load(
                running=load.running,
                waiting=load.waiting,
                waiting_prefill_tokens=load.waiting_prefill_tokens,
                kv_usage=load.kv_usage,
            )
            for sample in load.prefill_samples:
                log.prefill_sample(*sample)
            self._running_samples[name].append(load.running)
        if self.pool is not None:
            self.logs["pool"].set_load()
        for name, log in self.logs.items():
            if not self.joined and name in self.late:
                continue
            for subject, data in log.heartbeat_messages():
                self.send(subject, data)
        self._sample_replicas()
        self.later(self.cluster.heartbeat_s, self._heartbeat)

    def _sample_replicas(self) -> None:
        for key, _n in self._hot.most_common(10):
            holders = sum(1 for m in self.index.match(MODEL, [key]).values() if m.length)
            self.max_replicas = max(self.max_replicas, holders)

    # -- routing ------------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        if req.keys:
            self._hot[req.keys[home_block(len(req.keys), self.block_size, 2048)]] += 1
        route = RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, req.id)
        if self.admission is not None:
            self._admit(req, route)
            return
        # top_k as a router asks: policies that can rank only the holders and the best few others
        # (ttft) do, and must place exactly as their full ranking would (tables byte-identical).
        ranker = self.rankers[len(self.ranker_of) % len(self.rankers)]
        self.ranker_of[req.id] = ranker
        result = ranker.score(route, commit=True, top_k=self.cluster.top_k)
        assert result.committed is not None, "no routable instance"
        self.estimate_s[req.id] = result.choices[0].candidate.est_ttft_ms / 1000.0
        if self.promised is not None:
            self._promise(req, result.choices[0].candidate)
        self.routed[req.id] = (req.arrival, result.committed.worker)
        self.engines[result.committed.worker].submit(req, self.now)

    def _promise(self, req: SimRequest, candidate: Any) -> None:
        engine = self.engines[candidate.state.worker]
        assert self.promised is not None and isinstance(engine, HybridSimEngine)
        self.promised[req.id] = (candidate.match.length * self.block_size, engine.cached_tokens(req))

    # -- admission ----------------------------------------------------------------------------------

    def objective(self, req: SimRequest) -> Objective:
        return Objective(1000.0 * (req.ttft_slo_s or self.cluster.slo_s))

    def _look(self, req: SimRequest, route: RouteRequest, elapsed_s: float) -> tuple[Any, Any]:
        """Score without commit, and admission's verdict on it."""
        assert self.admission is not None
        result = self.ranker.score(route, top_k=self.cluster.top_k)
        estimates = self.correction.apply(MODEL, [Estimate.of(c.candidate) for c in result.choices], self.now)
        return result, judge(self.objective(req), elapsed_s * 1000.0, estimates, self.admission)

    def _serve(self, req: SimRequest, route: RouteRequest, result: Any, pick: int) -> None:
        est_ms = result.choices[pick].candidate.est_ttft_ms
        self._estimated[req.id] = (est_ms, self.now)
        self.estimate_s[req.id] = est_ms / 1000.0
        self.correction.start(
            MODEL, req.id, est_ms, self.now, result.choices[pick].candidate.state.instance_id
        )
        state = result.choices[pick].candidate.state
        if self.promised is not None:
            self._promise(req, result.choices[pick].candidate)
        assert self.ranker.commit(route, state.key), "no routable instance"
        self.routed[req.id] = (req.arrival, state.worker)
        self.engines[state.worker].submit(req, self.now)

    def _admit(self, req: SimRequest, route: RouteRequest) -> None:
        cfg = self.admission
        assert cfg is not None
        result, verdict = self._look(req, route, 0.0)
        objective = self.objective(req)
        entry = QueueEntry(
            objective,
            MODEL,
            req.arrival,
            deadline_of(objective, req.arrival, cfg),
            self.queue.next_seq(),
            service_ms=min(
                (c.candidate.prefill_ms + c.candidate.fetch_ms for c in result.choices), default=0.0
            ),
            can_meet=verdict.can_meet,
        )
        if verdict.action == ADMIT and not self.queue.ahead_of(entry.key):
            self._serve(req, route, result, verdict.pick)
            return
        if verdict.action == SHED:
            self.shed[verdict.reason] += 1
            return
        displaced = self.queue.push(entry)
        if displaced is entry:
            if verdict.can_meet:
                self._serve(req, route, result, verdict.pick)
            else:
                self.shed[QUEUE_FULL] += 1
            return
        self.held[entry.seq] = req
        self.queued += 1
        if displaced is not None:
            self._evict(displaced)
        if not self._ticking:
            self._ticking = True
            self.later(cfg.tick_s, self._tick)

    def _route_of(self, req: SimRequest) -> RouteRequest:
        return RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, req.id)

    def _evict(self, entry: QueueEntry) -> None:
        """Displaced from a full queue: served if an instance can meet it now, else shed."""
        req = self.held.pop(entry.seq)
        route = self._route_of(req)
        result, verdict = self._look(req, route, self.now - req.arrival)
        if verdict.can_meet:
            self._serve(req, route, result, verdict.pick)
        else:
            self.shed[QUEUE_FULL] += 1

    def _tick(self) -> None:
        self._drain()
        if self.queue:
            assert self.admission is not None
            self.later(self.admission.tick_s, self._tick)
        else:
            self._ticking = False

    def _drain(self) -> None:
        """Queued requests' turn (after a release, and every tick): the expired are shed, the first
        few re-scored, and served if they fit now."""
        cfg = self.admission
        if cfg is None or not self.queue:
            return
        for entry, reason in self.queue.expired(self.now, cfg):
            self.queue.remove(entry)
            req = self.held.pop(entry.seq)
            route = self._route_of(req)
            result, verdict = self._look(req, route, self.now - req.arrival)
            if verdict.action == ADMIT:  # a last look: it fits after all, or an idle instance takes it
                self._serve(req, route, result, verdict.pick)
            else:
                self.shed[reason] += 1
        for entry in list(self.queue)[: cfg.scan]:
            req = self.held[entry.seq]
            route = self._route_of(req)
            result, verdict = self._look(req, route, self.now - req.arrival)
            entry.service_ms = min(
                (c.candidate.prefill_ms + c.candidate.fetch_ms for c in result.choices), default=0.0
            )
            if verdict.action == ADMIT:
                self.queue.remove(entry)
                del self.held[entry.seq]
                self._serve(req, route, result, verdict.pick)
            elif verdict.action == SHED:
                self.queue.remove(entry)
                del self.held[entry.seq]
                self.shed[DEADLINE if verdict.reason == UNATTAINABLE else verdict.reason] += 1

    def run(self) -> None:
        arrivals = sorted(self.requests, key=lambda r: r.arrival)
        for name, log in self.logs.items():  # workers announce themselves before traffic starts
            if name in self.late:
                continue
            for subject, data in log.heartbeat_messages():
                on = self.consumer.on_events if ".events." in subject else self.consumer.on_heartbeat
                on(subject, data)
        self.later(self.cluster.heartbeat_s, self._heartbeat)
        if self.late:
            self.later(self.cluster.join_at, self._join)
        i = 0
        engines = list(self.engines.values())
        while (
            i < len(arrivals)
            or any(e.next_time() is not None for e in engines)
            or len(self.completions) < 2 * len(arrivals)
        ):
            times = [e.next_time() for e in engines]
            t_engine = min((t for t in times if t is not None), default=math.inf)
            t_arrival = arrivals[i].arrival if i < len(arrivals) else math.inf
            t_event = self._events[0][0] if self._events else math.inf
            t = min(t_engine, t_arrival, t_event)
            if t == math.inf:
                break
            self.now = max(self.now, t)
            if t_engine <= t:
                for e, et in zip(engines, times, strict=True):
                    if et is not None and et <= t:
                        for done in e.advance(t):
                            self._complete(done)
                self._flush()
                self._drain()  # instances have room: held requests may fit now
            while self._events and self._events[0][0] <= t:
                _t, _n, action = heapq.heappop(self._events)
                action()
            while i < len(arrivals) and arrivals[i].arrival <= t:
                self._arrive(arrivals[i])
                i += 1
                self._flush()
            if i >= len(arrivals) and all(e.next_time() is None for e in engines) and not self.queue:
                break

    def _complete(self, done: Any) -> None:
        rid = done.request.id
        if done.kind == "first_token":
            self.completions[rid] = done
            self.ranker_of.get(rid, self.ranker).release(rid, "prefill")
            estimated = self._estimated.pop(rid, None)
            if estimated is not None:
                self.correction.finish(MODEL, rid)
                self.correction.observe(MODEL, estimated[0], (done.first_token_at - estimated[1]) * 1000.0)
        else:
            self.completions[rid + "#end"] = done
            self.ranker_of.get(rid, self.ranker).release(rid, "finished")

    # -- results ------------------------------------------------------------------------------------

    def result(self, label: str, wall: float) -> RunResult:
        firsts = [c for k, c in self.completions.items() if not k.endswith("#end")]
        ttfts = np.array([c.ttft for c in firsts])
        prompt = sum(c.request.prompt_tokens for c in firsts)
        # Prefix hits found when the request was first admitted (a preempted request re-admitted
        # finds its own blocks again: that is recomputation avoided, not a prefix hit).
        hit = sum(sum((c.first_cached_tokens or c.cached_tokens).values()) for c in firsts)
        tm = EngineConfig.from_profile(**self.cluster.engine).time
        prefill_s = (
            sum(tm.chunk_ms(c.computed_tokens, c.request.prompt_tokens - c.computed_tokens) for c in firsts)
            / 1000
        )
        means = [np.mean(v) for v in self._running_samples.values() if v]
        ratio = (max(means) / min(means)) if means and min(means) > 0 else float("inf")
        c = self.consumer.counters
        met = sum(1 for x in firsts if x.ttft <= (x.request.ttft_slo_s or self.cluster.slo_s))
        times = [r.arrival for r in self.requests]
        return RunResult(
            policy=self.policy,
            label=label,
            requests=len(firsts),
            ttft={
                "mean": float(ttfts.mean()),
                "p50": float(np.percentile(ttfts, 50)),
                "p90": float(np.percentile(ttfts, 90)),
                "p99": float(np.percentile(ttfts, 99)),
            },
            goodput=float((ttfts <= self.cluster.slo_s).mean()),
            hit_rate=hit / prompt if prompt else 0.0,
            prefill_gpu_s=prefill_s,
            load_ratio=ratio,
            max_replicas=self.max_replicas,
            repairs={
                "gaps": c.gaps,
                "replays_ok": c.replays_ok,
                "snapshots": sum(c.snapshots_requested.values()),
            },
            wall_s=wall,
            ttfts=[float(x) for x in ttfts],
            arrivals=len(self.requests),
            slo_met=met,
            span_s=(max(times) - min(times)) if times else 0.0,
            shed=sum(self.shed.values()),
            queued=self.queued,
            shed_reasons=dict(self.shed),
            join=self._join_windows(firsts),
            predicted=[
                (self.estimate_s[c.request.id], c.ttft) for c in firsts if c.request.id in self.estimate_s
            ],
            extra=self._promises(firsts),
        )

    def _promises(self, firsts: list[Any]) -> dict[str, float]:
        """Hybrid fleets, at each routing decision: the share of requests for which the index's
        answer for the instance chosen was what that engine would reuse then (``exact``); of those
        with a promised hit (the index's answer > 0), how many the engine held less of (``short``:
        false residency) or none of (``cold``), and the share of promised tokens not there. (Event
        propagation, 5 ms, is the only other difference; speculative hits of prompts in flight and
        evictions while a request waits are not counted.)"""
        if self.promised is None:
            return {}
        promised = short = cold = exact = 0
        wanted = missing = 0
        for c in firsts:
            p, got = self.promised.get(c.request.id, (0, 0))
            exact += p == got
            if p <= 0:
                continue
            promised += 1
            wanted += p
            if got < p:
                short += 1
                missing += p - got
                cold += got == 0
        return {
            "exact": exact / len(firsts) if firsts else 0.0,
            "promised": promised,
            "short": short,
            "cold": cold,
            "missing_share": missing / wanted if wanted else 0.0,
        }

    def _join_windows(
        self, firsts: list[Any], width: float = 15.0, windows: int = 6
    ) -> list[dict[str, float]]:
        """Per ``width`` s after the join: the share of arrivals routed to the new instances, the
        mean and p90 TTFT of all arrivals, and the new instances' peak running requests."""
        if not self.late:
            return []
        ttft = {c.request.id: c.ttft for c in firsts}
        out = []
        for w in range(-1, windows):
            lo = self.cluster.join_at + w * width
            ids = [rid for rid, (t, _inst) in self.routed.items() if lo <= t < lo + width]
            if not ids:
                continue
            new = sum(1 for rid in ids if self.routed[rid][1] in self.late)
            values = np.array([ttft[rid] for rid in ids if rid in ttft])
            out.append(
                {
                    "from_s": w * width,
                    "arrivals": len(ids),
                    "new_share": new / len(ids) / (len(self.late) / len(self.engines)),
                    "mean": float(values.mean()) if len(values) else math.nan,
                    "p90": float(np.percentile(values, 90)) if len(values) else math.nan,
                }
            )
        return out


class PdSimulation(Simulation):
    """Disaggregated serving (preset ``pd``): ``mode`` is ``pd-<prefill policy>`` (conditional
    disaggregation with Dynamo's thresholds, kvindex/route/pd.py), ``pd-always-<policy>`` (every
    request in two steps), ``pd-rr`` (vllm-router's PD mode: round-robin prefill and decode, the
    decode instance prefilling itself when at most 256 tokens are uncached there) or
    ``unified-<policy>`` (the same fleet, every instance serving whole requests).

    A two-step request is committed on its decode instance (``decode`` ranking among decode
    instances), then its prefill (id ``<id>:p``, one output token) on the prefill instance with the
    lowest estimated TTFT plus transfer; when that prefill's first token is out, the request goes to
    the decode instance, which receives the blocks (``SimRequest.remote_blocks``, at the profile's
    RDMA link speed) instead of computing them. Its TTFT counts from the original arrival."""

    def __init__(
        self, mode: str, requests: list[SimRequest], cluster: Cluster, seed: int, options: Any
    ) -> None:
        from kvindex.route.pd import PairCosts, PdConfig

        self.mode = mode
        unified = mode.startswith("unified-")
        policy = mode.split("-")[-1] if mode != "pd-rr" else "round_robin"
        if unified:
            cluster = Cluster(**{**asdict(cluster), "roles": ()})
        super().__init__(policy, requests, cluster, seed, options)
        self.policy = mode
        self.unified = unified
        remote_ms = self.engines["sim0"].cfg.fetch_ms_per_block.get("remote", 0.0)
        self.pd_config = PdConfig(
            min_input_tokens=0 if mode.startswith("pd-always") else 2048,
            min_uncached_share=0.0 if mode.startswith("pd-always") else 0.7,
            transfer_ms_per_1k=remote_ms * 1000.0 / self.block_size,
            measure=False,
        )
        self.costs = PairCosts(self.pd_config)
        self._pending_decode: dict[str, tuple[SimRequest, str, int]] = {}
        self._prefill_steps: dict[str, Any] = {}  # request id -> its prefill step's first token
        self._rr = 0
        self.remote = 0

    def _members(self) -> list[Any]:
        return self.registry.routable(MODEL)

    def _arrive(self, req: SimRequest) -> None:
        if self.unified:
            super()._arrive(req)
            return
        from kvindex.route.pd import PrefillOption, choose_prefill, decide_local, decode_candidates

        if req.keys:
            self._hot[req.keys[home_block(len(req.keys), self.block_size, 2048)]] += 1
        members = self._members()
        decodes = decode_candidates(members)
        route = RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, req.id, "decode")
        if self.mode == "pd-rr":
            decode_id = decodes[self._rr % len(decodes)]
            self._rr += 1
            state = self.registry.get((decode_id.partition("/")[0], 0))
            assert state is not None
            cand = self.ranker.candidates(route, [state], 0.0)[0]
            matched = cand.blocks * self.block_size
            self.ranker.commit(
                RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, req.id), state.key
            )
            local = "uncached<=256" if req.prompt_tokens - matched <= 256 else None
        else:
            result = self.ranker.score(route, decodes, commit=True, top_k=self.cluster.top_k)
            assert result.committed is not None and result.choices
            state = result.committed
            matched = result.choices[0].candidate.blocks * self.block_size
            local = decide_local(req.prompt_tokens, matched, self.pd_config)
        decode = state.worker
        prefills = [m for m in members if m.role in ("prefill", "both") and m.worker != decode]
        if local is not None or not prefills:
            if self.mode != "pd-rr":
                # A whole request now: the decode instance to serve it by the TTFT ranking (as
                # kvindex route --pd does; it may hold the prompt's prefix), committed whole.
                whole = RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, req.id)
                res = self.ranker.score(whole, decodes, commit=True, top_k=self.cluster.top_k)
                assert res.committed is not None
                decode = res.committed.worker
            self.engines[decode].submit(req, self.now)
            return
        self.remote += 1
        pid = req.id + ":p"
        proute = RouteRequest(MODEL, req.keys, req.prompt_tokens, self.block_size, pid)
        if self.mode == "pd-rr":
            pstate = prefills[self._rr % len(prefills)]
            self.ranker.commit(proute, pstate.key)
        else:
            ids = sorted(m.instance_id for m in prefills)
            ranked = self.ranker.score(proute, ids, commit=True, top_k=self.pd_config.prefill_top_k)
            options = [
                PrefillOption(c.candidate.state.instance_id, "x", c.candidate.est_ttft_ms)
                for c in ranked.choices
            ]
            pick = choose_prefill(options, state.instance_id, req.prompt_tokens - matched, self.costs)
            assert pick is not None
            pstate = self.registry.get((pick.option.instance_id.partition("/")[0], 0))
            assert pstate is not None
            if ranked.committed is None or ranked.committed.key != pstate.key:
                self.ranker.commit(proute, pstate.key)
        self._pending_decode[pid] = (req, decode, len(req.keys))
        self.engines[pstate.worker].submit(
            SimRequest(pid, req.keys, req.prompt_tokens, 1, self.now), self.now
        )

    def _complete(self, done: Any) -> None:
        rid = done.request.id
        pending = self._pending_decode.get(rid)
        if pending is None:
            super()._complete(done)
            return
        if done.kind == "first_token":
            self.ranker.release(rid, "finished")  # the prefill step is over: its KV is handed over
            req, decode, blocks = self._pending_decode.pop(rid)
            self._prefill_steps[req.id] = done
            # The decode step: same arrival (TTFT counts from the client's request), blocks received.
            step = SimRequest(
                req.id, req.keys, req.prompt_tokens, req.output_tokens, req.arrival, req.meta, blocks
            )
            self.engines[decode].submit(step, self.now)

    def result(self, label: str, wall: float) -> RunResult:
        out = super().result(label, wall)
        # A two-step request's prefix hits and prefill compute are its prefill step's (the decode
        # step receives the blocks), plus the few tokens its decode step computes.
        firsts = [c for k, c in self.completions.items() if not k.endswith("#end")]
        steps = [(c, self._prefill_steps.get(c.request.id)) for c in firsts]
        prompt = sum(c.request.prompt_tokens for c in firsts)
        hit = sum(sum(((p or c).first_cached_tokens or (p or c).cached_tokens).values()) for c, p in steps)
        tm = EngineConfig.from_profile(**self.cluster.engine).time
        ms = sum(
            tm.chunk_ms(x.computed_tokens, x.request.prompt_tokens - x.computed_tokens)
            for c, p in steps
            for x in ((c,) if p is None else (c, p))
        )
        out.hit_rate = hit / prompt if prompt else 0.0
        out.prefill_gpu_s = ms / 1000
        tpots = [
            (c.finished_at - c.first_token_at) / (c.request.output_tokens - 1)
            for k, c in self.completions.items()
            if k.endswith("#end") and c.finished_at is not None and c.request.output_tokens > 1
        ]
        if tpots:
            out.extra["tpot_p50_ms"] = float(np.percentile(tpots, 50) * 1000)
            out.extra["tpot_p90_ms"] = float(np.percentile(tpots, 90) * 1000)
        out.extra["two_step_share"] = self.remote / max(1, out.requests)
        return out


def run_one(args: tuple[Any, ...]) -> RunResult:
    """(policy, label, arrivals, cluster, seed, options[, name shown for the run])"""
    policy, label, requests, cluster, seed, options = args[:6]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    started = time.perf_counter()
    if policy.startswith(("pd-", "unified-")):
        sim: Simulation = PdSimulation(policy, requests, cluster, seed, options)
        sim.run()
        return sim.result(label, time.perf_counter() - started)
    sim = Simulation(policy, requests, cluster, seed, options)
    sim.run()
    result = sim.result(label, time.perf_counter() - started)
    if len(args) > 6:
        result.policy = args[6]
    return result


def pick_variants(text: str) -> list[tuple[str, float]]:
    """``best,softmax:0.1`` -> [("best", 0.0), ("softmax", 0.1)]."""
    out = []
    for item in text.split(","):
        mode, _, temperature = item.strip().partition(":")
        if mode not in ("best", "softmax"):
            raise SystemExit(f"--pick: {item!r} is not best or softmax:T")
        out.append((mode, float(temperature or 0.0) if mode == "softmax" else 0.0))
    return out


def join_table(results: list[RunResult]) -> str:
    """The join experiment: per window after the join, the new instances' share of the arrivals
    (1.0 = an equal share per instance) and everyone's TTFT."""
    lines = [
        f"{'level':<22} {'run':<22} {'from s':>7} {'arrivals':>8} {'new share':>9} {'mean':>7} {'p90':>7}"
    ]
    lines.append("-" * len(lines[0]))
    for r in results:
        for w in r.join:
            lines.append(
                f"{r.label:<22} {r.policy:<22} {w['from_s']:7.0f} {w['arrivals']:8.0f} {w['new_share']:9.2f} "
                f"{w['mean']:7.2f} {w['p90']:7.2f}"
            )
    return "\n".join(lines)


# -- presets ------------------------------------------------------------------------------------------


@dataclass
class Experiment:
    name: str
    levels: list[tuple[str, list[SimRequest], Cluster]]  # label, arrivals, deployment
    policies: tuple[str, ...]
    options: dict[str, dict] | None = None
    notes: str = ""
    # Runs of each policy on other deployments: (suffix of its name, Cluster fields set).
    variants: tuple[tuple[str, dict[str, Any]], ...] = (("", {}),)


def preset_mooncake(args: argparse.Namespace) -> Experiment:
    limit = 1500 if args.quick else args.limit
    cluster = Cluster(
        args.instances or 16,
        {"profile": "llama3-70b-8xa800", "block_size": 512},
        slo_s=args.slo or 5.0,
        loss=args.loss,
        delay_s=args.delay,
    )
    levels = []
    # Load levels by where the fleet stands, not by trace speed alone: at x1 the trace's own rate
    # leaves room; around x2.6 the best load-balancing peers reach their knee (their p90 doubles
    # from x2 to x2.6); at x3.3 every policy queues.
    for label, scale in (("light", 1.0), ("near-saturation", 0.38), ("overload", 0.3)):
        reqs = mooncake_requests(args.trace, model=MODEL, block_size=512, limit=limit, time_scale=scale)
        levels.append((f"{label} (x{1 / scale:.1f})", reqs, cluster))
    return Experiment("mooncake", levels, args.policies)


def preset_global_pool(args: argparse.Namespace) -> Experiment:
    limit = 1500 if args.quick else args.limit
    reqs = mooncake_requests(args.trace, model=MODEL, block_size=512, limit=limit, time_scale=0.5)
    per_node = 3_000_000 // 512  # 3 M tokens per node (FAST'25 §5.3)
    engine = {"profile": "llama3-70b-8xa800", "block_size": 512}
    local = Cluster(10, {**engine, "cpu_blocks": per_node}, slo_s=args.slo or 5.0)
    shared = Cluster(10, engine, pool_blocks=10 * per_node, slo_s=args.slo or 5.0)
    return Experiment(
        "global-pool", [("local caches", reqs, local), ("global pool", reqs, shared)], args.policies
    )


def preset_loadaware(args: argparse.Namespace) -> Experiment:
    n = 600 if args.quick else 3000
    reqs = zipf_prefixes(
        prefixes=128,
        prefix_tokens=2048,
        zipf=0.9,
        suffix_tokens=64,
        output_tokens=args.output_tokens or 128,
        qps=16,
        requests=n,
        block_size=16,
        seed=args.seed,
    )
    # production-stack serves with LMCache CPU offload: every prefix fits in host memory.
    engine = {"profile": "llama3-8b-h100", "block_size": 16, "cpu_blocks": 128 * 2048 // 16}
    cluster = Cluster(2, engine, slo_s=args.slo or 1.0)
    return Experiment(
        "loadaware",
        [("2 inst, 16 req/s", reqs, cluster)],
        args.policies,
        options={"loadaware": {"beta": 0.5}},
    )


def llmd_levels(args: argparse.Namespace, n: int, cluster: Cluster) -> list[Any]:
    """llm-d's workload at its three rates (or --rates): 150 groups of 5 users sharing a 6,000-token
    system prompt, 1,200-token questions, 256-token answers, ``n`` requests per level."""
    levels = []
    for qps in args.rates or (40, 80, 120):
        reqs = shared_prefix_groups(
            groups=150,
            prefix_tokens=6000 // 16 * 16,
            users=5,
            question_tokens=1200,
            output_tokens=256,
            qps=qps,
            requests=n,
            block_size=16,
            seed=args.seed,
        )
        levels.append((f"{qps:g} req/s", reqs, cluster))
    return levels


def preset_llmd(args: argparse.Namespace) -> Experiment:
    # --limit: requests per level (a longer trace keeps an overload going longer).
    n = args.limit or (800 if args.quick else 3000)
    cluster = Cluster(8, {"profile": "llama3-8b-h100", "block_size": 16}, slo_s=args.slo or 2.0)
    levels = llmd_levels(args, n, cluster)
    return Experiment("llmd", levels, args.policies)


def preset_fleet256(args: argparse.Namespace) -> Experiment:
    """The Mooncake trace on 256 instances at 16x its rate: per instance, the load of the 16-instance
    preset's near-saturation level, on a fleet where bounded spread and homes matter more and most
    instances hold nothing of a given prompt (ttft ranks only holders and the best few others)."""
    # The first 3,000 trace rows (--limit for more): all policies in the other presets' time budget.
    limit = 1000 if args.quick else (args.limit or 3000)
    n = args.instances or 256
    cluster = Cluster(
        n,
        {"profile": "llama3-70b-8xa800", "block_size": 512},
        slo_s=args.slo or 5.0,
        loss=args.loss,
        delay_s=args.delay,
    )
    scale = 0.38 * 16 / n
    reqs = mooncake_requests(args.trace, model=MODEL, block_size=512, limit=limit, time_scale=scale)
    return Experiment("fleet256", [(f"{n} inst (x{1 / scale:.0f})", reqs, cluster)], args.policies)


def preset_pd(args: argparse.Namespace) -> Experiment:
    """Disaggregated prefill/decode on 8 instances (--pd-prefill of them prefill, default 4; the
    rest decode; Llama-3-8B on H100s):
    multi-turn chats whose history grows (the decode instance that served the last turn holds most
    of the next one, where conditional disaggregation keeps the prefill local) and long one-shot
    documents. kvindex's PD routing against every request in two steps, vllm-router's PD mode
    (round robin, local under 256 uncached tokens) and the same 8 instances serving whole requests."""
    n = 600 if args.quick else 2000
    # Transfers overlap compute (fetch_overlap): vLLM's NIXL reads are asynchronous, a request
    # waits for its KV while the batch runs (the engine's loads are otherwise synchronous with
    # admission, stalling every decoding sequence of the step: --pd-sync-transfers).
    engine = {"profile": "llama3-8b-h100", "block_size": 16, "fetch_overlap": not args.pd_sync_transfers}
    cluster = Cluster(
        8,
        engine,
        slo_s=args.slo or 1.0,
        roles=("prefill",) * args.pd_prefill + ("decode",) * (8 - args.pd_prefill),
    )
    levels = []
    for qps in (30, 60, 90):
        chats = sessions(
            sessions=n // 8, turns=4, system_tokens=1024, turn_tokens=512, answer_tokens=200,
            think_s=4.0, qps=qps / 8, block_size=16, seed=args.seed,
        )  # fmt: skip
        docs = zipf_prefixes(
            prefixes=n // 4, prefix_tokens=4096, zipf=0.2, suffix_tokens=64, output_tokens=200,
            qps=qps / 2, requests=n // 2, block_size=16, seed=args.seed + 1,
        )  # fmt: skip
        reqs = sorted(chats + docs, key=lambda r: r.arrival)
        rate = len(reqs) / (reqs[-1].arrival - reqs[0].arrival)
        levels.append((f"{rate:.0f} req/s", reqs, cluster))
    policies = tuple(p for p in args.policies if p.startswith(("pd-", "unified-"))) or (
        "pd-ttft", "pd-always-ttft", "pd-rr", "unified-ttft", "unified-dynamo", "unified-round_robin",
    )  # fmt: skip
    return Experiment("pd", levels, policies)


def preset_demo(args: argparse.Namespace) -> Experiment:
    """The `make run` demo's fleet (8 x Llama-3-8B on H100, 16-token blocks, 50,000 CPU blocks each)
    at its default load (the trace x2.5) and at x4: where its default was chosen."""
    cluster = Cluster(
        args.instances or 8,
        {"profile": "llama3-8b-h100", "block_size": 16, "cpu_blocks": 50_000},
        slo_s=args.slo or 2.0,
        loss=args.loss,
        delay_s=args.delay,
    )
    limit = 3000 if args.quick else args.limit
    levels = []
    for scale in (0.4, 0.25):
        reqs = mooncake_requests(args.trace, model=MODEL, block_size=16, limit=limit, time_scale=scale)
        levels.append((f"x{1 / scale:.1f}", reqs, cluster))
    return Experiment("demo", levels, args.policies)


def preset_hybrid(args: argparse.Namespace) -> Experiment:
    """A hybrid-attention fleet (issue 33): 16 Gemma-3-like instances (``--kv-groups``, default five
    sliding-window groups of 1,024 tokens per full-attention group; the 70B profile's time model and
    memory) on the Mooncake trace at the mooncake preset's three loads. The same policies and
    arrivals twice: the index knows the layout (every group's events, kvindex's rule), or it is told
    only the full-attention group's blocks, as one cache (false residency: it promises hits the
    sliding-window groups cannot serve)."""
    limit = 1500 if args.quick else args.limit
    engine = {"profile": "llama3-70b-8xa800", "block_size": 512, "kv_groups": args.kv_groups or "gemma3"}
    cluster = Cluster(args.instances or 16, engine, slo_s=args.slo or 5.0, loss=args.loss, delay_s=args.delay)
    levels = []
    for label, scale in (("light", 1.0), ("near-saturation", 0.38), ("overload", 0.3)):
        reqs = mooncake_requests(args.trace, model=MODEL, block_size=512, limit=limit, time_scale=scale)
        levels.append((f"{label} (x{1 / scale:.1f})", reqs, cluster))
    policies = ("ttft", "dynamo") if args.policies == DEFAULT_POLICIES else args.policies
    variants = ((" groups", {"index_groups": "all"}), (" full-attn", {"index_groups": "full"}))
    return Experiment("hybrid", levels, policies, variants=variants)


def preset_hybrid_llmd(args: argparse.Namespace) -> Experiment:
    """The llmd preset's workload (groups of users sharing a 6,000-token system prompt, new
    questions; 8 x Llama-3-8B on H100, 16-token blocks) on Gemma-3-like engines, with the hybrid
    preset's two indexes: the shape of issue 33's scenario, where the second request of a group on an
    instance finds the system prompt's full-attention blocks but no sliding window ending there."""
    n = args.limit or (800 if args.quick else 3000)
    engine = {"profile": "llama3-8b-h100", "block_size": 16, "kv_groups": args.kv_groups or "gemma3"}
    cluster = Cluster(8, engine, slo_s=args.slo or 2.0, loss=args.loss, delay_s=args.delay)
    levels = llmd_levels(args, n, cluster)
    policies = ("ttft", "dynamo") if args.policies == DEFAULT_POLICIES else args.policies
    variants = ((" groups", {"index_groups": "all"}), (" full-attn", {"index_groups": "full"}))
    return Experiment("hybrid-llmd", levels, policies, variants=variants)


PRESETS = {
    "hybrid": preset_hybrid,
    "hybrid-llmd": preset_hybrid_llmd,
    "pd": preset_pd,
    "demo": preset_demo,
    "fleet256": preset_fleet256,
    "mooncake": preset_mooncake,
    "global-pool": preset_global_pool,
    "loadaware": preset_loadaware,
    "llmd": preset_llmd,
}


# -- output -------------------------------------------------------------------------------------------


def table(results: list[RunResult]) -> str:
    width = max([13, *(len(r.policy) for r in results)])
    head = (
        f"{'level':<22} {'policy':<{width}} {'mean':>7} {'p50':>7} {'p90':>7} {'p99':>7} {'goodput':>8} "
        f"{'hit':>6} {'prefill':>8} {'busy/idle':>9} {'replicas':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.label:<22} {r.policy:<{width}} {r.ttft['mean']:7.2f} {r.ttft['p50']:7.2f} "
            f"{r.ttft['p90']:7.2f} {r.ttft['p99']:7.2f} {r.goodput:8.1%} {r.hit_rate:6.1%} "
            f"{r.prefill_gpu_s:8.0f} {r.load_ratio:9.2f} {r.max_replicas:8d}"
        )
    return "\n".join(lines)


def promise_table(results: list[RunResult]) -> str:
    """Hybrid fleets, at each routing decision: the share of requests for which the index's answer
    was the chosen engine's truth; requests with a promised hit, those the engine held less of
    (false residency), none of (cold), and the share of promised tokens that were not cached."""
    width = max([13, *(len(r.policy) for r in results)])
    head = (
        f"{'level':<22} {'policy':<{width}} {'mean':>7} {'p90':>7} {'goodput':>8} {'exact':>7} "
        f"{'promised':>8} {'short':>6} {'cold':>6} {'missing':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        e = r.extra
        lines.append(
            f"{r.label:<22} {r.policy:<{width}} {r.ttft['mean']:7.2f} {r.ttft['p90']:7.2f} "
            f"{r.slo_met / max(r.arrivals, 1):8.1%} {e['exact']:7.1%} {e['promised']:8.0f} {e['short']:6.0f} "
            f"{e['cold']:6.0f} "
            f"{e['missing_share']:8.1%}"
        )
    return "\n".join(lines)


def goodput_table(results: list[RunResult]) -> str:
    """SLO goodput over every arrival (shed = missed), and what admission did."""
    head = (
        f"{'level':<22} {'policy':<13} {'goodput':>8} {'req/s':>7} {'shed':>6} {'queued':>7} "
        f"{'served p90':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        share = r.slo_met / r.arrivals if r.arrivals else 0.0
        rate = r.slo_met / r.span_s if r.span_s else 0.0
        lines.append(
            f"{r.label:<22} {r.policy:<13} {share:8.1%} {rate:7.2f} {r.shed / max(r.arrivals, 1):6.1%} "
            f"{r.queued / max(r.arrivals, 1):7.1%} {r.ttft['p90']:10.2f}"
        )
    return "\n".join(lines)


def write_outputs(exp: Experiment, results: list[RunResult]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{exp.name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "level",
                "policy",
                "requests",
                "ttft_mean",
                "ttft_p50",
                "ttft_p90",
                "ttft_p99",
                "goodput",
                "hit_rate",
                "prefill_gpu_s",
                "busiest_idlest",
                "max_replicas",
            ]
        )
        for r in results:
            w.writerow(
                [
                    r.label,
                    r.policy,
                    r.requests,
                    *(round(r.ttft[k], 4) for k in ("mean", "p50", "p90", "p99")),
                    round(r.goodput, 4),
                    round(r.hit_rate, 4),
                    round(r.prefill_gpu_s, 1),
                    round(r.load_ratio, 3),
                    r.max_replicas,
                ]
            )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (make install-bench): CSV and JSON written, no plots")
        return
    labels = list(dict.fromkeys(r.label for r in results))
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        for r in (r for r in results if r.label == label):
            xs = np.sort(r.ttfts)
            ax.plot(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                label=r.policy,
                linewidth=2.2 if r.policy == "ttft" else 1,
            )
        ax.set_xscale("log")
        ax.set_title(f"{exp.name}: {label}")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{exp.name}_ttft_cdf.png", dpi=110)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == policy]
        a1.plot([r.label for r in rs], [r.hit_rate for r in rs], marker="o", label=policy)
        a2.plot([r.label for r in rs], [min(r.load_ratio, 10) for r in rs], marker="o", label=policy)
    a1.set_title("prefix hit rate vs load")
    a2.set_title("busiest / idlest running requests")
    a2.legend(fontsize=7)
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{exp.name}_hit_and_spread.png", dpi=110)
    plt.close(fig)
    plot_load_and_predictions(exp.name, results, OUT)


def plot_load_and_predictions(name: str, results: list[RunResult], out: Path) -> list[Path]:
    """<name>_load.png: TTFT p50/p90 and goodput (over every arrival) against load, per policy;
    <name>_predicted.png: the estimated TTFT of the chosen instance against the measured one, for the
    policies that estimate (ttft and its variants). kvtools/plots.py draws both."""
    from kvtools.plots import LoadPoint, load_curves, predicted_vs_actual

    points = [
        LoadPoint(
            r.policy, r.label, r.ttft["p50"], r.ttft["p90"], r.slo_met / r.arrivals if r.arrivals else 0.0
        )
        for r in results
    ]
    files = [load_curves(points, out / f"{name}_load.png", f"routing simulation: {name}")]
    ours = {
        f"{r.policy}, {r.label}": r.predicted for r in results if r.predicted and r.policy.startswith("ttft")
    }
    if ours:
        files.append(
            predicted_vs_actual(ours, out / f"{name}_predicted.png", f"{name}: estimated vs simulated TTFT")
        )
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument(
        "--limit", type=int, default=None, help="first N trace rows (llmd preset: requests per level)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--rates",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(),
        help="llmd preset: arrival rates (req/s, comma-separated) instead of 40,80,120",
    )
    parser.add_argument("--instances", type=int, default=0)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=0.0, help="TTFT objective (s) for goodput")
    parser.add_argument(
        "--slo-margin", type=float, default=0.0, help="admission (ttft+admit): objective x (1 + margin)"
    )
    parser.add_argument("--delay", type=float, default=0.005, help="event propagation delay (s)")
    parser.add_argument("--loss", type=float, default=0.0, help="probability a batch is lost")
    parser.add_argument("--output-tokens", type=int, default=0, help="loadaware preset: output length")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--pd-prefill", type=int, default=4, choices=range(1, 8), help="pd preset: prefill instances of 8"
    )
    parser.add_argument(
        "--pd-sync-transfers",
        action="store_true",
        help="pd preset: KV transfers stall the receiving step (default: they overlap compute)",
    )
    parser.add_argument(
        "--top-k", type=int, default=4, help="Score top_k (0: every instance ranked, no pruning)"
    )
    parser.add_argument(
        "--kv-groups",
        default="",
        help="hybrid preset: the engines' KV-cache groups (workers_shim/sim/hybrid.py; default gemma3)",
    )
    parser.add_argument(
        "--pick",
        default="best",
        help="picks after the ranking, one run each: best, softmax:T (comma-separated)",
    )
    parser.add_argument("--warmup", type=float, default=0.0, help="warm-up ramp of new instances (s)")
    parser.add_argument("--join", default="", metavar="N@T", help="the last N instances join at T s")
    parser.add_argument(
        "--routers", type=int, default=1, help="independent routers (no routing sync), arrivals dealt in turn"
    )
    parser.add_argument(
        "--policy-option",
        action="append",
        default=[],
        type=parse_policy_option,
        metavar="POLICY.NAME=VALUE",
        help="a policy parameter, as `kvindex serve --policy-option` (repeatable)",
    )
    args = parser.parse_args(argv)
    args.policies = tuple(p for p in args.policies.split(",") if p)
    picks = pick_variants(args.pick)
    exp = PRESETS[args.preset](args)
    join_count, join_at = 0, 0.0
    if args.join:
        count, _, at = args.join.partition("@")
        join_count, join_at = int(count), float(at)
    for _label, _reqs, cluster in exp.levels:
        cluster.top_k = args.top_k
        cluster.slo_margin = args.slo_margin
        cluster.warmup = args.warmup
        cluster.join_count, cluster.join_at = join_count, join_at
        cluster.routers = args.routers
    named = len(picks) > 1 or picks[0][0] != "best" or args.warmup > 0
    options = dict(exp.options or {})
    for policy, params in check_policy_options(args.policy_option).items():
        options[policy] = {**options.get(policy, {}), **params}
    jobs = []
    for label, reqs, cluster in exp.levels:
        for p in exp.policies:
            for (suffix, overrides), (mode, temperature) in itertools.product(exp.variants, picks):
                c = Cluster(**{**asdict(cluster), **overrides, "pick": mode, "temperature": temperature})
                name = p + suffix
                if named:
                    name += f" {mode}" + (f" T={temperature:g}" if mode == "softmax" else "")
                    name += f" ramp {args.warmup:g}s" if args.warmup > 0 else ""
                jobs.append((p, label, reqs, c, args.seed, options, name))
    started = time.perf_counter()
    results: list[RunResult] = []
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = None
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, j) for j in jobs]
        if Progress is not None:
            with Progress(transient=True) as progress:
                task = progress.add_task(f"{exp.name}: {len(jobs)} runs", total=len(jobs))
                for f in futures:
                    results.append(f.result())
                    progress.advance(task)
        else:
            results = [f.result() for f in futures]
    order = {(job[1], job[6]): i for i, job in enumerate(jobs)}
    results.sort(key=lambda r: order[(r.label, r.policy)])
    print(table(results))
    if join_count:
        print(join_table(results))
    if any("promised" in r.extra for r in results):
        print("\nThe index's answer for the instance chosen against that engine's cache, at each decision")
        print(promise_table(results))
    elif any(r.extra for r in results):
        keys = sorted({k for r in results for k in r.extra})
        print(f"\n{'level':<22} {'policy':<20} " + " ".join(f"{k:>15}" for k in keys))
        for r in results:
            print(
                f"{r.label:<22} {r.policy:<20} "
                + " ".join(f"{r.extra.get(k, float('nan')):15.3f}" for k in keys)
            )
    print()
    print("SLO goodput: requests within their TTFT objective over all arrivals (a shed request is missed)")
    print(goodput_table(results))
    print(f"({len(jobs)} runs, {time.perf_counter() - started:.0f} s; outputs in {OUT.relative_to(ROOT)}/)")
    write_outputs(exp, results)
    with open(OUT / f"{exp.name}.json", "w") as f:
        json.dump(
            [{k: v for k, v in asdict(r).items() if k not in ("ttfts", "predicted")} for r in results],
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
