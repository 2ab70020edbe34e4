# cython: annotation_typing=False, boundscheck=False, wraparound=False, initializedcheck=False
"""The cost model: the time model behind est_ttft (prefill time of the missed tokens, cost of
loading matched blocks from slower tiers, the queue ahead of a request; docs/scoring.md has the
reasoning), its parameters, and the one definition of the estimate's arithmetic.

Every ranking prices with these functions and nothing else: the candidates of every fleet size one
instance at a time (kvindex/scoring/candidates.py), and the pruned rankings' columns over a fleet's
rows through the row loops at the end of this module (``wait_rows``, ``cost_rows``,
``rank_others``, ``rank_grouped``: kvindex/scoring/fleet_table.py, pool.py). With a C compiler at
install time this very source is compiled by Cython (costs.pxd gives its C types; setup.py builds it
without FMA contraction), so every operation rounds as it does in Python; without one it runs as
Python, slower, to the same values. tests/unit/test_cost_forms.py holds the two builds, and the
candidates against the columns, bit-identical on random inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


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
        c, t = self.per_token_ms, tokens_by_tier
        return fetch_ms(c[1], c[2], c[3], t[1], t[2], t[3])


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


# -- the definition ---------------------------------------------------------------------------------


def drain_rate(model: PrefillModel, drain: bool) -> float:
    """Tokens per second at which a reported queue is assumed to drain since its heartbeat: the
    prefill rate, 1000 / b; 0 for none (``CostConfig.drain_reported_queue`` off, or b <= 0)."""
    b_ms = model.b_ms_per_token
    return 1000 / b_ms if drain and b_ms > 0 else 0.0


def drained_queue(reported: float, reported_at: float, now: float, rate: float) -> float:
    """A heartbeat's ``reported`` queue at ``reported_at``, drained until ``now`` at ``rate``
    tokens/s, never below 0."""
    left = reported - (now - reported_at) * rate
    return left if left > 0 else 0.0


def queued_now(reported: float, reported_at: float | None, now: float, rate: float, routed: float) -> float:
    """Prefill tokens queued at an instance at ``now``: the ``reported`` queue of its heartbeat at
    ``reported_at``, drained since at ``rate`` tokens/s (``drain_rate``) but never below 0, plus the
    ``routed`` tokens sent there since (the ledger)."""
    if reported and rate and reported_at is not None:
        reported = drained_queue(reported, reported_at, now, rate)
    return reported + routed


def chunks(tokens: float, chunk: float) -> float:
    """Engine steps to get through ``tokens`` (> 0), ``chunk`` per step: ``-(-tokens // chunk)``.
    Python's float floor division written out operation by operation (CPython's float_floor_div),
    so that the compiled build, where ``//`` would be C's ``floor(a / b)``, rounds alike; ``x // 1.0``
    is floor(x) exactly in both."""
    if tokens <= chunk:
        return 1.0
    r = tokens % chunk  # fmod(tokens, chunk): the remainder of -tokens, negated
    div = -((tokens - r) / chunk)
    if r:
        div -= 1.0
    steps = div // 1.0
    if div - steps > 0.5:
        steps += 1.0
    return -steps


def queue_wait(b_ms: float, step_ms: float, chunk: float, dps: float, queued: float, running: float) -> float:
    """Time to drain ``queued`` tokens of prefill on an engine with ``running`` decoding requests
    (prefill b ms per token; steps of ``chunk`` tokens, each ``step_ms`` plus ``dps`` per running
    request): the request's wait."""
    if queued <= 0:
        return 0.0
    # The calibrated per-prefill constant (a) is not paid per step: a step costs the engine's own
    # fixed overhead plus one decode token per running request.
    return b_ms * queued + chunks(queued, chunk) * (step_ms + dps * running)


def queue_ms(model: PrefillModel, shape: EngineShape, queued_tokens: float, running: int) -> float:
    """``queue_wait`` with ``model``'s prefill rate on ``shape``'s engine."""
    return queue_wait(
        model.b_ms_per_token,
        shape.step_ms,
        shape.chunk_tokens,
        shape.decode_ms_per_seq,
        queued_tokens,
        running,
    )


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
    """(per_running, alone): ``prefill_ms`` is ``prefill_at(per_running, alone, running)``, computed
    once per request (or match group, or miss size) and the running count per instance."""
    if miss <= 0:
        return 0.0, 0.0
    return chunks(miss, shape.chunk_tokens) * shape.decode_ms_per_seq, model.ms(miss, context)


def prefill_at(per_running: float, alone: float, running: float) -> float:
    """The prefill beside ``running`` decoding requests, from ``prefill_terms``."""
    return alone + per_running * running


def prefill_ms(model: PrefillModel, shape: EngineShape, miss: int, context: int, running: float) -> float:
    """Time to prefill ``miss`` tokens of a ``context``-token prompt on an engine with ``running``
    decoding requests: the model's time, plus one decode token of every running request per chunk
    of the prefill (chunked prefill shares each step with the decodes)."""
    per_running, alone = prefill_terms(model, shape, miss, context)
    return prefill_at(per_running, alone, running) if miss > 0 else 0.0


