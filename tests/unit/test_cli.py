"""The CLI's argument errors, in process: each bad query argument is one line naming the problem. The
CLI against a running `kvindex serve`: tests/integration/test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--tokens", "a,b", "'a' is not an integer"),
        ("--tokens", "@missing.json", "@missing.json: no such file"),
        ("--tokens", "99999999999999999999999", "out of range: token ids are unsigned 32-bit"),
        ("--tokens", "-1,2", "-1 is out of range: token ids are unsigned 32-bit integers (0 to 4294967295)"),
        ("--keys", "x", "'x' is not an integer"),
        ("--keys", "-5", "block keys are unsigned 64-bit"),
        ("--tokens", "@list.json", "True is not an integer"),
        ("--tokens", "@bad.json", "not JSON"),
        ("--prompt", "@missing.txt", "--prompt @missing.txt: no such file"),
    ],
)
def test_bad_query_arguments_are_one_line_errors(
    flag: str,
    value: str,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked before any connection: no server is needed to be told what is wrong."""
    from kvindex.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text("[1, true]")
    (tmp_path / "bad.json").write_text("[1,")
    assert main(["score", "--server", "127.0.0.1:1", "--model", "m", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvindex score: error: ") and says in err and err.count("\n") == 1, err
