"""TLS and mutual TLS: the server's certificate and key (credentials that pick up renewed files) and
the client's trust anchors, certificate and expected server name."""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvindex.security.errors import SecurityConfigError
from kvindex.security.files import RELOAD_CHECK_INTERVAL, file_signature, read_file

log = structlog.get_logger("kvindex.security")


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM files); with ``client_ca``, mutual TLS: clients
    must present a certificate signed by it."""

    cert: str | Path
    key: str | Path
    client_ca: str | Path | None = None

    def _config(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(read_file(self.key, "TLS key"), read_file(self.cert, "TLS certificate"))],
            read_file(self.client_ca, "client CA") if self.client_ca else None,
        )

    def credentials(self, reload_interval: float = RELOAD_CHECK_INTERVAL) -> grpc.ServerCredentials:
        """Server credentials that pick up renewed files (cert-manager, a rotated Secret) for new
        connections, checking at most every ``reload_interval`` s; established connections keep
        their session."""
        initial = self._config()  # unreadable files fail here, at start
        sig = file_signature([self.cert, self.key, self.client_ca])
        state: dict[str, Any] = {"sig": sig, "next": time.monotonic() + reload_interval}
        lock = threading.Lock()

        def fetch() -> Any:
            # Called by gRPC core before each handshake; None keeps the current configuration.
            with lock:
                now = time.monotonic()
                if now < state["next"]:
                    return None
                state["next"] = now + reload_interval
                sig = file_signature([self.cert, self.key, self.client_ca])
                if sig == state["sig"]:
                    return None
                state["sig"] = sig
            try:
                config = self._config()
            except SecurityConfigError as exc:
                log.warning("tls_files_unusable_keeping_previous", error=str(exc))
                return None
            log.info("tls_files_reloaded", cert=str(self.cert))
            return config

        return grpc.dynamic_ssl_server_credentials(
            initial, fetch, require_client_authentication=self.client_ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    """TLS towards a kvindex server. ``ca``: the CA that signed the server's certificate (None: the
    system's trust store); ``cert``/``key``: this client's certificate for mutual TLS;
    ``server_name``: the name to check the server certificate against when the address differs
    (an IP, a port-forward)."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise SecurityConfigError("a client certificate needs both --tls-cert and --tls-key")
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca, "CA") if self.ca else None,
            private_key=read_file(self.key, "TLS key") if self.key else None,
            certificate_chain=read_file(self.cert, "TLS certificate") if self.cert else None,
        )

    def options(self) -> list[tuple[str, Any]]:
        if not self.server_name:
            return []
        name = self.server_name
        return [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientTLS | None:
        """From ``add_client_options`` flags; None (plaintext) unless a TLS flag is given."""
        if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.server_name):
            return None
        path = lambda p: Path(p) if p else None  # noqa: E731
        return cls(path(args.tls_ca), path(args.tls_cert), path(args.tls_key), args.server_name)
