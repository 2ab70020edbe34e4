"""gRPC TLS, mutual TLS and bearer tokens over real sockets: a real service (real nats-server), real
clients, certificates made at test time by trustme; and the CLI as an operator runs it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvindex.capture.recorder import CaptureConfig
from kvindex.capture.replay import replay
from kvindex.capture.serve import serve_replayed
from kvindex.cli import main
from kvindex.keys import block_keys
from kvindex.security import (
    ClientTLS,
    SecurityConfigError,
    ServerSecurity,
    ServerTLS,
    add_server_options,
    open_channel,
    read_token,
)
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.test_cli import KVINDEX, serve_argv
from workers_shim.publisher import Publisher

TOKEN = "s3cret-token.Abc_123"
TOKENS = list(range(64))


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


@pytest.fixture
async def secured(
    nats_server: EmbeddedNats,
) -> AsyncIterator[Callable[[ServerSecurity], Awaitable[IndexService]]]:
    """Factory of started services with the given gRPC security, on the shared nats-server."""
    made: list[IndexService] = []

    async def make(security: ServerSecurity) -> IndexService:
        config = ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0)
        config.grpc_security = security
        svc = IndexService(config)
        await svc.start()
        made.append(svc)
        return svc

    yield make
    for svc in made:
        await svc.stop()


async def stats_code(address: str, tls: ClientTLS | None = None, token: str | None = None) -> grpc.StatusCode:
    """The status of a Stats call from a fresh aio channel (OK when it is answered)."""
    async with open_channel(address, tls, token, aio=True) as channel:
        try:
            await pb_grpc.KvIndexStub(channel).Stats(pb.StatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def token_file(directory: Path, *tokens: str, name: str = "token") -> Path:
    path = directory / name
    path.write_text("".join(f"{t}\n" for t in tokens))
    return path


# -- TLS and mutual TLS ----------------------------------------------------------------------------


async def test_tls_refuses_plaintext_and_a_wrong_ca_and_serves_the_right_one(secured, pki: Pki) -> None:
    svc = await secured(ServerSecurity(ServerTLS(pki.server_cert, pki.server_key)))
    address = svc.grpc.address
    assert svc.grpc.security.mode == "tls"
    assert await stats_code(address) == grpc.StatusCode.UNAVAILABLE  # plaintext client
    assert await stats_code(address, ClientTLS(ca=pki.other_ca)) == grpc.StatusCode.UNAVAILABLE
    assert await stats_code(address, ClientTLS(ca=pki.ca)) == grpc.StatusCode.OK

    # Sync channel too (what the CLI uses), from a thread: the server runs on this loop.
    def sync_stats() -> int:
        with open_channel(address, ClientTLS(ca=str(pki.ca))) as channel:  # str paths too
            return pb_grpc.KvIndexStub(channel).Stats(pb.StatsRequest(), timeout=5).instances

    assert await asyncio.to_thread(sync_stats) == 0


async def test_server_name_override_checks_the_certificate_against_the_given_name(
    secured, pki: Pki, tmp_path: Path
) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert, key = _write_pair(ca.issue_cert("kvindex.internal"), tmp_path, "named")
    svc = await secured(ServerSecurity(ServerTLS(cert, key)))
    # Dialled by IP, the certificate (for kvindex.internal only) does not match...
    ca_file = tmp_path / "ca.pem"
    assert await stats_code(svc.grpc.address, ClientTLS(ca=ca_file)) == grpc.StatusCode.UNAVAILABLE
    # ...unless the client is told which name to expect.
    named = ClientTLS(ca=ca_file, server_name="kvindex.internal")
    assert await stats_code(svc.grpc.address, named) == grpc.StatusCode.OK
    wrong = ClientTLS(ca=ca_file, server_name="other.internal")
    assert await stats_code(svc.grpc.address, wrong) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_clients_without_a_certificate_from_the_client_ca(secured, pki: Pki) -> None:
    svc = await secured(ServerSecurity(ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca)))
    address = svc.grpc.address
    assert svc.grpc.security.mode == "mtls"
    assert await stats_code(address) == grpc.StatusCode.UNAVAILABLE
    assert await stats_code(address, ClientTLS(ca=pki.ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
    intruder = ClientTLS(ca=pki.ca, cert=pki.other_client_cert, key=pki.other_client_key)
    assert await stats_code(address, intruder) == grpc.StatusCode.UNAVAILABLE
    client = ClientTLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    assert await stats_code(address, client) == grpc.StatusCode.OK


async def test_renewed_server_certificate_is_used_for_new_connections_without_a_restart(
    secured, pki: Pki, tmp_path: Path
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    svc = await secured(ServerSecurity(ServerTLS(cert, key), reload_interval=0.0))
    assert await stats_code(svc.grpc.address, ClientTLS(ca=pki.ca)) == grpc.StatusCode.OK
    # Renewal by a new CA, written as a Secret update does: new files swapped in.
    renewed = trustme.CA()
    renewed.cert_pem.write_to_path(str(tmp_path / "renewed-ca.pem"))
    new_cert, new_key = _write_pair(renewed.issue_cert("127.0.0.1"), tmp_path, "new")
    os.replace(new_key, key)
    os.replace(new_cert, cert)
    assert await stats_code(svc.grpc.address, ClientTLS(ca=tmp_path / "renewed-ca.pem")) == grpc.StatusCode.OK
    assert await stats_code(svc.grpc.address, ClientTLS(ca=pki.ca)) == grpc.StatusCode.UNAVAILABLE


# -- bearer token ------------------------------------------------------------------------------------


async def test_token_is_required_on_every_rpc_but_health(secured, tmp_path: Path) -> None:
    security = ServerSecurity(token_file=token_file(tmp_path, TOKEN))
    svc = await secured(security)
    address = svc.grpc.address
    assert security.mode == "plaintext+token"
    unauth = grpc.StatusCode.UNAUTHENTICATED
    assert await stats_code(address) == unauth
    assert await stats_code(address, token="wrong") == unauth
    assert await stats_code(address, token=TOKEN + "x") == unauth
    assert await stats_code(address, token=TOKEN) == grpc.StatusCode.OK

    async with grpc.aio.insecure_channel(address) as bare:
        stub = pb_grpc.KvIndexStub(bare)
        for metadata in [(("authorization", f"Basic {TOKEN}"),), (("authorization", TOKEN),), ()]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS), metadata=metadata, timeout=5)
            assert err.value.code() == unauth and "bearer token" in (err.value.details() or "")
        # The scheme is case-insensitive.
        await stub.Stats(pb.StatsRequest(), metadata=(("authorization", f"bearer {TOKEN}"),), timeout=5)
        # A stream is refused before any request is read; so is reflection, and an unknown method.
        stream = stub.ScoreStream(timeout=5)
        await stream.write(pb.ScoreRequest(model="m", token_ids=TOKENS))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
        assert err.value.code() == unauth
        refl = reflection_pb2_grpc.ServerReflectionStub(bare).ServerReflectionInfo(timeout=5)
        await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await refl.read()
        assert err.value.code() == unauth
        unknown = bare.unary_unary("/kvindex.v1.KvIndex/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unknown(b"", timeout=5)
        assert err.value.code() == unauth
        # Health answers without a token (probes carry no secrets).
        health = health_pb2_grpc.HealthStub(bare)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reply = await health.Check(health_pb2.HealthCheckRequest(service="kvindex.v1.KvIndex"), timeout=5)
        assert reply.status in (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
    assert security.interceptor is not None and security.interceptor.rejected == 9

    # With the token: unary, stream and reflection all served (aio channel, as routers use).
    async with open_channel(address, token=TOKEN, aio=True) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        await stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS), timeout=5)
        stream = stub.ScoreStream(timeout=5)
        for i in range(3):
            await stream.write(pb.ScoreRequest(model="m", token_ids=TOKENS, request_id=f"r{i}"))
        await stream.done_writing()
        assert [r.request_id async for r in stream] == ["r0", "r1", "r2"]
        refl = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        listed = await refl.read()
        await refl.done_writing()
        assert "kvindex.v1.KvIndex" in {s.name for s in listed.list_services_response.service}

    def sync_score() -> int:  # the sync channel adds the token too
        with open_channel(address, token=TOKEN) as channel:
            stub = pb_grpc.KvIndexStub(channel)
            return len(stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS), timeout=5).ranked)

    assert await asyncio.to_thread(sync_score) == 0
    assert security.interceptor.rejected == 9


async def test_token_file_rotation_accepts_listed_tokens_and_keeps_the_last_good_file(
    secured, tmp_path: Path
) -> None:
    path = token_file(tmp_path, "old-token")
    svc = await secured(ServerSecurity(token_file=path, reload_interval=0.0))
    address = svc.grpc.address
    assert await stats_code(address, token="old-token") == grpc.StatusCode.OK
    # Rotation: the new token first (what clients read), the old one still accepted.
    os.replace(token_file(tmp_path, "new-token", "old-token", name="next"), path)
    assert await stats_code(address, token="new-token") == grpc.StatusCode.OK
    assert await stats_code(address, token="old-token") == grpc.StatusCode.OK
    assert read_token(path) == "new-token"
    os.replace(token_file(tmp_path, "# rotated", "new-token", name="next"), path)
    assert await stats_code(address, token="old-token") == grpc.StatusCode.UNAUTHENTICATED
    # A file emptied by mistake does not lock everyone out (nor let anyone in).
    path.write_text("")
    assert await stats_code(address, token="new-token") == grpc.StatusCode.OK
    assert await stats_code(address) == grpc.StatusCode.UNAUTHENTICATED


async def test_tls_and_token_together_and_replay_serve_uses_the_same_security(
    secured, nats_server: EmbeddedNats, pki: Pki, tmp_path: Path
) -> None:
    # A capture of a live service, replayed and served with mutual TLS and a token.
    log = tmp_path / "events.kvlog"
    config = ServiceConfig(nats_url=nats_server.url, grpc_host="127.0.0.1", grpc_port=0)
    config.capture = CaptureConfig(log)
    live = IndexService(config)
    await live.start()
    try:
        pub = await Publisher.connect(nats_server.url, worker="w1", model="m", block_size=16)
        pub.stored(block_keys(TOKENS, 16, "m"))
        await pub.close()
        await wait_until(lambda: live.index.stats().entries[0] == 4, what="4 blocks applied")
    finally:
        await live.stop()
    token = token_file(tmp_path, TOKEN)
    security = ServerSecurity(ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca), token_file=token)
    client = ClientTLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    server = await serve_replayed(replay(str(log)).replayer, "127.0.0.1", 0, security)
    try:
        assert await stats_code(server.address, client) == grpc.StatusCode.UNAUTHENTICATED
        assert await stats_code(server.address, ClientTLS(ca=pki.ca), TOKEN) == grpc.StatusCode.UNAVAILABLE
        async with open_channel(server.address, client, TOKEN, aio=True) as channel:
            reply = await pb_grpc.KvIndexStub(channel).Lookup(pb.LookupRequest(model="m", token_ids=TOKENS))
            assert [(m.instance_id, m.matched.gpu) for m in reply.matches] == [("w1/0", 4)]
    finally:
        await server.stop()

    # The same through the command line: kvindex replay --serve takes serve's flags.
    port = free_port()
    tls_flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    mtls = ["--tls-client-ca", str(pki.ca), "--auth-token-file", str(token)]
    proc = subprocess.Popen(
        [KVINDEX, "replay", str(log), "--plain", "--serve", "--grpc-port", str(port), *tls_flags, *mtls],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the test timeout
            if "serving the replayed state" in line:
                break
        address = f"127.0.0.1:{port}"
        assert await stats_code(address, client) == grpc.StatusCode.UNAUTHENTICATED
        assert await stats_code(address, client, TOKEN) == grpc.StatusCode.OK
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- configuration errors -----------------------------------------------------------------------------


def test_bad_configurations_fail_at_start_with_a_message_naming_the_problem(pki: Pki, tmp_path: Path) -> None:
    def serve_args(*argv: str) -> Any:
        p = argparse.ArgumentParser()
        add_server_options(p)
        return p.parse_args(argv)

    with pytest.raises(SystemExit, match="--tls-cert and --tls-key go together"):
        ServerSecurity.from_args(serve_args("--tls-cert", str(pki.server_cert)))
    with pytest.raises(SystemExit, match="--tls-client-ca"):
        ServerSecurity.from_args(serve_args("--tls-client-ca", str(pki.ca)))
    with pytest.raises(SystemExit, match=r"no-such\.pem"):
        ServerSecurity.from_args(serve_args("--tls-cert", "no-such.pem", "--tls-key", str(pki.server_key)))
    with pytest.raises(SecurityConfigError, match="is empty"):
        ServerSecurity(token_file=token_file(tmp_path, "", name="empty"))
    with pytest.raises(SecurityConfigError, match="spaces or non-ASCII") as err:
        ServerSecurity(token_file=token_file(tmp_path, "two words", name="spaced"))
    assert "two" not in str(err.value)  # the token itself never appears in a message
    with pytest.raises(SecurityConfigError, match="holds no token"):
        read_token(token_file(tmp_path, "# only a comment", name="comment"))
    with pytest.raises(SecurityConfigError, match="both --tls-cert and --tls-key"):
        open_channel("127.0.0.1:1", ClientTLS(ca=pki.ca, cert=pki.client_cert))


# -- the CLI -------------------------------------------------------------------------------------------


def _read_log_until(proc: subprocess.Popen[str], event: str, seen: list[str], timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"kvindex exited early (code {proc.poll()}): {''.join(seen)}")
        seen.append(line)
        record = json.loads(line)
        if record.get("event") == event:
            return record
    raise AssertionError(f"no {event!r} log line within {timeout}s")


def test_cli_queries_a_mutual_tls_and_token_server(pki: Pki, tmp_path: Path, capsys) -> None:
    token = token_file(tmp_path, TOKEN)
    port = free_port()
    proc = subprocess.Popen(
        [
            *serve_argv(port),
            "--log-format",
            "json",
            "--tls-cert",
            str(pki.server_cert),
            "--tls-key",
            str(pki.server_key),
            "--tls-client-ca",
            str(pki.ca),
            "--auth-token-file",
            str(token),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seen: list[str] = []
    try:
        nats_url = _read_log_until(proc, "embedded_nats_started", seen)["url"]
        serving = _read_log_until(proc, "kvindex_serving", seen)
        assert serving["grpc_security"] == "mtls+token"

        async def publish() -> None:
            pub = await Publisher.connect(nats_url, worker="node-a", model="demo", block_size=16)
            pub.stored(block_keys(TOKENS, 16, "demo")[:3])
            await pub.close()

        asyncio.run(publish())
        server = f"127.0.0.1:{port}"
        client = ["--server", server, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
        client += ["--tls-key", str(pki.client_key)]
        authed = [*client, "--auth-token-file", str(token)]
        tokens = ",".join(map(str, TOKENS))

        deadline = time.monotonic() + 10
        while True:  # in-process main(argv): the same code path as the command, without its start-up
            assert main(["stats", *authed]) == 0
            stats = json.loads(capsys.readouterr().out)
            if int(stats["entries"]["gpu"]) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert int(stats["entries"]["gpu"]) == 3
        assert main(["score", *authed, "--model", "demo", "--tokens", tokens]) == 0
        (ranked,) = json.loads(capsys.readouterr().out)["ranked"]
        assert ranked["instanceId"] == "node-a/0" and int(ranked["matched"]["gpu"]) == 3
        assert main(["lookup", *authed, "--model", "demo", "--tokens", tokens]) == 0
        assert json.loads(capsys.readouterr().out)["matches"][0]["matched"]["gpu"] == "3"
        assert main(["instances", *authed]) == 0
        assert json.loads(capsys.readouterr().out)["instances"][0]["instanceId"] == "node-a/0"

        assert main(["stats", *client]) == 1  # no token
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["stats", "--server", server, "--auth-token-file", str(token)]) == 1  # plaintext
        assert "UNAVAILABLE" in capsys.readouterr().err
        no_cert = ["--server", server, "--tls-ca", str(pki.ca), "--auth-token-file", str(token)]
        assert main(["stats", *no_cert]) == 1  # mutual TLS: no client certificate
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert main(["stats", *authed, "--server-name", "elsewhere"]) == 1  # name not in the certificate
        assert "UNAVAILABLE" in capsys.readouterr().err

        # The command itself, as installed (one run: the flags reach the same code through the script).
        done = subprocess.run(
            [KVINDEX, "instances", *authed], capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["instances"][0]["instanceId"] == "node-a/0"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    rest = proc.stderr.read()
    assert "grpc_unauthenticated" in rest or any("grpc_unauthenticated" in line for line in seen)
    assert TOKEN not in "".join(seen) + rest  # never logged


async def test_one_security_serves_tls_on_two_ports(pki: Pki) -> None:
    """`serve --ext-proc-port` with TLS: the API and the ext_proc port share one ServerSecurity. gRPC's
    dynamic credentials give their initial certificate to the first port only, so a second port on
    the same credentials failed to bind; each port now gets its own, and both handshake."""
    security = ServerSecurity(ServerTLS(pki.server_cert, pki.server_key))
    servers = []
    try:
        for _ in range(2):
            server = security.new_server()
            health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
            port = security.add_port(server, "127.0.0.1:0")
            assert port > 0, "the port did not bind"
            await server.start()
            servers.append((server, port))
        for _server, port in servers:
            async with open_channel(f"127.0.0.1:{port}", ClientTLS(ca=pki.ca), aio=True) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for server, _port in servers:
            await server.stop(None)
