"""kvindex.lifecycle's runner in a child process: its last resorts when main ignores the stop, and
main's exit code. The bounded helpers and the readiness decision: tests/unit/test_lifecycle.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_script(body: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    script = "import asyncio, signal, os, time\nfrom kvindex.lifecycle import run\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


def test_run_exits_when_main_ignores_the_stop() -> None:
    """A main that never looks at the stop request and swallows every cancellation: cancelled after
    the grace, then the watchdog ends the process (code 1) at force_after, not never."""
    out = run_script(
        """
        async def main(stop):
            asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
            while True:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    pass
        started = time.monotonic()
        code = run(main, grace=0.5, force_after=1.5)
        print("returned", code)
        """
    )
    assert out.returncode == 1, out
    assert "still running 1.5 s after the stop request" in out.stderr
    assert "returned" not in out.stdout


def test_run_returns_mains_code_and_leaves_no_task_waiting() -> None:
    """A clean stop on SIGHUP returns main's code even with a stubborn leftover task (asyncio.run
    would wait for it for ever)."""
    out = run_script(
        """
        async def leftover():
            while True:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    pass
        async def main(stop):
            asyncio.ensure_future(leftover())
            asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGHUP)
            print("stopped by", await stop.wait(), flush=True)
            return 3
        started = time.monotonic()
        code = run(main, grace=5.0)
        print("returned", code, round(time.monotonic() - started, 1))
        """
    )
    assert out.returncode == 0, out
    assert "stopped by SIGHUP" in out.stdout
    returned = out.stdout.split("returned ")[1].split()
    assert returned[0] == "3" and float(returned[1]) < 3.0
