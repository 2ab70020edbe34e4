"""The commands as an operator runs them: `kvindex capture` (killed mid-run), `kvindex serve --capture`
with rotation and zstd, then `kvindex replay` on what they wrote."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

from kvindex.capture.digest import state_digest
from kvindex.capture.format import LogReader, segments
from kvindex.capture.replay import replay
from kvindex.cli import main
from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.service.natsd import EmbeddedNats, free_port
from tests.conftest import wait_until
from tests.integration.test_cli import KVINDEX, read_log_until, serve_argv
from workers_shim.publisher import Publisher
from workers_shim.sim import EngineConfig, SimRequest, TimeModel
from workers_shim.sim.fleet import run_fleet

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


async def test_capture_of_a_sim_fleet_survives_kill_and_replays_to_the_live_state(
    nats_server: EmbeddedNats, service: IndexService, tmp_path: Path
) -> None:
    out = tmp_path / "fleet.kvlog"
    proc = subprocess.Popen(
        [KVINDEX, "capture", "--nats", nats_server.url, "--out", str(out), "--zstd", "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        await asyncio.to_thread(read_log_until, proc, "capture_started")
        cfg = EngineConfig(
            gpu_blocks=24,
            cpu_blocks=12,
            block_size=4,
            max_batched_tokens=64,
            max_running=4,
            time=TimeModel(a_ms=1.0, b_ms_per_token=0.01, d_ms_per_decode_seq=2.0),
        )
        fleet = await run_fleet(nats_server.url, 2, cfg, pool_blocks=16, heartbeat_interval=0.05)
        async with fleet:
            for i in range(10):  # shared prefixes, more blocks than fit: evictions to cpu and drops
                keys = [1, 2, *range(100 + 10 * i, 104 + 10 * i)]
                await fleet.submit(f"sim-{i % 2}", SimRequest(f"r{i}", keys, 4 * len(keys) + 1, 3))
            await wait_until(lambda: fleet.completed == 10, what="requests finished")
            await fleet.flush()
            pubs = [*fleet.publishers.values(), fleet.pool_publisher]
            await wait_until(
                lambda: all(
                    (s := service.registry.get((p.worker, 0))) is not None and s.last_seq == p.seq  # type: ignore[union-attr]
                    for p in pubs
                ),
                what="the service applied everything",
            )
            live = state_digest(service.consumer)
            await asyncio.sleep(0.5)  # the capture writes what it buffered every 0.2 s
            proc.send_signal(signal.SIGKILL)  # no clean shutdown: no close record
            proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = replay(str(out))
    r = result.replayer
    assert result.error is None and not r.closed and LogReader(out).zstd
    # Captured from the wire: no repairs were needed here, so the replay is the live index.
    assert r.source == "capture" and r.counters.gaps == 0
    assert {s.instance_id for s in r.registry.all()} == {"sim-0/0", "sim-1/0", "sim-pool/0"}
    assert sum(r.index.block_counts(("sim-0", 0))) > 0 and r.counters.events_applied[1] > 0  # evictions
    assert r.digest() == live


def test_serve_capture_rotates_compresses_and_replays(tmp_path: Path, capsys) -> None:
    path = tmp_path / "serve.kvlog"
    port = free_port()
    proc = subprocess.Popen(
        [
            *serve_argv(port),
            "--capture",
            str(path),
            "--capture-max-bytes",
            "3K",
            "--capture-zstd",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    tokens = list(range(4000))
    keys = block_keys(tokens, 4, "demo")  # hashed keys: a burst of 400 is ~3.5 KB even compressed
    try:
        nats_url = read_log_until(proc, "embedded_nats_started")["url"]
        read_log_until(proc, "kvindex_serving")

        async def publish() -> None:
            pub = await Publisher.connect(nats_url, worker="node-a", model="demo", block_size=4)
            for burst in range(3):
                pub.stored(keys[burst * 300 : (burst + 1) * 300 + 100])
                await pub.flush()
                await asyncio.sleep(0.3)  # one frame per burst
            pub.removed(keys[:10])
            await pub.close()

        asyncio.run(publish())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(segments(path)) >= 3
    query = tmp_path / "prompt.json"
    query.write_text(json.dumps({"model": "demo", "token_ids": tokens[:400]}))
    report = tmp_path / "report.json"
    code = main(["replay", str(path), "--plain", "--query", str(query), "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    rep = json.loads(report.read_text())
    summary = rep["summary"]
    assert summary["closed"] == "stopped" and summary["checks"] == {"matched": 1, "diverged": 0}
    assert len(rep["read"]["segments"]) >= 3 and rep["meta"]["codec"] == "zstd"
    assert summary["blocks"]["gpu"] == 990 and summary["instances"][0]["instance"] == "node-a/0"
    assert f"state digest: {summary['digest']}" in out and "joined" in out
    (ranked,) = [q["response"]["ranked"] for q in rep["queries"]]
    # The prompt's first 10 blocks were removed: no prefix left on node-a.
    assert [(x["instance_id"], x["matched_blocks"]) for x in ranked] == [("node-a/0", 0)]
    assert "node-a/0" in out.split("query")[-1]
