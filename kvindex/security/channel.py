"""The client side: a channel to a kvindex server (plaintext, TLS or mutual TLS, with the bearer
token on every call) and the query commands' security flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import grpc

from kvindex.security.errors import SecurityConfigError
from kvindex.security.tls import ClientTLS
from kvindex.security.tokens import aio_token_interceptors, read_token, sync_token_interceptor


def token_from_args(args: argparse.Namespace) -> str | None:
    try:
        return read_token(args.auth_token_file) if args.auth_token_file else None
    except SecurityConfigError as exc:
        raise SystemExit(f"kvindex: error: {exc}") from None


def open_channel(
    address: str,
    tls: ClientTLS | None = None,
    token: str | None = None,
    *,
    aio: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> Any:
    """A channel to a kvindex server: plaintext when ``tls`` is None, else TLS (mutual when it has a
    client certificate); ``token`` (see ``read_token``) is sent as ``authorization: Bearer`` on
    every call. ``aio``: a ``grpc.aio.Channel`` (create it inside the running event loop), else a
    ``grpc.Channel``. Both close with ``close()`` or as a context manager. Files are read here."""
    opts = [*options, *(tls.options() if tls else [])]
    creds = tls.credentials() if tls else None
    if aio:
        interceptors = aio_token_interceptors(token) if token else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)
    channel = (
        grpc.insecure_channel(address, options=opts)
        if creds is None
        else grpc.secure_channel(address, creds, options=opts)
    )
    return grpc.intercept_channel(channel, sync_token_interceptor(token)) if token else channel


def add_client_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC security (docs/deploy.md)")
    g.add_argument("--tls", action="store_true", help="TLS with the system's trust store")
    g.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA for the server certificate")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (implies TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--server-name", metavar="NAME", help="expected name in the server certificate")
    g.add_argument("--auth-token-file", metavar="FILE", help="send the (first) token in FILE as bearer token")
