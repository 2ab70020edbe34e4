"""The one place a client's gRPC channel is made: plaintext or TLS/mTLS, plus call metadata.

Secured deployments pass ``grpc.ChannelCredentials`` (``grpc.ssl_channel_credentials(...)``, built by
whatever reads the TLS options) and a bearer token; nothing else in the client knows about security.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

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
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (``host:port``): TLS when ``credentials`` are given.

    ``options`` are added to (and override) DEFAULT_OPTIONS. Must be called on the event loop that
    will use the channel.
    """
    merged = dict(DEFAULT_OPTIONS)
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
