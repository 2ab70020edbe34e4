"""Randomized fault schedules (kvtools.testing.chaos): after the faults stop, the index must equal
what every worker holds, per instance and per tier, within two reconciliation periods."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtools.testing.chaos import ChaosConfig, ScheduleResult, run_schedule, summarize

SEEDS = range(50)
_results: list[ScheduleResult] = []


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    if _results:
        print("\n" + summarize(_results))


@pytest.mark.parametrize("seed", SEEDS)
async def test_schedule_converges(seed: int) -> None:
    cfg = ChaosConfig()
    result = await run_schedule(seed, cfg)
    _results.append(result)
    assert result.converged, f"seed {seed}: {result.mismatches}"
    assert result.converge_seconds <= 2 * cfg.reconcile_interval
