"""benchmarks/bench_mooncake.py (Dynamo's Mooncake indexer benchmark) in its --quick configuration:
the replay applies every event and its sampled answers agree with the set model. No timing is
asserted: speed is the benchmark's business."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from benchmarks import bench_mooncake


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
