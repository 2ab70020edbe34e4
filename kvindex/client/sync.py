"""The blocking client: the asyncio client run on a private event loop thread.

One implementation of the protocol (stream matching, deadlines, reopening, fallback) serves both
APIs; a blocking call costs one hop to the loop thread and back (tens of microseconds). Safe to call
from many threads at once: their Score calls share the one stream.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvindex.client.aio import AsyncKvIndexClient, ClientStats, Decision, IndexHealth
from kvindex.client.fallback import InstanceCache
from kvindex.v1 import kvindex_pb2 as pb

T = TypeVar("T")


class KvIndexClient:
    """Blocking twin of :class:`AsyncKvIndexClient` (same arguments, same methods)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvindex-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncKvIndexClient:  # gRPC aio channels belong to the loop they are made on
            client = AsyncKvIndexClient(target, **kwargs)
            client.start()
            return client

        self._client = self._run(make())
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def stats(self) -> ClientStats:
        return self._client.stats

    @property
    def instances(self) -> InstanceCache:
        return self._client.instances

    @property
    def health(self) -> IndexHealth:
        return self._client.health

    def call(self, name: str, request: Any = None, *, timeout: float | None = None, **fields: Any) -> Any:
        """``AsyncKvIndexClient.call``: any unary method by its proto name."""
        return self._run(self._client.call(name, request, timeout=timeout, **fields))

    def score(self, model: str, **kwargs: Any) -> Decision:
        return self._run(self._client.score(model, **kwargs))

    def commit(self, request_id: str, instance_id: str, model: str, **kwargs: Any) -> bool:
        return self._run(self._client.commit(request_id, instance_id, model, **kwargs))

    def release(self, request_id: str, phase: str = "finished", *, timeout: float | None = None) -> bool:
        return self._run(self._client.release(request_id, phase, timeout=timeout))

    def release_reported(self, request_id: str, phase: str = "finished", **report: Any) -> tuple[bool, str]:
        """``AsyncKvIndexClient.release_reported``: cached_tokens, ttft_ms, prompt_tokens, timeout."""
        return self._run(self._client.release_reported(request_id, phase, **report))

    def lookup(self, model: str, **kwargs: Any) -> pb.LookupResponse:
        return self._run(self._client.lookup(model, **kwargs))

    def list_instances(self, model: str = "", **kwargs: Any) -> list[pb.InstanceInfo]:
        """``AsyncKvIndexClient.list_instances``: timeout, view, page_size."""
        return self._run(self._client.list_instances(model, **kwargs))

    def stats_rpc(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return self._run(self._client.stats_rpc(timeout=timeout))

    def refresh_instances(self, timeout: float | None = None) -> bool:
        return self._run(self._client.refresh_instances(timeout))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> KvIndexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KvIndexClient"]
