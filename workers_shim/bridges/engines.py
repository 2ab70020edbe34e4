"""Per-engine facts the bridge needs: default block size, storage-medium names, Prometheus metric names.

Everything engine-specific that is not the event encoding itself lives here, so supporting another
engine (or another version's metric names) is a table change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

# Storage medium strings seen in engines' events -> the project's tiers (docs/wire.md §3).
#   vLLM:   "GPU"; CPU offloading connector "CPU"; storage offloading "STORAGE"
#   SGLang: StorageMedium GPU / CPU_PINNED / DISK / EXTERNAL (a shared remote pool such as Mooncake)
#   TRT-LLM: "GPU" (streaming); pull API cache_level 0 (primary) / 1 (secondary = host memory)
# STORAGE is the vLLM offloading connector's local storage medium, so it maps to "disk"; a deployment
# whose storage backend is a pool shared by every instance remaps it with ``--medium STORAGE=shared``.
DEFAULT_MEDIA: Final[dict[str, str]] = {
    "GPU": "gpu",
    "HBM": "gpu",
    "DEVICE": "gpu",
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "HOST": "cpu",
    "PINNED": "cpu",
    "DISK": "disk",
    "SSD": "disk",
    "NVME": "disk",
    "LOCAL_DISK": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "shared",
    "REMOTE": "shared",
    "SHARED": "shared",
}


@dataclass(frozen=True)
class EngineProfile:
    name: str
    # Prometheus sample names, first present wins.
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]
    # Gauges giving queued prompt tokens directly, if the engine has one.
    waiting_tokens: tuple[str, ...] = ()
    # (sum, count) sample pairs giving the mean prompt length; queued prompt tokens are estimated as
    # waiting requests x mean prompt length when no direct gauge exists.
    prompt_mean: tuple[tuple[str, str], ...] = ()
    # Labels that tell data-parallel ranks apart in one /metrics page.
    rank_labels: tuple[str, ...] = ("dp_rank",)
    # An info gauge carrying the engine's block size / pool sizes as labels (vLLM).
    cache_info: str | None = None
    # Prefill samples for the index's calibration (load.PrefillSampler): histograms observed once per
    # finished request, so that their deltas between two scrapes cover the same requests: prefill
    # seconds, prompt tokens, and prompt tokens computed (not found cached). Without the last, counters
    # of cached prompt tokens (first present wins) stand in for it.
    prefill_seconds: str | None = None
    prefill_prompt: str | None = None
    prefill_computed: str | None = None
    prefill_cached: tuple[str, ...] = ()
    # The engine may store a short last block (announcing its own length as block_size): SGLang pages,
    # vLLM's partial entries.
    partial_blocks: bool = False
    media: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MEDIA))

    def sample_names(self) -> frozenset[str]:
        """Every Prometheus sample name the shim reads: a scrape parses only these lines (a vLLM page
        is 600 lines and parsing all of it costs 7 ms a scrape, on a core an engine may be using)."""
        names = {*self.running, *self.waiting, *self.kv_usage, *self.waiting_tokens, *self.prefill_cached}
        names.update(name for pair in self.prompt_mean for name in pair)
        if self.cache_info is not None:
            names.add(self.cache_info)
        for histogram in (self.prefill_seconds, self.prefill_prompt, self.prefill_computed):
            if histogram is not None:
                names.update((histogram + "_sum", histogram + "_count"))
        return frozenset(names)


VLLM = EngineProfile(
    name="vllm",
    # With --prefix-match-unit vLLM caches partial (sub-block) entries announcing the hash block.
    partial_blocks=True,
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prompt_mean=(("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count"),),
    rank_labels=("engine", "dp_rank"),
    cache_info="vllm:cache_config_info",
    prefill_seconds="vllm:request_prefill_time_seconds",
    prefill_prompt="vllm:request_prompt_tokens",
    prefill_computed="vllm:request_prefill_kv_computed_tokens",
    prefill_cached=("vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total"),
)

SGLANG = EngineProfile(
    name="sglang",
    partial_blocks=True,
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    prompt_mean=(("sglang:prompt_tokens_total", "sglang:num_requests_total"),),
    rank_labels=("dp_rank", "attn_dp_rank"),
)

TRTLLM = EngineProfile(
    name="trtllm",
    # trtllm-serve exposes trtllm_* on /prometheus/metrics; Dynamo re-exports them as trtllm:*.
    running=("trtllm_num_requests_running", "trtllm:num_requests_running"),
    waiting=("trtllm_num_requests_waiting", "trtllm:num_requests_waiting"),
    kv_usage=("trtllm_kv_cache_utilization", "trtllm:kv_cache_utilization"),
    prompt_mean=(
        ("trtllm_prompt_tokens_total", "trtllm_request_success_total"),
        ("trtllm:prompt_tokens_total", "trtllm:request_success_total"),
    ),
    rank_labels=("attention_dp_rank", "dp_rank"),
)

ENGINES: Final[dict[str, EngineProfile]] = {p.name: p for p in (VLLM, SGLANG, TRTLLM)}
