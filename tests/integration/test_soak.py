"""`make soak`'s sustained-load run, small: it must generate the rate it asks for, and its end check
(the index agrees with every worker's last seq and block count) must pass on a healthy service."""

from __future__ import annotations

import pytest

from kvtools.testing.soak import sustained


async def test_sustained_load_run_passes_small(capsys: pytest.CaptureFixture[str]) -> None:
    ok = await sustained(seconds=3.0, rate=4000.0, processes=1, publishers=3, score_rate=50.0)
    out = capsys.readouterr().out
    assert ok, out
    assert "false gaps 0" in out and "index equals all 3 workers' blocks" in out
