"""The index and kvshim containers of deploy/k8s, run as processes with their manifests' command lines
and environment: Secrets written as the files the pods mount (NATS .creds and CA, gRPC certificate
and token), a real nats-server requiring JWT credentials and TLS, a fake vLLM publishing KV events.
Only what a cluster would provide is substituted: mount paths, the NATS URL, free ports (the test
cannot take 50051), the fake engine's ZMQ endpoints, and the tokenizer the index's init container
would fetch from the Hugging Face Hub (a ChatML fixture tokenizer in its place: no network here).
What the probes and a router see is checked: liveness and readiness over TLS, the token required, the
worker's blocks and endpoint in the index, a chat tokenized and ranked, and a clean exit on SIGTERM
within the pod's grace period."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvindex.api.server import LIVENESS, READINESS
from kvindex.security import ClientTLS, open_channel
from kvindex.service.natsd import EmbeddedNats, free_port
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from kvtools.testing.natsauth import Operator, make_tls_files
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir
from tests.test_bridge_fakes import FakeEngine, VllmBatch, VllmStored, encode, expect, fake_hash
from tests.test_deploy_files import FIELD_SAMPLES, RUNS, Run, parse

BIN = Path(sys.executable).parent
TOKEN = "f3c1e0b2a9d84c7e-deploy-test-token"


def _run(prefix: list[str], pod: str | None = None) -> Run:
    found = [r for r in RUNS if r.argv[: len(prefix)] == prefix and (pod is None or r.pod.name == pod)]
    assert found, f"no container runs {prefix}"
    return found[0]


def _pod_files(run: Run, root: Path, secrets: dict[tuple[str, str], bytes]) -> dict[str, Path]:
    """Each volume mount of ``run``'s container as a local folder holding what the kubelet would put
    there; returns mountPath -> folder."""
    volumes = {v["name"]: v for v in run.pod.spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in run.container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        folder = root / run.pod.name / run.container["name"] / mount["name"]
        folder.mkdir(parents=True)
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            items = volume["secret"].get("items")
            pairs = (
                [(i["key"], i["path"]) for i in items]
                if items
                else [(k, k) for (n, k) in secrets if n == name]
            )
            for key, path in pairs:
                (folder / path).write_bytes(secrets[(name, key)])
        mounts[mount["mountPath"].rstrip("/")] = folder
    return mounts


def _local(value: str, mounts: dict[str, Path]) -> str:
    """``value`` with a mounted path (also the DIR of ``MODEL=DIR``) moved to its local folder."""
    head, sep, path = value.rpartition("=") if "=" in value and not value.startswith("/") else ("", "", value)
    for mount_path, folder in sorted(mounts.items(), key=lambda m: -len(m[0])):
        if path.startswith(mount_path + "/"):
            return head + sep + str(folder) + path[len(mount_path) :]
    return value


def _replace_option(argv: list[str], option: str, value: str) -> list[str]:
    at = argv.index(option)
    return [*argv[: at + 1], value, *argv[at + 2 :]]


async def _until(
    proc: asyncio.subprocess.Process, stream: Any, event: str, lines: list[str]
) -> dict[str, Any]:
    while True:
        raw = await asyncio.wait_for(stream.readline(), 30)
        if not raw:
            raise AssertionError(f"process {proc.pid} ended before {event}: {''.join(lines)[-3000:]}")
        lines.append(raw.decode())
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if record.get("event") == event:
            return record


async def _drain(stream: Any, lines: list[str]) -> None:
    """Keep reading a process's log (a full pipe would block it)."""
    while raw := await stream.readline():
        lines.append(raw.decode())


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=2
    )
    return reply.status


