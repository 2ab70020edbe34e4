"""Helpers shared by unit and integration tests (the real parts' fixtures: tests/integration/conftest.py)."""

from __future__ import annotations

import os

# Before grpc is imported: grpcio's fork handlers can crash a subprocess.Popen child before it execs
# (epoll_wait EBADF, SIGABRT; grpc/grpc#43055, open since 1.81). The tests start processes beside live
# channels and never use gRPC in a forked child, so they need no fork support.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from kvindex.service.app import IndexService, ServiceConfig
from kvtools.testing.faults import FaultyPublisher

ROOT = Path(__file__).resolve().parents[1]


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


# -- gRPC TLS: certificates made at test time (tests/*/test_grpc_security.py) --------------------------


@dataclass
class Pki:
    """A CA with a server certificate for 127.0.0.1/localhost and a client certificate; another CA
    (the wrong one) with its own client certificate; all as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    dir: Path


def _write_pair(cert: trustme.LeafCert, directory: Path, name: str) -> tuple[Path, Path]:
    chain, key = directory / f"{name}.pem", directory / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(chain))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(chain), append=True)
    cert.private_key_pem.write_to_path(str(key))
    return chain, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    server_cert, server_key = _write_pair(ca.issue_cert("127.0.0.1", "localhost"), d, "server")
    client_cert, client_key = _write_pair(ca.issue_cert("router-1.clients"), d, "client")
    o_cert, o_key = _write_pair(other.issue_cert("intruder.clients"), d, "other-client")
    return Pki(
        d / "ca.pem", server_cert, server_key, client_cert, client_key, d / "other-ca.pem", o_cert, o_key, d
    )


def token_file(directory: Path, *tokens: str, name: str = "token") -> Path:
    path = directory / name
    path.write_text("".join(f"{t}\n" for t in tokens))
    return path
