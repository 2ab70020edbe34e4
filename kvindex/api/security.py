"""gRPC transport security for every kvindex server and client: TLS, mutual TLS and a bearer token.

Server side (``kvindex serve``, ``kvindex replay --serve``, any further port such as ext_proc)::

    add_server_options(parser)                     # --tls-cert --tls-key --tls-client-ca --auth-token-file
    security = ServerSecurity.from_args(args)      # or ServerSecurity(ServerTLS(...), token_file=...)
    server = security.new_server(options=[...])    # grpc.aio.server with the token check installed
    port = security.add_port(server, "0.0.0.0:50051")   # TLS port when certificates are given

Client side (``kvindex score|lookup|stats|instances``, ``kvindex.client``)::

    add_client_options(parser)                     # --tls --tls-ca --tls-cert --tls-key --server-name
                                                   # --auth-token-file
    channel = open_channel(address, ClientTLS.from_args(args), token_from_args(args), aio=False)

The token is checked on every RPC except the health service (``grpc.health.v1.Health``: probes
carry no secrets). Reflection needs the token like the API: it lists the whole API surface, and
``grpcurl -H 'authorization: Bearer ...'`` sends it. Certificates and the token file are re-read by
the server when they change on disk (rotation without a restart); clients read them once, when the
channel is opened. The token never reaches a log line, an exception message or a metric.
"""

from __future__ import annotations

import argparse
import hmac
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import structlog

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTH_HEADER = "authorization"
DENIED = "missing or invalid bearer token (send 'authorization: Bearer <token>')"
# Re-reading files is a stat() per check; once a second bounds it under any call or handshake rate.
RELOAD_CHECK_INTERVAL = 1.0

log = structlog.get_logger("kvindex.security")


class SecurityConfigError(ValueError):
    """A TLS or token setting that cannot work; the message names the flag or file (never the token)."""


# -- files ---------------------------------------------------------------------------------------


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityConfigError(f"{what} {path} is empty")
    return data


