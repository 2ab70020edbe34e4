"""ListInstances' pages and tokens (kvindex/api/listing.py) over a registry, without gRPC: every
instance exactly once, in (model, key) order, whatever joins or leaves between pages. Over a real
server and client: tests/integration/test_list_pages.py."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api.errors import BadRequest
from kvindex.api.listing import (
    BRIEF,
    FULL,
    InstanceListing,
    brief_info,
    check_view,
    decode_token,
    encode_token,
)
from kvindex.fleet import registry as registry_module
from kvindex.fleet.registry import Registry


def registry_of(models: dict[str, int]) -> Registry:
    registry = Registry()
    for model, n in models.items():
        for w in random.Random(model).sample(range(10 * n + 10), n):
            registry.add((f"{model}-w{w}", w % 3), model, 16)  # a key is one model's
    return registry


def walk(listing: InstanceListing, model: str, size: int, between=lambda: None) -> list[tuple[str, tuple]]:
    out, after = [], None
    while True:
        states, after = listing.page(model, after, size)
        assert len(states) <= size or size == 0
        out.extend((s.model, s.key) for s in states)
        if after is None:
            return out
        between()
        # The token round trip is what a client does between pages.
        after = decode_token(encode_token(after), model)


@pytest.mark.parametrize("size", [0, 1, 3, 7, 100])
def test_pages_list_every_instance_once_in_order(size: int) -> None:
    registry = registry_of({"b": 11, "a": 5, "c": 1})
    expected = sorted((s.model, s.key) for s in registry.all())
    listing = InstanceListing(registry)
    assert walk(listing, "", size) == expected
    assert walk(listing, "a", size) == [e for e in expected if e[0] == "a"]


def test_the_last_page_has_no_token_even_when_it_is_full() -> None:
    registry = registry_of({"a": 4, "b": 2})
    listing = InstanceListing(registry)
    states, after = listing.page("", None, 4)
    assert len(states) == 4 and after is not None  # model b follows
    states, after = listing.page("", after, 2)
    assert len(states) == 2 and after is None
    states, after = listing.page("a", None, 4)
    assert len(states) == 4 and after is None


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.sampled_from("ab")), max_size=30),
)
def test_joins_and_leaves_between_pages_never_repeat_or_reorder(size: int, changes: list) -> None:  # type: ignore[type-arg]
    for journal in (4096, 2):  # the registry's journal of joins and leaves, and its overflow
        joins_and_leaves(size, changes, journal)


def joins_and_leaves(size: int, changes: list, journal: int) -> None:  # type: ignore[type-arg]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry_module, "JOURNAL", journal)
        registry = registry_of({"a": 9, "b": 6})
    before = {(s.model, s.key) for s in registry.all()}
    listing = InstanceListing(registry)
    todo = list(changes)

    def change() -> None:  # up to three joins or leaves between two pages (a journal of 2 overflows)
        for join, w, model in [todo.pop() for _ in range(min(3, len(todo)))]:
            key = (f"x{w}", 0)
            if join and registry.get(key) is None:
                registry.add(key, model, 16)
            elif not join:
                registry.remove(key)

    seen = walk(listing, "", size, change)
    after = {(s.model, s.key) for s in registry.all()}
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    # Everything there throughout is listed; nothing listed was never there.
    assert before & after <= set(seen) <= before | {(m, (f"x{w}", 0)) for _, w, m in changes}


def test_a_model_that_empties_and_returns_is_listed_afresh() -> None:
    registry = registry_of({"a": 3})
    listing = InstanceListing(registry)
    assert len(listing.page("a", None, 0)[0]) == 3
    for state in registry.all():
        registry.remove(state.key)
    assert listing.page("a", None, 0) == ([], None)
    registry.add(("z", 0), "a", 16)
    assert [s.key for s in listing.page("a", None, 0)[0]] == [("z", 0)]


@pytest.mark.parametrize(
    ("token", "model", "message"),
    [
        ("not base64!", "", "is not a next_page_token"),
        (encode_token(("a", ("w", 0)))[:-3], "", "is not a next_page_token"),
        ("WzEsMiwzXQ", "", "is not a next_page_token"),  # [1,2,3]
        (encode_token(("a", ("w", 0))), "b", "belongs to a listing of model 'a', not 'b'"),
    ],
)
def test_a_token_this_index_did_not_give_is_a_bad_request(token: str, model: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_token(token, model)


def test_views() -> None:
    assert check_view("") == FULL and check_view(BRIEF) == BRIEF
    with pytest.raises(BadRequest, match="view must be"):
        check_view("everything")
    registry = registry_of({"m": 1})
    state = registry.all()[0]
    registry.set_endpoint(state, "10.0.0.1:8000")
    registry.set_role(state, "prefill", "g1")
    info = brief_info(state)
    assert (info.instance_id, info.model, info.block_size, info.endpoint, info.role, info.pd_group) == (
        state.instance_id,
        "m",
        16,
        "10.0.0.1:8000",
        "prefill",
        "g1",
    )
    assert not info.HasField("load")  # the brief view leaves the rest out
