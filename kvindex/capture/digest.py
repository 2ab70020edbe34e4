"""The state digest: one short hash of everything a replay must reproduce exactly.

Per instance, in key order: worker, dp_rank, model, block_size, epoch, last applied seq, health
(stale, sync state), the sequencer cursor (epoch, applied seq, repair in progress, held seqs) and,
per tier, the index's ``[count, xor]`` of the instance's keys (the same order-independent digest
heartbeats carry). Times, loads and counters are left out: they are reproduced too, but are not
*state* in the sense "would a query see the same blocks and the same instances".

SHA-256 of the canonical msgpack of that list, first 32 hex digits.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from kvindex.ingest.consumer import Consumer


def state_rows(consumer: Consumer) -> list[list[Any]]:
    index = consumer.index
    rows: list[list[Any]] = []
    for state in sorted(consumer.registry.all(), key=lambda s: s.key):
        key = state.key
        cursor = consumer.sequencer.cursor(key)
        cur = (
            None
            if cursor is None
            else [cursor.epoch, cursor.applied, cursor.repairing or "", list(cursor.buffer.keys())]
        )
        rows.append(
            [
                state.worker,
                state.dp_rank,
                state.model,
                state.block_size,
                state.epoch,
                state.last_seq,
                state.stale,
                state.repair.sync,
                cur,
                [list(index.digest(key, t)) for t in range(4)],
            ]
        )
    return rows


def state_digest(consumer: Consumer) -> str:
    packed = msgpack.packb(state_rows(consumer), use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:32]
