"""`kvshim` as an operator runs it: a subprocess beside a fake engine, garbage on the wire, its own
counters on --stats-port, a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.bridge_fakes import FakeEngine, VllmBatch, VllmStored, encode, expect, fake_hash

KVSHIM = str(Path(sys.executable).with_name("kvshim"))
MODEL = "cli-model"
BS = 4
P = list(range(40, 40 + 3 * BS))


async def read_until(proc: asyncio.subprocess.Process, event: str, timeout: float = 20.0) -> dict[str, Any]:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise AssertionError(f"kvshim exited early (code {proc.returncode})")
        record = json.loads(line)
        if record.get("event") == event:
            return record
    raise AssertionError(f"no {event!r} log line within {timeout}s")


def test_help_lists_the_engines() -> None:
    out = subprocess.run([KVSHIM, "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    for engine in ("vllm", "sglang", "trtllm"):
        assert engine in out
    bad = subprocess.run([KVSHIM, "vllm", "--zmq", "tcp://x:1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--worker-id" in bad.stderr


async def test_kvshim_process_survives_garbage_and_stops_cleanly(
    nats_server: EmbeddedNats, service: IndexService, stub: pb_grpc.KvIndexStub
) -> None:
    engine = await FakeEngine().start()
    proc = await asyncio.create_subprocess_exec(
        KVSHIM,
        "vllm",
        "--zmq",
        engine.endpoint,
        "--replay",
        engine.replay_endpoint,
        "--topic",
        "kv-events",
        "--worker-id",
        "cli1",
        "--model",
        MODEL,
        "--block-size",
        str(BS),
        "--nats",
        nats_server.url,
        "--role",
        "decode",
        "--pd-group",
        "rack-1",
        "--stats-port",
        "0",
        "--log-format",
        "json",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await read_until(proc, "kvshim_started")
        port = (await read_until(proc, "kvshim_stats_serving"))["port"]
        await engine.wait_subscribed()
        await engine.publish(b"\x93\xcb")  # truncated msgpack
        await engine.send_raw([b"kv-events", b"short"])
        await engine.publish(
            encode(
                VllmBatch(
                    time.time(),
                    [VllmStored([fake_hash(i) for i in range(3)], None, P, BS, None, "GPU", None)],
                )
            )
        )
        await expect(stub, MODEL, {"cli1/0": (3, (3, 0, 0, 0))}, token_ids=P, timeout=10)
        # --role and --pd-group reach the index in the heartbeats.
        await wait_until(lambda: service.registry.get(("cli1", 0)).role == "decode", what="the role")  # type: ignore[union-attr]
        assert service.registry.get(("cli1", 0)).pd_group == "rack-1"  # type: ignore[union-attr]

        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'kvshim_garbage_total{reason="malformed_msgpack"} 1.0' in body
        assert 'kvshim_garbage_total{reason="bad_seq_frame"} 1.0' in body
        assert 'kvshim_keys_total{op="stored"} 3.0' in body

        proc.send_signal(signal.SIGTERM)
        stopped = await read_until(proc, "kvshim_stopped")
        assert stopped["stats"]["batches"] == {"applied": 1, "garbage": 1}
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await engine.close()
