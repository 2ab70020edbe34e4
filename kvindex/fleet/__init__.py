"""Instances of the fleet: identity, ordering state, load and health as the index sees them."""

from kvindex.fleet.registry import InstanceState, Registry, instance_id

__all__ = ["InstanceState", "Registry", "instance_id"]
