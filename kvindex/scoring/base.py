"""What every ranking policy sees and returns (one interface, one module per policy)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from msgspec import Struct

from kvindex.fleet.registry import InstanceState
from kvindex.index.base import InstanceMatch
from kvindex.instance import InstanceKey
from kvindex.scoring.costs import CostModel, est_ttft_ms
from kvindex.scoring.ledger import LedgerEntry

if TYPE_CHECKING:
    from kvindex.scoring.pool import CandidatePool

PREFILL_ROLE: Final = "prefill"  # also the default for unified (non-disaggregated) serving
DECODE_ROLE: Final = "decode"


@dataclass(slots=True)
class RouteRequest:
    model: str
    keys: list[int]  # block keys of the prompt's full blocks
    prompt_tokens: int  # L
    block_size: int
    request_id: str = ""
    role: str = PREFILL_ROLE


class PromptCounts(Protocol):
    """What a request says about its prompt's length (a Score or Commit request has both fields)."""

    @property
    def token_ids(self) -> Sized: ...

    @property
    def prompt_tokens(self) -> int: ...


def prompt_length(request: PromptCounts, block_size: int, keys: Sized) -> int:
    """L (``RouteRequest.prompt_tokens``): the token count when tokens were sent, else the caller's
    figure, else whole blocks. The service and replay both derive it here, so a replayed commit
    charges the ledger what the live one did."""
    if len(request.token_ids):
        return len(request.token_ids)
    return request.prompt_tokens or len(keys) * block_size


# Candidates and choices are made for every instance on every Score: msgspec Structs construct in C,
# several times faster than dataclasses (whose __init__ is Python code). Not tracked by the cycle
# collector: they only point at longer-lived objects.
class Candidate(Struct, gc=False):
    """One instance as the router sees it for one request, with the TTFT estimate's parts."""

    state: InstanceState
    match: InstanceMatch  # from the index (real events)
    blocks: int  # consecutive usable blocks, speculative ones included
    tokens_by_tier: tuple[int, int, int, int]  # hit tokens by fastest tier (speculative count as gpu)
    hit_tokens: int
    miss_tokens: int
    wait_ms: float
    prefill_ms: float
    fetch_ms: float
    inflight: int  # requests routed here and not finished (ledger)
    queued_tokens: float  # prefill tokens ahead of this request (reported and drained since, + routed since)
    routed_tokens: int  # prefill tokens routed here since the last heartbeat (ledger)
    # A hybrid-attention model's instance whose full-attention group holds more of the prompt than
    # the engine can reuse (no window ends there): those blocks (0: nothing beyond ``blocks``), and
    # what the prefill would cost with them as the hit. Not this request's estimate (it is cold
    # there): the engine keeps a window at that junction after this request, so later requests
    # sharing the prefix hit it (docs/scoring.md, "Reach"); the ttft policy's ranking counts it.
    reach: int = 0
    reach_prefill_ms: float = 0.0

    @property
    def est_ttft_ms(self) -> float:
        return est_ttft_ms(self.wait_ms, self.prefill_ms, self.fetch_ms)

    @property
    def load(self) -> int:
        """Requests on the instance: reported running + waiting, plus those routed since."""
        load = self.state.load
        return load.running + load.waiting + self.inflight


class Choice(Struct, gc=False):
    candidate: Candidate
    cost: float  # the policy's own figure, lower is better
    reason: str = ""


class IndexView(Protocol):
    """What a policy may read of the index: how many blocks an instance holds per tier."""

    def block_counts(self, instance: InstanceKey) -> tuple[int, int, int, int]: ...


class LedgerView(Protocol):
    """What a policy may read of the in-flight ledger: the requests routed to an instance."""

    def of(self, instance: InstanceKey) -> Iterable[LedgerEntry]: ...


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """All a policy sees besides its request and candidates (one per router): the router's clock,
    its seeded generator, read views of the index and the in-flight ledger, and the cost model."""

    clock: Callable[[], float]
    rng: random.Random
    index: IndexView
    ledger: LedgerView
    costs: CostModel


class Policy(Protocol):
    name: str
    cost_unit: str  # what Choice.cost means ("ms", "-score", ...); lower is always better
    # How long a committed prompt's blocks count as present on its instance before the real
    # stored events arrive (seconds); 0 for policies that do not use the index.
    speculative_ttl: float

    def rank(self, request: RouteRequest, candidates: list[Candidate], ctx: PolicyContext) -> list[Choice]:
        """All candidates, best first."""
        ...

    def on_commit(self, request: RouteRequest, instance: Candidate, ctx: PolicyContext) -> None:
        """Called when a routing decision is committed (policies with memory update it here)."""
        ...


@runtime_checkable
class PrunedPolicy(Policy, Protocol):
    """A policy that can rank a pruned pool: Score with ``top_k`` then builds candidates for the
    instances holding some of the prompt only and hands the others over as columns
    (``CandidatePool``), instead of a candidate per instance. The router checks for it once per
    policy, when it is built (kvindex/scoring/ranker.py)."""

    def rank_top(
        self, request: RouteRequest, pool: CandidatePool, ctx: PolicyContext, top_k: int
    ) -> list[Choice]:
        """The first ``top_k`` of ``rank`` over every candidate of ``pool``, the same choices."""
        ...
