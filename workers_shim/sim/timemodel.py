"""Step-time model of a GPU engine, and hardware profiles with their derivation.

One engine step (one forward pass of a continuous batch) takes, in milliseconds,

    a + b·Σ chunk + c·Σ chunk·ctx + d·decode_seqs + e·Σ decode_ctx  (+ fetch, see EngineConfig)

- ``a``: fixed cost of a step: reading the weights once from HBM plus launch/scheduling overhead.
- ``b``: linear layers (QKV/O projections, MLP) per prefill token: 2·N_params FLOPs at a sustained
  fraction of peak.
- ``c``: attention per (query token, attended token) pair: 4·layers·d_model FLOPs. A chunk of ``n``
  tokens starting after ``s`` cached/computed tokens attends to ``n·(s + (n+1)/2)`` pairs, so ``ctx``
  is the chunk's mean attended length ``s + (n+1)/2`` (a whole prompt alone: ``n·(n+1)/2``).
- ``d``: per decoded sequence (one token each): its linear-layer FLOPs, taken equal to ``b``.
- ``e``: per context token a decoding sequence attends to: reading its K and V from HBM.

The additive form is a deliberate approximation: a real step is closer to max(compute, memory), so
the model overstates mixed steps by about ``a`` (a few percent of a long prefill chunk) and small
decode batches by their ``d`` term. Profiles below are derived from public hardware and model
specifications (numbers in the docstrings); calibrate them with measured samples before trusting
absolute TTFTs (README.md, "Parameters").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["PROFILES", "Profile", "TimeModel"]


@dataclass
class TimeModel:
    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float = 0.0
    d_ms_per_decode_seq: float = 0.0
    e_ms_per_decode_ctx: float = 0.0
    name: str = "custom"

    def chunk_ms(self, tokens: int, context: int = 0) -> float:
        """Compute cost of one prefill chunk of ``tokens`` after ``context`` tokens (no step overhead)."""
        return tokens * (self.b_ms_per_token + self.c_ms_per_token2 * (context + (tokens + 1) / 2))

    def step_ms(
        self, chunks: Iterable[tuple[int, int]] = (), decode_seqs: int = 0, decode_context: int = 0
    ) -> float:
        """One step: ``chunks`` as (tokens, context before the chunk); ``decode_context`` is the sum over
        decoding sequences of the tokens each attends to (its KV length including the new token)."""
        ms = self.a_ms + self.d_ms_per_decode_seq * decode_seqs + self.e_ms_per_decode_ctx * decode_context
        for n, s in chunks:
            ms += self.chunk_ms(n, s)
        return ms

    @classmethod
    def llama3_8b_h100(cls) -> TimeModel:
        """Llama-3-8B, BF16, one H100 SXM (989 TFLOP/s dense BF16, 3.35 TB/s HBM3).

        - b: 2 x 6.98 G non-embedding parameters = 13.96 GFLOP per token at 55 % of peak → 0.0257 ms.
        - c: 4 x 32 layers x 4096 = 524,288 FLOP per attended pair at 45 % of peak (FlashAttention-3
          class kernels) → 1.18e-6 ms.
        - a: 16.06 GB of weights read at 85 % of 3.35 TB/s = 5.6 ms, plus 0.5 ms scheduling/launch.
        - d = b.
        - e: K+V = 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B per token, read at 80 % of
          3.35 TB/s → 4.89e-5 ms.
        One 12k-token prompt alone (8192-token chunks) → ≈0.41 s TTFT.
        """
        return cls(6.1, 0.0257, 1.18e-6, 0.0257, 4.89e-5, name="llama3-8b-h100")

    @classmethod
    def llama3_70b_8xa800(cls) -> TimeModel:
        """Llama-3-70B, BF16, tensor-parallel over 8 x A800 SXM4 80 GB (312 TFLOP/s dense BF16 and
        2.04 TB/s HBM2e each; NVLink capped at 400 GB/s), the hardware of Mooncake's experiments.

        - b: 2 x 68.45 G non-embedding parameters = 136.9 GFLOP per token at 45 % of 8 x 312 TFLOP/s
          (TP all-reduces over the reduced NVLink cost ~20 % of a chunk) → 0.122 ms.
        - c: 4 x 80 layers x 8192 = 2.62 MFLOP per attended pair at 50 % of peak (FlashAttention-2
          on Ampere) → 2.10e-6 ms.
        - a: 141 GB of weights read at 80 % of 8 x 2.04 TB/s = 10.8 ms, plus 160 decode all-reduces
          (~15 µs each) and scheduling → 14 ms.
        - d = b.
        - e: K+V = 2 x 80 x 8 x 128 x 2 B = 327,680 B per token (Mooncake's README: 40 GB for 128k
          tokens of LLaMA3-70B), read at 80 % of 8 x 2.04 TB/s → 2.51e-5 ms.
        One 12k-token prompt alone → ≈1.65 s TTFT.
        """
        return cls(14.0, 0.122, 2.10e-6, 0.122, 2.51e-5, name="llama3-70b-8xa800")


@dataclass
class Profile:
    """A model on some hardware: its time model, KV footprint, GPU KV capacity and link bandwidths."""

    name: str
    time: TimeModel
    kv_bytes_per_token: int
    gpu_kv_tokens: int
    link_gbps: Mapping[str, float] = field(default_factory=dict)  # GB/s into GPU memory per tier

    def fetch_ms_per_block(self, block_size: int) -> dict[str, float]:
        """Milliseconds to bring one block into GPU memory from each tier."""
        nbytes = self.kv_bytes_per_token * block_size
        return {tier: nbytes / (gbps * 1e9) * 1e3 for tier, gbps in self.link_gbps.items()}


PROFILES: dict[str, Profile] = {
    # KV capacity: 0.9 x 80 GB - 16.06 GB weights - ~4 GB activations/graphs ≈ 51.9 GB / 131,072 B.
    # Links: CPU = PCIe Gen5 x16 pinned H2D, ~50 GB/s (a public vLLM CPU-offload microbenchmark on
    # PCIe Gen5 measured ~54 GB/s); disk = one PCIe Gen4 NVMe, ~6 GB/s; shared = one 200 Gb/s RDMA
    # NIC at 80 % ≈ 20 GB/s; remote = KV received from a prefill instance (disaggregated decode) over
    # that same NIC.
    "llama3-8b-h100": Profile(
        "llama3-8b-h100",
        TimeModel.llama3_8b_h100(),
        kv_bytes_per_token=131_072,
        gpu_kv_tokens=396_000,
        link_gbps={"cpu": 50.0, "disk": 6.0, "shared": 20.0, "remote": 20.0},
    ),
    # KV capacity: 8 x 0.9 x 80 GB - 141 GB weights - 8 x 5 GB activations ≈ 395 GB / 327,680 B.
    # Links: CPU = 8 x PCIe Gen4 x16, host-memory bound ~100 GB/s; disk = NVMe RAID ~8 GB/s;
    # shared = Mooncake Transfer Engine, 87 GB/s on 4 x 200 Gb/s RoCE (Mooncake README); remote (KV
    # from a prefill instance) over the same.
    "llama3-70b-8xa800": Profile(
        "llama3-70b-8xa800",
        TimeModel.llama3_70b_8xa800(),
        kv_bytes_per_token=327_680,
        gpu_kv_tokens=1_205_000,
        link_gbps={"cpu": 100.0, "disk": 8.0, "shared": 87.0, "remote": 87.0},
    ),
}
