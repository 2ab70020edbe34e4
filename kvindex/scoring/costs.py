"""The time model behind est_ttft: prefill time of the missed tokens, cost of loading matched
blocks from slower tiers, and the queue ahead of a request (docs/scoring.md has the reasoning).

This module is the definition. The rankings compute the same terms in three more forms, each
repeating these float64 operations in the same order so that every form gives bit-identical values:
inline in ``Ranker.candidates``' per-instance loop (kvindex/scoring/ranker.py), as numpy columns over
a fleet's rows (``fleet_table.wait_columns``, ``CandidatePool``'s columns) and as native loops over
those columns (kvindex/scoring/_kernels.pyx). tests/unit/test_cost_forms.py compares every form with
these functions on random inputs; a change here is a change to all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """prefill_ms(miss, L) = a + b*miss + c*miss*L   (c: attention over the whole context)."""

    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float

    def ms(self, miss: float, context: float) -> float:
        if miss <= 0:
            return 0.0
        return self.a_ms + self.b_ms_per_token * miss + self.c_ms_per_token2 * miss * context


# Default before any calibration: a Llama-3-70B class model with TP8 on A800/H100-class GPUs,
# ~9 K prefill tokens/s at short context and ~2x slower per token at 32 K context (the attention
# term), plus ~25 ms fixed per prefill. Workers' own samples replace it within minutes.
DEFAULT_PREFILL = PrefillModel(a_ms=25.0, b_ms_per_token=0.11, c_ms_per_token2=0.11 / 32_768)


@dataclass(frozen=True, slots=True)
class KvProfile:
    """What it costs to move KV: bytes per token and link bandwidths (GB/s = 1e9 B/s)."""

    kv_bytes_per_token: float = 320 * 1024  # Llama-3-70B: 80 layers x 8 KV heads x 128 x 2 (K,V) x 2 B
    pcie_gbps: float = 25.0  # host memory -> GPU (PCIe 5 x16, effective)
    disk_gbps: float = 6.0  # local NVMe -> GPU
    network_gbps: float = 12.5  # remote pool -> GPU (100 Gb/s RDMA/TCP, effective)

    def ms_per_token(self, gbps: float) -> float:
        return self.kv_bytes_per_token / (gbps * 1e9) * 1e3


@dataclass(frozen=True, slots=True)
class FetchCosts:
    """ms per token to bring a matched block to GPU, per tier (gpu, cpu, disk, shared)."""

    per_token_ms: tuple[float, float, float, float]

    @classmethod
    def from_profile(cls, p: KvProfile) -> FetchCosts:
        return cls(
            (0.0, p.ms_per_token(p.pcie_gbps), p.ms_per_token(p.disk_gbps), p.ms_per_token(p.network_gbps))
        )

    def ms(self, tokens_by_tier: tuple[int, int, int, int]) -> float:
        c = self.per_token_ms
        return c[1] * tokens_by_tier[1] + c[2] * tokens_by_tier[2] + c[3] * tokens_by_tier[3]


DEFAULT_FETCH = FetchCosts.from_profile(KvProfile())


@dataclass(frozen=True, slots=True)
class EngineShape:
    """How the engine schedules, for the queueing estimate.

    Continuous batching with chunked prefill processes at most ``chunk_tokens`` prompt tokens per
    step, and every step also decodes one token for each running request, which costs
    ``decode_ms_per_seq`` per request per step. Queued prefill work is drained in token order at
    the engine's throughput: work that runs side by side in one batch is not counted twice.
    """

    chunk_tokens: int = 8192
    step_ms: float = 10.0  # fixed cost of one engine step (launches, scheduling, weights read)
    decode_ms_per_seq: float = 0.3  # per running request per step: its decode token (70B, ~12 K context)


@dataclass(slots=True)
class CostConfig:
    fetch: FetchCosts = DEFAULT_FETCH
    engine: EngineShape = field(default_factory=EngineShape)
    default_prefill: PrefillModel = DEFAULT_PREFILL
    # Assume the queue a heartbeat reported has been draining since, at the prefill rate.
    drain_reported_queue: bool = True
    # Learn the prefill model from measured prefills (kvindex/scoring/calibration.py); False: the
    # default ranks every instance.
    calibrate: bool = True


class PrefillModels(Protocol):
    """Which prefill model ranks an instance: the calibration's (kvindex/scoring/calibration.py)."""

    def prefill(self, model: str) -> PrefillModel:
        """The model's shared prefill model in use."""
        ...

    def own_models(self, model: str) -> Mapping[str, PrefillModel]:
        """The instances of ``model`` ranked with their own fit: instance id -> fit."""
        ...

    def prefill_of(self, model: str, instance: str) -> PrefillModel:
        """The prefill model ranking one instance (its own fit, else the shared one)."""
        ...


