"""A request's TTFT objective and priority (kvindex/scoring/admission.py judges by them): from its
headers, from a gateway's named objective, or from the router's flags (per model).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

HEADER_TTFT = "x-kvindex-ttft-slo-ms"
HEADER_PRIORITY = "x-kvindex-priority"
# The Gateway API Inference Extension names an InferenceObjective (a Kubernetes object holding the
# request's priority) in this header; the picker maps names to objectives from its flags.
HEADER_GIE_OBJECTIVE = "x-gateway-inference-objective"

MAX_PRIORITY = 100  # |priority| bound: it is a metrics label, and a stack rank needs few values
MAX_TTFT_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class Objective:
    """A request's TTFT objective in ms (None: none) and its priority (higher first)."""

    ttft_ms: float | None = None
    priority: int = 0

    @property
    def label(self) -> str:
        return str(self.priority)


class ObjectiveError(ValueError):
    """A malformed objective or priority: rejected (400 naming ``header``), never queued."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(f"{header}: {message}")
        self.header = header


def parse_ttft_ms(value: str, where: str = HEADER_TTFT) -> float:
    try:
        ms = float(value.strip())
    except ValueError:
        raise ObjectiveError(where, f"not a number of milliseconds: {value!r}") from None
    if not (0 < ms <= MAX_TTFT_MS):  # also rejects nan and inf
        raise ObjectiveError(where, f"must be > 0 and <= {MAX_TTFT_MS:.0f} ms, got {value!r}")
    return ms


def parse_priority(value: str, where: str = HEADER_PRIORITY) -> int:
    try:
        p = int(value.strip())
    except ValueError:
        raise ObjectiveError(where, f"not an integer: {value!r}") from None
    if abs(p) > MAX_PRIORITY:
        raise ObjectiveError(where, f"must be between -{MAX_PRIORITY} and {MAX_PRIORITY}, got {p}")
    return p


@dataclass
class ObjectiveDefaults:
    """Objectives from flags: per model (``""``: every model), and the named InferenceObjectives a
    gateway may refer to (``x-gateway-inference-objective``; an unknown name means priority 0, as in
    the Inference Extension when no such object exists)."""

    ttft_ms: dict[str, float] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    named: dict[str, Objective] = field(default_factory=dict)

    @classmethod
    def from_flags(
        cls, ttft: Iterable[str] = (), priority: Iterable[str] = (), objectives: Iterable[str] = ()
    ) -> ObjectiveDefaults:
        """``ttft``: ``MS`` or ``MODEL=MS``; ``priority``: ``N`` or ``MODEL=N``; ``objectives``:
        ``NAME=PRIORITY`` or ``NAME=PRIORITY:TTFT_MS``. ValueError naming the bad flag value."""
        out = cls()
        for item in ttft:
            model, _, value = item.rpartition("=")
            out.ttft_ms[model] = parse_ttft_ms(value, f"--ttft-slo-ms {item}")
        for item in priority:
            model, _, value = item.rpartition("=")
            out.priority[model] = parse_priority(value, f"--priority {item}")
        for item in objectives:
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise ObjectiveError(f"--objective {item}", "expected NAME=PRIORITY[:TTFT_MS]")
            prio, _, ms = value.partition(":")
            out.named[name] = Objective(
                parse_ttft_ms(ms, f"--objective {item}") if ms else None,
                parse_priority(prio, f"--objective {item}"),
            )
        return out

    @property
    def any(self) -> bool:
        return bool(self.ttft_ms or self.priority or self.named)

    def of(self, model: str, headers: Mapping[str, str]) -> Objective:
        """The request's objective: its own headers first, then a named objective, then the model's
        defaults. ``headers`` with lower-case names. ObjectiveError for a malformed value."""
        ttft: float | None = self.ttft_ms.get(model, self.ttft_ms.get(""))
        prio = self.priority.get(model, self.priority.get("", 0))
        name = headers.get(HEADER_GIE_OBJECTIVE)
        if name:
            named = self.named.get(name.strip())
            if named is not None:
                prio = named.priority
                ttft = named.ttft_ms if named.ttft_ms is not None else ttft
        raw = headers.get(HEADER_TTFT)
        if raw is not None:
            ttft = parse_ttft_ms(raw)
        raw = headers.get(HEADER_PRIORITY)
        if raw is not None:
            prio = parse_priority(raw)
        return Objective(ttft, prio)


def check_headers(headers: Mapping[str, str]) -> None:
    """Validate the objective headers alone (before anything else is done with the request)."""
    raw = headers.get(HEADER_TTFT)
    if raw is not None:
        parse_ttft_ms(raw)
    raw = headers.get(HEADER_PRIORITY)
    if raw is not None:
        parse_priority(raw)
