"""The type check: mypy as pyproject.toml configures it (all of kvindex, strict on the core stages:
wire, sequencer, index, fleet, scoring) and every protocol against its implementations
(tests/typecheck/implementations.py). Here because CI runs ``make test`` only (``make lint`` runs it
too); mypy's cache (.mypy_cache) makes a run after the first take seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kvindex_type_checks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-color-output"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout
