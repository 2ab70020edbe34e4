"""Prefill/decode disaggregation for ``kvindex route --pd`` and the ext_proc picker's PD mode.

A disaggregated request is served in two steps, as vLLM's disaggregated proxies do (its
``examples/online_serving/disaggregated_serving``; the ``kv_transfer_params`` protocol of
NixlConnector and the other KV connectors):

1. the **prefill** instance gets the request with ``max_tokens`` 1, ``stream`` false and
   ``kv_transfer_params = {"do_remote_decode": true, ...}``; it computes the prompt's KV, keeps it for
   the decode instance to pull and answers with the ``kv_transfer_params`` that say where it is;
2. the **decode** instance gets the original request plus those ``kv_transfer_params``; it loads the
   KV (only the part it does not hold itself) and generates. Its answer goes back to the client.

Which instances (``decide_local``, ``choose_prefill``, pure functions shared by both routers):

- the decode instance first, by the index's ``decode`` policy (KV headroom, then running requests),
  among instances announcing role ``decode`` or ``both``;
- **conditional disaggregation**: when the part of the prompt the decode instance does not hold is
  short — fewer than ``min_input_tokens`` prompt tokens (default 2,048), or an uncached share below
  ``min_uncached_share`` (default 0.7), Dynamo's defaults — a decode instance prefills it (one step,
  the plain request), the one the TTFT ranking prefers among them (it may hold the prefix);
- otherwise the prefill instance with the lowest estimated TTFT *including the KV transfer*: the
  index's ``est_ttft_ms`` (queue, prefill of the uncached part, loads) plus the transfer of the
  tokens the decode instance lacks, at a cost per (prefill, decode) pair (``PairCosts``: given per
  pair, else measured, else a default per 1,000 tokens), optionally only within the decode
  instance's ``pd_group``.

Design and failure modes: README.md in this folder ("Disaggregated prefill/decode") and docs/pd.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvindex.wire.role import DECODES, PREFILLS

# Why a request was served the way it was (metric label ``reason``, response header x-kvindex-pd).
REMOTE = "remote"  # two steps: prefill instance, then decode instance
SHORT_INPUT = "short_input"  # fewer prompt tokens than min_input_tokens
CACHED_ON_DECODE = "cached_on_decode"  # the decode instance holds enough of the prompt
NO_PREFILL_INSTANCE = "no_prefill_instance"  # no other instance takes prefills (in the group)
NO_ESTIMATE = "no_estimate"  # the index did not rank (down, or fallback): no TTFT to compare
PREFILL_FAILED = "prefill_failed"  # the prefill instance failed or refused: decode prefills itself
NO_KV_PARAMS = "no_kv_transfer_params"  # the prefill answered without kv_transfer_params
REASONS = (
    REMOTE,
    SHORT_INPUT,
    CACHED_ON_DECODE,
    NO_PREFILL_INSTANCE,
    NO_ESTIMATE,
    PREFILL_FAILED,
    NO_KV_PARAMS,
)

# What vLLM's prefill step sends (toy_proxy_server / disagg_proxy): the prefill instance keeps the
# KV for a remote decode; the remaining fields are filled in by its answer.
PREFILL_KV_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class PdConfig:
    """Settings of disaggregated routing (``kvindex route --pd-*`` flags).

    ``transfer_ms_per_1k``: the default KV transfer cost, ms per 1,000 tokens moved, for a pair with
    neither a given nor a measured cost; ``pair_ms_per_1k``: given costs by ``(prefill, decode)``,
    each a worker id or an instance id; ``measure``: learn each pair's cost from the decode step's
    time to its first byte (``PairCosts``); ``same_group``: keep the prefill within the decode
    instance's ``pd_group`` when it has one (and some prefill instance shares it)."""

    min_input_tokens: int = 2048
    min_uncached_share: float = 0.7
    transfer_ms_per_1k: float = 2.0
    pair_ms_per_1k: dict[tuple[str, str], float] = field(default_factory=dict)
    measure: bool = True
    same_group: bool = False
    prefill_top_k: int = 8
    prefill_timeout: float = 600.0  # a prefill's whole answer (s); the decode step then runs

    def __post_init__(self) -> None:
        if self.min_input_tokens < 0:
            raise ValueError("min_input_tokens must be >= 0")
        if not 0.0 <= self.min_uncached_share <= 1.0:
            raise ValueError("min_uncached_share must be in [0, 1]")
        if self.transfer_ms_per_1k < 0 or any(v < 0 for v in self.pair_ms_per_1k.values()):
            raise ValueError("transfer costs must be >= 0")
        if self.prefill_top_k < 1:
            raise ValueError("prefill_top_k must be >= 1")


