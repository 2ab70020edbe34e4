"""Routing state shared between index replicas over NATS (docs/wire.md §7, docs/deploy.md#replicas)."""

from kvindex.routing_sync.sync import RoutingSync, SyncConfig, default_replica_id

__all__ = ["RoutingSync", "SyncConfig", "default_replica_id"]
