"""`make run-route`: one request routed by `kvindex route` to a simulated fleet, on one machine.

    python -m kvtools.route_demo               # the README's ports: 50051, 4222, 8100-8103, 8080
    python -m kvtools.route_demo --free-ports  # any free ports (next to another run)
    python -m kvtools.route_demo --once        # stop after the two requests (exit 1 if not routed)

It runs the README's recipe ("A routed request on one machine, without an engine"), whose
commands are the ones :func:`recipe` returns (a test pins the README's text to
:func:`readme_block`): `kvindex serve` with its embedded NATS, `kvshim sim` serving four simulated
engines over HTTP (an OpenAI-compatible server each, announced as its endpoint;
workers_shim/sim/http.py), and `kvindex route`. Once the proxy knows the fleet it sends the README's
request twice: the index routes the first to an idle engine and the second to the same one, which
now holds the prompt's first block (`cached_tokens` 16). Then it waits for Ctrl-C (or SIGTERM, or
the terminal closing) and stops the three processes, the proxy first, each with SIGTERM. Their logs
go to files in ``--logs`` (a new temporary folder by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvindex.client import AsyncKvIndexClient, IndexUnavailable
from kvindex.lifecycle import Stop, die_with_parent
from kvindex.lifecycle import run as lifecycle_run
from kvindex.service.natsd import free_port

MODEL = "sim-model"  # kvshim sim's default model
WORKERS = 4
BLOCK_SIZE = 16  # kvshim sim's default
# 20 token ids: one full 16-token block, which the engine that served them keeps for the next request.
PROMPT = list(range(1, 21))
REQUEST: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
NAMES = ("serve", "sim", "route")


@dataclass(frozen=True)
class Ports:
    grpc: int = 50051
    metrics: int = 9400
    nats: int = 4222
    engines: int = 8100  # engine i listens on engines + i
    route: int = 8080

    @classmethod
    def free(cls) -> Ports:
        engines = _free_run(WORKERS)
        return cls(free_port(), free_port(), free_port(), engines, free_port())


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for _ in range(100):
        base = free_port()
        if base + n <= 65535 and all(_is_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def recipe(ports: Ports, bin_dir: str = ".venv/bin") -> list[list[str]]:
    """The three commands of the README's recipe: the index, the simulated fleet, the proxy."""
    return [
        [f"{bin_dir}/kvindex", "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(ports.grpc),
         "--metrics-port", str(ports.metrics), "--embedded-nats-listen", f"127.0.0.1:{ports.nats}"],
        [f"{bin_dir}/kvshim", "sim", "--nats", f"nats://127.0.0.1:{ports.nats}", "--workers", str(WORKERS),
         "--http-port", str(ports.engines)],
        [f"{bin_dir}/kvindex", "route", "--index", f"127.0.0.1:{ports.grpc}", "--host", "127.0.0.1",
         "--port", str(ports.route)],
    ]  # fmt: skip


_COMMENTS = (
    "the index, with its own NATS server on :{nats} for the engines' KV events",
    "{workers} simulated engines publishing KV events, each an OpenAI-compatible server (:{engines}-{last})",
    "the proxy: point OpenAI clients at :{route}",
)


def request_json() -> str:
    """The request's body as the README's curl sends it (the token ids written compactly)."""
    ids = ",".join(map(str, PROMPT))
    return f'{{"model": "{MODEL}", "prompt": [{ids}], "max_tokens": {REQUEST["max_tokens"]}}}'


def _wrapped(words: list[str], width: int = 110) -> str:
    """A shell command over lines of at most ``width`` characters, continued with backslashes."""
    units: list[str] = []  # a flag and its value stay on one line
    for word in words:
        if units and units[-1].startswith("--") and " " not in units[-1] and not word.startswith("-"):
            units[-1] += " " + word
        else:
            units.append(word)
    lines = [""]
    for word in units:
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width - 2:
            lines.append("  ")
        lines[-1] += word if not lines[-1].strip() else " " + word
    return " \\\n".join(lines)


def readme_block(ports: Ports = Ports()) -> str:
    """The recipe as the README shows it (a shell session to paste), from :func:`recipe`."""
    values = {
        "nats": ports.nats,
        "workers": WORKERS,
        "engines": ports.engines,
        "last": ports.engines + WORKERS - 1,
        "route": ports.route,
    }
    lines = []
    for name, cmd, comment in zip(NAMES, recipe(ports), _COMMENTS, strict=True):
        lines.append(f"# {comment.format(**values)}")
        lines.append(_wrapped([*map(shlex.quote, cmd), f">/tmp/kvindex-{name}.log", "2>&1", "&"]))
    url = f"localhost:{ports.route}"
    lines += [
        f"until curl -sf {url}/v1/models | grep -q {MODEL}; do sleep 0.5; done   # until it knows them",
        f"curl -si {url}/v1/completions -H 'Content-Type: application/json' \\",
        f"  -d '{request_json()}'",
        "kill %1 %2 %3   # each stops cleanly on SIGTERM",
    ]
    return "\n".join(lines)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