async def test_index_and_sidecar_containers_run_as_the_manifests_say(tmp_path: Path) -> None:
    index = _run(["kvindex", "serve"])
    shim = _run(["kvshim", "vllm"], pod="vllm-0")
    nats_ca = make_tls_files(tmp_path)
    op = Operator.create()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        op.server_config()
        + f'tls {{ cert_file: "{nats_ca.server_cert}", key_file: "{nats_ca.server_key}" }}\n'
    )
    natsd = EmbeddedNats(config=conf, scheme="tls")
    await natsd.start()
    grpc_ca = trustme.CA()
    grpc_cert = grpc_ca.issue_cert("kvindex", "kvindex.kvindex.svc", "127.0.0.1")
    # What docs/deploy.md's `kubectl create secret` commands put in the cluster.
    secrets = {
        ("kvindex-nats-index", "index.creds"): op.user_creds(tmp_path / "index.creds", "index").read_bytes(),
        ("kvindex-nats-workers", "vllm-0.creds"): op.user_creds(tmp_path / "w0.creds", "vllm-0").read_bytes(),
        ("kvindex-nats-workers", "vllm-1.creds"): op.user_creds(tmp_path / "w1.creds", "vllm-1").read_bytes(),
        ("kvindex-nats-ca", "ca.crt"): nats_ca.ca.read_bytes(),
        ("kvindex-grpc-tls", "tls.crt"): grpc_cert.cert_chain_pems[0].bytes(),
        ("kvindex-grpc-tls", "tls.key"): grpc_cert.private_key_pem.bytes(),
        ("kvindex-grpc-tls", "ca.crt"): grpc_ca.cert_pem.bytes(),
        ("kvindex-grpc-token", "token"): f"{TOKEN}\n".encode(),
    }
    engine = await FakeEngine(topic=b"kv-events").start()
    procs: list[asyncio.subprocess.Process] = []
    try:
        # -- the index container
        mounts = _pod_files(index, tmp_path, secrets)
        tokenizer_dir = _local(index.argv[index.argv.index("--tokenizer") + 1], mounts).split("=", 1)[1]
        make_tokenizer_dir(Path(tokenizer_dir), style="chatml")
        grpc_port = free_port()
        argv = [_local(a, mounts) for a in index.argv]
        argv = _replace_option(argv, "--grpc-port", str(grpc_port))
        argv = _replace_option(argv, "--ext-proc-port", str(free_port()))
        argv = _replace_option(argv, "--metrics-port", str(free_port()))
        env = {k: _local(v, mounts) for k, v in index.env.items()} | {"KVINDEX_NATS_URL": natsd.url}
        parse(argv, env, "index, as run")  # still the manifest's command line
        proc = await asyncio.create_subprocess_exec(
            str(BIN / argv[0]), *argv[1:], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}, **env},
        )  # fmt: skip
        procs.append(proc)
        index_lines: list[str] = []
        serving = await _until(proc, proc.stdout, "kvindex_serving", index_lines)
        assert serving.get("grpc_security") == "tls+token", serving
        drains = [asyncio.create_task(_drain(proc.stdout, index_lines))]

        # -- what the probes and a router see (the probes' TLS: the CA instead of -tls-no-verify)
        ca_file = tmp_path / "grpc-ca.pem"
        ca_file.write_bytes(secrets[("kvindex-grpc-tls", "ca.crt")])
        tls = ClientTLS(ca=ca_file, server_name="kvindex")
        address = f"127.0.0.1:{grpc_port}"
        async with open_channel(address, tls, None, aio=True) as probe:
            assert await _health(probe, LIVENESS) == health_pb2.HealthCheckResponse.SERVING
            for _ in range(100):  # no worker yet: ready after the first heartbeat window
                if await _health(probe, READINESS) == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            assert await _health(probe, READINESS) == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.KvIndexStub(probe).Stats(pb.StatsRequest(), timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # -- the vllm-0 pod's kvshim sidecar, against a fake vLLM
        shim_mounts = _pod_files(shim, tmp_path, secrets)
        shim_argv = [_local(a, shim_mounts) for a in shim.argv]
        shim_argv = _replace_option(shim_argv, "--zmq", engine.endpoint)
        shim_argv = _replace_option(shim_argv, "--replay", engine.replay_endpoint)
        shim_argv = _replace_option(shim_argv, "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics")
        shim_argv = _replace_option(shim_argv, "--stats-port", str(free_port()))
        shim_env = {k: _local(v, shim_mounts) for k, v in shim.env.items()} | {"KVINDEX_NATS_URL": natsd.url}
        parse(shim_argv, shim_env, "kvshim, as run")
        sproc = await asyncio.create_subprocess_exec(
            str(BIN / shim_argv[0]), *shim_argv[1:], stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}, **shim_env},
        )  # fmt: skip
        procs.append(sproc)
        shim_lines: list[str] = []
        started = await _until(sproc, sproc.stderr, "kvshim_started", shim_lines)
        assert started["nats"]["auth"] == "creds" and started["nats"]["tls"] == "on", started
        drains.append(asyncio.create_task(_drain(sproc.stderr, shim_lines)))
        await engine.wait_subscribed()
        prompt = list(range(48))  # three 16-token blocks (--block-size 16, as vLLM's)
        stored = VllmStored([fake_hash(i) for i in range(3)], None, prompt, 16, None, "GPU", None)
        await engine.publish(encode(VllmBatch(0.0, [stored])))
        async with open_channel(address, tls, TOKEN, aio=True) as router:
            stub = pb_grpc.KvIndexStub(router)
            model = shim_argv[shim_argv.index("--model") + 1]
            await expect(stub, model, {"vllm-0/0": (3, (3, 0, 0, 0))}, timeout=10, token_ids=prompt)
            # A chat as an OpenAI client sends it: tokenized by the index with the mounted tokenizer.
            messages = json.dumps([{"role": "user", "content": "Where is my KV cache?"}])
            chat = await stub.Score(pb.ScoreRequest(model=model, messages=messages), timeout=5)
            assert [r.instance_id for r in chat.ranked] == ["vllm-0/0"]
            listed = await stub.ListInstances(pb.ListInstancesRequest(model=model), timeout=2)
            endpoints = {i.instance_id: i.endpoint for i in listed.instances}
            assert endpoints == {"vllm-0/0": f"{FIELD_SAMPLES['status.podIP']}:8000"}

        # -- SIGTERM, as the kubelet stops a pod: exit 0 within the grace period
        for p, run in ((sproc, shim), (proc, index)):
            p.send_signal(signal.SIGTERM)
            grace = run.pod.spec.get("terminationGracePeriodSeconds", 30)
            assert await asyncio.wait_for(p.wait(), grace) == 0
        await asyncio.gather(*drains)
        # No secret in what the pods log.
        logged = "".join(index_lines + shim_lines)
        assert TOKEN not in logged
        for (name, _key), content in secrets.items():
            if name.startswith("kvindex-nats-") and name != "kvindex-nats-ca":
                seed = content.decode().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
                assert seed not in logged
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await engine.close()
        await natsd.stop()
