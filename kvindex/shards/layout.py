"""Which shard owns which worker, and the subjects shards and fronts use (docs/shards.md).

The partition is the nats-server's own: a subject mapping ``{{partition(N,1)}}`` on the worker id
token (FNV-1a 32-bit of the id, modulo N) moves each worker's events and heartbeats to
``{prefix}.part.{N}.{i}.{events|status}.{worker}``, so shard ``i`` subscribes to its partition only
and never receives (and drops) the others' messages. Both of a worker's subjects map to one
partition, so its batches and heartbeats still reach one subscription in publishing order.
``partition_of`` computes the same function here (tests check it against a real server)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvindex.wire.subjects import EVENTS, HEARTBEAT, Subjects

MAX_SHARDS = 1024  # far beyond any useful fan-out; a typo such as 1000/2000 should not pass

_SPEC_RE = re.compile(r"(\d+)/(\d+)")


def partition_of(worker: str, shards: int) -> int:
    """The shard owning ``worker`` out of ``shards``: nats-server's ``partition(shards, 1)``."""
    h = 0x811C9DC5
    for byte in worker.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % shards


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` of ``count`` (``serve --shard I/N``)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 2 <= self.count <= MAX_SHARDS:
            raise ValueError(f"shard count must be 2..{MAX_SHARDS}, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be 0..{self.count - 1}, got {self.index}")

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        """``I/N`` (ValueError saying what is wrong otherwise)."""
        m = _SPEC_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"expected I/N (e.g. 0/2), got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, worker: str) -> bool:
        return partition_of(worker, self.count) == self.index


def partition_subjects(fleet: Subjects, spec: ShardSpec) -> Subjects:
    """The subjects a shard's consumer reads: its partition's ``{prefix}.part.N.i``."""
    return Subjects(f"{fleet.prefix}.part.{spec.count}.{spec.index}")


def match_subject(fleet: Subjects, count: int, index: int) -> str:
    """Where shard ``index`` of ``count`` answers match queries (request/reply, one queue group:
    replicas of a shard share the load and take over from each other)."""
    return f"{fleet.prefix}.match.{count}.{index}"


MATCH_QUEUE = "kvindex-shard"


def nats_mappings(fleet: Subjects, count: int) -> str:
    """The nats-server configuration block that partitions the fleet into ``count`` shards (goes in
    the server's config file, or in the account's ``mappings``)."""
    p = fleet.prefix
    lines = ["mappings = {"]
    for kind in (EVENTS, HEARTBEAT):
        lines.append(
            f'  "{p}.{kind}.*": "{p}.part.{count}.{{{{partition({count},1)}}}}.{kind}.{{{{wildcard(1)}}}}"'
        )
    lines.append("}")
    return "\n".join(lines) + "\n"
