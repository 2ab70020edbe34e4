"""Every long-running entry point stops on SIGTERM, SIGINT and SIGHUP within its grace, whatever state
its NATS connection is in, and when its parent dies (issues 15 and 13 §4). Real processes, a real
nats-server killed at random moments around the signal."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import nats
import pytest

from kvindex.capture import records as R
from kvindex.capture.format import LogReader
from kvindex.lifecycle import close_nats
from kvindex.service.natsd import free_port, nats_server_binary

BIN = Path(sys.executable).parent
KVINDEX = str(BIN / "kvindex")
KVSHIM = str(BIN / "kvshim")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What each entry point promises: exit (code 0) within this long after the signal. serve runs with
# --shutdown-grace 1 (in-flight RPCs) plus its bounded cleanup; the others have a fixed 5 s.
GRACE = 5.0


class Lines:
    """A process's output, pumped by a thread (the pipe never fills), searchable with a deadline."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"process ended before {text!r}; output: {self.tail()}")
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout}s; output: {self.tail()}")

    def tail(self) -> str:
        while True:
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines[-15:])


def start_nats(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise AssertionError("nats-server did not start")


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while alive(pid):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"pid {pid} still running {timeout}s later")
        time.sleep(0.02)
    return time.monotonic() - start


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread exited between the listing and the read
            continue
    return out


def wait_handlers(pid: int, timeout: float = 30.0) -> None:
    """Until the process catches SIGTERM and SIGHUP (its stop handlers are installed: before that, a
    signal kills it the default way, which is not what these tests are about)."""
    wanted = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
        if caught & wanted == wanted:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} installed no SIGTERM/SIGHUP handlers within {timeout}s")


def port_free(port: int) -> bool:
    """Nothing listens on ``port``: a server could bind it again. SO_REUSEADDR as servers set it,
    so that connections in TIME_WAIT (left by whoever closed first) do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


# Each entry point: (command for a NATS URL and a scratch dir, the output line saying it is up, the
# capture log it must leave closed cleanly or None, output on stdout instead of stderr).
Command = Callable[[str, Path], list[str]]
ENTRY_POINTS: dict[str, tuple[Command, str, str | None, bool]] = {
    "serve": (
        lambda url, d: [
            KVINDEX, "serve", "--nats", url, "--grpc-host", "127.0.0.1", "--grpc-port", "0",
            "--metrics-port", "-1", "--shutdown-grace", "1", "--log-format", "json",
            "--capture", str(d / "serve.kvlog"),
        ],
        "kvindex_serving",
        "serve.kvlog",
        False,
    ),
    "capture": (
        lambda url, d: [
            KVINDEX, "capture", "--nats", url, "--out", str(d / "cap.kvlog"), "--log-format", "json",
        ],
        "capture_started",
        "cap.kvlog",
        False,
    ),
    "kvshim": (
        lambda url, d: [
            KVSHIM, "vllm", "--zmq", f"tcp://127.0.0.1:{free_port()}", "--worker-id", "w1", "--model", "m",
            "--block-size", "4", "--nats", url, "--log-format", "json",
        ],
        "kvshim_started",
        None,
        False,
    ),
    "heartbeat": (  # kvshim heartbeat: an engine without KV events, announced by a Publisher
        lambda url, d: [
            KVSHIM, "heartbeat", "--worker-id", "h1", "--model", "m", "--block-size", "4",
            "--endpoint", "127.0.0.1:8000", "--nats", url, "--log-format", "json",
        ],
        "kvshim_started",
        None,
        False,
    ),
    "route": (  # holds no NATS connection (the nats-server is a bystander): signals, parent death
        lambda url, d: [
            KVINDEX, "route", "--index", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1",
            "--port", str(free_port()), "--grace", "1", "--log-format", "json",
        ],
        "route_started",
        None,
        False,
    ),
    "kvsim": (  # the publisher library's owner: a fleet of Publisher.connect workers
        lambda url, d: [KVSHIM, "sim", "--nats", url, "--workers", "2", "--heartbeat-interval", "0.1"],
        "sim_fleet_started",
        None,
        True,
    ),
}  # fmt: skip


def spawn(cmd: list[str], on_stdout: bool, own_group: bool = False) -> tuple[subprocess.Popen[str], Lines]:
    """``own_group``: in a process group of its own, as a shell starts a job in a terminal."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if on_stdout else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if on_stdout else subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=own_group,
    )
    return proc, Lines(proc.stdout if on_stdout else proc.stderr)


