"""A short run of every fuzz target (tests/fuzz/harness.py) under atheris, each in its own process; long
runs are `make fuzz` (docs/fuzzing.md). Every seed passing its target uninstrumented:
tests/unit/test_fuzz.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import harness  # noqa: E402


def test_fuzz_targets_short_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "fuzz" / "run.py"),
            "--all",
            "--seconds",
            "1",
            "--jobs",
            "2",
            "--artifacts",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.split() and line.split()[0] in harness.TARGETS]
    assert len(lines) == len(harness.TARGETS) and all(" ok " in line for line in lines)
    # Each ran inputs, not just its seeds.
    assert all(
        int(line.split("execs=")[1].split()[0]) > len(harness.seeds(line.split()[0])) for line in lines
    )
