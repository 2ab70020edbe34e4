"""What every option of every command shares, checked over all of them so a new one cannot slip by:
help text, and ports that are 0-65535 (or -1 where that turns a listener off) or exit 2 naming the
flag. The commands: every ``kvindex`` and ``kvshim`` subcommand, and the demo's options."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from kvindex.config.args import port, port_or_off


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    from kvindex.cli import build_parser as kvindex_parser
    from workers_shim.cli import build_parser as kvshim_parser

    def walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from walk(f"{name} {sub}", p)

    yield from walk("kvindex", kvindex_parser())
    yield from walk("kvshim", kvshim_parser()[0])


def _options() -> Iterator[tuple[str, argparse.Action]]:
    for name, parser in _commands():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield name, action


def test_the_walk_sees_every_command() -> None:
    names = {name for name, _ in _commands()}
    assert {"kvindex serve", "kvindex score", "kvindex replay", "kvindex route", "kvshim sim"} <= names
    assert {"kvshim vllm", "kvshim sglang", "kvshim trtllm", "kvshim heartbeat"} <= names


def test_every_option_has_help() -> None:
    bare = [f"{name} {'/'.join(a.option_strings)}" for name, a in _options() if not (a.help or "").strip()]
    assert not bare, "options without help text:\n" + "\n".join(bare)


def test_every_port_option_is_range_checked() -> None:
    ports = [(name, a) for name, a in _options() if a.dest == "port" or a.dest.endswith("_port")]
    assert len(ports) >= 8  # serve's four, replay's, route's, kvshim's --stats-port and sim's --http-port
    unchecked = [f"{name} {a.option_strings[0]}" for name, a in ports if a.type not in (port, port_or_off)]
    assert not unchecked, "port options without the port type (kvindex.config.args):\n" + "\n".join(unchecked)


_VLLM = ["kvshim", "vllm", "--zmq", "tcp://h:5557", "--worker-id", "w", "--model", "m"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["kvindex", "serve", "--grpc-port", "99999"], "--grpc-port"),  # listened on 34463 (mod 65536)
        (["kvindex", "serve", "--grpc-port", "-1"], "--grpc-port"),
        (["kvindex", "serve", "--metrics-port", "65536"], "--metrics-port"),
        (["kvindex", "serve", "--metrics-port", "-2"], "--metrics-port"),
        (["kvindex", "serve", "--ext-proc-port", "70000"], "--ext-proc-port"),
        (["kvindex", "serve", "--route-port", "1e3"], "--route-port"),
        (["kvindex", "replay", "x.kvlog", "--serve", "--grpc-port", "65536"], "--grpc-port"),
        (["kvindex", "route", "--port", "65536"], "--port"),
        ([*_VLLM, "--stats-port", "-1"], "--stats-port"),
        (["kvshim", "sim", "--http-port", "99999"], "--http-port"),
        (["demo", "--grpc-port", "65536"], "--grpc-port"),
        (["demo", "--metrics-port", "-3"], "--metrics-port"),
    ],
)
def test_a_port_out_of_range_exits_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvindex.cli import main as kvindex_main
    from kvtools.demo import parse as demo_parse
    from workers_shim.cli import main as kvshim_main

    command, args = argv[0], argv[1:]
    with pytest.raises(SystemExit) as exc:
        {"kvindex": kvindex_main, "kvshim": kvshim_main, "demo": demo_parse}[command](args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and "is not a port number (0-65535" in err, err


@pytest.mark.parametrize("value", ["0", "-3", "4294967296"])
def test_route_top_k_is_at_least_one(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # -3 started a proxy whose every Score then failed in protobuf; 0 left the fallback no instance.
    from kvindex.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["route", "--top-k", value])
    assert exc.value.code == 2
    assert "error: argument --top-k: " in capsys.readouterr().err


def test_ports_at_the_ends_of_the_range_and_off() -> None:
    from kvindex.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--grpc-port",
            "0",
            "--metrics-port",
            "-1",
            "--ext-proc-port",
            "65535",
            "--route-port",
            "-1",
        ]
    )
    assert (args.grpc_port, args.metrics_port, args.ext_proc_port, args.route_port) == (0, -1, 65535, -1)


def test_a_port_from_the_environment_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvindex.cli import main

    monkeypatch.setenv("KVINDEX_GRPC_PORT", "99999")
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    assert "KVINDEX_GRPC_PORT: invalid value '99999': 99999 is not a port number" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--http-port", "65534", "--workers", "4"], "--http-port 65534: worker 3 would listen on 65537"),
        (
            ["--endpoint-base", "h:65533", "--workers", "4"],
            "--endpoint-base h:65533: worker 3 would be on port",
        ),
    ],
)
def test_sim_ports_per_worker_stay_in_range(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Worker i listens (or is announced) on PORT+i: the last one's must be a port too. Checked
    before anything starts (no NATS is needed to be told)."""
    from workers_shim.cli import main

    assert main(["sim", "--nats", "nats://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvshim sim: error: {says}") and err.count("\n") == 1, err
