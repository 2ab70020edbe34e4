"""The ext_proc picker's per-request state and its metrics (kvindex/route/ext_proc.py is the picker).

``Exchange``: one HTTP request's state across its ext_proc stream; ``PickerMetrics``: the picker's
own Prometheus series; ``QuietEvents``: the ledger events of a PD prefill entry, which are neither
counted nor a wake-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram

from kvindex.route.lifecycle import RequestLedger
from kvindex.route.metrics import TTFT_BUCKETS
from kvindex.route.usage import UsageReader
from kvindex.scoring.objectives import Objective
from kvindex.v1 import kvindex_pb2 as pb


@dataclass
class Exchange:
    """One HTTP request's state across its ext_proc stream."""

    full_duplex: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: list[str] | None = None
    request: pb.ScoreRequest | None = None
    request_id: str = ""
    # The request's ledger entry (kvindex/route/lifecycle.py; ``committed``: the instance holding
    # it), made with the request id; PD: the prefill step's, <request_id>:prefill.
    ledger: RequestLedger | None = None
    prefill: RequestLedger | None = None
    prefiller: str = ""  # PD: the prefill endpoint named in x-prefiller-host-port
    released_prefill: bool = False
    finished: bool = False
    arrived: float = field(default_factory=time.monotonic)  # the request headers: TTFT starts here
    model: str = ""
    objective: Objective = field(default_factory=Objective)
    est_ms: float = 0.0  # the index's TTFT estimate for the pick, and when it was made
    decided_at: float = 0.0
    streaming: bool = False  # the response is an event stream: its first body chunk is the first token
    picked_at: float = 0.0  # monotonic time of the pick (the TTFT the picker sees starts here)
    first_byte_at: float = 0.0
    reader: UsageReader | None = None  # the response's usage, when the gateway sends the body
    explained: str = ""  # asked for (x-kvindex-explain): the response header's value
    # Envoy served it on a fallback endpoint: re-committed there only once the engine answered, so
    # its engine's report is not compared (see _served).
    served_elsewhere: bool = False

    @property
    def committed(self) -> str:
        """The instance holding the request's ledger entry ("" for none)."""
        return self.ledger.committed if self.ledger is not None else ""


class PickerMetrics:
    def __init__(self, registry: Any) -> None:
        kw = {"registry": registry} if registry is not None else {}
        self.picks = Counter("kvindex_ext_proc_picks", "ext_proc requests by outcome", ["outcome"], **kw)
        self.served_elsewhere = Counter(
            "kvindex_ext_proc_served_elsewhere", "Requests Envoy served on a fallback endpoint", **kw
        )
        self.streams = Counter("kvindex_ext_proc_streams", "ext_proc streams opened", **kw)
        self.ttft = Histogram(
            "kvindex_ext_proc_ttft_seconds",
            "request headers -> first response body byte, as the picker sees them",
            buckets=TTFT_BUCKETS,
            **kw,
        )
        self.reports = Counter(
            "kvindex_ext_proc_reports",
            "outcome reports read from response bodies, by what the index did with them",
            ["result"],
            **kw,
        )


class QuietEvents:
    """LedgerEvents of the PD prefill entry: its release is neither counted nor a wake-up."""

    def released(self, phase: str, found: bool | None, reported: bool, status: str, wake: bool) -> None:
        pass

    def moved(self, committed: bool) -> None:
        pass