def assert_log_closed(path: Path) -> None:
    records = [rec for _seg, _off, rec in LogReader(path)]
    assert records and records[-1][0] == R.CLOSE, f"{path} does not end with a CLOSE record"


def stop_while_nats_dies(entry: str, work: Path, sig: int, mode: str, rng: random.Random, why: str) -> None:
    """One round: start ``entry``, then signal it while its nats-server dies (``mode``)."""
    command, up, capture, on_stdout = ENTRY_POINTS[entry]
    port = free_port()
    natsd = None if mode == "never_connected" else start_nats(port)
    work.mkdir()
    proc, lines = spawn(command(f"nats://127.0.0.1:{port}", work), on_stdout)
    try:
        wait_handlers(proc.pid)
        if natsd is None:
            time.sleep(rng.uniform(0.2, 1.0))  # retrying the connection meanwhile
        else:
            lines.wait_for(up)
            time.sleep(rng.uniform(0.0, 0.5))
            if mode == "killed_before":
                rng.choice([natsd.terminate, natsd.kill])()
                time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(sig)
        sent = time.monotonic()
        if natsd is not None and mode == "killed_after":
            time.sleep(rng.uniform(0.0, 0.3))
            rng.choice([natsd.terminate, natsd.kill])()
        try:
            code = proc.wait(timeout=GRACE + 0.5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{why}: still running {GRACE + 0.5}s after the signal") from None
        took = time.monotonic() - sent
        assert code == 0, f"{why}: exit code {code}; output: {lines.tail()}"
        assert took <= GRACE, f"{why}: took {took:.2f}s"
        if capture is not None and natsd is not None:
            assert_log_closed(work / capture)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if natsd is not None:
            natsd.kill()
            natsd.wait()


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_signal_while_nats_dies_exits_within_grace(entry: str, tmp_path: Path) -> None:
    """Issue 15: four rounds per entry point (each signal once, one more at random), at once, each
    with its own nats-server killed (SIGTERM or SIGKILL) at a random moment between 0.3 s before and
    0.3 s after the signal, or never reachable at all; exit code 0 within the grace every time."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    signals = [*rng.sample(SIGNALS, 3), rng.choice(SIGNALS)]
    modes = ["killed_before", "killed_after", "killed_after"]
    modes.append(rng.choice(["never_connected", "killed_before"]))
    rng.shuffle(modes)
    rounds = [
        (
            entry,
            tmp_path / str(i),
            sig,
            mode,
            random.Random(seed + i),
            f"{entry} round {i} seed {seed}: {mode}, {signal.Signals(sig).name}",
        )
        for i, (sig, mode) in enumerate(zip(signals, modes, strict=True))
    ]
    with ThreadPoolExecutor(len(rounds)) as pool:
        for done in [pool.submit(stop_while_nats_dies, *r) for r in rounds]:
            done.result()  # raises the round's assertion


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_parent_killed_stops_entry_point(entry: str, tmp_path: Path) -> None:
    """A harness SIGKILLed mid-run leaves nothing behind: its child entry point notices the parent
    is gone, stops cleanly (code 0 is unobservable here: it is no longer our child) and frees its
    ports; ``serve`` runs with its embedded nats-server, which must go too."""
    command, up, _capture, on_stdout = ENTRY_POINTS[entry]
    natsd = None
    if entry == "serve":
        grpc_port, metrics_port = free_port(), free_port()
        cmd = [
            KVINDEX, "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--log-format", "json",
        ]  # fmt: skip
        ports = [grpc_port, metrics_port]
    else:
        port = free_port()
        natsd = start_nats(port)
        cmd = command(f"nats://127.0.0.1:{port}", tmp_path)
        ports = []
    harness = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(sys.argv[1:])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", harness, *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if on_stdout else subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    lines = Lines(parent.stdout if on_stdout else parent.stderr)
    try:
        if entry == "serve":
            url = json.loads(lines.wait_for("embedded_nats_started"))["url"]
            ports.append(int(url.rsplit(":", 1)[1]))
        lines.wait_for(up)
        grandchildren = children(child)
        if entry == "serve":
            assert grandchildren, "serve started no embedded nats-server"
        parent.kill()
        parent.wait()
        wait_gone(child, GRACE + 1.0)
        for pid in grandchildren:
            wait_gone(pid, 2.0)
        for p in ports:
            assert port_free(p), f"port {p} still held after {entry} and its children exited"
    finally:
        for pid in [child, *(children(child) if alive(child) else [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        if natsd is not None:
            natsd.kill()
            natsd.wait()


def test_serve_sigkilled_takes_its_nats_server_along() -> None:
    """The one thing a process cannot clean up after itself: a SIGKILL. Its embedded nats-server asked
    the kernel for a SIGTERM when its parent dies (PR_SET_PDEATHSIG), so the port is freed anyway."""
    proc, lines = spawn(
        [KVINDEX, "serve", "--grpc-host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
         "--log-format", "json"],
        on_stdout=False,
    )  # fmt: skip
    try:
        url = json.loads(lines.wait_for("embedded_nats_started"))["url"]
        lines.wait_for("kvindex_serving")
        (natsd,) = children(proc.pid)
        proc.kill()
        proc.wait()
        wait_gone(natsd, 3.0)
        # Gone means its main thread exited: its other threads (Go's) may hold the socket a moment.
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 3.0
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert port_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def processes_naming(path: Path) -> list[int]:
    """Running processes whose command line names ``path`` (the embedded nats-server is started
    with ``-sd $TMPDIR/kvindex-js-...``: a test-private TMPDIR finds exactly the one a test made)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def stop_during_startup(work: Path, moment: str, delay: float, why: str) -> None:
    """One round: SIGTERM ``kvindex serve`` (embedded nats-server, TMPDIR ``work``) ``delay`` s after
    ``moment``; it must exit 0 having removed its JetStream store and reaped its nats-server."""
    work.mkdir()
    proc = subprocess.Popen(
        [KVINDEX, "serve", "--grpc-host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
         "--shutdown-grace", "1", "--log-format", "json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(work)},
    )  # fmt: skip
    lines = Lines(proc.stderr)
    try:
        if moment != "spawned":
            wait_handlers(proc.pid)
        if moment == "nats_spawned":  # the embedded nats-server exists: it is starting up now
            deadline = time.monotonic() + 30
            while not children(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=GRACE + 0.5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{why}: still running {GRACE + 0.5}s after the signal") from None
        # Before its handlers are installed (the first moments: imports) a SIGTERM kills it the
        # default way; it has created nothing by then.
        allowed = (0, -signal.SIGTERM) if moment == "spawned" else (0,)
        assert code in allowed, f"{why}: exit code {code}; output: {lines.tail()}"
        survivors = processes_naming(work)
        assert not survivors, f"{why}: pids {survivors} outlived kvindex serve; output: {lines.tail()}"
        left = sorted(p.name for p in work.iterdir())
        assert not left, f"{why}: left {left} in its TMPDIR; output: {lines.tail()}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_naming(work):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_during_startup_leaves_nothing_behind(tmp_path: Path) -> None:
    """Issue 31 §3: SIGTERM at random moments of ``kvindex serve``'s start-up (as soon as it runs,
    while its embedded nats-server starts, while it connects and binds): exit code 0, the
    ``kvindex-js-*`` store removed and the nats-server gone by the time serve exits, every time."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # (moment, delay after it). Measured on an idle machine: the nats-server is spawned ~0.6 s after
    # serve, greets ~25 ms later, and serve serves ~12 ms after that (connect, calibration bucket,
    # gRPC bind); five rounds spread over the first 60 ms of the server's life hit every step.
    rounds = [("spawned", rng.uniform(0.0, 0.3)), ("handlers", rng.uniform(0.0, 0.3))]
    rounds += [("nats_spawned", rng.uniform(i * 0.012, (i + 1) * 0.012)) for i in range(5)]
    with ThreadPoolExecutor(len(rounds)) as pool:
        futures = [
            pool.submit(
                stop_during_startup, tmp_path / str(i), moment, delay,
                f"round {i} seed {seed}: SIGTERM {delay:.3f}s after {moment}",
            )
            for i, (moment, delay) in enumerate(rounds)
        ]  # fmt: skip
        for done in futures:
            done.result()  # raises the round's assertion


async def close_while_reconnecting(
    close: Callable[[nats.aio.client.Client], Awaitable[object]], rounds: int, clients: int
) -> list[str]:
    """``rounds`` times: ``clients`` connections to a nats-server that is then killed, each closed
    by ``close`` at its own random moment while it reconnects; what went wrong, per client."""

    async def quiet(*_args: object) -> None:
        pass

    async def one(nc: nats.aio.client.Client, where: str) -> str | None:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        started = time.monotonic()
        await close(nc)
        took = time.monotonic() - started
        await asyncio.sleep(0.05)  # a surviving reconnect loop would have retried by now
        task = nc._reconnection_task
        if task is not None and not task.done():
            task.cancel()  # do not leak it into the next test
            return f"{where}: reconnect loop still running after close"
        if took > 1.5 or not nc.is_closed:
            return f"{where}: close took {took:.2f}s, closed={nc.is_closed}"
        return None

    rng = random.Random()
    problems: list[str] = []
    for r in range(rounds):
        port = free_port()
        server = start_nats(port)
        ncs = [
            await nats.connect(
                f"nats://127.0.0.1:{port}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.005,
                error_cb=quiet,
                disconnected_cb=quiet,
            )
            for _ in range(clients)
        ]
        server.kill() if rng.random() < 0.5 else server.terminate()
        found = await asyncio.gather(*(one(nc, f"round {r} client {c}") for c, nc in enumerate(ncs)))
        problems += [p for p in found if p]
        await asyncio.to_thread(server.wait)
    return problems


async def test_close_nats_ends_the_reconnect_loop_every_time() -> None:
    """The mechanism behind issue 15, 180 times: close while nats-py is reconnecting to a
    server that was just killed, at random moments. With a 5 ms reconnect wait each client retries
    constantly, so a close often lands just as an attempt fails, where Python 3.11's ``wait_for``
    loses the cancellation (nats-py's own ``close()`` then leaves the loop running for ever: about 1
    in 12 closes here, measured). ``close_nats`` must end every client, within its timeout."""
    problems = await close_while_reconnecting(lambda nc: close_nats(nc, 1.0), rounds=12, clients=15)
    assert not problems, problems


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL", "Ctrl-C"])
def test_demo_takes_its_service_and_nats_server_along(how: str) -> None:
    """`make run` in a terminal that is closed (SIGHUP), a demo killed outright, or Ctrl-C (SIGINT to
    the terminal's whole process group): the demo, its `kvindex serve` and the embedded nats-server
    all exit and :50051/:9400-like ports are freed. Ctrl-C stops the simulated workers before the
    service and its NATS: nothing is logged but the summary."""
    from kvtools.data import mooncake_trace

    grpc_port, metrics_port = free_port(), free_port()
    demo, lines = spawn(
        [sys.executable, "-m", "kvtools.demo", "--plain", "--report-every", "0.5",
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--instances", "2",
         "--limit", "200", "--trace", str(mooncake_trace())],
        on_stdout=True,
        own_group=how == "Ctrl-C",
    )  # fmt: skip
    try:
        lines.wait_for("routed", timeout=60)
        (serve,) = children(demo.pid)
        (natsd,) = children(serve)
        nats_port = int(Path(f"/proc/{natsd}/cmdline").read_text().split("\0")[4])
        if how == "SIGHUP":
            wait_handlers(demo.pid)
            demo.send_signal(signal.SIGHUP)
            assert demo.wait(timeout=15) == 0, lines.tail()
            assert "stopped:" in lines.tail()
        elif how == "Ctrl-C":
            wait_handlers(demo.pid)
            seen = len(lines.lines)
            os.killpg(demo.pid, signal.SIGINT)
            assert demo.wait(timeout=15) == 0, lines.tail()
            tail = lines.tail()  # also takes in every line left
            # Summary lines ("[  3 s wall] ...", "load: ...") may still come; nothing else may.
            after = [ln for ln in lines.lines[seen:] if ln.strip() and not ln.startswith(("[", "load:"))]
            assert len(after) == 1 and after[0].startswith("stopped:"), tail
        else:
            demo.kill()
            demo.wait()
        wait_gone(serve, GRACE + 1.0)
        wait_gone(natsd, 2.0)
        for port in (grpc_port, metrics_port, nats_port):
            assert port_free(port), f"port {port} still held"
    finally:
        for pid in [demo.pid, *(children(demo.pid) if alive(demo.pid) else [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        demo.wait()


async def test_publisher_close_is_bounded_whatever_nats_does() -> None:
    """The publisher library's owner: ``Publisher.close(timeout)`` returns within its timeout and
    leaves nothing of its connection running, with the server killed at a random moment before or
    after the close starts, while the workers publish."""
    from workers_shim.publisher import Publisher

    rng = random.Random()
    for i in range(8):
        port = free_port()
        server = start_nats(port)
        pubs = [
            await Publisher.connect(
                f"nats://127.0.0.1:{port}",
                worker=f"p{i}-{w}",
                model="m",
                block_size=4,
                heartbeat_interval=0.05,
            )
            for w in range(3)
        ]
        for pub in pubs:
            pub.stored([rng.getrandbits(63) for _ in range(50)])
        kill_after = rng.uniform(-0.1, 0.1)  # negative: before the close starts
        if kill_after < 0:
            server.kill()
            await asyncio.sleep(-kill_after)
        else:
            asyncio.get_running_loop().call_later(kill_after, server.kill)
        started = time.monotonic()
        await asyncio.gather(*(pub.close(timeout=1.0) for pub in pubs))
        took = time.monotonic() - started
        await asyncio.sleep(0.15)
        server.kill()
        await asyncio.to_thread(server.wait)
        assert took < 1.5, f"round {i}: close took {took:.2f}s (server killed at {kill_after:+.2f}s)"
        for pub in pubs:
            task = pub.nc._reconnection_task
            ended = pub.nc.is_closed and (task is None or task.done())
            assert ended, f"round {i}: {pub.worker}'s connection still running"


def nats_logs(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["event"], r["log_level"]) for r in logs if r["event"] in ("nats_disconnected", "nats_error")]


async def service_and_publisher_stop(natsd: Any, server_dies: bool) -> list[tuple[str, str]]:
    """A service and a publisher on ``natsd`` stopped in order (after killing it if
    ``server_dies``): what they logged of their NATS connection, (event, level)."""
    from structlog.testing import capture_logs

    from kvindex.service.app import IndexService, ServiceConfig
    from tests.conftest import wait_until
    from workers_shim.publisher import Publisher

    with capture_logs() as logs:
        svc = IndexService(ServiceConfig(nats_url=natsd.url, grpc_host="127.0.0.1", grpc_port=0))
        await svc.start()
        pub = await Publisher.connect(natsd.url, worker="w", model="m", block_size=4)
        await wait_until(lambda: len(svc.registry) == 1, what="the worker known")
        if server_dies:
            await natsd.kill()
            await wait_until(lambda: nats_logs(logs) != [], what="the disconnection logged")
        await pub.close(timeout=0.5)
        await svc.stop(grace=0.1)
    return nats_logs(logs)


async def test_nats_disconnect_is_a_warning_only_when_unexpected() -> None:
    """Issue 31: an orderly stop (the service's, a publisher's) says at info that its NATS connection
    closed; the server going away underneath them stays a warning."""
    from kvindex.service.natsd import EmbeddedNats

    natsd = EmbeddedNats()
    await natsd.start()
    try:
        said = await service_and_publisher_stop(natsd, server_dies=False)
        assert ("nats_disconnected", "info") in said and all(lvl == "info" for _e, lvl in said), said
        said = await service_and_publisher_stop(natsd, server_dies=True)
        assert ("nats_disconnected", "warning") in said, said
    finally:
        await natsd.stop()
