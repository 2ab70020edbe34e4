"""What a client call can raise."""

from __future__ import annotations

import grpc


class IndexUnavailable(ConnectionError):
    """The index could not answer (down, unreachable, past the deadline, stream broken) and no
    fallback decision was possible. ``reason`` is the counted label (``unavailable``, ``deadline``,
    ``stream_broken``, ``error``); ``code`` the gRPC status when there was one."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


class BadRequest(ValueError):
    """The index rejected the request's arguments (INVALID_ARGUMENT, or ScoreResponse.error on the
    stream): a caller's error, never answered by the fallback."""
