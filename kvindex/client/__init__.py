"""Python client for routers: ``KvIndexClient`` (blocking) and ``AsyncKvIndexClient`` (asyncio).

Score over one long-lived ScoreStream, unary Commit / Release / Lookup / ListInstances, per-call
deadlines, reopening of broken streams, and a fallback decision (rendezvous hash of the prompt's
first blocks over the instances last seen) when the index is down or slow. Design and failure
modes: kvindex/client/README.md.
"""

from kvindex.api.errors import BadRequest
from kvindex.client.aio import (
    DEADLINE,
    ERROR,
    INDEX_EMPTY,
    STREAM_BROKEN,
    UNAVAILABLE,
    AsyncKvIndexClient,
    ClientStats,
    Decision,
    IndexHealth,
    Target,
)
from kvindex.client.channel import call_metadata, create_channel
from kvindex.client.errors import IndexUnavailable
from kvindex.client.fallback import (
    Fallback,
    InstanceCache,
    KnownInstance,
    RendezvousFallback,
    prefix_key,
    static_instances,
)
from kvindex.client.sync import KvIndexClient

__all__ = [
    "DEADLINE",
    "ERROR",
    "INDEX_EMPTY",
    "STREAM_BROKEN",
    "UNAVAILABLE",
    "AsyncKvIndexClient",
    "BadRequest",
    "ClientStats",
    "Decision",
    "Fallback",
    "IndexHealth",
    "IndexUnavailable",
    "InstanceCache",
    "KnownInstance",
    "KvIndexClient",
    "RendezvousFallback",
    "Target",
    "call_metadata",
    "create_channel",
    "prefix_key",
    "static_instances",
]