def fetch_ms(f_cpu: float, f_disk: float, f_pool: float, cpu: float, disk: float, pool: float) -> float:
    """Time to bring matched tokens to the GPU from the CPU, the disk and the shared pool, at
    ``f_*`` ms per token (``FetchCosts``)."""
    return f_cpu * cpu + f_disk * disk + f_pool * pool


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


# -- the row loops: a fleet's columns (kvindex/scoring/fleet_table.py, pool.py) ---------------------
# Arrays are numpy's (float64 columns; uint8 flags; int64 rows); compiled, they are typed memoryviews
# (costs.pxd) and each loop runs in C.


def wait_rows(
    queued: Any,
    heartbeat_at: Any,
    tokens_new: Any,
    queued_routed: Any,
    running_now: Any,
    busy_until: Any,
    drains: Any,
    rows: Any,
    count: int,
    now: float,
    b_ms: float,
    step_ms: float,
    chunk: float,
    dps: float,
    rate: float,
    wait: Any,
    draining: Any,
    seen: Any,
) -> int:
    """The wait (``wait_ms(queue_wait(queued_now(...)), ledger_ms(...))``) of ``count`` rows
    (``rows[:count]``, or rows 0..count-1 when ``rows`` is empty; a row listed twice is computed
    twice, to the same value), written to ``wait[row]``. The columns are a fleet table's: reported
    queue, heartbeat time, tokens routed since, their sum, running requests (+ routed since), the
    ledger's end of work, whether the reported queue drains. The rows whose reported queue is still
    draining or whose ledger work is not over go to ``draining`` once each (``seen``: a zeroed flag
    per row, zeroed again on return); returns their number."""
    out = 0
    listed = rows.shape[0] > 0
    if chunk == 0:
        raise ZeroDivisionError("chunk_tokens is 0")
    for j in range(count):
        i = rows[j] if listed else j
        if rate != 0 and drains[i]:
            q = drained_queue(queued[i], heartbeat_at[i], now, rate)
            if q > 0 and not seen[i]:
                seen[i] = 1
                draining[out] = i
                out += 1
            q = q + tokens_new[i]
        else:
            q = queued_routed[i]
        ledger = ledger_ms(busy_until[i], now)
        if ledger > 0 and not seen[i]:
            seen[i] = 1
            draining[out] = i
            out += 1
        wait[i] = wait_ms(queue_wait(b_ms, step_ms, chunk, dps, q, running_now[i]), ledger)
    for j in range(out):
        seen[draining[j]] = 0
    return out


def cost_rows(
    wait: Any,
    running: Any,
    group: Any,
    ga: Any,
    gb: Any,
    gf: Any,
    k: float,
    prefill: Any,
    est: Any,
    cost: Any,
) -> None:
    """Per row, the prefill (``prefill_at`` with its group's ``prefill_terms`` ga[g], gb[g]), the
    estimate (with its group's fetch gf[g]) and the ttft policy's cost at congestion weight ``k``;
    ``group`` empty: every row in group 0."""
    grouped = group.shape[0] > 0
    for i in range(wait.shape[0]):
        g = group[i] if grouped else 0
        p = prefill_at(ga[g], gb[g], running[i])
        e = est_ttft_ms(wait[i], p, gf[g])
        prefill[i] = p
        est[i] = e
        cost[i] = weighted_cost(e, p, gf[g], k)


def _before(c1: float, kv1: float, ld1: float, r1: int, c2: float, kv2: float, ld2: float, r2: int) -> bool:
    """(cost, kv, load, key rank) order."""
    if c1 != c2:
        return c1 < c2
    if kv1 != kv2:
        return kv1 < kv2
    if ld1 != ld2:
        return ld1 < ld2
    return r1 < r2


def _insert(bc: Any, br: Any, base: int, j: int, c: float, kv: float, ld: float, rank: int, row: int) -> None:
    """Put (c, kv, ld, rank, row) into the sorted top-k buffer that starts at ``base``, at ``j`` (its
    first free place, or its last one when full) or before: the entries it ranks before move down
    one place (bc holds cost, kv, load per entry; br key rank, row)."""
    while j > base and _before(
        c, kv, ld, rank, bc[3 * (j - 1)], bc[3 * (j - 1) + 1], bc[3 * (j - 1) + 2], br[2 * (j - 1)]
    ):
        bc[3 * j] = bc[3 * (j - 1)]
        bc[3 * j + 1] = bc[3 * (j - 1) + 1]
        bc[3 * j + 2] = bc[3 * (j - 1) + 2]
        br[2 * j] = br[2 * (j - 1)]
        br[2 * j + 1] = br[2 * (j - 1) + 1]
        j -= 1
    bc[3 * j] = c
    bc[3 * j + 1] = kv
    bc[3 * j + 2] = ld
    br[2 * j] = rank
    br[2 * j + 1] = row


