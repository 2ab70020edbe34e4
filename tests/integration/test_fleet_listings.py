"""Answers that list the fleet, kept within a client's reach for large fleets, over a real server and
client: ListInstances in pages and in the brief view (the pages add up to the one full answer; bad
tokens and views are INVALID_ARGUMENT; the client's fallback refreshes from brief pages), and Lookup's
max_instances. The paging logic alone: tests/unit/test_listing.py; the encoding:
tests/unit/test_lookup_encode.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvindex.client import AsyncKvIndexClient
from kvindex.keys import block_keys
from kvindex.service.app import IndexService
from kvindex.v1 import kvindex_pb2 as pb
from kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from workers_shim.publisher import Publisher

MakePub = Callable[..., Awaitable[Publisher]]


async def test_pages_and_the_brief_view(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    for n in range(7):
        await make_publisher(
            worker=f"w{n}",
            model="m1" if n % 2 else "m2",
            block_size=16,
            capacity={"gpu": 100},
            endpoint=f"10.0.0.{n}:8000",
        )
    await wait_until(lambda: len(service.registry) == 7, what="7 instances")
    whole = await stub.ListInstances(pb.ListInstancesRequest())
    assert not whole.next_page_token and len(whole.instances) == 7
    pages, token = [], ""
    while True:
        reply = await stub.ListInstances(pb.ListInstancesRequest(page_size=3, page_token=token, view="brief"))
        pages.append(len(reply.instances))
        for info in reply.instances:  # brief: routing fields, no load or blocks
            assert info.endpoint and info.block_size == 16 and not info.HasField("load")
        pages[-1:] = [[i.instance_id for i in reply.instances]]
        token = reply.next_page_token
        if not token:
            break
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == [i.instance_id for i in whole.instances]
    one_model = await stub.ListInstances(pb.ListInstancesRequest(model="m1", page_size=2))
    assert [i.model for i in one_model.instances] == ["m1", "m1"] and one_model.next_page_token
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListInstances(pb.ListInstancesRequest(model="m2", page_token=one_model.next_page_token))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "belongs to a listing of model 'm1'" in (err.value.details() or "")
    for bad in (pb.ListInstancesRequest(page_token="garbage"), pb.ListInstancesRequest(view="all")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListInstances(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # The client asks page by page (here 2 a page) and its fallback learns the fleet from brief pages.
    async with AsyncKvIndexClient(service.grpc.address, timeout=5, refresh_interval=0) as client:
        listed = await client.list_instances(page_size=2)
        assert [i.instance_id for i in listed] == [i.instance_id for i in whole.instances]
        assert await client.refresh_instances(timeout=5)
        known = {k.instance_id: k.endpoint for k in client.instances.instances("m1")}
        assert known == {i.instance_id: i.endpoint for i in whole.instances if i.model == "m1"}


async def test_lookup_max_instances(
    service: IndexService, stub: pb_grpc.KvIndexStub, make_publisher: MakePub
) -> None:
    prompt = list(range(100, 100 + 6 * 16))
    keys = block_keys(prompt, 16, "m")
    for n in range(5):
        pub = await make_publisher(worker=f"w{n}", model="m", block_size=16, capacity={"gpu": 100})
        pub.stored(keys[: n + 1])  # w4 holds the most
        await pub.flush()
    await wait_until(
        lambda: all(service.index.block_counts((f"w{n}", 0))[0] == n + 1 for n in range(5)), what="blocks"
    )
    whole = await stub.Lookup(pb.LookupRequest(model="m", token_ids=prompt))
    assert [m.instance_id for m in whole.matches] == ["w4/0", "w3/0", "w2/0", "w1/0", "w0/0"]
    top = await stub.Lookup(pb.LookupRequest(model="m", token_ids=prompt, max_instances=2))
    assert list(top.matches) == list(whole.matches)[:2] and list(top.block_keys) == list(whole.block_keys)
    # The candidates path (a message built per instance) cuts the same way.
    some = await stub.Lookup(
        pb.LookupRequest(model="m", token_ids=prompt, max_instances=2, candidates=["w0", "w1", "w3"])
    )
    assert [m.instance_id for m in some.matches] == ["w3/0", "w1/0"]
