"""Hostile workers: publishers that keep the index repairing them and answer its repair requests
badly, to check that one worker's repairs never wait on another's (kvindex/repair/README.md).

A ``HostilePublisher`` publishes well-formed batches and heartbeats (so it stays alive and in the
index), but loses one batch in every ``drop_every``, so the index always has a hole to repair; and
it answers replay and snapshot requests according to ``answer``:

- ``silent``: never (each request waits for its timeout);
- ``garbage``: random bytes that decode as nothing;
- ``partial``: the first part of a real answer, never the last (the request waits for its timeout
  although something came).

Used by tests/integration/test_repair_fairness.py and benchmarks/bench_repair_fairness.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any, Final

from workers_shim.publisher import Publisher

ANSWERS: Final = ("silent", "garbage", "partial")


class HostilePublisher(Publisher):
    def __init__(self, *args: Any, answer: str = "silent", drop_every: int = 5, **kwargs: Any) -> None:
        if answer not in ANSWERS:
            raise ValueError(f"answer must be one of {ANSWERS}, not {answer!r}")
        super().__init__(*args, **kwargs)
        self.answer = answer
        self.drop_every = drop_every
        self.rng = random.Random(self.worker)
        self.requests = 0  # replay and snapshot requests received
        self.dropped = 0

    async def go_quiet(self) -> None:
        """Stop publishing (batches and heartbeats) but stay connected, still answering requests
        badly: the index goes on asking until it forgets the worker."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _publish(self, messages: list[tuple[str, bytes]]) -> None:
        for subject, data in messages:
            # Heartbeats always go out: they keep the worker alive, and show the index the hole.
            if ".status." not in subject and self.drop_every and self.rng.randrange(self.drop_every) == 0:
                self.dropped += 1
                continue
            await self.nc.publish(subject, data)

    async def _on_replay(self, msg: Any) -> None:
        self.requests += 1
        if msg.reply:
            answer = self.replay_messages(msg.data) if self.answer == "partial" else None
            await self._misanswer(msg.reply, answer)

    async def _on_snapshot(self, msg: Any) -> None:
        self.requests += 1
        if msg.reply:
            answer = self.snapshot_messages()[1] if self.answer == "partial" else None
            await self._misanswer(msg.reply, answer)

    async def _misanswer(self, reply: str, answer: list[bytes] | None) -> None:
        with contextlib.suppress(Exception):  # a closing connection: the index just times out
            if self.answer == "garbage":
                await self.nc.publish(reply, self.rng.randbytes(self.rng.randrange(1, 64)))
            elif self.answer == "partial" and answer and len(answer) > 1:
                await self.nc.publish(reply, answer[0])
            elif self.answer == "partial" and answer:
                # A one-part answer is complete: send a part 0 that is not marked last instead.
                await self.nc.publish(reply, _not_last(answer[0]))


def _not_last(part: bytes) -> bytes:
    import msgpack

    message = msgpack.unpackb(part, raw=False, strict_map_key=False)
    message["last"] = False
    return msgpack.packb(message, use_bin_type=True)


async def run_hostile(pubs: list[HostilePublisher], stop: asyncio.Event, interval: float = 0.2) -> None:
    """Each hostile worker stores a block every ``interval`` (and evicts old ones) until ``stop``."""
    rng = random.Random(0)
    n = 0
    while not stop.is_set():
        for pub in pubs:
            n += 1
            pub.stored([rng.getrandbits(63) | 1])
            if len(pub.blocks.get("gpu", ())) > 64:
                pub.removed([next(iter(pub.blocks["gpu"]))])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