class CostModel:
    """The estimate as it prices now: the cost parameters (``config``) and the prefill models the
    calibration ranks with (``models``). What rankings, the candidate pool and policies price with
    (a policy sees it as ``PolicyContext.costs``); the arithmetic is this module's functions."""

    __slots__ = ("config", "engine", "fetch", "models")

    def __init__(self, config: CostConfig, models: PrefillModels) -> None:
        self.config = config
        self.engine = config.engine
        self.fetch = config.fetch
        self.models = models

    def prefill(self, model: str) -> PrefillModel:
        return self.models.prefill(model)

    def own_models(self, model: str) -> Mapping[str, PrefillModel]:
        return self.models.own_models(model)

    def drain_rate(self, model: PrefillModel) -> float:
        """``drain_rate`` with this configuration's ``drain_reported_queue``."""
        return drain_rate(model, self.config.drain_reported_queue)

    def prefill_terms(self, model: str, miss: int, context: int) -> tuple[float, float]:
        """``prefill_terms`` with the model's shared prefill model and this engine."""
        return prefill_terms(self.models.prefill(model), self.engine, miss, context)

    def work_ms(self, model: str, instance: str, miss: int, prompt: int) -> float:
        """The engine time a prefill of ``miss`` of ``prompt`` tokens takes on ``instance``, by the
        prefill model that ranks it."""
        return self.models.prefill_of(model, instance).ms(miss, prompt)


def drain_rate(model: PrefillModel, drain: bool) -> float:
    """Tokens per second at which a reported queue is assumed to drain since its heartbeat: the
    prefill rate, 1000 / b; 0 for none (``CostConfig.drain_reported_queue`` off, or b <= 0)."""
    b_ms = model.b_ms_per_token
    return 1000 / b_ms if drain and b_ms > 0 else 0.0


def queued_now(reported: float, reported_at: float | None, now: float, rate: float, routed: float) -> float:
    """Prefill tokens queued at an instance at ``now``: the ``reported`` queue of its heartbeat at
    ``reported_at``, drained since at ``rate`` tokens/s (``drain_rate``) but never below 0, plus the
    ``routed`` tokens sent there since (the ledger)."""
    if reported and rate and reported_at is not None:
        reported = max(0.0, reported - (now - reported_at) * rate)
    return reported + routed


