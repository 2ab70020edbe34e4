"""``kvindex replay --serve``: the gRPC API (the service's own server and servicer) on replayed state."""

from __future__ import annotations

from kvindex.api.server import GrpcServer
from kvindex.capture.replay import Replayer
from kvindex.security import ServerSecurity


async def serve_replayed(
    replayer: Replayer, host: str = "127.0.0.1", port: int = 50051, security: ServerSecurity | None = None
) -> GrpcServer:
    """Start serving ``replayer``'s index, registry and router; stop with ``await server.stop()``.

    Queries see the replayed state at its virtual time (heartbeat ages as of the last record applied, or
    of ``--until``); Commit and Release change the replayed router's ledger like the live one's.
    ``security``: TLS / token as ``kvindex serve`` (None: plaintext, open).
    """
    server = GrpcServer(replayer.servicer, host, port, security)
    await server.start()
    return server
