"""gRPC security configurations refused at start with a message naming the problem (certificates made
at test time by trustme). Over real sockets: tests/integration/test_grpc_security.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvindex.security import (
    ClientTLS,
    SecurityConfigError,
    ServerSecurity,
    add_server_options,
    open_channel,
    read_token,
)
from tests.conftest import Pki, token_file

# -- configuration errors -----------------------------------------------------------------------------


def test_bad_configurations_fail_at_start_with_a_message_naming_the_problem(pki: Pki, tmp_path: Path) -> None:
    def serve_args(*argv: str) -> Any:
        p = argparse.ArgumentParser()
        add_server_options(p)
        return p.parse_args(argv)

    with pytest.raises(SystemExit, match="--tls-cert and --tls-key go together"):
        ServerSecurity.from_args(serve_args("--tls-cert", str(pki.server_cert)))
    with pytest.raises(SystemExit, match="--tls-client-ca"):
        ServerSecurity.from_args(serve_args("--tls-client-ca", str(pki.ca)))
    with pytest.raises(SystemExit, match=r"no-such\.pem"):
        ServerSecurity.from_args(serve_args("--tls-cert", "no-such.pem", "--tls-key", str(pki.server_key)))
    with pytest.raises(SecurityConfigError, match="is empty"):
        ServerSecurity(token_file=token_file(tmp_path, "", name="empty"))
    with pytest.raises(SecurityConfigError, match="spaces or non-ASCII") as err:
        ServerSecurity(token_file=token_file(tmp_path, "two words", name="spaced"))
    assert "two" not in str(err.value)  # the token itself never appears in a message
    with pytest.raises(SecurityConfigError, match="holds no token"):
        read_token(token_file(tmp_path, "# only a comment", name="comment"))
    with pytest.raises(SecurityConfigError, match="both --tls-cert and --tls-key"):
        open_channel("127.0.0.1:1", ClientTLS(ca=pki.ca, cert=pki.client_cert))
