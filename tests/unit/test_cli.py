"""The CLI's argument errors, in process: each bad query argument is one line naming the problem. The
CLI against a running `kvindex serve`: tests/integration/test_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
        # Only commas and whitespace separate ids: anything else is refused, never joined.
        ("--tokens", "1;2", "--tokens: '1;2' is not an integer"),
        ("--tokens", "1.5", "'1.5' is not an integer"),
        ("--tokens", "1_000", "'1_000' is not an integer"),
        ("--tokens", " , ", "--tokens: no token ids given"),
        ("--tokens", "@empty.json", "--tokens @empty.json: expected a prompt object"),
        ("--tokens", "@two.json", "--tokens @two.json: holds 2 prompts; --tokens takes one"),
        ("--tokens", "@keys.json", "no token_ids in it (it has block_keys: --keys @keys.json)"),
        ("--tokens", "@other.json", "is a prompt for model 'other', not --model 'm'"),
        ("--tokens", "@salted.json", "is a prompt for salt 's', not --salt ''"),
        ("--tokens", "@big.json", "@big.json: token_ids: 4294967296 is out of range"),
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
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "two.json").write_text('[{"model": "m", "token_ids": [1]}, {"model": "m", "token_ids": [2]}]')
    (tmp_path / "keys.json").write_text('{"model": "m", "block_keys": [1, 2]}')
    (tmp_path / "other.json").write_text('{"model": "other", "token_ids": [1, 2]}')
    (tmp_path / "salted.json").write_text('{"model": "m", "salt": "s", "token_ids": [1, 2]}')
    (tmp_path / "big.json").write_text('{"model": "m", "token_ids": [1, 4294967296]}')
    assert main(["score", "--server", "127.0.0.1:1", "--model", "m", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvindex score: error: ") and says in err and err.count("\n") == 1, err


def test_policy_options_reach_the_policies_and_typos_are_refused() -> None:
    """``serve --policy-option``: values typed as numbers or booleans, checked against the policy's
    own parameters, and given to the service's ranker."""
    import argparse

    from kvindex.cli import check_policy_options, parse_policy_option
    from kvindex.service.app import IndexService, ServiceConfig

    texts = ("ttft.replica_cost=0", "ttft.margin=0.25", "cache_aware.x=true")
    parsed = [parse_policy_option(t) for t in texts]
    assert parsed == [("ttft", "replica_cost", 0), ("ttft", "margin", 0.25), ("cache_aware", "x", True)]
    with pytest.raises(argparse.ArgumentTypeError, match=r"POLICY\.NAME=VALUE"):
        parse_policy_option("replica_cost=0")
    with pytest.raises(SystemExit, match="ttft has no parameter 'replica_costs'"):
        check_policy_options([("ttft", "replica_costs", 1)])
    with pytest.raises(SystemExit, match="unknown policy 'tft'"):
        check_policy_options([("tft", "margin", 1)])
    options = check_policy_options(parsed[:2])
    assert options == {"ttft": {"replica_cost": 0, "margin": 0.25}}
    service = IndexService(ServiceConfig(policy_options=options))
    ttft = service.ranker.policies["ttft"]
    assert ttft.replica_cost == 0 and ttft.margin == 0.25  # type: ignore[attr-defined]


def test_serve_route_flags_make_the_embedded_proxy_config() -> None:
    from kvindex.cli import _embedded_route, build_parser

    def config(*argv: str) -> object:
        args = build_parser().parse_args(["serve", *argv])
        return _embedded_route(args, "ADMISSION", "OBJECTIVES")

    assert config() is None  # off unless a port is given
    cfg = config(
        "--route-port", "0", "--route-host", "127.0.0.1", "--route-top-k", "2", "--shutdown-grace", "7"
    )
    assert (cfg.host, cfg.port, cfg.top_k, cfg.grace) == ("127.0.0.1", 0, 2, 7.0)  # type: ignore[attr-defined]
    assert (cfg.admission, cfg.objectives) == ("ADMISSION", "OBJECTIVES")  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match="--route-top-k must be at least 1"):
        config("--route-port", "8080", "--route-top-k", "0")


def _fields(*argv: str) -> dict[str, object]:
    from kvindex.cli import _prompt_fields, build_parser

    return _prompt_fields(build_parser().parse_args(["score", "--model", "m", *argv]))


