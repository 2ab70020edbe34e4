"""Secured NATS: every authentication method and TLS against a real nats-server started with the
config file an operator would write, wrong credentials refused with a clear error, processes taking
options from the environment and a TOML file, and no secret in logs, ListInstances or metrics. The
settings alone: tests/unit/test_nats_security.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvindex.config import NatsConnectError, NatsSettings, redact_url
from kvindex.keys import block_keys
from kvindex.repair.nats_repair import RepairConfig
from kvindex.service.app import IndexService, ServiceConfig
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.natsauth import Operator, make_tls_files, new_nkey
from tests.conftest import index_view, wait_until
from tests.unit.test_nats_security import PASSWORD, TOKEN
from workers_shim.publisher import Publisher

BIN = Path(sys.executable).parent
MODEL = "llama"


@pytest.fixture
async def servers() -> AsyncIterator[list[EmbeddedNats]]:
    started: list[EmbeddedNats] = []
    yield started
    for s in started:
        await s.stop()


async def _serve_config(tmp_path: Path, text: str, scheme: str = "nats") -> EmbeddedNats:
    conf = tmp_path / f"nats-{len(list(tmp_path.glob('nats-*.conf')))}.conf"
    conf.write_text(text)
    server = EmbeddedNats(config=conf, scheme=scheme)
    await server.start()
    return server


async def _index_and_worker(settings: NatsSettings) -> None:
    """A real index and a real publisher on ``settings``: the worker's blocks reach the index."""
    svc = IndexService(
        ServiceConfig(nats_url=settings, grpc_host="127.0.0.1", grpc_port=0, repair=RepairConfig())
    )
    await svc.start()
    pub = await Publisher.connect(settings, worker="w1", model=MODEL, block_size=4, heartbeat_interval=0.1)
    try:
        keys = block_keys(list(range(16)), 4, MODEL)
        pub.stored(keys)
        await pub.flush()
        await wait_until(
            lambda: index_view(svc.index, ("w1", 0)) == {0: set(keys)}, what="the worker's blocks indexed"
        )
    finally:
        await pub.close()
        await svc.stop()


# -- each authentication method over a real server -------------------------------------------------