def _signature(paths: Iterable[str | Path | None]) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is replaced (also through a Kubernetes Secret's symlink swap)."""
    out = []
    for p in paths:
        if p is None:
            continue
        try:
            st = os.stat(p)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


def parse_tokens(data: bytes, path: Path) -> list[bytes]:
    """One token per line; blank lines and ``#`` comments ignored. Several lines = several accepted
    tokens (rotation: add the new one, move the clients, remove the old one)."""
    tokens = []
    for line in data.splitlines():
        line = line.strip()
        if not line or line.startswith(b"#"):
            continue
        # Header values must be visible ASCII; a space would split "Bearer <token>" differently.
        if any(c <= 0x20 or c >= 0x7F for c in line):
            raise SecurityConfigError(f"auth token file {path}: a token has spaces or non-ASCII characters")
        tokens.append(line)
    if not tokens:
        raise SecurityConfigError(f"auth token file {path} holds no token")
    return tokens


def read_token(path: str | Path) -> str:
    """The token a client sends: the first one in the file (the newest, by the rotation convention)."""
    path = Path(path)
    return parse_tokens(_read(path, "auth token file"), path)[0].decode("ascii")


class TokenFile:
    """The accepted tokens, re-read when the file changes. A change that cannot be read (missing,
    empty, malformed) keeps the previous tokens and is logged: failing open or locking every client
    out on a half-written file would both be worse."""

    def __init__(self, path: str | Path, check_interval: float = RELOAD_CHECK_INTERVAL) -> None:
        self.path = Path(path)
        self.check_interval = check_interval
        self._sig = _signature([self.path])
        self._tokens = parse_tokens(_read(self.path, "auth token file"), self.path)  # errors at start
        self._next_check = time.monotonic() + check_interval
        self.reloads = 0

    def tokens(self) -> list[bytes]:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_interval
            sig = _signature([self.path])
            if sig != self._sig:
                self._sig = sig
                try:
                    self._tokens = parse_tokens(_read(self.path, "auth token file"), self.path)
                    self.reloads += 1
                    log.info("auth_token_file_reloaded", path=str(self.path), tokens=len(self._tokens))
                except SecurityConfigError as exc:
                    log.warning("auth_token_file_unusable_keeping_previous", error=str(exc))
        return self._tokens

    def accepts(self, presented: bytes) -> bool:
        ok = False
        for token in self.tokens():
            ok |= hmac.compare_digest(presented, token)  # constant time; every token compared
        return ok


# -- server --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM files); with ``client_ca``, mutual TLS: clients
    must present a certificate signed by it."""

    cert: str | Path
    key: str | Path
    client_ca: str | Path | None = None

    def _config(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))],
            _read(self.client_ca, "client CA") if self.client_ca else None,
        )

    def credentials(self, reload_interval: float = RELOAD_CHECK_INTERVAL) -> grpc.ServerCredentials:
        """Server credentials that pick up renewed files (cert-manager, a rotated Secret) for new
        connections, checking at most every ``reload_interval`` s; established connections keep
        their session."""
        initial = self._config()  # unreadable files fail here, at start
        sig = _signature([self.cert, self.key, self.client_ca])
        state = {"sig": sig, "next": time.monotonic() + reload_interval}
        lock = threading.Lock()

        def fetch() -> Any:
            # Called by gRPC core before each handshake; None keeps the current configuration.
            with lock:
                now = time.monotonic()
                if now < state["next"]:
                    return None
                state["next"] = now + reload_interval
                sig = _signature([self.cert, self.key, self.client_ca])
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


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED, reading
    nothing from the client."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    if handler is None:  # unknown method: do not tell an unauthenticated caller what exists
        return grpc.unary_unary_rpc_method_handler(abort)
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **codec)
    return grpc.unary_unary_rpc_method_handler(abort, **codec)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` on every call except the exempt services."""

    def __init__(self, tokens: TokenFile, exempt_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        self.tokens = tokens
        self.exempt = frozenset(exempt_services)
        self.rejected = 0
        self._last_log = -1e9

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                if not isinstance(value, str):
                    return False
                scheme, _, presented = value.partition(" ")
                if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 7235)
                    return False
                return self.tokens.accepts(presented.strip().encode("ascii", "replace"))
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        service = method[1:].split("/", 1)[0]
        if service in self.exempt or self.authorized(handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return await continuation(handler_call_details)
        self.rejected += 1
        now = time.monotonic()
        if now - self._last_log >= 60.0:  # a client retrying in a loop must not flood the log
            self._last_log = now
            log.warning("grpc_unauthenticated", method=method, rejected_total=self.rejected)
        return _deny(await continuation(handler_call_details))


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


# -- client --------------------------------------------------------------------------------------


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
            root_certificates=_read(self.ca, "CA") if self.ca else None,
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None,
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


def token_from_args(args: argparse.Namespace) -> str | None:
    try:
        return read_token(args.auth_token_file) if args.auth_token_file else None
    except SecurityConfigError as exc:
        raise SystemExit(f"kvindex: error: {exc}") from None


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call of a sync channel (works with and without TLS, unlike
    call credentials, which gRPC refuses to send over plaintext — a mesh sidecar may provide the TLS)."""

    def __init__(self, token: str) -> None:
        self.header = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, d: Any) -> _CallDetails:
        return _CallDetails(
            d.method,
            d.timeout,
            [*(d.metadata or ()), self.header],
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioToken:
    """``_SyncToken`` for grpc.aio channels. A grpc.aio channel files each interceptor under the
    first call kind it implements only, so there is one class per kind (``aio_token_interceptors``)."""

    def __init__(self, token: str) -> None:
        self.header = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self.header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioTokenUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioTokenUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioTokenStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioTokenStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding ``authorization: Bearer <token>`` to every call of a grpc.aio channel."""
    kinds = (_AioTokenUnaryUnary, _AioTokenUnaryStream, _AioTokenStreamUnary, _AioTokenStreamStream)
    return [kind(token) for kind in kinds]


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
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel


# -- command line --------------------------------------------------------------------------------


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


def add_client_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC security (docs/deploy.md)")
    g.add_argument("--tls", action="store_true", help="TLS with the system's trust store")
    g.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA for the server certificate")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (implies TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--server-name", metavar="NAME", help="expected name in the server certificate")
    g.add_argument("--auth-token-file", metavar="FILE", help="send the (first) token in FILE as bearer token")
