"""The bearer token: the token file (one token per line, re-read when it changes), the server's check
of ``authorization: Bearer <token>`` on every call but the exempt services, and the interceptors
that send it from a client channel (sync or aio)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import structlog

from kvindex.security.errors import SecurityConfigError
from kvindex.security.files import RELOAD_CHECK_INTERVAL, file_signature, read_file

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTH_HEADER = "authorization"
DENIED = "missing or invalid bearer token (send 'authorization: Bearer <token>')"

log = structlog.get_logger("kvindex.security")


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
    return parse_tokens(read_file(path, "auth token file"), path)[0].decode("ascii")


class TokenFile:
    """The accepted tokens, re-read when the file changes. A change that cannot be read (missing,
    empty, malformed) keeps the previous tokens and is logged: failing open or locking every client
    out on a half-written file would both be worse."""

    def __init__(self, path: str | Path, check_interval: float = RELOAD_CHECK_INTERVAL) -> None:
        self.path = Path(path)
        self.check_interval = check_interval
        self._sig = file_signature([self.path])
        self._tokens = parse_tokens(read_file(self.path, "auth token file"), self.path)  # errors at start
        self._next_check = time.monotonic() + check_interval
        self.reloads = 0

    def tokens(self) -> list[bytes]:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_interval
            sig = file_signature([self.path])
            if sig != self._sig:
                self._sig = sig
                try:
                    self._tokens = parse_tokens(read_file(self.path, "auth token file"), self.path)
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
        if service in self.exempt or self.authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        self.rejected += 1
        now = time.monotonic()
        if now - self._last_log >= 60.0:  # a client retrying in a loop must not flood the log
            self._last_log = now
            log.warning("grpc_unauthenticated", method=method, rejected_total=self.rejected)
        return _deny(await continuation(handler_call_details))


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


def sync_token_interceptor(token: str) -> grpc.UnaryUnaryClientInterceptor:
    """An interceptor adding ``authorization: Bearer <token>`` to every call of a sync channel
    (``grpc.intercept_channel``)."""
    return _SyncToken(token)
