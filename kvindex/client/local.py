"""The same client, in the index's own process: calls go straight to the servicer, no gRPC.

``kvindex serve --route-port`` runs the routing proxy inside the index. The proxy then needs what
``AsyncKvIndexClient`` gives it (Score, Commit, Release, ListInstances, the fallback's instance
list, the stats) without a channel: each call is the servicer's own method on the same event loop,
with the same argument checks and the same errors (``BadRequest`` for what gRPC would answer with
INVALID_ARGUMENT). What the hop cost (benchmarks/bench_route_chat.py, new 1,600-token chat documents):
the proxy's time before forwarding fell from 5.2 to 3.8 ms (no serializing of the text twice, no
second process to wake) and its CPU per request from 9.5 ms in two processes to 5.6 ms in one.

What it cannot do that the remote client does: survive the index's process (it is that process),
or be scaled apart from it. A fallback still exists for a Score that outlives its deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from kvindex.api.errors import BadRequest
from kvindex.api.inprocess import Aborted, InProcessContext
from kvindex.api.methods import METHODS
from kvindex.client.aio import AsyncKvIndexClient, _reason
from kvindex.client.errors import IndexUnavailable
from kvindex.security import ClientTLS
from kvindex.v1 import kvindex_pb2 as pb

if TYPE_CHECKING:  # the servicer brings the whole index; the client package must not need it
    from kvindex.api.servicer import KvIndexServicer


class LocalKvIndexClient(AsyncKvIndexClient):
    """An ``AsyncKvIndexClient`` bound to ``servicer`` in this process (``target`` names it in logs)."""

    def __init__(self, servicer: KvIndexServicer, target: str = "in-process", **kwargs: Any) -> None:
        self.servicer = servicer
        super().__init__(target, **kwargs)

    def _connect(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None,
        options: Any,
        tls: ClientTLS | None,
        channel: grpc.aio.Channel | None,
    ) -> None:
        self.channel = None
        self._owns_channel = False
        self.stub = None  # type: ignore[assignment]  # (its calls are the servicer's, below)

    async def open_stream(self) -> None:
        self.start()  # no stream to open: Score is a call on the servicer

    async def _score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        # As ScoreStream answers it: a bad request is an answer with ``error``, not an exception.
        if request.prompt or request.messages:
            await self.servicer.pretokenize(request)
        try:
            return self.servicer.score_request(request)
        except BadRequest as exc:
            return pb.ScoreResponse(model=request.model, request_id=request.request_id, error=str(exc))

    async def _unary(self, name: str, request: Any, timeout: float | None) -> Any:
        self.start()
        try:
            # The servicer's handler of the method (kvindex/api/methods.py: same name as the rpc).
            method = METHODS[name]
            response = await getattr(self.servicer, method.name)(request, InProcessContext())
            # A method may answer with the response's bytes (Lookup: kvindex/api/lookup.py).
            return method.response.FromString(response) if type(response) is bytes else response
        except Aborted as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details) from None
            reason = _reason(exc.code)
            self.stats.errors[f"{name}:{reason}"] += 1
            raise IndexUnavailable(reason, f"{name}: {exc.code.name}: {exc.details}", exc.code) from None
