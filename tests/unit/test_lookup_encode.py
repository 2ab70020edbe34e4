"""The Lookup answer encoded from the index's grouped answer (kvindex/api/lookup.py) is the same bytes
as the response built one protobuf message per instance (the servicer's way before it, kept here as
the reference), natively and with the pure-Python twin."""

from __future__ import annotations

import random

import pytest

from kvindex.api import lookup as lookup_mod
from kvindex.api.lookup import LookupEncoder, _encode_matches, tier_blocks
from kvindex.fleet.registry import Registry
from kvindex.index.base import NO_MATCH
from kvindex.index.hybrid import GroupLayout, GroupSpec
from kvindex.index.inverted import InvertedIndex
from kvindex.keys import group_key
from kvindex.v1 import kvindex_pb2 as pb

ENCODERS = [pytest.param(_encode_matches, id="python")]
if lookup_mod._native_encode_matches is not None:
    ENCODERS.append(pytest.param(lookup_mod._native_encode_matches, id="native"))

BS = 16


def reference(
    index: InvertedIndex, registry: Registry, model: str, keys: list[int], limit: int | None
) -> bytes:
    """The response as the servicer built it before: a message per instance, best match first."""
    response = pb.LookupResponse(
        model=model, block_size=BS, total_blocks=len(keys), block_keys=keys, prompt_tokens=7
    )
    states = registry.of_model(model)
    matches = index.match(model, keys, [s.key for s in states], limit) if keys else {}
    for s in sorted(states, key=lambda s: (-matches.get(s.key, NO_MATCH).length, s.key)):
        m = matches.get(s.key, NO_MATCH)
        response.matches.add(
            instance_id=s.instance_id,
            worker=s.worker,
            dp_rank=s.dp_rank,
            matched_blocks=m.length,
            matched=tier_blocks(m.tiers),
        )
    return response.SerializeToString()


def encoded(encoder: LookupEncoder, model: str, keys: list[int], limit: int | None = None) -> bytes:
    header = pb.LookupResponse(model=model, block_size=BS, total_blocks=len(keys), block_keys=keys)
    return encoder.encode(header, pb.LookupResponse(prompt_tokens=7), keys, limit)


