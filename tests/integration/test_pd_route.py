"""``kvindex route --pd`` end to end over HTTP, with real processes and sockets: a ``kvshim sim``
process serving four simulated engines over HTTP (two prefill, two decode, in two KV-transfer
groups, announcing roles in real heartbeats on NATS), a real index (gRPC over a socket) and the
proxy as its own process. The simulated engines speak vLLM's disaggregated protocol: a prefill step
keeps the KV for a pull, the decode step pulls it from the instance its ``kv_transfer_params`` name
(workers_shim/sim/http.py), so a wrong or missing parameter shows as a failed pull."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
KVSHIM = str(Path(sys.executable).with_name("kvshim"))
MODEL = "sim-model"
BS = 16
ROLES = {"sim-0": "prefill", "sim-1": "prefill", "sim-2": "decode", "sim-3": "decode"}
GROUPS = {"sim-0": "a", "sim-1": "b", "sim-2": "a", "sim-3": "b"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")


class PdFleet:
    def __init__(self, service: IndexService, http: aiohttp.ClientSession, port: int) -> None:
        self.service = service
        self.http = http
        self.port = port

    def endpoint(self, worker: str) -> str:
        endpoint = self.service.registry.endpoint(f"{worker}/0")
        assert endpoint is not None
        return endpoint

    async def stats(self, worker: str) -> dict[str, Any]:
        async with self.http.get(f"http://{self.endpoint(worker)}/sim/stats") as resp:
            return dict(await resp.json())

    async def post(self, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, bytes]:
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body) as resp:
            return resp, await resp.read()


@pytest.fixture
async def pd(nats_server: EmbeddedNats, service: IndexService) -> AsyncIterator[PdFleet]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sim = subprocess.Popen(
        [KVSHIM, "sim", "--nats", nats_server.url, "--workers", "4", "--model", MODEL,
         "--block-size", str(BS), "--gpu-blocks", "2000", "--http-port", "0",
         "--roles", ",".join(ROLES.values()), "--pd-groups", ",".join(GROUPS.values()),
         "--heartbeat-interval", "0.2"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    route: subprocess.Popen[bytes] | None = None
    try:

        def announced() -> bool:
            states = [service.registry.get((w, 0)) for w in ROLES]
            return all(s is not None and s.endpoint and s.role == ROLES[s.worker] for s in states)

        await wait_until(announced, timeout=30, what="four simulated engines with endpoints and roles")
        port = _free_port()
        route = subprocess.Popen(
            [sys.executable, "-m", "kvindex.cli", "route", "--index", service.grpc.address,
             "--host", "127.0.0.1", "--port", str(port), "--log-format", "json",
             "--pd", "--pd-min-input-tokens", "64", "--pd-same-group", "--score-timeout", "2"],
            cwd=ROOT, env=env, stderr=subprocess.PIPE,
        )  # fmt: skip
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                        # Serving, and its instance list (roles, groups) fetched from the index.
                        if resp.status == 200 and (await resp.json())["instances_known"] == len(ROLES):
                            break
                except aiohttp.ClientConnectorError:
                    pass
                await asyncio.sleep(0.05)
            yield PdFleet(service, http, port)
    finally:
        if route is not None:
            print(_stop(route)[-4000:], file=sys.stderr)
        print(_stop(sim)[-4000:], file=sys.stderr)


async def test_long_prompts_take_two_steps_and_short_ones_one(pd: PdFleet) -> None:
    prompt = list(range(1000, 1000 + 32 * BS))  # 512 tokens, 32 full blocks
    resp, body = await pd.post({"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert resp.status == 200, body
    assert resp.headers["x-kvindex-pd"] == "remote"
    decode = resp.headers["x-kvindex-instance"].partition("/")[0]
    prefill = resp.headers["x-kvindex-prefill-instance"].partition("/")[0]
    assert ROLES[decode] == "decode" and ROLES[prefill] == "prefill"
    assert GROUPS[decode] == GROUPS[prefill]  # --pd-same-group
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 4 and answer["kv_transfer_params"] is None
    # The prefill engine ran a one-token prefill step and handed its blocks over once; the decode
    # engine pulled them from there and received them instead of computing (the last token's block
    # is computed: at most (512 - 1) // 16 blocks can be reused).
    p_stats, d_stats = await pd.stats(prefill), await pd.stats(decode)
    assert p_stats["requests"] == {"prefill": 1} and p_stats["kv_pulls_served"] == 1
    assert d_stats["requests"] == {"decode": 1} and d_stats["kv_pulls_failed"] == 0
    assert d_stats["pulled_blocks"] == 32 and d_stats["engine_transferred_blocks"] == 31
    assert d_stats["engine_computed_tokens"] == 512 - 31 * BS

    # Streaming: the decode step streams back; the prefill step was not streamed.
    prompt2 = list(range(5000, 5000 + 20 * BS))
    async with pd.http.post(
        f"http://127.0.0.1:{pd.port}/v1/completions",
        json={"model": MODEL, "prompt": prompt2, "max_tokens": 3, "stream": True,
              "stream_options": {"include_usage": True}},
    ) as resp:  # fmt: skip
        assert resp.status == 200 and resp.headers["x-kvindex-pd"] == "remote"
        assert resp.content_type == "text/event-stream"
        events = (await resp.read()).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and len(events) >= 3

    # Short prompts: the decode instance prefills itself (one step, the plain request).
    resp, body = await pd.post({"model": MODEL, "prompt": list(range(7, 7 + 40)), "max_tokens": 2})
    assert resp.status == 200 and resp.headers["x-kvindex-pd"] == "local;reason=short_input"
    assert "x-kvindex-prefill-instance" not in resp.headers
    local = resp.headers["x-kvindex-instance"].partition("/")[0]
    assert ROLES[local] == "decode" and (await pd.stats(local))["requests"].get("whole") == 1

    # Every ledger entry (decode ones under the request id, prefill ones under <id>:prefill) is gone.
    await wait_until(lambda: len(pd.service.ranker.ledger) == 0, what="ledger empty")
    async with pd.http.get(f"http://127.0.0.1:{pd.port}/metrics") as resp:
        metrics = await resp.text()
    assert 'kvindex_route_pd_requests_total{path="remote",reason="remote"} 2.0' in metrics
    assert 'kvindex_route_pd_requests_total{path="local",reason="short_input"} 1.0' in metrics
    assert "kvindex_route_pd_prefill_seconds_count 2.0" in metrics


async def test_concurrent_requests_all_pair_within_their_group(pd: PdFleet) -> None:
    prompts = [list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BS)) for i in range(12)]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 2} for p in prompts]
    results = await asyncio.gather(*(pd.post(b) for b in bodies))
    for resp, body in results:
        assert resp.status == 200, body
        assert resp.headers["x-kvindex-pd"] == "remote"
        d = resp.headers["x-kvindex-instance"].partition("/")[0]
        p = resp.headers["x-kvindex-prefill-instance"].partition("/")[0]
        assert GROUPS[d] == GROUPS[p]
    pulls = sum([(await pd.stats(w))["kv_pulls_served"] for w in ("sim-0", "sim-1")])
    failed = sum([(await pd.stats(w))["kv_pulls_failed"] for w in ("sim-2", "sim-3")])
    assert pulls == len(prompts) and failed == 0
    await wait_until(lambda: len(pd.service.ranker.ledger) == 0, what="ledger empty")


async def test_a_failed_prefill_step_never_fails_the_request(
    service: IndexService, make_publisher: Any
) -> None:
    """Against fake engines (real aiohttp servers): a prefill instance that answers without
    kv_transfer_params (no KV connector), fails (500) or is unreachable: the decode instance gets the
    client's own request and prefills itself; every path counted; the ledger ends empty."""
    from kvindex.route.pd import PdConfig
    from kvindex.route.proxy import RouteConfig, RouteProxy
    from tests.integration.fake_openai import FakeOpenAIEngine

    model = "pd-fake"
    engines = {w: await FakeOpenAIEngine(w, model).start() for w in ("p1", "d1")}
    for w, role in (("p1", "prefill"), ("d1", "decode")):
        await make_publisher(worker=w, model=model, block_size=4, capacity={"gpu": 100},
                             endpoint=engines[w].endpoint, role=role)  # fmt: skip
    await wait_until(lambda: all(service.registry.endpoint(f"{w}/0") for w in engines), what="endpoints")
    config = RouteConfig(index=service.grpc.address, host="127.0.0.1", port=0, score_timeout=2.0,
                         refresh_interval=0.2, pd=PdConfig(min_input_tokens=8))  # fmt: skip
    proxy = RouteProxy(config)
    await proxy.start()
    body = {"model": model, "prompt": list(range(100, 140)), "max_tokens": 5, "stream": True}
    try:
        async with aiohttp.ClientSession() as http:

            async def post() -> aiohttp.ClientResponse:
                async with http.post(f"http://127.0.0.1:{proxy.port}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp

            await wait_until(lambda: len(proxy.client.instances.instances(model)) == 2, what="roles known")
            resp = await post()  # a prefill without a KV connector: 200 but no kv_transfer_params
            assert resp.status == 200
            assert resp.headers["x-kvindex-pd"] == "local;reason=no_kv_transfer_params"
            sent = json.loads(engines["p1"].bodies[-1])
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert sent["kv_transfer_params"]["do_remote_decode"] is True
            # The client's request as sent, plus the usage the proxy asks a stream for (and strips again).
            assert json.loads(engines["d1"].bodies[-1]) == {**body, "stream_options": {"include_usage": True}}

            engines["p1"].status = 500
            resp = await post()
            assert resp.status == 200 and resp.headers["x-kvindex-pd"] == "local;reason=prefill_failed"

            await engines["p1"].close()  # unreachable now
            resp = await post()
            assert resp.status == 200 and resp.headers["x-kvindex-pd"] == "local;reason=prefill_failed"
            assert len(engines["d1"].bodies) == 3
            await wait_until(lambda: len(service.ranker.ledger) == 0, what="ledger empty")
            async with http.get(f"http://127.0.0.1:{proxy.port}/metrics") as m:
                text = await m.text()
            assert 'kvindex_route_pd_requests_total{path="local",reason="prefill_failed"} 2.0' in text
            assert 'kvindex_route_pd_requests_total{path="local",reason="no_kv_transfer_params"} 1.0' in text
    finally:
        await proxy.stop()
        for e in engines.values():
            await e.close()


async def test_the_simulated_engine_ends_a_stream_with_usage_only_when_asked(pd: PdFleet) -> None:
    """As vLLM: ``stream_options.include_usage`` adds a last chunk with ``choices: []`` and the usage,
    whose ``cached_tokens`` is the engine's hit; without it the stream carries no usage."""
    prompt = list(range(5000, 5000 + 8 * BS))
    url = f"http://{pd.endpoint('sim-2')}/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}

    async def events(extra: dict[str, Any]) -> list[dict[str, Any]]:
        async with pd.http.post(url, json={**body, **extra}) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    plain = await events({})
    assert all("usage" not in e for e in plain)
    asked = await events({"stream_options": {"include_usage": True}})
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["prompt_tokens"] == len(prompt)
    # The second identical prompt found its full blocks cached (all but the last, recomputed token).
    assert asked[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * BS
    async with pd.http.post(url, json={**body, "stream_options": "yes"}) as resp:
        assert resp.status == 400 and "stream_options" in (await resp.text())
