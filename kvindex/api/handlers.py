"""gRPC method handlers that answer a request whose bytes do not parse with INVALID_ARGUMENT.

grpc's generated ``add_*Servicer_to_server`` registers the request class's ``FromString`` as the
deserializer. When it raises (bytes that are not protobuf; a string field that is not UTF-8, which
upb checks when parsing proto3) grpc.aio answers ``UNKNOWN "Unexpected <class DecodeError>"``, as if
the server had failed, and the servicer never sees the call. Here the deserializer never raises: it
returns a ``Malformed`` that says what is wrong. A unary method is wrapped to abort with
``INVALID_ARGUMENT`` and that message; a streaming method receives it in its request iterator and
answers it itself (ScoreStream: ``ScoreResponse.error``, as for any bad request; the ext_proc picker:
``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

_PARSE_PREFIX = "Error parsing message"


def serializer(cls: type[Message]) -> Callable[[Any], bytes]:
    """``cls.SerializeToString``, except that a method may answer with the bytes themselves (the
    Lookup RPC does, kvindex/api/lookup.py): sent as they are."""
    serialize = cls.SerializeToString

    def encode(response: Any) -> bytes:
        return response if type(response) is bytes else serialize(response)

    return encode


class Malformed:
    """What a streaming method receives instead of a request whose bytes did not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"Malformed({self.message!r})"


def deserializer(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """``cls.FromString`` that returns a Malformed instead of raising."""
    parse = cls.FromString
    name = cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Malformed:
        try:
            return parse(data)
        except Exception as exc:  # whatever the parser raises, the bytes are not a valid request
            text = str(exc)
            if text.startswith(_PARSE_PREFIX):  # "...with type 'kvindex.v1.X': <why>": keep the why
                text = text.rpartition("': ")[2]
            return Malformed(f"the request is not a valid {name} message: {text or type(exc).__name__}")

    return deserialize


def _refusing_malformed(
    method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    @functools.wraps(method)
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return handle


def method_handlers(service: ServiceDescriptor, servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """The handlers of every method of ``service``, implemented by ``servicer``'s methods of the same
    names (as the generated code registers them, but with the deserializers above)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        request = GetMessageClass(method.input_type)
        response = GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        codec: dict[str, Any] = {
            "request_deserializer": deserializer(request),
            "response_serializer": serializer(response),
        }
        streaming = (method.client_streaming, method.server_streaming)
        if streaming == (False, False):
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_refusing_malformed(impl), **codec)
        elif streaming == (True, True):
            # The method gets Malformed items in its request iterator and answers them itself.
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(impl, **codec)
        else:  # pragma: no cover - no such method in the services served here
            raise NotImplementedError(f"{service.full_name}/{method.name}: only unary or bidi methods")
    return handlers


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Register ``servicer`` for ``service`` on ``server`` (instead of the generated
    ``add_*Servicer_to_server``)."""
    handlers = method_handlers(service, servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
