"""Routing sync's switches: on with an external NATS unless switched off, and the serve flags from the
command line, the environment and a file (bad ones refused). Replicas over real parts:
tests/integration/test_routing_sync_e2e.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvindex.cli import _add_serve
from kvindex.config.layers import parse_layered
from kvindex.routing_sync.sync import SyncConfig
from kvindex.service.app import IndexService, ServiceConfig


def test_routing_sync_is_on_with_an_external_nats_unless_switched_off() -> None:
    def service(**kw: object) -> IndexService:
        return IndexService(ServiceConfig(grpc_host="127.0.0.1", grpc_port=0, **kw))  # type: ignore[arg-type]

    assert service().routing_sync is None  # embedded nats-server: no other replica can reach it
    on = service(nats_url="nats://127.0.0.1:1")
    assert on.routing_sync is not None and on.ranker.observer is on.routing_sync
    assert service(nats_url="nats://127.0.0.1:1", routing_sync=SyncConfig(enabled=False)).routing_sync is None
    named = service(routing_sync=SyncConfig(enabled=True, replica_id="index-a"))
    assert named.routing_sync is not None and named.routing_sync.replica_id == "index-a"


@pytest.mark.parametrize(
    ("argv", "env", "toml", "expected"),
    [
        ([], {}, "", (None, "")),
        (["--no-routing-sync"], {}, "", (False, "")),
        (["--routing-sync"], {}, "", (True, "")),
        (["--routing-sync", "off", "--replica-id", "pod-a"], {}, "", (False, "pod-a")),
        ([], {"KVINDEX_ROUTING_SYNC": "false", "KVINDEX_REPLICA_ID": "pod-e"}, "", (False, "pod-e")),
        (["--no-routing-sync"], {"KVINDEX_ROUTING_SYNC": "on"}, "", (False, "")),
        ([], {}, "[serve]\nrouting-sync = false\nreplica-id = 'pod-t'\n", (False, "pod-t")),
        (["--routing-sync"], {}, "routing-sync = false\n", (True, "")),
    ],
)
def test_serve_flags_from_command_line_environment_and_file(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml: str, expected: tuple[bool | None, str]
) -> None:
    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers(dest="command"))
    if toml:
        (tmp_path / "k.toml").write_text(toml)
        argv = [*argv, "--config", str(tmp_path / "k.toml")]
    args = parse_layered(parser, ["serve", *argv], env)
    assert (args.routing_sync, args.replica_id) == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--replica-id", "a.b"], {}, "replica id 'a.b' must match"),
        ([], {"KVINDEX_ROUTING_SYNC": "maybe"}, "KVINDEX_ROUTING_SYNC: invalid value 'maybe'"),
    ],
)
def test_bad_serve_flags_are_refused(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture
) -> None:
    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parse_layered(parser, ["serve", *argv], env)
    assert message in capsys.readouterr().err