class Recipe:
    """The recipe's processes, started, waited for, asked, stopped."""

    def __init__(self, ports: Ports, bin_dir: str, logs: Path) -> None:
        self.ports = ports
        self.commands = recipe(ports, bin_dir)
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.route}"

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for name, cmd in zip(NAMES, self.commands, strict=True):
            with open(self.logs / f"{name}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                        preexec_fn=die_with_parent(),  # even a SIGKILLed driver takes them along
                        # Their own sessions: Ctrl-C reaches the driver only, which stops them in order.
                        start_new_session=True,
                    )
                )

    def exited(self) -> str | None:
        """The first process that exited already, with its code and log, or None."""
        for name, proc in zip(NAMES, self.procs, strict=True):
            if proc.poll() is not None:
                return f"{name} exited with code {proc.returncode}; its log: {self.logs / (name + '.log')}"
        return None

    async def wait_routable(self, timeout: float = 60.0) -> bool:
        """What the README's ``until curl .../v1/models | grep -q sim-model`` loop waits for: the proxy
        knows the fleet (ListInstances) and the engines answer."""
        deadline = time.monotonic() + timeout
        # Each look bounded: something else listening on the proxy's port may never answer.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while time.monotonic() < deadline:
                if (why := self.exited()) is not None:
                    raise RuntimeError(why)
                try:
                    async with http.get(self.url + "/v1/models") as resp:
                        if resp.status == 200 and MODEL in {m.get("id") for m in (await resp.json())["data"]}:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(
            f"the proxy did not know the simulated fleet within {timeout:g} s (logs: {self.logs})"
        )

    async def settled(self, instance_id: str, timeout: float = 30.0) -> None:
        """Until the index ranks ``instance_id`` first for the prompt, holding its first block: the
        engine's KV events and the proxy's release of the request before have reached the index (a
        moment after the answer; by hand, between two curls, they always have)."""
        deadline = time.monotonic() + timeout
        async with AsyncKvIndexClient(
            f"127.0.0.1:{self.ports.grpc}", timeout=2.0, refresh_interval=0
        ) as index:
            while time.monotonic() < deadline:
                with contextlib.suppress(IndexUnavailable):
                    ranked = (await index.score(MODEL, token_ids=PROMPT, top_k=1)).response
                    if ranked is not None and ranked.ranked:
                        top = ranked.ranked[0]
                        if top.instance_id == instance_id and top.matched_blocks >= 1:
                            return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"the index did not learn {instance_id}'s cached block within {timeout:g} s")

    async def request(self) -> Answer:
        """The README's ``curl -si .../v1/completions -d '...'``."""
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as http,
            http.post(
                self.url + "/v1/completions",
                data=request_json(),
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            return Answer(resp.status, dict(resp.headers), await resp.json())

    async def stop(self, timeout: float = 15.0) -> list[int]:
        """SIGTERM to each, the proxy first and the index (with its NATS) last; their exit codes."""
        codes = []
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes.append(await asyncio.to_thread(proc.wait, timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(await asyncio.to_thread(proc.wait))
        return codes[::-1]


def describe(answer: Answer) -> str:
    h = answer.headers
    usage = answer.body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return (
        f"HTTP {answer.status}, x-kvindex-instance {h.get('x-kvindex-instance')}, x-kvindex-decision "
        f"{h.get('x-kvindex-decision')}, est. TTFT {h.get('x-kvindex-est-ttft-ms')} ms, "
        f"{usage.get('prompt_tokens')} prompt tokens of which {cached} cached"
    )


async def _main(args: argparse.Namespace, stop: Stop) -> int:
    ports = Ports.free() if args.free_ports else Ports()
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="kvindex-run-route-"))
    bin_dir = str(Path(sys.executable).parent)
    run = Recipe(ports, bin_dir, logs)
    print(f"kvindex serve (gRPC 127.0.0.1:{ports.grpc}, NATS nats://127.0.0.1:{ports.nats}), {WORKERS} "
          f"simulated engines on 127.0.0.1:{ports.engines}-{ports.engines + WORKERS - 1}, kvindex route "
          f"on 127.0.0.1:{ports.route}; logs in {logs}", flush=True)  # fmt: skip
    run.start()
    code = 0
    try:
        if await stop.run_or_stop(run.wait_routable()) is None:
            return 0  # stopped while waiting
        first = await run.request()
        if first.status == 200:
            await run.settled(first.headers["x-kvindex-instance"])
        second = await run.request()
        for n, answer in ((1, first), (2, second)):
            print(f"request {n}: {describe(answer)}", flush=True)
        routed = all(
            a.status == 200 and a.headers.get("x-kvindex-decision") == "index" for a in (first, second)
        )
        if not routed:
            print(f"not routed by the index; logs in {logs}", file=sys.stderr)
            code = 1
        if not args.once:
            curl = f"curl -si localhost:{ports.route}/v1/completions -H 'Content-Type: application/json'"
            print(f"\ntry: {curl} -d '{request_json()}'\nCtrl-C stops everything.", flush=True)
            await stop.wait()
    except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"error: {exc or type(exc).__name__}; logs in {logs}", file=sys.stderr)
        code = 1
    finally:
        codes = await run.stop()
        if any(codes):
            print(f"exit codes (serve, sim, route): {codes}; logs in {logs}", file=sys.stderr)
            code = code or 1
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtools.route_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--free-ports", action="store_true", help="any free ports instead of the README's")
    p.add_argument("--once", action="store_true", help="stop after the two requests (exit 1 if not routed)")
    p.add_argument(
        "--logs", default="", help="folder for the three processes' logs (default: a new one in /tmp)"
    )
    args = p.parse_args(argv)
    return lifecycle_run(lambda stop: _main(args, stop), grace=20.0, name="kvtools-route-demo")


if __name__ == "__main__":
    sys.exit(main())
