"""benchmarks/bench_mooncake.py (Dynamo's Mooncake indexer benchmark) in its --quick configuration:
the replay applies every event and its sampled answers agree with the set model. No timing is
asserted: speed is the benchmark's business."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from benchmarks import bench_mooncake
from kvindex.index.hybrid import GroupLayout


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """The benchmark drops info logs (quiet_logs) for the whole process: later tests that capture
    logs (tests/integration/test_client.py) must see them again."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


def run(*argv: str) -> bench_mooncake.Results:
    args = bench_mooncake.parse_args(["--quick", "--no-pin", "--window-seconds", "0.3", *argv])
    return bench_mooncake.run_bench(args, log=lambda _line: None)


def assert_checked(result: bench_mooncake.Results, paths: list[str]) -> None:
    assert [r.path for r in result.steady] == paths
    for r in result.steady:
        assert r.check["ingest_ok"], r.check["ingest"]
        assert r.check["checked"] > 0
        assert r.check["mismatches"] == 0, r.check["examples"]
        assert r.check["passed"]
        assert r.entries == r.check["ingest"]["expected_entries"] > 0


def test_quick_run_agrees_with_the_set_model_on_every_path() -> None:
    result = run()
    assert_checked(result, ["score", "match", "lookup"])
    facts = result.facts
    assert facts["workers"] == 48
    assert facts["matches"] == 2 * facts["requests"]  # one match per request and copy of its worker


@pytest.mark.parametrize("duplication", ["own", "shared"])
def test_evictions_and_trace_copies_agree_with_the_set_model(duplication: str) -> None:
    # Small engines evict (removed events), two trace copies in disjoint hash spaces.
    result = run(
        "--paths",
        "match",
        "--gpu-blocks",
        "300",
        "--trace-duplication-factor",
        "2",
        "--duplication-workers",
        duplication,
    )
    assert result.facts["removed_events"] > 0
    assert result.facts["workers"] == (96 if duplication == "own" else 48)
    assert_checked(result, ["match"])


def test_bad_option_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_mooncake.parse_args(["--paths", "score,nope"])
    assert exc.value.code == 2
    assert "--paths" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["gemma3", "qwen3-next"])
def test_hybrid_model_agrees_with_the_group_aware_set_model(layout: str) -> None:
    # Engines keeping per KV-cache group what vLLM keeps, small enough to evict (per group); the
    # index told the layout by the heartbeats; answers against vLLM's rule over each worker's groups.
    result = run("--hybrid", layout, "--preregister", "--paths", "score,match", "--gpu-blocks", "400")
    assert result.facts["removed_events"] > 0
    assert_checked(result, ["score", "match"])
    for r in result.steady:
        # The workload is one where the groups matter: full attention alone would promise more.
        assert r.check["full_attention_over"] > 0


def _wider_window(layout: GroupLayout | None) -> list[dict[str, Any]] | None:
    """The engines' groups with every sliding window doubled: what a wrong layout announces."""
    if layout is None:
        return None
    return [{**g, "window": 2 * g["window"]} if "window" in g else g for g in layout.to_wire()]


def _full_attention_alone(layout: GroupLayout, held: Callable[[int, int], bool], limit: int) -> int:
    """The check's rule made wrong: the leading run of the full-attention group only."""
    n = 0
    while n < limit // layout.block_size and held(layout.primary, n):  # type: ignore[arg-type]
        n += 1
    return n * layout.block_size


@pytest.mark.parametrize("wrong", ["index", "check"])
def test_a_wrong_group_rule_fails_the_check(wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The index told windows twice the engines' (its rule wrong), or the check following full
    # attention alone: either way the answers disagree and the run fails.
    if wrong == "index":
        monkeypatch.setattr(bench_mooncake, "announced_groups", _wider_window)
    else:
        monkeypatch.setattr(bench_mooncake, "hit_tokens", _full_attention_alone)
    result = run("--hybrid", "gemma3", "--preregister", "--paths", "match")
    (r,) = result.steady
    assert r.check["ingest_ok"], r.check["ingest"]
    assert r.check["checked"] > 0
    assert r.check["mismatches"] > 0
    assert not r.check["passed"]


def test_hybrid_without_preregister_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_mooncake.parse_args(["--quick", "--hybrid", "gemma3"])
    assert exc.value.code == 2
    assert "--preregister" in capsys.readouterr().err