def fleet(rng: random.Random, n: int, chain: list[int]) -> tuple[InvertedIndex, Registry]:
    """``n`` instances over several banks holding random prefixes of ``chain`` on random tiers, a
    few in the registry only (no events yet) and one in the index only (being dropped)."""
    index, registry = InvertedIndex(), Registry()
    order = list(range(n))
    rng.shuffle(order)  # slots in another order than the keys
    for i in order:
        key = (f"w{i % 37:03d}", i // 37)
        registry.add(key, "m", BS)
        if i % 29 == 5:
            continue  # registry only: lists with no match
        index.add_instance(key, "m")
        depth = rng.choice([0, 1, 3, 3, 3, 8, len(chain)])
        tier = rng.choice([0, 0, 0, 1, 2]) if i % 7 else 0
        index.store(key, tier, chain[:depth])
    index.add_instance(("gone", 0), "m")
    index.store(("gone", 0), 0, chain)
    return index, registry


@pytest.mark.parametrize("encode", ENCODERS)
def test_encoded_lookup_is_the_message_built_one(encode, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup_mod, "encode_matches", encode)
    rng = random.Random(7)
    chain = [rng.getrandbits(64) for _ in range(12)]
    index, registry = fleet(rng, 300, chain)
    encoder = LookupEncoder(registry, index)
    for keys in (chain, chain[:2], [*chain[:1], 12345], [], [999], [*chain, 1, 2]):
        got = encoded(encoder, "m", keys)
        assert type(got) is bytes  # (what gRPC then sends as it is)
        assert got == reference(index, registry, "m", keys, None)
    # A shared pool holding the chain: every instance matches it (tier split per instance).
    index.add_instance(("pool", 0), "m")
    registry.add(("pool", 0), "m", BS)
    index.store(("pool", 0), 3, chain[:5])
    assert encoded(encoder, "m", chain) == reference(index, registry, "m", chain, None)
    # Membership and slot changes are seen (the roster is rebuilt).
    index.drop_instance(("w001", 0))
    registry.remove(("w001", 0))
    index.add_instance(("new", 0), "m")
    registry.add(("new", 0), "m", BS)
    index.store(("new", 0), 0, chain)
    assert encoded(encoder, "m", chain) == reference(index, registry, "m", chain, None)
    assert encoded(encoder, "other", chain) == reference(index, registry, "other", chain, None)


@pytest.mark.parametrize("encode", ENCODERS)
def test_encoded_lookup_hybrid_and_limit(encode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's answers come listed per instance; the token limit cuts the match."""
    monkeypatch.setattr(lookup_mod, "encode_matches", encode)
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(10)]
    index, registry = InvertedIndex(), Registry()
    layout = GroupLayout(
        [GroupSpec("sliding_window", BS, window=2 * BS), GroupSpec("full_attention", BS)], BS
    )
    for i in range(90):
        key = (f"h{i:02d}", 0)
        registry.add(key, "hy", BS)
        index.add_instance(key, "hy")
        depth = rng.randrange(len(chain) + 1)
        index.store(key, 0, [group_key(k, 1) for k in chain[:depth]])  # full attention: group 1
        index.store(key, 0, [k for j, k in enumerate(chain[:depth]) if rng.random() < 0.6 or j == 0])
    index.set_layout("hy", layout)
    encoder = LookupEncoder(registry, index)
    for limit in (None, len(chain) * BS - 1, 3 * BS):
        assert encoded(encoder, "hy", chain, limit) == reference(index, registry, "hy", chain, limit)
    index.set_layout("hy", GroupLayout.single(BS))
    assert encoded(encoder, "hy", chain, 4 * BS + 3) == reference(index, registry, "hy", chain, 4 * BS + 3)


@pytest.mark.parametrize("encode", ENCODERS)
def test_raw_answers(encode) -> None:
    """The encoder's own contract on raw arguments: slots in no answer or beyond every mask, answers
    of equal length (key order among them), a length past one varint byte."""
    import numpy as np

    idents = b"".join(bytes([65 + i % 26]) * (1 + i % 3) for i in range(200))
    offsets = np.zeros(201, dtype=np.int64)
    np.cumsum([1 + i % 3 for i in range(200)], out=offsets[1:])
    slots = np.array([i * 2 if i % 5 else -1 for i in range(200)], dtype=np.int64)
    answers = [
        (3, b"\x20\x03", ((1 << 64) - 1).to_bytes(8, "little") + (0).to_bytes(8, "little")),
        (300, b"\x20\xac\x02", (0b1010).to_bytes(8, "little") + (1 << 63).to_bytes(8, "little")),
        (3, b"\x20\x03\x2a\x00", (0).to_bytes(8, "little") + (0xF0).to_bytes(8, "little")),
    ]
    pairs = [(0, s) for s in range(64)] + [(1, 1), (1, 3), (1, 127)] + [(2, s) for s in range(68, 72)]
    answer_of = {slot: a for a, slot in pairs}  # (a later answer's slot wins, as in the encoders)
    expected = []
    for i in range(200):
        a = answer_of.get(int(slots[i]))
        length, fields = (0, b"\x2a\x00") if a is None else answers[a][:2]
        body = idents[offsets[i] : offsets[i + 1]] + fields
        expected.append((-length, i, b"\x2a" + bytes([len(body)]) + body))
    got = encode(idents, offsets, slots, answers, b"\x2a\x00")
    assert got == b"".join(e[2] for e in sorted(expected))
    # max_instances: the first n of the same order, however n falls against equal lengths.
    for n in (0, 1, 63, 64, 65, 199, 200, 500):
        assert (
            encode(idents, offsets, slots, answers, b"\x2a\x00", b"H", b"T", n)
            == b"H" + b"".join(e[2] for e in sorted(expected)[:n]) + b"T"
        )


@pytest.mark.parametrize("encode", ENCODERS)
def test_max_instances_is_the_head_of_the_whole_answer(encode, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup_mod, "encode_matches", encode)
    rng = random.Random(11)
    chain = [rng.getrandbits(64) for _ in range(12)]
    index, registry = fleet(rng, 300, chain)
    encoder = LookupEncoder(registry, index)
    header = pb.LookupResponse(model="m", block_size=BS, total_blocks=len(chain), block_keys=chain)
    whole = pb.LookupResponse.FromString(encoder.encode(header, pb.LookupResponse(), chain, None))
    for n in (1, 5, 299, 300, 301):
        head = pb.LookupResponse.FromString(encoder.encode(header, pb.LookupResponse(), chain, None, n))
        assert list(head.matches) == list(whole.matches)[:n]
