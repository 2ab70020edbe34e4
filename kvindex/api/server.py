"""The gRPC server: KvIndex plus the standard health and reflection services (grpcurl works)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvindex.api.security import ServerSecurity
from kvindex.api.servicer import KvIndexServicer
from kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc

SERVICE_NAME = kvindex_pb2.DESCRIPTOR.services_by_name["KvIndex"].full_name


class GrpcServer:
    def __init__(
        self,
        servicer: KvIndexServicer,
        host: str = "0.0.0.0",
        port: int = 50051,
        security: ServerSecurity | None = None,
    ) -> None:
        self.servicer = servicer
        self.security = security or ServerSecurity()  # default: plaintext, no token
        self.host = host
        self.requested_port = port
        self.port = 0
        self.health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        server = self.security.new_server(
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ]
        )
        kvindex_pb2_grpc.add_KvIndexServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = self.security.add_port(server, f"{self.host}:{self.requested_port}")
        if not self.port:
            raise OSError(f"cannot bind gRPC port {self.host}:{self.requested_port}")
        await server.start()
        self._server = server
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self.set_serving(False)
            await self._server.stop(grace)
            self._server = None
