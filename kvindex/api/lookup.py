"""The Lookup RPC's answer, encoded straight to protobuf bytes.

A Lookup lists every instance of the model with its match, best first. Built as protobuf messages
(``response.matches.add(...)`` per instance, then serialized by gRPC) that cost ~5 us per instance:
~25 ms a Lookup at 7,000 workers, so the Lookup path fell far behind Dynamo's Mooncake trace
(benchmarks/README.md, "Dynamo's Mooncake indexer benchmark"). Here:

- the index answers grouped (``GroupedIndex.match_groups`` with every answer as a slot mask: the
  cost follows the distinct answers, not the instances);
- each instance's identity fields (instance_id, worker, dp_rank) are encoded once and kept, per
  model, with its index slot, sorted by key (``_Roster``, rebuilt when the fleet's membership or the
  index's slot layout changes);
- one native pass (kvindex/api/_lookup.pyx; ``_encode_matches`` below is its pure-Python twin, used
  without a C compiler) orders the instances by matched blocks (a counting sort, stable in key order)
  and writes each entry from the cached identity and its answer's encoded fields.

The servicer returns these bytes, which gRPC sends as they are (kvindex/api/handlers.py, ``serializer``):
the same bytes the message-built response serializes to (tests/unit/test_lookup_encode.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvindex.fleet.registry import Registry
from kvindex.index.base import NO_MATCH, GroupedIndex, InstanceMatch
from kvindex.instance import InstanceKey
from kvindex.v1 import kvindex_pb2 as pb

try:
    from kvindex.api._lookup import encode_matches as _native_encode_matches
except ImportError:  # no compiler at install time: the twin below
    _native_encode_matches = None

_MATCHES_TAG = b"\x2a"  # LookupResponse.matches: field 5, length-delimited


def tier_blocks(t: Sequence[int]) -> pb.TierBlocks:
    return pb.TierBlocks(gpu=t[0], cpu=t[1], disk=t[2], shared=t[3])


def match_fields(match: InstanceMatch) -> bytes:
    """An InstanceMatch's matched_blocks and matched fields, encoded (what follows its identity)."""
    return pb.InstanceMatch(matched_blocks=match.length, matched=tier_blocks(match.tiers)).SerializeToString()


_NONE_FIELDS = match_fields(NO_MATCH)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _encode_matches(
    idents: bytes,
    offsets: np.ndarray,
    slots: np.ndarray,
    answers: list[tuple[int, bytes, bytes]],
    none: bytes,
    head: bytes = b"",
    tail: bytes = b"",
    limit: int = -1,
) -> bytes:
    """The pure-Python twin of _lookup.encode_matches (see there)."""
    answer_of: dict[int, int] = {}
    for a, (_, _, masks) in enumerate(answers):
        for b in range(len(masks) // 8):
            m = int.from_bytes(masks[b * 8 : b * 8 + 8], "little")
            while m:
                low = m & -m
                answer_of[b * 64 + low.bit_length() - 1] = a
                m ^= low
    rows = []
    for i in range(len(slots)):
        a = answer_of.get(int(slots[i]), -1)
        rows.append((-(answers[a][0] if a >= 0 else 0), i, answers[a][1] if a >= 0 else none))
    rows.sort(key=lambda r: (r[0], r[1]))  # most blocks first, then key order (the roster's)
    if limit >= 0:
        del rows[limit:]
    parts = [head]
    for _, i, fields in rows:
        body = idents[offsets[i] : offsets[i + 1]] + fields
        parts.append(_MATCHES_TAG + _varint(len(body)) + body)
    parts.append(tail)
    return b"".join(parts)


encode_matches = _native_encode_matches or _encode_matches


class _Roster:
    """One model's instances sorted by key: their encoded identities and index slots."""

    __slots__ = ("idents", "layout", "membership", "offsets", "slot_of", "slots")

    def __init__(
        self, membership: int, layout: int, states: list[Any], owners: list[InstanceKey | None]
    ) -> None:
        self.membership = membership
        self.layout = layout
        slot_of = {owner: slot for slot, owner in enumerate(owners) if owner is not None}
        states = sorted(states, key=lambda s: s.key)
        encoded = [
            pb.InstanceMatch(
                instance_id=s.instance_id, worker=s.worker, dp_rank=s.dp_rank
            ).SerializeToString()
            for s in states
        ]
        self.idents = b"".join(encoded)
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.slots = np.array([slot_of.get(s.key, -1) for s in states], dtype=np.int64)
        self.slot_of = slot_of


class LookupEncoder:
    """Encodes Lookup responses for the instances of a model (every one, no candidate filter), over
    an index that answers grouped. Keeps one roster per model it was asked about."""

    def __init__(self, registry: Registry, index: GroupedIndex) -> None:
        self.registry = registry
        self.index = index
        self._rosters: dict[str, _Roster] = {}

    def _roster(self, model: str) -> _Roster:
        roster = self._rosters.get(model)
        layout, owners = self.index.slot_layout(model, -1 if roster is None else roster.layout)
        membership = self.registry.membership
        if roster is None or roster.membership != membership or layout != roster.layout:
            if roster is not None and layout == roster.layout:  # (the owners were not sent again)
                owners = self.index.slot_layout(model)[1]
            states = self.registry.of_model(model)
            roster = self._rosters[model] = _Roster(membership, layout, states, owners)
        return roster

    def encode(
        self,
        header: pb.LookupResponse,
        trailer: pb.LookupResponse,
        keys: list[int],
        limit: int | None,
        max_instances: int = 0,
    ) -> bytes:
        """``header`` (fields 1-4) + every instance of ``header.model`` with its match (the first
        ``max_instances`` of them, 0: all) + ``trailer`` (fields 30-31), as the bytes of one
        LookupResponse. ``limit``: the hit rule's (kvindex/index/hybrid.py)."""
        model = header.model
        roster = self._roster(model)
        answers: list[tuple[int, bytes, bytes]] = []
        if keys and len(roster.slots):
            listed, groups = self.index.match_groups(model, keys, None, 0, limit)
            answers = [(g.match.length, match_fields(g.match), g.masks) for g in groups]
            if listed:  # a hybrid model answers per instance: its listed answers as masks too
                answers.extend(self._masks(listed, roster.slot_of))
        head, tail = header.SerializeToString(), trailer.SerializeToString()
        return encode_matches(
            roster.idents,
            roster.offsets,
            roster.slots,
            answers,
            _NONE_FIELDS,
            head,
            tail,
            max_instances or -1,
        )

    @staticmethod
    def _masks(
        listed: dict[InstanceKey, InstanceMatch], slot_of: dict[InstanceKey, int]
    ) -> list[tuple[int, bytes, bytes]]:
        by_match: dict[InstanceMatch, int] = {}
        for instance, match in listed.items():
            slot = slot_of.get(instance)
            if slot is not None and match.length:
                by_match[match] = by_match.get(match, 0) | 1 << slot
        return [
            (m.length, match_fields(m), mask.to_bytes((mask.bit_length() + 63) // 64 * 8, "little"))
            for m, mask in by_match.items()
        ]
