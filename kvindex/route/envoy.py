"""The Envoy side of the ext_proc endpoint picker (kvindex/route/ext_proc.py): the Gateway API
Inference Extension's names (headers, metadata namespaces), reading Envoy's messages (headers,
dynamic metadata, the subset hint), building its answers (an immediate response, a body streamed
back in pieces), and ``ExtProcServer``, the picker's gRPC port.
"""

from __future__ import annotations

import json

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvindex.api.handlers import add_servicer
from kvindex.api.server import READINESS, GrpcPort
from kvindex.security import ServerSecurity

SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"]
SERVICE_NAME = SERVICE.full_name
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
REQUEST_ID_HEADER = "x-request-id"
# Disaggregated prefill/decode (llm-d's disaggregation profile): the destination is the decode
# endpoint; this header names the prefill endpoint ("host:port") for the decode side's sidecar, which
# runs the prefill step there first. Absent: the decode instance prefills itself.
PREFILLER = "x-prefiller-host-port"
PREFILL_SUFFIX = ":prefill"  # the prefill's ledger id: the request's id + this
STREAMED_CHUNK = 62 * 1024  # body pieces sent back in full-duplex mode stay under Envoy's 64 KiB frames

FULL_DUPLEX = mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = mode_pb2.ProcessingMode.NONE


def headers_of(header_map: core_pb2.HeaderMap) -> dict[str, str]:
    out = {}
    for h in header_map.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def metadata_value(metadata: core_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    return fields.get(key)  # a protobuf map: .get does not insert


def metadata_string(metadata: core_pb2.Metadata, namespace: str, key: str) -> str:
    value = metadata_value(metadata, namespace, key)
    if value is None:
        return ""
    if value.HasField("string_value"):
        return value.string_value
    if value.HasField("list_value") and value.list_value.values:
        return value.list_value.values[0].string_value
    return ""


def subset_hint(metadata: core_pb2.Metadata) -> list[str] | None:
    """The subset hint: None when absent (every endpoint eligible), else the listed ``ip:port``s."""
    value = metadata_value(metadata, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def immediate(status: int, details: str, headers: dict[str, str] | None = None) -> ep.ProcessingResponse:
    body = json.dumps({"error": {"message": details, "type": "kvindex_endpoint_picker", "code": status}})
    values = {"content-type": "application/json", **(headers or {})}
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            body=body.encode(),
            details=details,
            headers=ep.HeaderMutation(
                set_headers=[
                    core_pb2.HeaderValueOption(header=core_pb2.HeaderValue(key=k, raw_value=v.encode()))
                    for k, v in values.items()
                ]
            ),
        )
    )


def streamed_body(data: bytes, phase: str, end: bool = True) -> list[ep.ProcessingResponse]:
    """A body handed back unchanged in full-duplex mode, in pieces Envoy accepts."""
    pieces = [data[i : i + STREAMED_CHUNK] for i in range(0, len(data), STREAMED_CHUNK)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        mutation = ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=piece, end_of_stream=end and i == len(pieces) - 1)
        )
        body = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
        out.append(ep.ProcessingResponse(**{phase: body}))
    return out


class ExtProcServer(GrpcPort):
    """The picker on its own port (``kvindex serve --ext-proc-port``), with the health services the
    Inference Extension probes: ``liveness``, ``readiness`` and the ExternalProcessor service. The
    service's TLS / mutual TLS / token settings apply to this port too (docs/deploy.md)."""

    ready_names = (READINESS, "", SERVICE_NAME)
    what = "ext_proc"

    def __init__(
        self,
        picker: ep_grpc.ExternalProcessorServicer,
        host: str = "0.0.0.0",
        port: int = 9002,
        security: ServerSecurity | None = None,
        ready: bool = True,
    ) -> None:
        super().__init__(host, port, security, ready)
        self.picker = picker

    def register(self, server: grpc.aio.Server) -> None:
        add_servicer(server, SERVICE, self.picker)  # malformed messages: INVALID_ARGUMENT