def queue_ms(model: PrefillModel, shape: EngineShape, queued_tokens: float, running: int) -> float:
    """Time to drain ``queued_tokens`` of prefill on an engine with ``running`` decoding requests:
    the request's wait."""
    if queued_tokens <= 0:
        return 0.0
    # The calibrated per-prefill constant (a) is not paid per step: a step costs the engine's own
    # fixed overhead plus one decode token per running request.
    steps = -(-queued_tokens // shape.chunk_tokens)
    return model.b_ms_per_token * queued_tokens + steps * (shape.step_ms + shape.decode_ms_per_seq * running)


def ledger_ms(busy_until: float, now: float) -> float:
    """What is left at ``now`` of the prefill work the ledger holds for an instance: the requests
    routed there whose first token is not out yet, run one after the other from when each was
    committed (or the engine's last finished prefill) for its own estimated prefill time, end at
    ``busy_until`` (``Ledger.busy_until``, seconds on the ranker's clock); in ms, 0 once that has
    passed."""
    left = (busy_until - now) * 1000.0
    return left if left > 0 else 0.0


def wait_ms(queue: float, ledger: float) -> float:
    """The request's wait: the longer of the reported queue's drain (``queue_ms``) and the ledger's
    work left (``ledger_ms``). Both are lower bounds of the same queue: a heartbeat does not count
    prompts the engine is prefilling (vLLM reports them as running, and a CPU or long-context
    prefill runs for seconds), and the ledger does not know what other routers sent."""
    return queue if queue >= ledger else ledger


def prefill_terms(model: PrefillModel, shape: EngineShape, miss: int, context: int) -> tuple[float, float]:
    """(per_running, alone): ``prefill_ms`` is ``alone + per_running * running``. The columns compute
    these once per request (or match group) and the running count per row."""
    if miss <= 0:
        return 0.0, 0.0
    return -(-miss // shape.chunk_tokens) * shape.decode_ms_per_seq, model.ms(miss, context)


def prefill_ms(model: PrefillModel, shape: EngineShape, miss: int, context: int, running: float) -> float:
    """Time to prefill ``miss`` tokens of a ``context``-token prompt on an engine with ``running``
    decoding requests: the model's time, plus one decode token of every running request per chunk
    of the prefill (chunked prefill shares each step with the decodes)."""
    per_running, alone = prefill_terms(model, shape, miss, context)
    return alone + per_running * running if miss > 0 else 0.0


def est_ttft_ms(wait_ms: float, prefill_ms: float, fetch_ms: float) -> float:
    """The estimated time to first token (``Candidate.est_ttft_ms``): wait, then prefill, then the
    fetch of matched blocks from slower tiers, added in that order."""
    return wait_ms + prefill_ms + fetch_ms


def weighted_cost(est_ms: float, prefill_ms: float, fetch_ms: float, k: float) -> float:
    """The ttft policy's cost with congestion weight ``k`` (kvindex/scoring/policies/ttft.py): the
    estimate plus ``k`` times the engine work the request adds (its prefill and fetch), which every
    request queued after it waits for; the estimate itself when ``k`` is 0."""
    return est_ms + k * (prefill_ms + fetch_ms) if k else est_ms


# ``kvindex serve --cost NAME=VALUE``: the estimate's parameters for the engines an index serves,
# instead of the defaults above (a Llama-3-70B class model on 8 GPUs). name -> (part, field).
COST_PARAMETERS: dict[str, tuple[str, str]] = {
    "prefill_a_ms": ("prefill", "a_ms"),
    "prefill_b_ms_per_token": ("prefill", "b_ms_per_token"),
    "prefill_c_ms_per_token2": ("prefill", "c_ms_per_token2"),
    "chunk_tokens": ("engine", "chunk_tokens"),
    "step_ms": ("engine", "step_ms"),
    "decode_ms_per_seq": ("engine", "decode_ms_per_seq"),
    "kv_bytes_per_token": ("kv", "kv_bytes_per_token"),
    "pcie_gbps": ("kv", "pcie_gbps"),
    "disk_gbps": ("kv", "disk_gbps"),
    "network_gbps": ("kv", "network_gbps"),
}
# Divisors and step sizes: 0 would divide by zero or never end.
_POSITIVE = frozenset({"chunk_tokens", "kv_bytes_per_token", "pcie_gbps", "disk_gbps", "network_gbps"})


def cost_config(options: Mapping[str, float], calibrate: bool = True) -> CostConfig:
    """The defaults with ``options`` (``COST_PARAMETERS`` names -> values) in their place; ValueError
    names an unknown parameter or a value out of range. ``prefill_*`` is the model every instance is
    ranked with until calibration replaces it (and the prior calibration starts from)."""
    parts: dict[str, dict[str, Any]] = {"prefill": {}, "engine": {}, "kv": {}}
    for name, value in options.items():
        if name not in COST_PARAMETERS:
            raise ValueError(f"unknown cost parameter {name!r} (one of {', '.join(COST_PARAMETERS)})")
        if not math.isfinite(value) or value < 0 or (name in _POSITIVE and value <= 0):
            bound = "> 0" if name in _POSITIVE else ">= 0"
            raise ValueError(f"{name} must be a finite number {bound}, got {value:g}")
        if name == "chunk_tokens":
            if value != int(value):
                raise ValueError(f"chunk_tokens must be a whole number of tokens, got {value:g}")
            value = int(value)
        part, attr = COST_PARAMETERS[name]
        parts[part][attr] = value
    return CostConfig(
        fetch=FetchCosts.from_profile(KvProfile(**parts["kv"])),
        engine=EngineShape(**parts["engine"]),
        default_prefill=dataclasses.replace(DEFAULT_PREFILL, **parts["prefill"]),
        calibrate=calibrate,
    )


def cost_parameters(config: CostConfig) -> dict[str, Any]:
    """What a ``CostConfig`` prices with, as plain values (a capture's header, from which a replay
    rebuilds it with ``cost_config_of``)."""
    p, e = config.default_prefill, config.engine
    return {
        "prefill": [p.a_ms, p.b_ms_per_token, p.c_ms_per_token2],
        "engine": [e.chunk_tokens, e.step_ms, e.decode_ms_per_seq],
        "fetch_ms_per_token": list(config.fetch.per_token_ms),
        "drain_reported_queue": config.drain_reported_queue,
        "calibrate": config.calibrate,
    }


def cost_config_of(data: Mapping[str, Any] | None) -> CostConfig:
    """``cost_parameters``' inverse; the defaults for what ``data`` lacks (logs written before)."""
    d = {**cost_parameters(CostConfig()), **(data or {})}
    a, b, c = (float(x) for x in d["prefill"])
    chunk, step, decode = d["engine"]
    gpu, cpu, disk, pool = (float(x) for x in d["fetch_ms_per_token"])
    return CostConfig(
        fetch=FetchCosts((gpu, cpu, disk, pool)),
        engine=EngineShape(int(chunk), float(step), float(decode)),
        default_prefill=PrefillModel(a, b, c),
        drain_reported_queue=bool(d["drain_reported_queue"]),
        calibrate=bool(d["calibrate"]),
    )
