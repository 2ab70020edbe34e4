"""Instance roles through the gRPC API: ListInstances returns the role and group each instance
announced in a real heartbeat. The parsing and the wire: tests/unit/test_pd_role.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.unit.test_pd_role import MODEL
from workers_shim.publisher import Publisher

MakePub = Callable[..., Awaitable[Publisher]]


async def test_list_instances_returns_roles(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    await make_publisher(worker="p1", model=MODEL, block_size=4, role="prefill", pd_group="rack-a")
    await make_publisher(worker="d1", model=MODEL, block_size=4, role="decode", pd_group="rack-a")
    await make_publisher(worker="old", model=MODEL, block_size=4)  # an older worker: no field
    await wait_until(lambda: len(service.registry) == 3, what="three heartbeats")
    await wait_until(lambda: service.registry.get(("d1", 0)).role == "decode", what="roles")  # type: ignore[union-attr]
    listed = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
    assert {i.instance_id: (i.role, i.pd_group) for i in listed.instances} == {
        "p1/0": ("prefill", "rack-a"),
        "d1/0": ("decode", "rack-a"),
        "old/0": ("both", ""),
    }
