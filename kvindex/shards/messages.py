"""What crosses NATS between a front and its shards (request/reply on ``{prefix}.match.N.i``).

A query asks one shard for (a) the match of a prompt's block keys on its instances and (b) every
change of its instances' state since the version the front last saw, so the front's copy of the
fleet is current when it ranks. Times travel as ages (seconds before the answer), never as a
process's monotonic clock: shards and fronts may run on different machines.

msgpack through msgspec (as the routing sync, kvindex/routing_sync/messages.py): a query with a
prompt of 8,192 blocks is ~75 KB, an answer ~30 bytes per matched instance and ~120 per state.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvindex.fleet.registry import InstanceState, RepairStatus
from kvindex.wire.schema import Load


class Query(msgspec.Struct, array_like=True):
    model: str  # "": states only (the front's refresh), no match
    keys: list[int]
    instances: list[tuple[str, int]] | None  # restrict the match (None: every instance of the model)
    limit: int | None  # the match's limit in tokens (KvBlockIndex.match)
    since: int  # the last version the front applied from this shard's replica (0: send everything)
    replica: str  # the replica that version came from ("" at first)
    # Instances the front's outcomes found degraded: the shard asks their workers for a snapshot.
    reconcile: list[tuple[str, int]] = []


class Answer(msgspec.Struct, array_like=True):
    replica: str  # this shard process (a random id: versions are per process)
    version: int
    full: bool  # ``states`` is every instance: the front drops the ones it has that are not listed
    states: list[list[Any]]  # encode_state rows
    removed: list[tuple[str, int]]
    matches: list[tuple[str, int, int, int, int, int, int]]  # worker, rank, length, tiers
    samples: list[tuple[str, str, list[tuple[int, int, float]]]]  # model, instance id, prefill samples
    ready: bool
    reason: str
    instances: int
    batches: int  # batches this shard has applied (its ingest, for the front's metrics)


query_encoder = msgspec.msgpack.Encoder()
query_decoder = msgspec.msgpack.Decoder(Query)
answer_decoder = msgspec.msgpack.Decoder(Answer)


def encode_state(
    state: InstanceState, now: float, blocks: tuple[int, int, int, int], reconciles: int
) -> list[Any]:
    """The fields of an instance that rankings, the pick and ListInstances read, ``blocks`` (the
    index's count per tier, for ListInstances) and ``reconciles`` (how many times the shard made its
    blocks equal to the worker's: outcome evidence before one is void, kvindex/scoring/outcomes.py)."""
    load = state.load
    hb = state.last_heartbeat_at
    r = state.repair
    return [
        state.key[0],
        state.key[1],
        state.model,
        state.block_size,
        now - state.first_seen,
        None if hb is None else now - hb,
        [load.running, load.waiting, load.waiting_prefill_tokens, load.kv_usage, load.extra],
        state.capacity,
        state.stale,
        state.local_blocks_seen,
        state.batches,
        state.approximate,
        state.static,
        state.role,
        state.pd_group,
        state.endpoint,
        [r.sync, r.cause, r.failed],
        state.removals,
        state.groups_inexact,
        [state.epoch, state.last_seq, state.gaps, state.missing_batches, state.restarts],
        list(blocks),
        reconciles,
    ]


def apply_state(state: InstanceState, row: list[Any], now: float) -> None:
    """Write a shard's ``encode_state`` row into the front's copy (the watched fields by
    assignment, so the rankers' columns follow: kvindex/fleet/registry.py)."""
    (
        _w,
        _r,
        _model,
        _bs,
        first_age,
        hb_age,
        load,
        capacity,
        stale,
        local_seen,
        batches,
        approximate,
        static,
        role,
        pd_group,
        _endpoint,
        repair,
        removals,
        groups_inexact,
        seqs,
        _blocks,
        _reconciles,
    ) = row
    state.first_seen = now - first_age
    state.last_heartbeat_at = None if hb_age is None else now - hb_age
    running, waiting, wpt, usage, extra = load
    old = state.load
    if (old.running, old.waiting, old.waiting_prefill_tokens, old.kv_usage, old.extra) != (
        running,
        waiting,
        wpt,
        usage,
        extra,
    ):
        state.load = Load(running, waiting, wpt, usage, extra)
    state.capacity = {int(t): n for t, n in capacity.items()}
    state.stale = stale
    state.local_blocks_seen = local_seen
    state.batches = batches
    state.approximate = approximate
    state.static = static
    state.role, state.pd_group = role, pd_group
    state.repair = RepairStatus(repair[0], repair[1], repair[2])
    state.removals = removals
    state.groups_inexact = groups_inexact
    state.epoch, state.last_seq, state.gaps, state.missing_batches, state.restarts = seqs
