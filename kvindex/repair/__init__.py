"""Self-healing: replays and snapshots over NATS, periodic reconciliation, liveness."""

from kvindex.repair.nats_repair import NatsRepairer, RepairConfig

__all__ = ["NatsRepairer", "RepairConfig"]