def _listed(rows: Any, n: int, row: int) -> bool:
    """Whether ``row`` is in the ascending ``rows[:n]`` (binary search)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if rows[mid] < row:
            lo = mid + 1
        else:
            hi = mid
    return lo < n and rows[lo] == row


def rank_others(
    wait: Any,
    running: Any,
    mask: Any,
    explicit_rows: Any,
    has_prompt: bool,
    a: float,
    b: float,
    k: float,
    kv: Any,
    load: Any,
    key_rank: Any,
    out: Any,
) -> tuple[int, float, int]:
    """The ttft policy's pruned ranking over the rows that hold nothing of the prompt (the request's
    candidates in ``mask`` that are not in ``explicit_rows``, sorted), in one loop (and a count).

    Per row: prefill = ``prefill_at(a, b, running)`` (0 without a prompt), est = ``est_ttft_ms(wait,
    prefill, 0)``, cost = ``weighted_cost(est, prefill, 0, k)``. Puts the first ``len(out)`` rows in
    (cost, kv, load, key rank) order into ``out`` (unordered) and returns (how many, the lowest
    prefill of every row, how many rows wait at most that long): the last two are what the
    congestion bound (kvindex/scoring/policies/ttft.py ``_uncongested``) counts."""
    n = wait.shape[0]
    top_k = out.shape[0]
    filled = 0
    n_explicit = explicit_rows.shape[0]
    waiting = 0
    low = 0.0
    bc = np.empty((top_k + 1) * 3)
    br = np.empty((top_k + 1) * 2, dtype=np.int64)
    if not has_prompt:  # every prefill is 0.0, as 0.0 * running + 0.0 is
        a = b = 0.0
    for i in range(n):
        p = prefill_at(a, b, running[i])
        if i == 0 or p < low:  # the lowest prefill of every row
            low = p
        c = weighted_cost(est_ttft_ms(wait[i], p, 0.0), p, 0.0, k)
        last = filled - 1
        if filled == top_k and c > bc[3 * last]:
            continue  # after every buffered row whatever the tie-breaks (the common case)
        if not mask[i] or _listed(explicit_rows, n_explicit, i):
            continue
        if filled == top_k and not _before(
            c, kv[i], load[i], key_rank[i], bc[3 * last], bc[3 * last + 1], bc[3 * last + 2], br[2 * last]
        ):
            continue
        _insert(bc, br, 0, filled if filled < top_k else top_k - 1, c, kv[i], load[i], key_rank[i], i)
        if filled < top_k:
            filled += 1
    for i in range(n):
        if wait[i] <= low:
            waiting += 1
    for j in range(filled):
        out[j] = br[2 * j + 1]
    return filled, low, waiting


def rank_grouped(
    wait: Any,
    running: Any,
    mask: Any,
    explicit_rows: Any,
    group: Any,
    ga: Any,
    gb: Any,
    gf: Any,
    k: float,
    kv: Any,
    load: Any,
    key_rank: Any,
    out: Any,
    filled: Any,
) -> tuple[float, int]:
    """``rank_others`` with the rows split into groups by match (``group[row]``; 0: the rows that
    hold nothing of the prompt, g > 0: the instances sharing one answer of the index): per row of
    group g, prefill = ``prefill_at(ga[g], gb[g], running)``, est with the fetch gf[g], cost at
    ``k``. Puts the first ``top_k = len(out) // len(ga)`` rows of each group in (cost, kv, load, key
    rank) order into ``out[g * top_k:]`` (unordered; ``filled[g]`` of them) and returns (the lowest
    prefill of every row, how many rows wait at most that long), as ``rank_others`` does."""
    n = wait.shape[0]
    n_groups = ga.shape[0]
    top_k = out.shape[0] // n_groups if n_groups else 0
    n_explicit = explicit_rows.shape[0]
    waiting = 0
    low = 0.0
    if top_k <= 0:
        raise ValueError("out must hold top_k rows per group")
    bc = np.empty(n_groups * (top_k + 1) * 3)
    br = np.empty(n_groups * (top_k + 1) * 2, dtype=np.int64)
    for g in range(n_groups):
        filled[g] = 0
    for i in range(n):
        g = group[i]
        p = prefill_at(ga[g], gb[g], running[i])
        if i == 0 or p < low:
            low = p
        c = weighted_cost(est_ttft_ms(wait[i], p, gf[g]), p, gf[g], k)
        f = filled[g]
        base = g * (top_k + 1)
        last = base + f - 1
        if f == top_k and c > bc[3 * last]:
            continue
        if not mask[i] or _listed(explicit_rows, n_explicit, i):
            continue
        if f == top_k and not _before(
            c, kv[i], load[i], key_rank[i], bc[3 * last], bc[3 * last + 1], bc[3 * last + 2], br[2 * last]
        ):
            continue
        _insert(bc, br, base, base + (f if f < top_k else top_k - 1), c, kv[i], load[i], key_rank[i], i)
        if f < top_k:
            filled[g] = f + 1
    for i in range(n):
        if wait[i] <= low:
            waiting += 1
    for g in range(n_groups):
        for j in range(filled[g]):
            out[g * top_k + j] = br[2 * (g * (top_k + 1) + j) + 1]
    return low, waiting
