"""Secured NATS settings without a server: checked before connecting, secrets out of repr and
descriptions, options from the command line, the environment and a TOML file (their precedence and
errors). Against a real nats-server: tests/integration/test_nats_security.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import NatsSettings, parse_layered, redact_url
from kvindex.config.layers import add_config_option
from kvindex.config.nats import NatsConfigError, add_nats_arguments
from workers_shim.cli import build_parser as kvshim_parser

PASSWORD = "pw-7f3a9c1e-secret"
TOKEN = "tok-2b8d4e6f-secret"


# -- settings: validation, redaction ---------------------------------------------------------------


def test_settings_are_checked_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(NatsConfigError, match="one NATS authentication method"):
        NatsSettings(token="t", user="u", password="p").validate()
    with pytest.raises(NatsConfigError, match="--nats-password needs --nats-user"):
        NatsSettings(password="p").validate()
    with pytest.raises(NatsConfigError, match="both --nats-tls-cert and --nats-tls-key"):
        NatsSettings(tls_cert=str(tmp_path)).validate()
    with pytest.raises(NatsConfigError, match=r"--nats-creds .*missing\.creds: no such file"):
        NatsSettings(creds=str(tmp_path / "missing.creds")).validate()
    with pytest.raises(NatsConfigError, match="scheme"):
        NatsSettings(servers=("http://h:1",)).validate()
    # serve without --nats embeds a server: credentials given for a real one must not be dropped.
    with pytest.raises(NatsConfigError, match="without --nats URL"):
        NatsSettings.from_args(parse_layered(_parser(), ["serve"], {"KVINDEX_NATS_TOKEN": "t"}))
    assert NatsSettings.from_args(parse_layered(_parser(), ["serve"], {})) is None


def test_secrets_stay_out_of_repr_and_description() -> None:
    s = NatsSettings(
        servers=(f"nats://bob:{PASSWORD}@h:4222", "tls://h2:4222"), user="bob", password=PASSWORD
    )
    t = NatsSettings(token=TOKEN)
    for text in (repr(s), repr(t), json.dumps(s.describe()), json.dumps(t.describe()), s.redacted_servers()):
        assert PASSWORD not in text and TOKEN not in text
    assert redact_url(f"nats://{TOKEN}@h:4222") == "nats://***@h:4222"
    assert s.describe() == {
        "servers": ["nats://bob:***@h:4222", "tls://h2:4222"],
        "auth": "user",
        "tls": "on",
    }


# -- the layers: command line > environment > TOML file > default ----------------------------------


def _parser() -> Any:
    import argparse

    root = argparse.ArgumentParser(prog="t")
    sub = root.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    add_nats_arguments(p, default=None)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--jetstream", action="store_true")
    p.add_argument("--log-format", choices=("json", "console"), default="console")
    q = sub.add_parser("other")
    add_config_option(q)
    q.add_argument("--worker-id", required=True)
    return root


def test_layers_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "kvindex.toml"
    cfg.write_text(
        'nats-url = ["nats://file-a:4222", "nats://file-b:4222"]\n'
        'nats-creds = "/file.creds"\n'
        "grpc-port = 1111\n"
        'worker-id = "from-file"\n'  # an option of another command: allowed at the top level
        "[serve]\n"
        "grpc-port = 2222\n"  # the command's table overrides the top level
        "jetstream = true\n"
    )
    env = {"KVINDEX_NATS_CREDS": "/env.creds", "KVINDEX_LOG_FORMAT": "json"}
    args = parse_layered(_parser(), ["serve", "--config", str(cfg), "--nats-token", "cli"], env)
    assert args.nats == ["nats://file-a:4222", "nats://file-b:4222"]  # file
    assert args.nats_creds == "/env.creds"  # environment over file
    assert args.nats_token == "cli"  # command line
    assert args.grpc_port == 2222 and args.jetstream is True and args.log_format == "json"
    assert args.nats_user is None  # built-in default
    # Command line over environment over file, for the list option too.
    env2 = {"KVINDEX_CONFIG": str(cfg), "KVINDEX_NATS_URL": "nats://env-a:1,nats://env-b:2"}
    args = parse_layered(_parser(), ["serve"], env2)
    assert NatsSettings.from_args(args).servers == ("nats://env-a:1", "nats://env-b:2")  # type: ignore[union-attr]
    args = parse_layered(_parser(), ["serve", "--nats", "x:1", "--nats", "y:2,z:3", "--grpc-port", "7"], env2)
    assert NatsSettings.from_args(args).servers == ("nats://x:1", "nats://y:2", "nats://z:3")  # type: ignore[union-attr]
    assert args.grpc_port == 7
    # A required option satisfied by the environment; booleans from the environment.
    assert parse_layered(_parser(), ["other"], {"KVINDEX_WORKER_ID": "w9"}).worker_id == "w9"
    assert parse_layered(_parser(), ["serve"], {"KVINDEX_JETSTREAM": "no"}).jetstream is False


@pytest.mark.parametrize(
    ("argv", "env", "toml", "message"),
    [
        (["other"], {}, None, "required: --worker-id"),
        (["serve"], {"KVINDEX_GRPC_PORT": "many"}, None, "KVINDEX_GRPC_PORT: invalid value 'many'"),
        (["serve"], {"KVINDEX_LOG_FORMAT": "xml"}, None, "'xml' is not one of"),
        (["serve"], {"KVINDEX_JETSTREAM": "maybe"}, None, "expected true or false"),
        (["serve"], {}, "nats-tokn = 'x'\n", "unknown option 'nats-tokn'"),
        (["serve"], {}, "grpc-port = [", "not valid TOML"),
    ],
)
def test_layers_bad_values_are_clear_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    toml: str | None,
    message: str,
) -> None:
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        argv = [*argv, "--config", str(tmp_path / "c.toml")]
    with pytest.raises(SystemExit):
        parse_layered(_parser(), argv, env)
    assert message in capsys.readouterr().err


def test_kvshim_takes_every_option_from_the_environment(tmp_path: Path) -> None:
    """The real kvshim parser: required options and the NATS group from env and TOML."""
    cfg = tmp_path / "shim.toml"
    cfg.write_text(
        'nats = "tls://nats-1:4222,tls://nats-2:4222"\nnats-tls-ca = "/ca.pem"\n[vllm]\nmodel = "llama"\n'
    )
    env = {"KVINDEX_WORKER_ID": "node-7", "KVINDEX_ZMQ": "tcp://e:5557", "KVINDEX_NATS_CREDS": "/w.creds"}
    parser, _ = kvshim_parser()
    args = parse_layered(parser, ["vllm", "--config", str(cfg), "--capacity", "gpu=10"], env)
    s = NatsSettings.from_args(args)
    assert s is not None
    assert (args.worker_id, args.zmq, args.model, args.capacity) == (
        "node-7",
        "tcp://e:5557",
        "llama",
        {"gpu": 10},
    )
    assert (
        s.servers == ("tls://nats-1:4222", "tls://nats-2:4222")
        and s.creds == "/w.creds"
        and s.tls_ca == "/ca.pem"
    )
    # Without anything, the bridge's default server.
    args = parse_layered(parser, ["sglang", "--zmq", "tcp://e:1", "--worker-id", "a", "--model", "m"], {})
    assert NatsSettings.from_args(args).servers == ("nats://127.0.0.1:4222",)  # type: ignore[union-attr]
