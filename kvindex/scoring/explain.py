"""Why a request goes where it goes: the verdict over a ranking (the ``Explain`` RPC, ``kvindex
explain``, ``kvindex replay``'s re-ranked decisions and the proxy's debug header all use this).

A ranking lists, per instance, the estimate's terms as the cost model priced them
(``costs.est_ttft_ms``: wait + prefill + fetch, in that order) and the policy's cost. The verdict
compares the first-ranked with the second: the margin in the policy's cost and in estimated TTFT,
and the term that decided it, the one whose difference favours the winner most. When the winner's
estimate is not the lower one, no term decided: a placement rule of the policy did (its reason,
e.g. ``replica``: a holder of a hot prefix kept over an idle instance), or the pick's draw did.
Nothing here prices anything: the terms are read from the ranking, as the cost model made them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# The estimate's terms, as ``costs.est_ttft_ms`` adds them (tests/unit/test_explain.py holds the
# sum equal to it): the name shown, and the ranked instance's field.
TERMS: tuple[tuple[str, str], ...] = (("wait", "wait_ms"), ("prefill", "prefill_ms"), ("fetch", "fetch_ms"))
PLACEMENT = "placement"  # the policy's rule chose the winner, not a lower estimate
PICK = "pick"  # the pick drew a later-ranked instance


class Ranked(Protocol):
    """One ranked instance as a ranking answers it (``RankedInstance``)."""

    instance_id: str
    cost: float
    est_ttft_ms: float
    wait_ms: float
    prefill_ms: float
    fetch_ms: float
    explain: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why ``winner`` is first (the ``Verdict`` message's fields)."""

    winner: str = ""
    reason: str = ""
    runner_up: str = ""
    margin: float = 0.0
    margin_ms: float = 0.0
    deciding_term: str = ""
    deciding_ms: float = 0.0
    summary: str = ""


def term_differences(winner: Ranked, other: Ranked) -> dict[str, float]:
    """``other``'s term minus ``winner``'s, per term (ms; positive: the winner is faster there)."""
    return {name: getattr(other, field) - getattr(winner, field) for name, field in TERMS}


def verdict(ranked: Sequence[Ranked], cost_unit: str, picked_rank: int = 0) -> Verdict:
    """The verdict over ``ranked`` (best first, as Score lists it); ``picked_rank``: where the pick
    found the first in the policy's ranking (ScoreResponse.picked_rank, 0: its first choice)."""
    if not ranked:
        return Verdict(summary="no instance was ranked")
    w = ranked[0]
    reason = w.explain or ""
    said = f" ({reason})" if reason and reason != "ranked" else ""
    if len(ranked) == 1:
        alone = f"{w.instance_id}{said} is the only instance ranked: estimated TTFT {w.est_ttft_ms:.1f} ms"
        return Verdict(w.instance_id, reason, summary=alone)
    r = ranked[1]
    margin = r.cost - w.cost
    margin_ms = r.est_ttft_ms - w.est_ttft_ms
    diffs = term_differences(w, r)
    unit = f" {cost_unit}" if cost_unit else ""
    if picked_rank > 0:
        term, by = PICK, 0.0
        why = f"the pick drew it (rank {picked_rank} of the policy's ranking)"
    elif margin_ms <= 0:
        term, by = PLACEMENT, 0.0
        rule = f"the policy's rule {reason!r}" if reason and reason != "ranked" else "the policy's cost"
        why = f"{rule} placed it first although {r.instance_id}'s estimate is {-margin_ms:.1f} ms lower"
    else:
        term, by = max(diffs.items(), key=lambda kv: kv[1])
        others = ", ".join(f"{n} {d:+.1f}" for n, d in diffs.items() if n != term and d)
        why = f"its {term} is {by:.1f} ms shorter" + (f" (and {others} ms)" if others else "")
    summary = (
        f"{w.instance_id}{said} beats {r.instance_id} by {margin:.3g}{unit} "
        f"(estimated TTFT {w.est_ttft_ms:.1f} vs {r.est_ttft_ms:.1f} ms): {why}"
    )
    return Verdict(w.instance_id, reason, r.instance_id, margin, margin_ms, term, by, summary)


__all__ = ["PICK", "PLACEMENT", "TERMS", "Ranked", "Verdict", "term_differences", "verdict"]
