"""Where each instance serves, through the gRPC API: ListInstances and Score return the endpoints
announced in real heartbeats. The parsing and the wire: tests/unit/test_endpoint.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.unit.test_endpoint import BS, MODEL
from workers_shim.publisher import Publisher

PROMPT = list(range(500, 500 + 4 * BS))
KEYS = block_keys(PROMPT, BS, MODEL)


MakePub = Callable[..., Awaitable[Publisher]]


async def test_list_instances_and_score_return_endpoints(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    w1 = await make_publisher(
        worker="w1", model=MODEL, block_size=BS, capacity={"gpu": 100}, endpoint="10.0.0.1:8000"
    )
    await make_publisher(worker="w2", model=MODEL, block_size=BS, capacity={"gpu": 100})  # an old worker
    w1.stored(KEYS)
    await w1.flush()
    await wait_until(
        lambda: (
            service.registry.endpoint("w1/0") == "10.0.0.1:8000"
            and service.registry.get(("w2", 0)) is not None
        ),
        what="both heartbeats",
    )
    listed = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
    assert {i.instance_id: i.endpoint for i in listed.instances} == {"w1/0": "10.0.0.1:8000", "w2/0": ""}
    await wait_until(lambda: service.index.block_counts(("w1", 0))[0] == len(KEYS), what="blocks")
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT))
    assert [(r.instance_id, r.endpoint) for r in reply.ranked] == [("w1/0", "10.0.0.1:8000"), ("w2/0", "")]
    # The worker moves (a new heartbeat): the next Score says so (the cached part is rebuilt).
    w1.endpoint = "10.0.0.9:8001"
    await w1.heartbeat()
    await wait_until(lambda: service.registry.endpoint("w1/0") == "10.0.0.9:8001", what="the move")
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT))
    assert reply.ranked[0].endpoint == "10.0.0.9:8001"
