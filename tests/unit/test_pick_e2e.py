"""The softmax pick's command-line flags, in process: `kvindex route` refuses a temperature without
softmax, `kvindex serve` parses the pick flags. Over real parts: tests/integration/test_pick_e2e.py."""

from __future__ import annotations

import pytest

from kvindex.cli import main


def test_route_cli_rejects_a_temperature_without_softmax() -> None:
    with pytest.raises(SystemExit, match="--temperature applies to --pick softmax"):
        main(["route", "--index", "127.0.0.1:1", "--temperature", "0.5"])


def test_serve_pick_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from kvindex.cli import build_parser

    args = build_parser().parse_args(["serve", "--pick", "softmax", "--temperature", "0.2", "--warmup", "30"])
    assert (args.pick, args.temperature, args.warmup, args.seed) == ("softmax", 0.2, 30.0, 0)
    for bad, said in (
        (["--temperature", "-1"], "finite number >= 0"),
        (["--warmup", "inf"], "finite number >= 0"),
        (["--pick", "random"], "invalid choice"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
        assert said in capsys.readouterr().err
