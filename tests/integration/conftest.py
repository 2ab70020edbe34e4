"""Fixtures of the real parts: a real nats-server, a real kvindex service, a real gRPC client over a
socket, publishers on their own NATS connections and a fake engine speaking real ZMQ."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import nats
import pytest

from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.faults import FaultyPublisher
from workers_shim.publisher import Publisher


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    """A fake inference engine publishing KV events over real ZMQ (tests/integration/bridge_fakes.py)."""
    from tests.integration.bridge_fakes import FakeEngine  # it imports this module's helpers

    eng = await FakeEngine().start()
    try:
        yield eng
    finally:
        await eng.close()


@pytest.fixture
async def nats_server() -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def service(nats_server: EmbeddedNats) -> AsyncIterator[IndexService]:
    svc = IndexService(ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


@pytest.fixture
async def make_service(nats_server: EmbeddedNats) -> AsyncIterator[Callable[..., Awaitable[IndexService]]]:
    """Factory of started services on the shared nats-server, with a custom repair config."""
    made: list[IndexService] = []

    async def make(repair: RepairConfig | None = None, **kwargs: object) -> IndexService:
        config = ServiceConfig(
            nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0, repair=repair or RepairConfig()
        )
        for name, value in kwargs.items():
            setattr(config, name, value)
        svc = IndexService(config)
        await svc.start()
        made.append(svc)
        return svc

    yield make
    for svc in made:
        await svc.stop()


@pytest.fixture
async def stub(service: IndexService) -> AsyncIterator[pb_grpc.KvIndexStub]:
    async with grpc.aio.insecure_channel(service.grpc.address) as channel:
        yield pb_grpc.KvIndexStub(channel)


@pytest.fixture
async def make_publisher(nats_server: EmbeddedNats) -> AsyncIterator[Callable[..., Awaitable[Publisher]]]:
    """Factory of started publishers, each on its own NATS connection, closed at teardown."""
    made: list[Publisher] = []

    async def make(cls: type[Publisher] = Publisher, **kwargs: object) -> Publisher:
        nc = await nats.connect(nats_server.url)
        kwargs.setdefault("heartbeat_interval", 0.2)
        pub = cls(nc, **kwargs)  # type: ignore[arg-type]
        pub._owns_nc = True
        await pub.start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        if isinstance(pub, FaultyPublisher):
            pub.faults.quiet()  # no delayed sends or partitions while closing
        await pub.close()
