"""Where `kvindex serve` listens, as a user sees it: the embedded NATS on an address workers elsewhere
can reach (`--embedded-nats-listen`), the start log naming the addresses actually bound, one warning
for listeners open to other machines without protection, and a taken port named with its flag."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time

import pytest

from kvindex.api.listen import ListenError
from kvindex.keys import block_keys
from kvindex.service.natsd import EmbeddedNats, free_port
from tests.integration.test_cli import KVINDEX, run_cli
from workers_shim.publisher import Publisher


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [KVINDEX, "serve", "--log-format", "json", *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def read_log_until(proc: subprocess.Popen[str], event: str, timeout: float = 20.0) -> dict:
    """The first JSON log record with ``event`` (gRPC's C core writes its own plain lines too)."""
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"kvindex exited early (code {proc.poll()})")
        if line.startswith("{") and json.loads(line).get("event") == event:
            return json.loads(line)
    raise AssertionError(f"no {event!r} log line within {timeout}s")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_embedded_nats_for_remote_workers_and_what_is_bound() -> None:
    grpc_port, metrics_port, nats_port = free_port(), free_port(), free_port("0.0.0.0")
    proc = _serve(
        "--grpc-host", "0.0.0.0", "--grpc-port", str(grpc_port),
        "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
        "--embedded-nats-listen", f"0.0.0.0:{nats_port}",
    )  # fmt: skip
    try:
        nats = read_log_until(proc, "embedded_nats_started")
        assert nats["listen"] == f"0.0.0.0:{nats_port}"
        assert nats["workers_url"] == f"nats://{socket.gethostname()}:{nats_port}"
        assert nats["url"] == f"nats://127.0.0.1:{nats_port}"
        warning = read_log_until(proc, "serving_without_protection")
        assert warning["listeners"] == [
            f"gRPC 0.0.0.0:{grpc_port} (no TLS, no token)",
            f"embedded NATS 0.0.0.0:{nats_port} (no TLS, no authentication: anyone can publish events)",
        ]
        serving = read_log_until(proc, "kvindex_serving")
        assert (serving["grpc"], serving["metrics"]) == (f"0.0.0.0:{grpc_port}", f"127.0.0.1:{metrics_port}")

        # A worker that knows only the fixed port: the address it would be configured with elsewhere.
        async def publish() -> None:
            pub = await Publisher.connect(
                f"nats://127.0.0.1:{nats_port}", worker="far", model="m", block_size=4
            )
            pub.stored(block_keys(list(range(8)), 4, "m"))
            await pub.close()

        asyncio.run(publish())
        deadline = time.monotonic() + 10
        while True:
            score = run_cli(
                "score", "--server", f"127.0.0.1:{grpc_port}", "--model", "m", "--tokens", "0,1,2,3"
            )
            if score.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert score.returncode == 0, score.stderr
        assert json.loads(score.stdout)["ranked"][0]["instanceId"] == "far/0"
    finally:
        _stop(proc)


def test_loopback_only_says_so_and_warns_about_nothing() -> None:
    proc = _serve("--grpc-host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1")
    try:
        nats = read_log_until(proc, "embedded_nats_started")
        assert nats["listen"].startswith("127.0.0.1:") and nats["workers_url"] == nats["url"]
        assert "this machine only" in nats["reachable_from"]
        seen = []
        assert proc.stderr is not None
        while True:
            record = json.loads(proc.stderr.readline())
            seen.append(record["event"])
            if record["event"] == "kvindex_serving":
                break
        assert "serving_without_protection" not in seen
        assert record["grpc"].startswith("127.0.0.1:") and record["metrics"] is None
    finally:
        _stop(proc)


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--metrics-port", "{port}"], "--metrics-host/--metrics-port"),
        (["--grpc-port", "{port}"], "--grpc-host/--grpc-port"),
        (["--ext-proc-port", "{port}"], "--ext-proc-host/--ext-proc-port"),
        (["--embedded-nats-listen", "0.0.0.0:{port}"], "--embedded-nats-listen"),
    ],
)
def test_a_taken_port_is_named_with_its_flag(flags: list[str], flag: str) -> None:
    """The error names the address, the OS's reason and the flag, and comes first: before the stop's
    own lines, and with no line of gRPC's C core (``E... add_port.cc:...``) anywhere (issue 31)."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--grpc-port", "0", "--metrics-port", "-1"] + [f.format(port=port) for f in flags]
        proc = _serve(*argv)
        try:
            _out, err = proc.communicate(timeout=30)
        finally:
            _stop(proc)
    assert proc.returncode == 2, err
    lines = err.splitlines()
    assert all(line.startswith("{") for line in lines), err  # ours only: JSON records
    events = [json.loads(line)["event"] for line in lines]
    assert "listen_failed" in events, err
    failed = json.loads(lines[events.index("listen_failed")])
    assert f":{port} " in failed["error"] and flag in failed["error"], failed
    assert "address already in use" in failed["error"].lower(), failed
    assert "kvindex_stopped" not in events[: events.index("listen_failed")], events


async def test_embedded_nats_port_held_by_another_program() -> None:
    """A fixed port answered by something else is not mistaken for our server being up."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match="address already in use") as err:
            await EmbeddedNats(port, "127.0.0.1").start(timeout=3)
    assert err.value.where == f"127.0.0.1:{port}" and err.value.what == "embedded NATS"