async def test_user_password(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    server = await _serve_config(tmp_path, f'authorization {{ user: alice, password: "{PASSWORD}" }}\n')
    servers.append(server)
    await _index_and_worker(NatsSettings(servers=(server.url,), user="alice", password=PASSWORD))
    with pytest.raises(NatsConnectError, match="refused the credentials") as info:
        await Publisher.connect(
            NatsSettings(servers=(server.url,), user="alice", password="wrong"),
            worker="w",
            model="m",
            block_size=4,
        )
    assert "wrong" not in str(info.value)
    with pytest.raises(NatsConnectError, match="Authorization Violation"):
        await Publisher.connect(server.url, worker="w", model="m", block_size=4)  # no credentials


async def test_password_in_url_is_redacted_and_works(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    server = await _serve_config(tmp_path, f'authorization {{ user: alice, password: "{PASSWORD}" }}\n')
    servers.append(server)
    url = f"nats://alice:{PASSWORD}@127.0.0.1:{server.port}"
    assert redact_url(url) == f"nats://alice:***@127.0.0.1:{server.port}"
    settings = NatsSettings.from_url(url)
    assert settings.auth == "url" and PASSWORD not in json.dumps(settings.describe())
    await _index_and_worker(settings)


async def test_token(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    server = await _serve_config(tmp_path, f'authorization {{ token: "{TOKEN}" }}\n')
    servers.append(server)
    await _index_and_worker(NatsSettings(servers=(server.url,), token=TOKEN))
    with pytest.raises(NatsConnectError, match="refused the credentials"):
        await Publisher.connect(
            NatsSettings(servers=(server.url,), token="nope"), worker="w", model="m", block_size=4
        )


async def test_nkey(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    user, stranger = new_nkey("user"), new_nkey("user")
    server = await _serve_config(tmp_path, f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}\n")
    servers.append(server)
    seed = tmp_path / "user.nk"
    seed.write_bytes(user.seed)
    await _index_and_worker(NatsSettings(servers=(server.url,), nkey_seed=str(seed)))
    other = tmp_path / "stranger.nk"
    other.write_bytes(stranger.seed)
    with pytest.raises(NatsConnectError, match="refused the credentials"):
        await Publisher.connect(
            NatsSettings(servers=(server.url,), nkey_seed=str(other)), worker="w", model="m", block_size=4
        )


async def test_creds_decentralized_jwt(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    """Operator -> account -> user JWTs signed with NKeys at test time; the server trusts the operator."""
    op = Operator.create()
    server = await _serve_config(tmp_path, op.server_config())
    servers.append(server)
    creds = op.user_creds(tmp_path / "worker.creds", "worker")
    await _index_and_worker(NatsSettings(servers=(server.url,), creds=str(creds)))
    # A user signed by an account the server does not know is refused.
    foreign = Operator.create().user_creds(tmp_path / "foreign.creds", "intruder")
    with pytest.raises(NatsConnectError, match="refused the credentials"):
        await Publisher.connect(
            NatsSettings(servers=(server.url,), creds=str(foreign)), worker="w", model="m", block_size=4
        )


# -- TLS and mutual TLS ----------------------------------------------------------------------------


async def test_tls_and_mutual_tls(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    tls = make_tls_files(tmp_path)
    plain_tls = await _serve_config(
        tmp_path,
        f'tls {{ cert_file: "{tls.server_cert}", key_file: "{tls.server_key}" }}\n',
        scheme="tls",
    )
    servers.append(plain_tls)
    await _index_and_worker(NatsSettings(servers=(plain_tls.url,), tls_ca=str(tls.ca)))
    with pytest.raises(NatsConnectError, match="certificate verification failed"):
        await Publisher.connect(
            NatsSettings(servers=(plain_tls.url,), tls_ca=str(tls.other_ca)),
            worker="w",
            model="m",
            block_size=4,
        )

    mutual = await _serve_config(
        tmp_path,
        f'tls {{ cert_file: "{tls.server_cert}", key_file: "{tls.server_key}", ca_file: "{tls.ca}", '
        "verify: true }\n",
        scheme="tls",
    )
    servers.append(mutual)
    await _index_and_worker(
        NatsSettings(
            servers=(mutual.url,),
            tls_ca=str(tls.ca),
            tls_cert=str(tls.client_cert),
            tls_key=str(tls.client_key),
        )
    )
    with pytest.raises(NatsConnectError, match="TLS"):
        await Publisher.connect(
            NatsSettings(servers=(mutual.url,), tls_ca=str(tls.ca)), worker="w", model="m", block_size=4
        )


# -- the real processes: kvindex serve and capture with secrets, nothing leaked --------------------


async def _read_json_until(
    proc: asyncio.subprocess.Process, event: str, lines: list[str], stderr: bool = False
) -> dict[str, Any]:
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    while True:
        raw = await asyncio.wait_for(stream.readline(), 20)
        if not raw:
            raise AssertionError(f"process ended before {event}: {''.join(lines)[-2000:]}")
        text = raw.decode()
        lines.append(text)
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if record.get("event") == event:
            return record


async def _drain(proc: asyncio.subprocess.Process, lines: list[str]) -> None:
    assert proc.stdout is not None
    while raw := await proc.stdout.readline():
        lines.append(raw.decode())


async def test_serve_and_capture_processes_with_secrets_from_env_and_toml(
    tmp_path: Path, servers: list[EmbeddedNats]
) -> None:
    server = await _serve_config(
        tmp_path,
        "authorization { users = [ "
        f'{{user: index, password: "{PASSWORD}"}}, {{user: cap, password: "{TOKEN}"}} ] }}\n',
    )
    servers.append(server)
    cfg = tmp_path / "kvindex.toml"
    cfg.write_text(f'nats-url = "{server.url}"\nnats-user = "index"\n[serve]\nmetrics-port = 0\n')
    grpc_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "KVINDEX_NATS_PASSWORD": PASSWORD, "KVINDEX_METRICS_PORT": str(metrics_port)}
    serve = await asyncio.create_subprocess_exec(
        str(BIN / "kvindex"), "serve", "--config", str(cfg), "--grpc-host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    capture_env = {
        **os.environ,
        "KVINDEX_NATS_URL": server.url,
        "KVINDEX_NATS_USER": "cap",
        "KVINDEX_NATS_PASSWORD": TOKEN,
    }
    capture = await asyncio.create_subprocess_exec(
        str(BIN / "kvindex"), "capture", "--out", str(tmp_path / "cap.kvlog"), "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=capture_env,
    )  # fmt: skip
    serve_lines: list[str] = []
    capture_lines: list[str] = []
    try:
        serving = await _read_json_until(serve, "kvindex_serving", serve_lines)
        assert (serving["nats_auth"], serving["metrics_port"]) == ("user", metrics_port)  # env over TOML
        await _read_json_until(capture, "capture_started", capture_lines)
        pub = await Publisher.connect(
            NatsSettings(servers=(server.url,), user="index", password=PASSWORD),
            worker="node-a", model=MODEL, block_size=4,
        )  # fmt: skip
        keys = block_keys(list(range(8)), 4, MODEL)
        pub.stored(keys)
        await pub.heartbeat()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.KvIndexStub(channel)
            reply: Any = None
            for _ in range(200):
                reply = await stub.ListInstances(pb.ListInstancesRequest())
                if reply.instances:
                    break
                await asyncio.sleep(0.05)
            assert [i.worker for i in reply.instances] == ["node-a"]
            listed = str(reply) + str(await stub.Stats(pb.StatsRequest()))
        await pub.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        metrics = (await reader.read()).decode()
        writer.close()
        assert "kvindex_batches_applied_total" in metrics
    finally:
        for proc in (serve, capture):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(_drain(serve, serve_lines), _drain(capture, capture_lines)), 20)
        await serve.wait()
        await capture.wait()
    everything = "".join(serve_lines + capture_lines) + listed + metrics
    assert PASSWORD not in everything and TOKEN not in everything
    assert (tmp_path / "cap.kvlog").stat().st_size > 0
    assert PASSWORD.encode() not in (tmp_path / "cap.kvlog").read_bytes()


async def test_serve_refuses_wrong_credentials_clearly(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    server = await _serve_config(tmp_path, f'authorization {{ token: "{TOKEN}" }}\n')
    servers.append(server)
    env = {**os.environ, "KVINDEX_NATS_TOKEN": "not-" + TOKEN}
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "kvindex"), "serve", "--nats", server.url, "--grpc-port", "0", "--metrics-port", "-1",
        "--log-format", "json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    failed = [json.loads(line) for line in out.decode().splitlines() if "nats_connect_failed" in line]
    assert failed and "refused the credentials (Authorization Violation)" in failed[0]["error"]
    assert "auth token" in failed[0]["error"] and TOKEN not in out.decode()


async def test_kvshim_bridge_process_with_creds_and_tls(tmp_path: Path, servers: list[EmbeddedNats]) -> None:
    """A `kvshim vllm` process: server list and CA from --config, its .creds from the environment, on
    a server requiring both JWT auth and TLS; the engine's blocks reach an index with its own creds."""
    from tests.integration.bridge_fakes import FakeEngine, VllmBatch, VllmStored, encode, expect, fake_hash
    from tests.integration.test_bridge_cli import KVSHIM

    op = Operator.create()
    tls = make_tls_files(tmp_path)
    server = await _serve_config(
        tmp_path,
        op.server_config() + f'tls {{ cert_file: "{tls.server_cert}", key_file: "{tls.server_key}" }}\n',
        scheme="tls",
    )
    servers.append(server)
    index_creds = op.user_creds(tmp_path / "index.creds", "index")
    shim_creds = op.user_creds(tmp_path / "shim.creds", "node-1")
    cfg = tmp_path / "shim.toml"
    cfg.write_text(f'nats-url = ["{server.url}"]\nnats-tls-ca = "{tls.ca}"\n[vllm]\nblock-size = 4\n')
    svc = IndexService(
        ServiceConfig(
            nats_url=NatsSettings(servers=(server.url,), creds=str(index_creds), tls_ca=str(tls.ca)),
            grpc_host="127.0.0.1",
            grpc_port=0,
        )
    )
    await svc.start()
    engine = await FakeEngine().start()
    seed = shim_creds.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]

    async def run_shim(creds: Path) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            KVSHIM, "vllm", "--config", str(cfg), "--zmq", engine.endpoint, "--topic", "kv-events",
            "--worker-id", "node-1", "--model", MODEL, "--log-format", "json",
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "KVINDEX_NATS_CREDS": str(creds)},
        )  # fmt: skip

    proc = await run_shim(shim_creds)
    try:
        lines: list[str] = []
        started = await _read_json_until(proc, "kvshim_started", lines, stderr=True)
        assert started["nats"] == {"servers": [server.url], "auth": "creds", "tls": "on"}
        await engine.wait_subscribed()
        prompt = list(range(12))
        stored = VllmStored([fake_hash(i) for i in range(3)], None, prompt, 4, None, "GPU", None)
        await engine.publish(encode(VllmBatch(0.0, [stored])))
        async with grpc.aio.insecure_channel(svc.grpc.address) as channel:
            await expect(
                pb_grpc.KvIndexStub(channel), MODEL, {"node-1/0": (3, (3, 0, 0, 0))}, token_ids=prompt
            )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.stderr is not None
        assert seed.encode() not in (await proc.stderr.read()) + "".join(lines).encode()
        # A worker whose credentials the server does not trust stops with a clear error.
        stranger = Operator.create().user_creds(tmp_path / "stranger.creds", "node-1")
        proc = await run_shim(stranger)
        failed = await _read_json_until(proc, "kvshim_failed", lines, stderr=True)
        assert "refused the credentials" in failed["error"] and "auth creds, tls on" in failed["error"]
        assert await asyncio.wait_for(proc.wait(), 10) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await engine.close()
        await svc.stop()


async def test_kvshim_sim_with_a_token_from_the_environment(
    tmp_path: Path, servers: list[EmbeddedNats]
) -> None:
    server = await _serve_config(tmp_path, f'authorization {{ token: "{TOKEN}" }}\n')
    servers.append(server)
    settings = NatsSettings(servers=(server.url,), token=TOKEN)
    svc = IndexService(ServiceConfig(nats_url=settings, grpc_host="127.0.0.1", grpc_port=0))
    await svc.start()
    kvshim = str(BIN / "kvshim")
    argv = [kvshim, "sim", "--nats", server.url, "--workers", "1", "--gpu-blocks", "64", "--duration", "2"]
    try:
        wrong = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "KVINDEX_NATS_TOKEN": "not-it"},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(wrong.communicate(), 30)
        assert wrong.returncode == 1 and b"refused the credentials" in out
        right = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "KVINDEX_NATS_TOKEN": TOKEN},
        )  # fmt: skip
        await wait_until(lambda: svc.registry.get(("sim-0", 0)) is not None, 20, "the simulated worker heard")
        out, _ = await asyncio.wait_for(right.communicate(), 30)
        assert right.returncode == 0 and TOKEN.encode() not in out
    finally:
        await svc.stop()