def parse_pair_cost(text: str) -> tuple[tuple[str, str], float]:
    """``PREFILL=DECODE:MS`` (worker or instance ids; MS per 1,000 tokens) -> ((prefill, decode), ms)."""
    pair, sep, ms = text.rpartition(":")
    prefill, eq, decode = pair.partition("=")
    if not (sep and eq and prefill and decode):
        raise ValueError(f"pair cost {text!r}: expected PREFILL=DECODE:MS_PER_1K_TOKENS")
    try:
        value = float(ms)
    except ValueError:
        raise ValueError(f"pair cost {text!r}: {ms!r} is not a number") from None
    if not value >= 0:
        raise ValueError(f"pair cost {text!r}: must be >= 0")
    return (prefill, decode), value


class PairCosts:
    """KV transfer cost per (prefill, decode) pair, in ms per 1,000 tokens moved.

    Given costs win (by instance id, then by worker id); then, with ``measure``, an exponentially
    weighted mean of what the pair showed once it has ``min_samples``; else the default. A sample is
    the decode step's time from sending to its first byte per 1,000 transferred tokens: the transfer
    plus the decode instance's first step (and any queueing there), so it errs on the high side when
    decode instances are busy, which is when a shorter transfer matters least."""

    def __init__(self, config: PdConfig, alpha: float = 0.2, min_samples: int = 3) -> None:
        self.config = config
        self.alpha = alpha
        self.min_samples = min_samples
        self._measured: dict[tuple[str, str], tuple[float, int]] = {}

    def per_1k(self, prefill: str, decode: str) -> float:
        given = self.config.pair_ms_per_1k
        if given:
            for key in ((prefill, decode), (_worker(prefill), _worker(decode))):
                if key in given:
                    return given[key]
        if self.config.measure:
            seen = self._measured.get((prefill, decode))
            if seen is not None and seen[1] >= self.min_samples:
                return seen[0]
        return self.config.transfer_ms_per_1k

    def estimate_ms(self, prefill: str, decode: str, tokens: int) -> float:
        return self.per_1k(prefill, decode) * max(0, tokens) / 1000.0

    def observe(self, prefill: str, decode: str, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms < 0 or not self.config.measure:
            return
        sample = ms * 1000.0 / tokens
        seen = self._measured.get((prefill, decode))
        if seen is None:
            self._measured[(prefill, decode)] = (sample, 1)
        else:
            mean, n = seen
            self._measured[(prefill, decode)] = (mean + self.alpha * (sample - mean), n + 1)

    def measured(self) -> dict[tuple[str, str], tuple[float, int]]:
        """(mean ms per 1k tokens, samples) per pair seen."""
        return dict(self._measured)


def _worker(instance_id: str) -> str:
    return instance_id.partition("/")[0]


def decide_local(prompt_tokens: int, decode_matched_tokens: int, config: PdConfig) -> str | None:
    """Why the decode instance should prefill itself (``SHORT_INPUT``, ``CACHED_ON_DECODE``), or None
    when the prefill is worth sending elsewhere."""
    if prompt_tokens < config.min_input_tokens:
        return SHORT_INPUT
    uncached = max(0, prompt_tokens - decode_matched_tokens)
    if prompt_tokens <= 0 or uncached / prompt_tokens < config.min_uncached_share:
        return CACHED_ON_DECODE
    return None


@dataclass(frozen=True, slots=True)
class PrefillOption:
    """A prefill instance as the index ranked it: its TTFT estimate and where it serves."""

    instance_id: str
    endpoint: str
    est_ttft_ms: float
    pd_group: str = ""


@dataclass(frozen=True, slots=True)
class PrefillPick:
    option: PrefillOption
    transfer_ms: float
    total_ms: float  # est_ttft_ms + transfer_ms: what the pick minimises


def prefill_candidates(
    members: Iterable[Any], decode_id: str, decode_group: str, same_group: bool
) -> list[str]:
    """Instance ids that may prefill for ``decode_id``: role prefill or both, with an endpoint, not
    the decode instance itself; within ``decode_group`` when ``same_group`` and any is in it.
    ``members`` have ``instance_id``, ``endpoint``, ``role``, ``pd_group`` (registry states or the
    client's known instances)."""
    able = [m for m in members if m.role in PREFILLS and m.endpoint and m.instance_id != decode_id]
    if same_group and decode_group:
        grouped = [m for m in able if (m.pd_group or "") == decode_group]
        if grouped:
            able = grouped
    return sorted(m.instance_id for m in able)


def decode_candidates(members: Iterable[Any]) -> list[str]:
    """Instance ids that may decode: role decode or both, with an endpoint."""
    return sorted(m.instance_id for m in members if m.role in DECODES and m.endpoint)


def choose_prefill(
    options: Iterable[PrefillOption], decode_id: str, transfer_tokens: int, costs: PairCosts
) -> PrefillPick | None:
    """The option with the lowest estimated TTFT including the transfer to ``decode_id`` (ties: the
    index's order, which ``options`` keeps); None when there is none."""
    best: PrefillPick | None = None
    for option in options:
        if option.instance_id == decode_id or not option.endpoint:
            continue
        transfer = costs.estimate_ms(option.instance_id, decode_id, transfer_tokens)
        total = option.est_ttft_ms + transfer
        if best is None or total < best.total_ms:
            best = PrefillPick(option, transfer, total)
    return best


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill step's request: the client's, generating one token, not streamed, asking the
    engine to keep the KV for a remote decode (vLLM's disaggregated proxy protocol)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return json.dumps(out, separators=(",", ":")).encode()


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> bytes:
    """The decode step's request: the client's own, plus where the prefill left the KV."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return json.dumps(out, separators=(",", ":")).encode()


def kv_params_of(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's JSON answer; None when absent or not an object."""
    try:
        data = json.loads(answer)
    except ValueError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) and params else None


class PdMetrics:
    """Prometheus metrics of disaggregated routing, in the router's registry."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.requests = Counter(
            f"{prefix}_pd_requests",
            "Disaggregated requests by how they were served (remote: two steps; else the decode "
            "instance prefilled itself) and why",
            ["path", "reason"],
            **kw,
        )
        self.prefill_seconds = Histogram(
            f"{prefix}_pd_prefill_seconds",
            "Prefill step: request sent to the prefill instance -> its whole answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            **kw,
        )
        self.decode_first_byte_seconds = Histogram(
            f"{prefix}_pd_decode_first_byte_seconds",
            "Decode step of a two-step request: sent -> first byte (KV transfer + first step)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            **kw,
        )
        for reason in REASONS:
            self.requests.labels(REMOTE if reason == REMOTE else "local", reason)

    def served(self, reason: str) -> None:
        self.requests.labels(REMOTE if reason == REMOTE else "local", reason).inc()


@dataclass
class PdPlan:
    """How one request is served: the decode target (the decision's first), and, for two steps,
    the prefill pick and the tokens its KV transfer moves."""

    reason: str
    prefill: PrefillPick | None = None
    transfer_tokens: int = 0
    prompt_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def remote(self) -> bool:
        return self.prefill is not None

    def header(self) -> str:
        """``x-kvindex-pd``: ``remote`` or ``local;reason=...``."""
        return REMOTE if self.remote else f"local;reason={self.reason}"
