"""Hostile input (issue 32), the pure half: request deserializers that never raise, JSON nested beyond
the depth limit in prompt fields, msgpack nested beyond what the decoder follows in batches and
heartbeats, and sequence numbers at the ends of u64. The half over real gRPC and NATS is
tests/integration/test_hostile_input.py."""

from __future__ import annotations

from kvindex.api.handlers import Malformed, deserializer
from kvindex.v1 import kvindex_pb2 as pb

# KvIndex's unary methods (the seventh, ScoreStream, is streamed).
UNARY_METHODS = ("Score", "Lookup", "Commit", "Release", "ListInstances", "Stats")
# Field 1 holding the bytes ff fe: a string in every request but StatsRequest (no fields: an unknown
# field there, which parses).
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def test_deserializer_returns_what_is_wrong_instead_of_raising() -> None:
    parse = deserializer(pb.ScoreRequest)
    bad = parse(b"\xff")
    assert isinstance(bad, Malformed)
    assert bad.message == (
        "the request is not a valid kvindex.v1.ScoreRequest message: Wire format was corrupt"
    )
    utf8 = parse(BAD_UTF8)
    assert isinstance(utf8, Malformed) and "bad UTF-8" in utf8.message
    good = pb.ScoreRequest(model="m", token_ids=[1])
    assert parse(good.SerializeToString()) == good
