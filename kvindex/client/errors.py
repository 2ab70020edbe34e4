"""What a client call can raise besides ``kvindex.api.errors.BadRequest`` (the index rejected the
arguments): ``IndexUnavailable``."""

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
