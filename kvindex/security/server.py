"""The server side: ``ServerSecurity`` (TLS or mutual TLS credentials, the token check, and the
ports and servers set up with them) and the serving commands' security flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvindex.security.errors import SecurityConfigError
from kvindex.security.files import RELOAD_CHECK_INTERVAL
from kvindex.security.tls import ServerTLS
from kvindex.security.tokens import HEALTH_SERVICE, TokenAuthInterceptor, TokenFile

log = structlog.get_logger("kvindex.security")


class ServerSecurity:
    """How a gRPC server authenticates: TLS (mutual with a client CA) and/or a bearer token file.
    ``ServerSecurity()`` is plaintext without a token (the embedded default)."""

    def __init__(
        self,
        tls: ServerTLS | None = None,
        token_file: str | Path | None = None,
        exempt_services: Iterable[str] = (HEALTH_SERVICE,),
        reload_interval: float = RELOAD_CHECK_INTERVAL,
    ) -> None:
        self.tls = tls
        self.token = TokenFile(token_file, reload_interval) if token_file else None
        self.interceptor = TokenAuthInterceptor(self.token, exempt_services) if self.token else None
        self._credentials: grpc.ServerCredentials | None = None
        self._reload_interval = reload_interval
        if self.token is not None and tls is None:
            # Legitimate behind a mesh sidecar that terminates TLS; otherwise the token crosses in clear.
            log.warning("auth_token_without_tls", hint="the token is sent in clear unless a proxy adds TLS")
        if tls is not None:
            # Read now: a bad file stops the start, with a message naming it.
            self._credentials = tls.credentials(reload_interval)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        """From ``add_server_options`` flags; a bad combination or file exits with a message."""
        cert, key, client_ca = args.tls_cert, args.tls_key, args.tls_client_ca
        try:
            if bool(cert) != bool(key):
                raise SecurityConfigError("--tls-cert and --tls-key go together")
            if client_ca and not cert:
                raise SecurityConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
            tls = ServerTLS(Path(cert), Path(key), Path(client_ca) if client_ca else None) if cert else None
            return cls(tls, args.auth_token_file)
        except SecurityConfigError as exc:
            raise SystemExit(f"kvindex: error: {exc}") from None

    @property
    def mode(self) -> str:
        """For logs: ``plaintext``, ``tls`` or ``mtls``, plus ``+token``."""
        mode = "plaintext" if self.tls is None else ("mtls" if self.tls.client_ca else "tls")
        return mode + ("+token" if self.token else "")

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [self.interceptor] if self.interceptor is not None else []

    def new_server(self, **kwargs: Any) -> grpc.aio.Server:
        """``grpc.aio.server(**kwargs)`` with the token check installed (before any given interceptors)."""
        interceptors = [*self.interceptors(), *(kwargs.pop("interceptors", None) or ())]
        return grpc.aio.server(interceptors=interceptors or None, **kwargs)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` (TLS when configured); the bound port, 0 when binding failed."""
        if self.tls is None:
            return server.add_insecure_port(address)
        # Dynamic credentials hand their initial configuration to the first port only (gRPC's fetcher
        # wrapper); a second port sharing them fails to bind. Each port (API, ext_proc) gets its own.
        credentials = self._credentials or self.tls.credentials(self._reload_interval)
        self._credentials = None
        return server.add_secure_port(address, credentials)


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC security (docs/deploy.md)")
    g.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (and --tls-key)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca", metavar="PEM", help="mutual TLS: require client certificates signed by this CA"
    )
    g.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <token>' (one token per line) on every RPC but health",
    )
