"""Shared fixtures: a real nats-server, a real kvindex service and a real gRPC client over a socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
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

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    """A fake inference engine publishing KV events over real ZMQ (tests/test_bridge_fakes.py)."""
    from tests.test_bridge_fakes import FakeEngine  # it imports this module's helpers

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


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def index_view(index: object, instance: tuple[str, int]) -> dict[int, set[int]]:
    """An instance's keys per tier (non-empty tiers only), as the index holds them."""
    return {t: keys for t in range(4) if (keys := set(index.keys_of(instance, t)))}  # type: ignore[attr-defined]


async def converged(svc: IndexService, *pubs: FaultyPublisher, timeout: float = 5.0) -> None:
    """Wait until the service has applied every publisher's last batch and holds exactly its blocks."""
    for p in pubs:
        await p.flush()

    def same() -> bool:
        for p in pubs:
            cursor = svc.consumer.sequencer.cursor((p.worker, p.dp_rank))
            if cursor is None or cursor.repairing is not None or cursor.applied != p.seq:
                return False
            if index_view(svc.index, (p.worker, p.dp_rank)) != p.truth():
                return False
        return True

    await wait_until(same, timeout, "index equal to what the workers hold")


def mtls_token_config(nats_url: str, directory: Path, token: str = "s3cret") -> ServiceConfig:
    """A service on ``nats_url`` with mutual TLS and a bearer token: certificates made at test time in
    ``directory`` (ca.pem, server.pem/.key, client.pem/.key: kvtools.testing.natsauth.make_tls_files)
    and the token in ``directory/token``."""
    from kvindex.security import ServerSecurity, ServerTLS
    from kvtools.testing.natsauth import make_tls_files

    files = make_tls_files(directory)
    (directory / "token").write_text(token + "\n")
    config = ServiceConfig(nats_url=nats_url, grpc_host="127.0.0.1", grpc_port=0)
    config.grpc_security = ServerSecurity(
        ServerTLS(files.server_cert, files.server_key, client_ca=files.ca), token_file=directory / "token"
    )
    return config
