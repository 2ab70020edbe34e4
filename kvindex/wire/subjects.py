"""NATS subject layout: ``{prefix}.{kind}.{worker_id}``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvindex.wire.errors import BAD_SUBJECT, WireError

WORKER_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")

EVENTS = "events"
HEARTBEAT = "status"  # the subject token heartbeats travel under (named so on the wire since v1)
SNAPSHOT = "snapshot"
REPLAY = "replay"
KINDS = (EVENTS, HEARTBEAT, SNAPSHOT, REPLAY)
# Index replica -> index replicas: routing state (kvindex/routing_sync); the last token is a replica id.
ROUTING = "routing"


def valid_worker_id(worker: object) -> bool:
    return isinstance(worker, str) and WORKER_ID_RE.fullmatch(worker) is not None


@dataclass(frozen=True)
class Subjects:
    """Builds and parses the subjects of one deployment (one prefix)."""

    prefix: str = "kvindex"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"subject prefix {self.prefix!r} must be dot-separated tokens of [A-Za-z0-9_-]")

    def for_worker(self, kind: str, worker: str) -> str:
        if not valid_worker_id(worker):
            raise ValueError(f"worker id {worker!r} must match [A-Za-z0-9_-]{{1,128}}")
        return f"{self.prefix}.{kind}.{worker}"

    def events(self, worker: str) -> str:
        return self.for_worker(EVENTS, worker)

    def heartbeat(self, worker: str) -> str:
        return self.for_worker(HEARTBEAT, worker)

    def snapshot(self, worker: str) -> str:
        return self.for_worker(SNAPSHOT, worker)

    def replay(self, worker: str) -> str:
        return self.for_worker(REPLAY, worker)

    def routing(self, replica: str) -> str:
        return self.for_worker(ROUTING, replica)

    def wildcard(self, kind: str) -> str:
        return f"{self.prefix}.{kind}.*"

    def worker_of(self, subject: str, kind: str) -> str:
        """The worker id a subject of ``kind`` names; WireError if it is not such a subject."""
        head = f"{self.prefix}.{kind}."
        if not subject.startswith(head):
            raise WireError(BAD_SUBJECT, f"subject {subject!r} is not under {head!r}")
        worker = subject[len(head) :]
        if not WORKER_ID_RE.fullmatch(worker):
            raise WireError(BAD_SUBJECT, f"subject {subject!r} does not end in a valid worker id")
        return worker
