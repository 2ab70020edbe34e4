"""Bounds on what the fleet can make the index hold: a runaway or hostile worker must not take the
index's memory (or the other workers' answers) with it.

Every bound is per instance or per model, so hitting one refuses only the offending input: other
instances are unaffected. Refusals are counted by reason (``kvindex_rejects{reason}``, Stats
``rejects_by_reason``), next to the wire's own rejection reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final

from kvindex.fleet.registry import InstanceState
from kvindex.repair.machine import HELD_LIMIT, REPAIR_LIMIT, SEQ_JUMP
from kvindex.wire.errors import WireError

# Refusal reasons (metric labels), alongside kvindex.wire.errors.REASONS; the repair machine's own
# three (held batches, pending repairs, a seq jump) are defined with it.
BLOCK_LIMIT: Final = "block_limit"  # an (instance, tier) would hold more than its limit: stores dropped
INSTANCE_LIMIT: Final = "instance_limit"  # a new instance of a model that has the most allowed
MODEL_LIMIT: Final = "model_limit"  # a new model beyond the most allowed

LIMIT_REASONS: Final = (BLOCK_LIMIT, INSTANCE_LIMIT, MODEL_LIMIT, HELD_LIMIT, REPAIR_LIMIT, SEQ_JUMP)


class LimitExceeded(WireError):
    """A well-formed message refused because accepting it would exceed a configured bound."""


@dataclass(frozen=True, slots=True)
class IngestLimits:
    """The bounds (``kvindex serve`` group "limits"; docs/deploy.md explains each)."""

    # Blocks per (instance, tier): the capacity the instance announced in its heartbeats times
    # ``capacity_slack`` (events and heartbeats are not atomic, so a worker at capacity may be seen
    # briefly above it); ``default_tier_blocks`` when it announced none (or 0) for that tier; never
    # above ``max_tier_blocks``, whatever it announced.
    capacity_slack: float = 1.25
    default_tier_blocks: int = 1 << 20
    max_tier_blocks: int = 1 << 24
    # 2^18: above the 224,000 workers of Dynamo's largest Mooncake run, which this index was measured
    # at (benchmarks/README.md; ~2-9 kB of memory per instance besides its blocks: docs/deploy.md).
    max_instances_per_model: int = 1 << 18
    max_models: int = 256
    # Batches held per instance while it is repaired, and the keys they carry.
    max_held_batches: int = 4096
    max_held_keys: int = 1 << 20
    # Instances being repaired (replay or snapshot) at once, periodic checks included.
    max_pending_repairs: int = 256

    def tier_limit(self, announced: int | None) -> int:
        if not announced:
            return min(self.default_tier_blocks, self.max_tier_blocks)
        return min(int(announced * self.capacity_slack), self.max_tier_blocks)

    def block_limits(self, capacity: dict[int, int]) -> tuple[int, int, int, int]:
        """Per tier (gpu, cpu, disk, shared), the most blocks an instance announcing ``capacity``
        may hold in the index."""
        gpu, cpu, disk, shared = (self.tier_limit(capacity.get(t)) for t in range(4))
        return (gpu, cpu, disk, shared)

    def limits_of(self, state: InstanceState) -> tuple[int, int, int, int]:
        """The instance's block limit per tier, from the capacity it announced last (kept on the
        state until a heartbeat changes the capacity)."""
        if state.block_limits is None:
            state.block_limits = self.block_limits(state.capacity)
        return state.block_limits


DEFAULT_INGEST_LIMITS: Final = IngestLimits()


def limits_from_meta(meta: dict[str, Any] | None) -> IngestLimits:
    """The limits an event log's header recorded (kvindex/capture), defaults for what it lacks."""
    known = {f.name for f in fields(IngestLimits)}
    return IngestLimits(**{k: v for k, v in (meta or {}).items() if k in known})
