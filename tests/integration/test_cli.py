"""The CLI as a user runs it: `kvindex serve` (embedded nats-server) queried by `kvindex score/stats`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvindex.keys import block_keys
from kvindex.service.natsd import free_port
from workers_shim.publisher import Publisher

KVINDEX = str(Path(sys.executable).with_name("kvindex"))


def serve_argv(port: int) -> list[str]:
    """``kvindex serve`` on 127.0.0.1:``port`` with its embedded NATS and no metrics port."""
    return [KVINDEX, "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(port), "--metrics-port", "-1"]


def read_log_until(proc: subprocess.Popen[str], event: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"kvindex exited early (code {proc.poll()})")
        record = json.loads(line)  # not a TTY: one JSON object per line
        if record.get("event") == event:
            return record
    raise AssertionError(f"no {event!r} log line within {timeout}s")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVINDEX, *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def served() -> tuple[subprocess.Popen[str], str, str]:
    port = free_port()
    proc = subprocess.Popen(
        # The test's publisher says its piece and leaves: a long --stale-after keeps its instance
        # ranked however slowly the CLI calls run on a loaded machine.
        [
            *serve_argv(port),
            "--stale-after",
            "120",
            "--forget-after",
            "300",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        nats_url = read_log_until(proc, "embedded_nats_started")["url"]
        read_log_until(proc, "kvindex_serving")
        yield proc, nats_url, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_serve_score_stats_and_clean_shutdown(served: tuple[subprocess.Popen[str], str, str]) -> None:
    proc, nats_url, server = served
    tokens = list(range(64))
    keys = block_keys(tokens, 16, "demo")

    async def publish() -> None:
        pub = await Publisher.connect(nats_url, worker="node-a", model="demo", block_size=16)
        pub.stored(keys[:3])
        await pub.close()

    asyncio.run(publish())
    deadline = time.monotonic() + 10
    while True:
        stats = json.loads(run_cli("stats", "--server", server).stdout)
        if int(stats["entries"]["gpu"]) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert int(stats["entries"]["gpu"]) == 3 and int(stats["batchesApplied"]) >= 1

    score = run_cli("score", "--server", server, "--model", "demo", "--tokens", ",".join(map(str, tokens)))
    assert score.returncode == 0, score.stderr
    ranked = json.loads(score.stdout)["ranked"]
    assert [(r["instanceId"], r["matchedBlocks"]) for r in ranked] == [("node-a/0", 3)]

    look = run_cli("lookup", "--server", server, "--model", "demo", "--keys", ",".join(map(str, keys)))
    assert json.loads(look.stdout)["matches"][0]["matched"]["gpu"] == "3"
    one = run_cli("lookup", "--server", server, "--model", "demo", "--keys", "1", "--max-instances", "1")
    assert len(json.loads(one.stdout)["matches"]) == 1

    listed = json.loads(run_cli("instances", "--server", server).stdout)["instances"]
    brief = json.loads(run_cli("instances", "--server", server, "--brief").stdout)["instances"]
    assert [i["instanceId"] for i in brief] == [i["instanceId"] for i in listed] == ["node-a/0"]
    assert "load" in listed[0] and "load" not in brief[0]

    bad = run_cli("score", "--server", server, "--model", "demo", "--tokens", "1", "--candidates", "no such")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def test_unknown_model_is_an_error_naming_the_known_ones(
    served: tuple[subprocess.Popen[str], str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvindex.cli import main

    _, nats_url, server = served

    async def publish() -> None:
        pub = await Publisher.connect(nats_url, worker="node-b", model="known", block_size=16)
        await pub.close()

    asyncio.run(publish())
    deadline = time.monotonic() + 10
    while main(["score", "--server", server, "--model", "known", "--tokens", "1,2"]) != 0:
        assert time.monotonic() < deadline, capsys.readouterr().err
        time.sleep(0.05)
    capsys.readouterr()
    for command in ("score", "lookup"):
        assert main([command, "--server", server, "--model", "nope", "--tokens", "1,2,3"]) == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err == (
            f"kvindex {command}: error: no instance of model 'nope' is known to the index (it knows: known)\n"
        )


def test_unknown_candidates_are_an_error_and_prompt_files_of_either_shape(
    served: tuple[subprocess.Popen[str], str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--candidates`` naming no instance the index knows is refused (the API ignores such ids: an
    empty ranking, exit 0, read as "nothing cached there"); ``--tokens @FILE`` takes the prompt object
    replay --query takes as well as a bare list."""
    from kvindex.cli import main

    _, nats_url, server = served
    tokens = list(range(32))

    async def publish() -> None:
        pub = await Publisher.connect(nats_url, worker="node-c", model="cand", block_size=16)
        pub.stored(block_keys(tokens, 16, "cand"))
        await pub.close()

    asyncio.run(publish())
    query = ["--server", server, "--model", "cand", "--tokens", " ".join(map(str, tokens))]
    deadline = time.monotonic() + 10
    while main(["score", *query]) != 0:
        assert time.monotonic() < deadline, capsys.readouterr().err
        time.sleep(0.05)
    assert json.loads(capsys.readouterr().out)["ranked"][0]["matchedBlocks"] == 2  # "0 1 2 ...": 32 tokens
    for command in ("score", "lookup"):
        for known in ("node-c", "node-c/0", "node-c/0,node-c"):
            assert main([command, *query, "--candidates", known]) == 0
            assert capsys.readouterr().out
        assert main([command, *query, "--candidates", "nosuch/0"]) == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err == (
            f"kvindex {command}: error: --candidates: no instance 'nosuch/0' of model 'cand' is known to "
            "the index (it knows: node-c/0)\n"
        )
        assert main([command, *query, "--candidates", "node-c/1,nosuch"]) == 2
        assert "no instances 'node-c/1', 'nosuch' of model 'cand'" in capsys.readouterr().err
    prompt = tmp_path / "prompt.json"
    for content in ({"model": "cand", "token_ids": tokens}, tokens):
        prompt.write_text(json.dumps(content))
        assert main(["lookup", "--server", server, "--model", "cand", "--tokens", f"@{prompt}"]) == 0
        assert json.loads(capsys.readouterr().out)["matches"][0]["matchedBlocks"] == 2


def _closed_pipe_run(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command whose stdout is a pipe nobody reads any more (``| head`` after it exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=30, check=False)
    finally:
        os.close(write)


def test_a_closed_stdout_pipe_ends_quietly(served: tuple[subprocess.Popen[str], str, str]) -> None:
    """``kvindex instances | head``: no BrokenPipeError traceback; status 141 (128 + SIGPIPE), as a
    shell reports for a Unix tool that met a closed pipe."""
    _, _, server = served
    for command in ("instances", "stats"):
        done = _closed_pipe_run(KVINDEX, command, "--server", server)
        assert (done.returncode, done.stderr) == (141, ""), (command, done.stderr)
