"""Simulated vLLM-like engines for routing experiments and live demos (README.md in this folder)."""

from workers_shim.sim.driver import MirrorSink, run_until_idle
from workers_shim.sim.engine import (
    TIERS,
    Completion,
    EngineConfig,
    EngineLoad,
    EngineStats,
    SimEngine,
    SimRequest,
)
from workers_shim.sim.tiers import EventSink, LruTier, SharedPool
from workers_shim.sim.timemodel import PROFILES, Profile, TimeModel

__all__ = [
    "PROFILES",
    "TIERS",
    "Completion",
    "EngineConfig",
    "EngineLoad",
    "EngineStats",
    "EventSink",
    "LruTier",
    "MirrorSink",
    "Profile",
    "SharedPool",
    "SimEngine",
    "SimRequest",
    "TimeModel",
    "run_until_idle",
]
