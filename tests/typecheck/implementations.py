"""Every protocol of kvindex against its implementations, for the type checker (mypy reads this file
with the package: tests/unit/test_types.py). Nothing here runs; an implementation that drifts from
its protocol (a method renamed, a signature changed) fails the check, not a caller at run time."""

from __future__ import annotations

from kvindex.api.servicer import KvIndexServicer
from kvindex.capture.replay import LoggedRepair
from kvindex.client.aio import AsyncKvIndexClient
from kvindex.client.fallback import Fallback, RendezvousFallback
from kvindex.client.local import LocalKvIndexClient
from kvindex.index import _pytable
from kvindex.index.base import Differ, GroupedIndex, KvBlockIndex
from kvindex.index.inverted import InvertedIndex
from kvindex.ingest.applier import Applier
from kvindex.ingest.limits import IngestLimits
from kvindex.ingest.rejects import Rejects
from kvindex.repair.machine import BlockApplier, HeldLimits, NoRepair, Rejecter, RepairScheduler
from kvindex.repair.nats_repair import NatsRepairer
from kvindex.route.ext_proc import EndpointPicker
from kvindex.route.lifecycle import LedgerCalls, LedgerEvents
from kvindex.route.proxy import RouteProxy
from kvindex.routing_sync.sync import RoutingSync
from kvindex.scoring.base import IndexView, LedgerView, Policy, PromptCounts, PrunedPolicy
from kvindex.scoring.calibration import Calibrator
from kvindex.scoring.costs import PrefillModels
from kvindex.scoring.ledger import Ledger
from kvindex.scoring.policies.cache_aware import CacheAware
from kvindex.scoring.policies.decode import DecodeHeadroom
from kvindex.scoring.policies.dynamo import Dynamo
from kvindex.scoring.policies.flexlb import FlexLB
from kvindex.scoring.policies.kvaware import KvAware
from kvindex.scoring.policies.llmd import LlmdPrecise
from kvindex.scoring.policies.loadaware import LoadAware
from kvindex.scoring.policies.overlap import Overlap
from kvindex.scoring.policies.power_of_two import PowerOfTwo
from kvindex.scoring.policies.preble import Preble
from kvindex.scoring.policies.prefix_hash import PrefixHash
from kvindex.scoring.policies.round_robin import RoundRobin
from kvindex.scoring.policies.ttft import Ttft
from kvindex.scoring.ranker import RoutingObserver
from kvindex.shards.front import MirrorIndex
from kvindex.v1 import kvindex_pb2 as pb

# The index (and its pure-Python twin's resumable diff).
index: type[KvBlockIndex] = InvertedIndex
grouped: type[GroupedIndex] = InvertedIndex
differ: type[Differ] = _pytable.Differ
index_view: type[IndexView] = InvertedIndex
mirror: type[KvBlockIndex] = MirrorIndex  # the shards' front (kvindex/shards/front.py)

# Ingest and repair.
applier: type[BlockApplier] = Applier
rejecter: type[Rejecter] = Rejects
held: type[HeldLimits] = IngestLimits
schedulers: list[type[RepairScheduler]] = [NoRepair, NatsRepairer, LoggedRepair]

# Scoring: policies (the pruned ones rank a pool too), what they read, the calibration's models.
policies: list[type[Policy]] = [
    Ttft, Overlap, KvAware, RoundRobin, PowerOfTwo, PrefixHash, CacheAware, LoadAware, Dynamo,
    LlmdPrecise, FlexLB, Preble, DecodeHeadroom,
]  # fmt: skip
pruned: list[type[PrunedPolicy]] = [Ttft, Overlap, KvAware, LoadAware, LlmdPrecise, DecodeHeadroom]
ledger_view: type[LedgerView] = Ledger
models: type[PrefillModels] = Calibrator
prompts: list[type[PromptCounts]] = [pb.ScoreRequest, pb.CommitRequest]
observer: type[RoutingObserver] = RoutingSync

# Routing: the clients a request's lifecycle calls, the front ends it tells, the fallback.
calls: list[type[LedgerCalls]] = [AsyncKvIndexClient, LocalKvIndexClient]
events: list[type[LedgerEvents]] = [RouteProxy, EndpointPicker]
fallback: type[Fallback] = RendezvousFallback
servicer: type[KvIndexServicer] = KvIndexServicer