@pytest.mark.parametrize("text", ["1,2,3", "1 2 3", "1, 2, 3", " 1\t2,,3 ", "1 ,2\n3"])
def test_token_lists_split_on_commas_and_whitespace(text: str) -> None:
    # "1 2 3" was read as 123: digits are never joined.
    assert _fields("--tokens", text)["token_ids"] == [1, 2, 3]
    assert _fields("--keys", text)["block_keys"] == [1, 2, 3]


def test_prompt_files_of_either_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tokens @FILE`` reads the object replay --query takes (make sample-log writes one) as well
    as a bare list: one reader for every prompt file."""
    sample = json.loads((ROOT / "docs" / "sample-prompt.json").read_text())
    fields = _fields("--model", sample["model"], "--tokens", f"@{ROOT / 'docs' / 'sample-prompt.json'}")
    assert fields["token_ids"] == sample["token_ids"] and fields["model"] == sample["model"]
    bare = tmp_path / "bare.json"
    bare.write_text("[5, 6, 7]")
    assert _fields("--tokens", f"@{bare}")["token_ids"] == [5, 6, 7]
    keyed = tmp_path / "keyed.json"
    keyed.write_text('[{"model": "m", "block_keys": [18446744073709551615], "top_k": 2}]')
    assert _fields("--keys", f"@{keyed}")["block_keys"] == [(1 << 64) - 1]
    # Replay's query options are not flags' business here: named, not silently dropped.
    assert capsys.readouterr().err == (
        f"kvindex score: note: --keys @{keyed}: top_k ignored (the flags set them here; replay --query "
        "reads them)\n"
    )


def test_top_k_is_checked_before_it_reaches_protobuf(capsys: pytest.CaptureFixture[str]) -> None:
    from kvindex.cli import main

    for value in ("-3", "4294967296", "two"):
        with pytest.raises(SystemExit) as exc:
            main(["score", "--server", "127.0.0.1:1", "--model", "m", "--tokens", "1", "--top-k", value])
        assert exc.value.code == 2
        assert "kvindex score: error: argument --top-k: " in capsys.readouterr().err


def test_cost_options_price_the_estimate_and_bad_ones_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --cost NAME=VALUE`` (issue 31: the demo's simulated 8B engines were estimated with the
    default 70B model): each value reaches the part of the estimate it names; the parameters a
    capture records rebuild the same costs in a replay; a typo or a value out of range exits 2 naming
    the flag, before anything starts."""
    import argparse

    from kvindex.cli import main, parse_cost_option
    from kvindex.scoring.costs import (
        CostConfig,
        KvProfile,
        cost_config,
        cost_config_of,
        cost_parameters,
    )

    options = dict(
        parse_cost_option(t)
        for t in ("prefill_a_ms=6.1", "prefill_b_ms_per_token=0.03", "step_ms=6", "chunk_tokens=4096",
                  "decode_ms_per_seq=0.6", "kv_bytes_per_token=131072", "pcie_gbps=50")
    )  # fmt: skip
    costs = cost_config(options, calibrate=False)
    assert (costs.default_prefill.a_ms, costs.default_prefill.b_ms_per_token) == (6.1, 0.03)
    assert costs.default_prefill.c_ms_per_token2 == CostConfig().default_prefill.c_ms_per_token2
    engine = costs.engine
    assert (engine.chunk_tokens, engine.step_ms, engine.decode_ms_per_seq) == (4096, 6.0, 0.6)
    assert costs.fetch.per_token_ms[1] == KvProfile(131072, 50.0).ms_per_token(50.0)
    assert costs.fetch.per_token_ms[2] == KvProfile(131072).ms_per_token(KvProfile().disk_gbps)
    assert not costs.calibrate
    assert cost_config({}) == CostConfig()
    assert cost_config_of(cost_parameters(costs)) == costs
    assert cost_config_of(None) == CostConfig()  # a log written before costs were recorded
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=NUMBER"):
        parse_cost_option("step_ms")
    for bad, says in [
        ("stepms=6", "unknown cost parameter 'stepms'"),
        ("pcie_gbps=0", "pcie_gbps must be a finite number > 0"),
        ("step_ms=-1", "step_ms must be a finite number >= 0"),
        ("chunk_tokens=0.5", "chunk_tokens must be a whole number"),
    ]:
        assert main(["serve", "--cost", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvindex serve: error: argument --cost: ") and says in err, err
