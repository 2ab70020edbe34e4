"""The KvIndex service's methods, one entry each: what the servicer times, the clients call and the
capture records and replays (proto/kvindex/v1/kvindex.proto has the messages).

Adding a method is the proto, one ``Method`` here and its handler on ``KvIndexServicer`` (same
name): the servicer's latency label, ``AsyncKvIndexClient.call`` (and the blocking and in-process
clients, which go through it) and, for a method that changes routing state, the capture's record and
the replay's re-application all follow from the entry. tests/unit/test_methods.py holds the table
equal to the proto's service and to the servicer's handlers.

Imports only the generated messages: the clients use it without the index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from kvindex.v1 import kvindex_pb2 as pb

# What a recorded call did to routing state, which a replay does again (kvindex/capture/replay.py).
COMMIT = "commit"  # a request committed on an instance (the ledger entry, speculative keys)
RELEASE = "release"  # a request released (with its outcome report)


@dataclass(frozen=True, slots=True)
class Method:
    name: str  # the proto's rpc: the servicer's handler and the stub's attribute
    request: type[Message]
    response: type[Message]
    # kvindex_rpc_latency_seconds{method}: ScoreStream's messages are timed as Score calls.
    label: str
    streaming: bool = False  # request and response streams (the proto's ``stream`` on both sides)
    # A call that changed routing state is recorded (``serve --capture``) and re-applied by a replay
    # as this (COMMIT / RELEASE); "": the method changes nothing a replay needs.
    changes: str = ""
    # For such a method: whether this call changed it, and the instance it is about (None: nothing
    # changed, the call is not recorded; "" for a release).
    changed: Callable[[Any, Any], str | None] | None = None


def _score_changed(request: pb.ScoreRequest, response: pb.ScoreResponse) -> str | None:
    return response.committed_instance_id or None


def _commit_changed(request: pb.CommitRequest, response: pb.CommitResponse) -> str | None:
    return request.instance_id if response.committed else None


def _release_changed(request: pb.ReleaseRequest, response: pb.ReleaseResponse) -> str | None:
    return "" if response.found else None


SCORE = Method("Score", pb.ScoreRequest, pb.ScoreResponse, "Score", changes=COMMIT, changed=_score_changed)
SCORE_STREAM = Method(
    "ScoreStream",
    pb.ScoreRequest,
    pb.ScoreResponse,
    "Score",
    streaming=True,
    changes=COMMIT,
    changed=_score_changed,
)
LOOKUP = Method("Lookup", pb.LookupRequest, pb.LookupResponse, "Lookup")
COMMIT_METHOD = Method(
    "Commit", pb.CommitRequest, pb.CommitResponse, "Commit", changes=COMMIT, changed=_commit_changed
)
RELEASE_METHOD = Method(
    "Release", pb.ReleaseRequest, pb.ReleaseResponse, "Release", changes=RELEASE, changed=_release_changed
)
LIST_INSTANCES = Method("ListInstances", pb.ListInstancesRequest, pb.ListInstancesResponse, "ListInstances")
STATS = Method("Stats", pb.StatsRequest, pb.StatsResponse, "Stats")
# A ranking explained; changes nothing (no commit), so nothing to record.
EXPLAIN = Method("Explain", pb.ScoreRequest, pb.ExplainResponse, "Explain")

# (In the order the latency histogram's children have always been made, which /metrics lists.)
METHODS: dict[str, Method] = {
    m.name: m
    for m in (SCORE, SCORE_STREAM, LOOKUP, LIST_INSTANCES, STATS, COMMIT_METHOD, RELEASE_METHOD, EXPLAIN)
}
# The latency histogram's label values, one per unary call kind.
LABELS: tuple[str, ...] = tuple(dict.fromkeys(m.label for m in METHODS.values()))


def method(name: str) -> Method:
    """The entry of ``name``; ValueError names an rpc the service does not have."""
    found = METHODS.get(name)
    if found is None:
        raise ValueError(f"KvIndex has no method {name!r} (one of {', '.join(METHODS)})")
    return found


__all__ = ["COMMIT", "LABELS", "METHODS", "RELEASE", "Method", "method"]
