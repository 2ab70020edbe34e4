"""The one place a client's gRPC channel is made: plaintext or TLS/mTLS, plus call metadata.

Secured deployments pass a :class:`kvindex.security.ClientTLS` (the CLI's ``--tls``, ``--tls-ca``,
``--tls-cert``/``--tls-key``, ``--server-name``; files read here) or ready ``grpc.ChannelCredentials``,
and a bearer token (``read_token(--auth-token-file)``), sent as call metadata on every call; nothing
else in the client knows about security.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvindex.security import ClientTLS

# Reconnect quickly after the index restarts: gRPC's default backoff grows to 120 s, during which
# every call would take the fallback although the index is back. Messages as large as the server's.
DEFAULT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)

Metadata = tuple[tuple[str, str], ...]


def create_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, object]] = (),
    tls: ClientTLS | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (``host:port``): TLS when ``tls`` or ``credentials`` are given
    (``tls`` also brings its server-name override).

    ``options`` are added to (and override) DEFAULT_OPTIONS. Must be called on the event loop that
    will use the channel.
    """
    if tls is not None:
        if credentials is not None:
            raise ValueError("give tls or credentials, not both")
        credentials = tls.credentials()
        options = [*tls.options(), *options]
    merged: dict[str, object] = dict(DEFAULT_OPTIONS)
    merged.update(dict(options))
    opts = list(merged.items())
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, credentials, options=opts)


def call_metadata(token: str | None = None, extra: Sequence[tuple[str, str]] = ()) -> Metadata:
    """Metadata sent with every call: ``authorization: Bearer <token>`` when a token is given."""
    md = [(k.lower(), v) for k, v in extra]
    if token:
        md.append(("authorization", f"Bearer {token}"))
    return tuple(md)
