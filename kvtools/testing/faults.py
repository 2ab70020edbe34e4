"""Fault injection: a publisher whose outgoing messages can be dropped, duplicated,
reordered and delayed, and which can be partitioned (nothing in or out) for a while.

Ground truth is what the publisher itself holds (``Publisher.blocks``): after faults stop, the index
must converge to exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats.errors

from kvindex.wire.schema import TIER_BY_NAME
from workers_shim.publisher import Publisher


@dataclass
class Faults:
    drop: float = 0.0  # probability a message is dropped
    dup: float = 0.0  # ... sent twice
    delay: float = 0.0  # ... held back (and so reordered after later ones)
    max_delay: float = 0.05
    heartbeats_too: bool = True  # apply to heartbeats as well as event batches
    partitioned: bool = False  # nothing goes out, requests are not answered
    only_seqs: set[int] = field(default_factory=set)  # drop exactly these batch seqs
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    injected: Counter[str] = field(default_factory=Counter)

    def quiet(self) -> None:
        self.drop = self.dup = self.delay = 0.0
        self.partitioned = False
        self.only_seqs.clear()


class FaultyPublisher(Publisher):
    def __init__(self, *args: Any, faults: Faults | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults or Faults()
        self._delayed: set[asyncio.Task[None]] = set()

    async def _publish(self, messages: list[tuple[str, bytes]]) -> None:
        f = self.faults
        for subject, data in messages:
            is_heartbeat = ".status." in subject
            if f.partitioned:
                f.injected["partition_drop"] += 1
                continue
            if not is_heartbeat and f.only_seqs and self._seq_of(data) in f.only_seqs:
                f.injected["drop"] += 1
                continue
            if is_heartbeat and not f.heartbeats_too:
                await self.nc.publish(subject, data)
                continue
            r = f.rng.random()
            if r < f.drop:
                f.injected["drop"] += 1
                continue
            if r < f.drop + f.dup:
                f.injected["dup"] += 1
                await self.nc.publish(subject, data)
            elif r < f.drop + f.dup + f.delay:
                f.injected["delay"] += 1
                self._later(subject, data, f.rng.uniform(0.001, f.max_delay))
                continue
            await self.nc.publish(subject, data)

    def _later(self, subject: str, data: bytes, after: float) -> None:
        async def send() -> None:
            await asyncio.sleep(after)
            if self.nc.is_closed or self.nc.is_draining:
                return  # the worker is going away: a delayed batch dies with it, like a dropped one
            with contextlib.suppress(nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                await self.nc.publish(subject, data)

        task = asyncio.create_task(send())
        self._delayed.add(task)
        task.add_done_callback(self._delayed.discard)

    @staticmethod
    def _seq_of(data: bytes) -> int:
        return int(msgpack.unpackb(data).get("seq", -1))

    async def _on_replay(self, msg: Any) -> None:
        if not self.faults.partitioned:
            await super()._on_replay(msg)

    async def _on_snapshot(self, msg: Any) -> None:
        if not self.faults.partitioned:
            await super()._on_snapshot(msg)

    def truth(self) -> dict[int, set[int]]:
        """What this worker holds, per tier number."""
        return {TIER_BY_NAME[t]: set(keys) for t, keys in self.blocks.items() if keys}
