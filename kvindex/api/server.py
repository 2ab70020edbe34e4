"""The gRPC server: KvIndex plus the standard health and reflection services (grpcurl works).

Health service names: ``liveness`` (SERVING while the process answers), ``readiness`` (whether the
index should be asked: see kvindex/service/readiness.py), and ``""`` and ``kvindex.v1.KvIndex``
reporting readiness (what a plain health check or a client of the KvIndex service wants to know).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvindex.api import listen
from kvindex.api.handlers import add_servicer
from kvindex.api.servicer import KvIndexServicer
from kvindex.security import ServerSecurity
from kvindex.v1 import kvindex_pb2

SERVICE = kvindex_pb2.DESCRIPTOR.services_by_name["KvIndex"]
SERVICE_NAME = SERVICE.full_name
LIVENESS = "liveness"
READINESS = "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcPort:
    """A ``grpc.aio`` server on one port with the health services: ``liveness`` while it answers, and
    readiness under each name in ``ready_names``. Subclasses add their services in :meth:`register`."""

    ready_names: tuple[str, ...] = (READINESS, "")
    options: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)
    what = "gRPC"

    def __init__(
        self, host: str, port: int, security: ServerSecurity | None = None, ready: bool = True
    ) -> None:
        """``ready``: readiness once started (False: the owner calls :meth:`set_ready` when it is)."""
        self.security = security or ServerSecurity()  # default: plaintext, no token
        self.ready = ready
        self.host = host
        self.requested_port = port
        self.port = 0
        self.health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """Where a client on this machine connects."""
        return listen.address(listen.connect_host(self.host), self.port)

    @property
    def bound(self) -> str:
        """The address as bound (``0.0.0.0:50051``: every interface)."""
        return listen.address(self.host, self.port)

    def register(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        # Checked first: gRPC's own failure says only "no port", after a C-core line on stderr.
        reason = listen.bind_error(self.host, self.requested_port)
        if reason is not None:
            raise listen.ListenError(self.what, listen.address(self.host, self.requested_port), reason)
        server = self.security.new_server(options=list(self.options))
        self.register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.port = self.security.add_port(server, f"{self.host}:{self.requested_port}")
        except RuntimeError:  # grpcio >= 1.6x raises where older ones returned 0
            self.port = 0
        if not self.port:
            # Taken since the check (gRPC says only that it failed; its C core logs why).
            raise listen.ListenError(
                self.what,
                listen.address(self.host, self.requested_port),
                "the port is in use or the host is not this machine's",
            )
        await server.start()
        self._server = server
        await self.health.set(LIVENESS, _SERVING)
        await self.set_ready(self.ready)

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready
        status = _SERVING if ready else _NOT_SERVING
        for name in self.ready_names:
            await self.health.set(name, status)

    async def stop(self, grace: float = 1.0) -> None:
        """Not ready first, then in-flight RPCs get up to ``grace`` seconds; new ones are refused."""
        if self._server is not None:
            await self.set_ready(False)
            await self._server.stop(grace)
            self._server = None


class GrpcServer(GrpcPort):
    ready_names = (READINESS, "", SERVICE_NAME)
    options = (("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0))

    def __init__(
        self,
        servicer: KvIndexServicer,
        host: str = "0.0.0.0",
        port: int = 50051,
        security: ServerSecurity | None = None,
        ready: bool = True,
    ) -> None:
        super().__init__(host, port, security, ready)
        self.servicer = servicer

    def register(self, server: grpc.aio.Server) -> None:
        # Not the generated add_KvIndexServicer_to_server: bytes that do not parse as the request are
        # INVALID_ARGUMENT, not UNKNOWN (kvindex/api/handlers.py).
        add_servicer(server, SERVICE, self.servicer)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
