"""Self-healing: the repair state machine (machine.py), replays and snapshots over NATS and periodic
reconciliation (nats_repair.py)."""

from kvindex.repair.nats_repair import NatsRepairer, RepairConfig

__all__ = ["NatsRepairer", "RepairConfig"]
