"""A simulated vLLM-like engine in virtual time: paged KV blocks with prefix caching, offload tiers,
continuous batching with chunked prefill, decode, and the block events a real worker would publish.

See README.md in this folder for the model, its parameters and its limits. In short:

- GPU blocks: a cached block is identified by its chain key (``SimRequest.keys``); in-use blocks are
  ref-counted; free blocks without a key are reused first, then cached free blocks in LRU order
  (head evicted first). A finished request frees its blocks tail first, so its last block is evicted
  first (vLLM v1 ``BlockPool.free_blocks``).
- Scheduling per step (vLLM v1 ``Scheduler.schedule``): decoding requests first (one token each),
  then the partially prefilled request, then waiting requests FCFS while the token budget, the
  ``max_running`` cap and free blocks allow. Blocks are allocated incrementally; a running request
  that cannot get a block preempts the newest running request (recompute mode).
- Runs of pure decode steps are jumped over analytically (one Python operation per run, not per
  token), and cut short when a request is submitted mid-run.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from sortedcontainers import SortedList

from kvindex.wire.groups import GroupSpec
from workers_shim.sim.tiers import EventSink, LruTier, SharedPool
from workers_shim.sim.timemodel import PROFILES, Profile, TimeModel

if TYPE_CHECKING:
    from kvindex.index.hybrid import GroupLayout

__all__ = [
    "TIERS",
    "Completion",
    "EngineConfig",
    "EngineLoad",
    "EngineStats",
    "SimEngine",
    "SimRequest",
]

TIERS = ("gpu", "cpu", "disk", "shared")
_GPU, _CPU, _DISK, _SHARED = 0, 1, 2, 3
_REMOTE = 4  # a block transferred from another instance (disaggregated prefill, SimRequest.remote_blocks)


@dataclass(slots=True)
class SimRequest:
    """One request. ``keys`` has one chained key per FULL block of the prompt (equal key ⇒ equal
    prefix; ``kvindex.keys.block_keys`` or ``workers_shim.sim.trace``); it may be shorter than
    ``prompt_tokens // block_size`` (blocks without a key are computed but never cached)."""

    id: str
    keys: list[int]
    prompt_tokens: int
    output_tokens: int
    arrival: float = 0.0
    meta: Any = None
    ttft_slo_s: float | None = None  # its TTFT objective, when the trace gives one (goodput, admission)
    # Disaggregated decode: the first ``remote_blocks`` blocks' KV was computed by a prefill instance
    # and is transferred at admission (fetch cost ``fetch_ms_per_block["remote"]``) where not cached.
    remote_blocks: int = 0


@dataclass(slots=True)
class Completion:
    """A request reached its first token (``kind="first_token"``) or finished (``kind="finished"``).

    Every request yields both, in that order (at the same instant when ``output_tokens == 1``).
    ``cached_tokens`` is per tier the prompt tokens found cached at the admission that produced the
    first token; ``computed_tokens`` the prefill tokens computed until the first token (including
    recomputation after a preemption); ``queued_s`` the time from submission to the first admission;
    ``prefill_s`` from the first admission to the first token.
    """

    request: SimRequest
    engine: str
    kind: Literal["first_token", "finished"]
    first_token_at: float
    cached_tokens: dict[str, int]
    computed_tokens: int
    queued_s: float
    prefill_s: float
    finished_at: float | None = None
    preemptions: int = 0
    first_cached_tokens: dict[str, int] | None = None  # per tier, at the first admission

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.request.arrival

    @property
    def finished(self) -> bool:
        return self.kind == "finished"

    @property
    def hit_tokens(self) -> int:
        return sum(self.cached_tokens.values())

    @property
    def reported_cached_tokens(self) -> int:
        """What vLLM reports as ``usage.prompt_tokens_details.cached_tokens``: the hit of the
        request's first admission (vLLM keeps its first scheduled prefill's, not that of a
        readmission after a preemption, which finds the request's own blocks again)."""
        return sum((self.first_cached_tokens or self.cached_tokens).values())


@dataclass(slots=True)
class EngineLoad:
    """The simulated engine's own load, before it becomes the heartbeat's ``load`` map (``wire()``;
    the index decodes that as ``kvindex.wire.schema.Load``): requests admitted (``running``) and
    queued (``waiting``), prompt tokens not yet prefilled (queued requests minus their cached part,
    estimated at submission, plus the remainder of admitted prefills), GPU KV usage (cached free
    blocks count as free), and the prefill samples ``(prompt_tokens, cached_tokens,
    measured_prefill_ms)`` since the last drain."""

    running: int
    waiting: int
    waiting_prefill_tokens: int
    kv_usage: float
    prefill_samples: list[tuple[int, int, float]]
    decoding: int = 0
    prefilling: int = 0

    def wire(self) -> dict[str, float]:
        """The heartbeat's ``load`` map (docs/wire.md §4; ints where the wire wants ints)."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "waiting_prefill_tokens": self.waiting_prefill_tokens,
            "kv_usage": self.kv_usage,
            "decoding": self.decoding,
            "prefilling": self.prefilling,
        }


@dataclass(kw_only=True)
class EngineConfig:
    gpu_blocks: int
    time: TimeModel
    block_size: int = 16
    cpu_blocks: int = 0  # 0: no CPU offload tier
    disk_blocks: int = 0  # 0: no disk tier
    max_batched_tokens: int = 8192  # token budget per step (chunked prefill)
    max_running: int = 256
    # Milliseconds to load one block into GPU memory from "cpu", "disk", "shared", or to receive it
    # from a prefill instance ("remote": disaggregated decode); missing ones cost 0.
    fetch_ms_per_block: dict[str, float] = field(default_factory=dict)
    # False: loads are synchronous, added to the step time; True: overlapped with compute (layer-wise
    # loading), the step takes max(compute, loads).
    fetch_overlap: bool = False
    # "evict": GPU evictions are offloaded to CPU (a victim cache); "store": computed blocks are
    # written to CPU as soon as computed (write-through, like vLLM's CPU offloading connector).
    offload: Literal["evict", "store"] = "evict"
    # A hybrid-attention model's KV-cache groups (workers_shim/sim/hybrid.py: HybridSimEngine), as
    # GroupSpecs or their text ("gemma3", "sliding_window:64x3,full_attention"; hybrid.parse_kv_groups).
    # Empty, or one full-attention group: the plain engine. With groups, ``gpu_blocks`` counts
    # (block, group) pairs: vLLM's groups share one pool.
    kv_groups: tuple[GroupSpec, ...] | str = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.gpu_blocks <= 0:
            raise ValueError("block_size and gpu_blocks must be positive")
        if isinstance(self.kv_groups, str):
            from workers_shim.sim.hybrid import parse_kv_groups

            self.kv_groups = parse_kv_groups(self.kv_groups, self.block_size)
        else:
            self.kv_groups = tuple(self.kv_groups)
        layout = self.layout()
        if layout is not None:
            from workers_shim.sim.hybrid import check_layout

            check_layout(self, layout)
        if self.cpu_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("cpu_blocks and disk_blocks must be >= 0")
        if self.max_running <= 0 or self.max_batched_tokens < self.max_running:
            # vLLM requires max_num_batched_tokens >= max_num_seqs: every running request can decode.
            raise ValueError("need max_running > 0 and max_batched_tokens >= max_running")
        if self.offload not in ("evict", "store"):
            raise ValueError(f"offload must be 'evict' or 'store', got {self.offload!r}")
        unknown = set(self.fetch_ms_per_block) - {"cpu", "disk", "shared", "remote"}
        if unknown:
            raise ValueError(f"fetch_ms_per_block has unknown tiers {sorted(unknown)}")

    @classmethod
    def from_profile(cls, profile: str | Profile, block_size: int = 16, **overrides: Any) -> EngineConfig:
        """A config for a named profile (``PROFILES``): its time model, GPU capacity in blocks of
        ``block_size`` and fetch costs derived from the profile's link bandwidths. With ``kv_groups``
        of G groups the capacity is G x as many (block, group) pairs: a pair holds the KV of a G-th
        of the layers, so the same memory."""
        p = PROFILES[profile] if isinstance(profile, str) else profile
        groups = overrides.get("kv_groups") or ()
        if isinstance(groups, str):
            from workers_shim.sim.hybrid import parse_kv_groups

            groups = parse_kv_groups(groups, block_size)
        kw: dict[str, Any] = {
            "gpu_blocks": p.gpu_kv_tokens // block_size * max(1, len(groups)),
            "time": p.time,
            "block_size": block_size,
            "fetch_ms_per_block": p.fetch_ms_per_block(block_size),
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def llama3_8b_h100(cls, block_size: int = 16, **overrides: Any) -> EngineConfig:
        return cls.from_profile("llama3-8b-h100", block_size, **overrides)

    @classmethod
    def llama3_70b_8xa800(cls, block_size: int = 512, **overrides: Any) -> EngineConfig:
        return cls.from_profile("llama3-70b-8xa800", block_size, **overrides)

    def layout(self) -> GroupLayout | None:
        """The KV-cache group layout when the model is hybrid (None: one full-attention cache)."""
        if not self.kv_groups:
            return None
        # Imported here: kvindex.index loads the index's native kernels, which a plain engine
        # does not need.
        from kvindex.index.hybrid import GroupLayout

        layout = GroupLayout(self.kv_groups, self.block_size)  # type: ignore[arg-type]
        return layout if layout.hybrid else None

    def capacity(self) -> dict[str, int]:
        """Blocks per tier, as a heartbeat announces them."""
        cap = {"gpu": self.gpu_blocks}
        if self.cpu_blocks:
            cap["cpu"] = self.cpu_blocks
        if self.disk_blocks:
            cap["disk"] = self.disk_blocks
        return cap

    def alone_ttft_ms(
        self, prompt_tokens: int, cached_tokens: int = 0, loaded: dict[str, int] | None = None
    ) -> float:
        """TTFT of one request on an idle engine: ``cached_tokens`` already on GPU (or, per tier in
        ``loaded``, blocks to load) and the rest prefilled in chunks of ``max_batched_tokens``."""
        fetch = sum(self.fetch_ms_per_block.get(t, 0.0) * n for t, n in (loaded or {}).items())
        tm = self.time
        done = cached_tokens + sum((loaded or {}).values()) * self.block_size
        total = 0.0
        first = True
        while done < prompt_tokens:
            n = min(self.max_batched_tokens, prompt_tokens - done)
            ms = tm.a_ms + tm.chunk_ms(n, done)
            if first:
                ms = max(ms, fetch) if self.fetch_overlap else ms + fetch
                first = False
            total += ms
            done += n
        return total


@dataclass
class EngineStats:
    submitted: int = 0
    admissions: int = 0  # including re-admissions after preemption
    first_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    queried_tokens: int = 0  # prompt tokens looked up at admissions
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    computed_tokens: int = 0  # prefill tokens computed (including recomputation)
    decode_tokens: int = 0
    gpu_evictions: int = 0  # cached GPU blocks evicted to make room
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[1:], 0))
    fetch_s: float = 0.0
    transferred_blocks: int = 0  # received from prefill instances (SimRequest.remote_blocks)

    @property
    def miss_tokens(self) -> int:
        """Looked-up prompt tokens not found on any tier (computed)."""
        return self.queried_tokens - sum(self.hit_tokens.values())

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens found cached (any tier)."""
        return sum(self.hit_tokens.values()) / self.queried_tokens if self.queried_tokens else 0.0


class _Req:
    __slots__ = (
        "O",
        "P",
        "blocks",
        "bounds",
        "cached",
        "computed",
        "d0",
        "dec_id",
        "decoding",
        "est",
        "first_cached",
        "first_sched",
        "first_token_at",
        "g0",
        "gen",
        "gheld",
        "keys_held",
        "lo",
        "n_computed",
        "n_tokens",
        "null",
        "preemptions",
        "req",
        "submitted",
        "u",
    )

    def __init__(self, req: SimRequest, now: float) -> None:
        self.req = req
        self.P = req.prompt_tokens
        self.O = req.output_tokens
        self.n_tokens = req.prompt_tokens  # tokens known (prompt + generated); KV needed for all
        self.n_computed = 0  # tokens whose KV is (being) computed, cached ones included
        self.gen = 0
        self.blocks = 0  # GPU blocks held while prefilling (decoders: derived from u and D)
        self.keys_held: list[int] = []  # cached keys this request references, in block order
        self.decoding = False
        self.u = 0  # decoders: KV length = u + D
        self.g0 = 0  # decoders: generated tokens when decode started at D = d0
        self.d0 = 0
        self.dec_id = 0
        self.submitted = now
        self.first_sched: float | None = None
        self.first_token_at: float | None = None
        self.cached: dict[str, int] = {}
        self.first_cached: dict[str, int] = {}  # found at the first admission (a preempted request
        # finds its own blocks again when re-admitted: that is not a prefix hit)
        self.computed = 0
        self.est = 0
        self.preemptions = 0
        # Hybrid engines (hybrid.py): per KV-cache group the cached blocks referenced (positions,
        # ascending) and the first block it holds (before it: vLLM's null blocks, no memory; their
        # pairs in total: null), and the boundaries (in blocks) whose windows sparse groups keep.
        self.gheld: list[list[int]] = []
        self.lo: list[int] = []
        self.null = 0
        self.bounds: tuple[int, ...] = ()


class _Step:
    __slots__ = ("alpha", "beta", "end", "k", "run", "sched", "start", "written")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end = start
        self.run = False
        self.k = 1
        self.alpha = 0.0
        self.beta = 0.0
        self.sched: list[tuple[_Req, int, int]] = []  # (request, chunk tokens, tokens before it)
        self.written: list[tuple[list[int], int | None]] = []  # computed key chains, for write-through


class SimEngine:
    """One simulated instance. Drive it with ``submit(req, now)``, ``next_time()`` and ``advance(now)``
    in non-decreasing virtual time (seconds); see ``workers_shim.sim.driver.run_until_idle``."""

    def __init__(
        self, name: str, cfg: EngineConfig, sink: EventSink | None = None, pool: SharedPool | None = None
    ) -> None:
        if cfg.kv_groups and type(self) is SimEngine and cfg.layout() is not None:
            raise ValueError("a config with KV-cache groups needs HybridSimEngine (sim.hybrid.new_engine)")
        self.name = name
        self.cfg = cfg
        self.sink = sink
        self.pool = pool
        self.block_size = cfg.block_size
        # Blocks of the pool per block of a request: 1 here, the number of KV-cache groups in a
        # hybrid engine (hybrid.py), whose pool counts (block, group) pairs.
        self._G = 1
        tm = cfg.time
        self._a, self._b, self._c = tm.a_ms, tm.b_ms_per_token, tm.c_ms_per_token2
        self._d, self._e = tm.d_ms_per_decode_seq, tm.e_ms_per_decode_ctx
        fetch = cfg.fetch_ms_per_block
        self._fetch = (
            0.0,
            fetch.get("cpu", 0.0),
            fetch.get("disk", 0.0),
            fetch.get("shared", 0.0),
            fetch.get("remote", 0.0),
        )
        # GPU: key -> ref count for every cached block (in use or free); free cached blocks in LRU
        # order (first = evicted first); free blocks without a key are interchangeable: a count.
        self._gpu: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()
        self._anon = cfg.gpu_blocks
        self._disk = LruTier("disk", cfg.disk_blocks, sink) if cfg.disk_blocks else None
        self._cpu = LruTier("cpu", cfg.cpu_blocks, sink, lower=self._disk) if cfg.cpu_blocks else None
        # Where GPU evictions go ("evict" mode) or computed blocks are written ("store" mode).
        self._offload = self._cpu if self._cpu is not None else self._disk
        self._waiting: deque[_Req] = deque()
        self._running: dict[_Req, None] = {}  # admission order
        self._prefilling: list[_Req] = []  # admitted, prefill not complete (at the tail of _running)
        # Decoders, lazily: KV length of decoder i is u_i + D. Their blocks in total, at any D, follow
        # from sum(u // B), the count and the sorted residues u % B (see _need).
        self._D = 0
        self._dn = 0
        self._dU = 0
        self._dQ = 0
        self._dres = SortedList()
        self._heap: list[tuple[int, int, _Req]] = []  # (D at which it finishes, dec_id, request)
        self._dec_seq = 0
        self._t = 0.0  # engine clock: start of the current step, or of the next one when idle
        self._now = 0.0  # latest time the driver told us about
        self._step: _Step | None = None
        self._out: list[Completion] = []
        self._samples: list[tuple[int, int, float]] = []
        self._wait_tokens = 0
        self._step_fetch_ms = 0.0
        self.stats = EngineStats()

    # -- driver API ---------------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` at virtual time ``now`` (not before the last call's time). Completions reached
        on the way to ``now`` are kept for the next ``advance``."""
        B = self.block_size
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(f"request {req.id}: prompt_tokens and output_tokens must be >= 1")
        if len(req.keys) > req.prompt_tokens // B:
            raise ValueError(f"request {req.id}: {len(req.keys)} keys for {req.prompt_tokens} tokens")
        if -(-(req.prompt_tokens + req.output_tokens - 1) // B) * self._G > self.cfg.gpu_blocks:
            raise ValueError(
                f"request {req.id} needs more KV blocks than the GPU has ({self.cfg.gpu_blocks})"
            )
        self._advance(now)
        r = _Req(req, now)
        r.est = len(self._lookup(r)[1]) * B
        self._waiting.append(r)
        self._wait_tokens += r.n_tokens - r.est
        self.stats.submitted += 1
        st = self._step
        if st is not None and st.run and now < st.end:
            self._truncate(st, now)

    def next_time(self) -> float | None:
        """Virtual time of this engine's next internal event (end of the current step), None if idle."""
        st = self._step
        if st is None:
            if not (self._running or self._waiting):
                return None
            self._start(self._t)
            st = self._step
            assert st is not None
        return st.end

    def advance(self, now: float) -> list[Completion]:
        """Process every step ending at or before ``now``; return the completions reached."""
        self._advance(now)
        out, self._out = self._out, []
        return out

    def load(self, drain: bool = True) -> EngineLoad:
        """Current load; ``drain`` hands over (and forgets) the prefill samples collected so far."""
        used = self.cfg.gpu_blocks - self._anon - len(self._free)
        st = self._step
        if st is not None and st.run:  # decode blocks allocated so far in the current run
            m = self._steps_done(st, self._now)
            if m:
                used += self._need(self._D + m) - self._need(self._D)
        pending = self._wait_tokens
        for r in self._prefilling:
            pending += r.n_tokens - r.n_computed
        samples = self._samples
        if drain:
            self._samples = []
        else:
            samples = list(samples)
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            waiting_prefill_tokens=pending,
            kv_usage=min(1.0, used / self.cfg.gpu_blocks),
            prefill_samples=samples,
            decoding=self._dn,
            prefilling=len(self._prefilling),
        )

    def holds(self, tier: str = "gpu") -> set[int]:
        """Ground truth of the blocks this engine holds on ``tier`` (the shared pool is not the engine's:
        ``holds("shared")`` is empty; see ``SharedPool.holds``)."""
        if tier == "gpu":
            return set(self._gpu)
        if tier == "cpu":
            return self._cpu.holds() if self._cpu is not None else set()
        if tier == "disk":
            return self._disk.holds() if self._disk is not None else set()
        if tier == "shared":
            return set()
        raise ValueError(f"unknown tier {tier!r}")

    @property
    def clock(self) -> float:
        """Virtual time of the events being emitted right now (for sinks that timestamp them): the
        start of the step being planned (blocks it allocates and caches), or the end of the step
        being completed (decode-run evictions, finishes, write-through)."""
        return self._t

    def attach(self, sink: EventSink | None) -> None:
        """Send this engine's (and its CPU/disk tiers') events to ``sink`` from now on."""
        self.sink = sink
        for tier in (self._cpu, self._disk):
            if tier is not None:
                tier.sink = sink

    @property
    def now(self) -> float:
        return self._now

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting)

    def reset_prefix_cache(self, tiers: tuple[str, ...] = ("gpu",)) -> bool:
        """Drop cached blocks (vLLM's reset_prefix_cache): only when no request holds GPU blocks;
        emits ``cleared`` per tier. Returns False (and changes nothing) while requests run."""
        if self._running:
            return False
        for tier in tiers:
            if tier == "gpu":
                self._anon += len(self._free)
                self._free.clear()
                self._gpu.clear()
                if self.sink is not None:
                    self.sink.cleared("gpu")
            elif tier == "cpu" and self._cpu is not None:
                self._cpu.clear()
            elif tier == "disk" and self._disk is not None:
                self._disk.clear()
        return True

    # -- time ---------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"time went backwards on {self.name}: {now} < {self._now}")
        self._now = now
        while True:
            st = self._step
            if st is None:
                if not (self._running or self._waiting):
                    self._t = now
                    return
                if now <= self._t:
                    return  # the next step starts now: requests submitted at this instant join it
                self._start(self._t)
                continue
            if st.end > now:
                return
            self._complete(st)

    def _start(self, t: float) -> None:
        decode_only = not self._prefilling and self._dn and (not self._waiting or not self._head_admissible())
        if not (decode_only and self._plan_run(t)):
            self._plan_step(t)

    def _complete(self, st: _Step) -> None:
        self._step = None
        self._t = st.end
        if st.run:
            self._alloc(self._need(self._D + st.k) - self._need(self._D))
            self._D += st.k
            self.stats.steps += st.k
            self.stats.decode_tokens += st.k * self._dn
        else:
            self._D += 1
            self.stats.steps += 1
            self.stats.decode_tokens += self._dn
        self.stats.busy_s += st.end - st.start
        self._finish_decoders(st.end)
        for r, chunk, start in st.sched:
            r.n_computed = start + chunk
            if r.first_token_at is None:
                r.computed += chunk
            if r.n_computed >= r.n_tokens:
                self._prefill_done(r, st.end)
        if st.written:
            pool = self.pool
            if pool is not None:
                pool.now = st.end
            store = self._offload if self.cfg.offload == "store" else None
            for keys, parent in st.written:
                if pool is not None:
                    pool.put(keys, parent, chain=True)
                if store is not None:
                    store.put(keys, parent, chain=True)

    # -- decode runs --------------------------------------------------------------------------

    def _need(self, D: int) -> int:
        """GPU blocks all current decoders hold at decode counter ``D``: sum of ceil((u_i + D) / B)."""
        n = self._dn
        if not n:
            return 0
        B = self.block_size
        m, t = divmod(D + B - 1, B)
        return self._dQ + n * m + n - self._dres.bisect_left(B - t)

    def _dec_add(self, r: _Req, kv: int) -> None:
        B = self.block_size
        u = kv - self._D
        r.u = u
        r.decoding = True
        r.g0 = r.gen
        r.d0 = self._D
        self._dres.add(u % B)
        self._dQ += u // B
        self._dU += u
        self._dn += 1
        self._dec_seq += 1
        r.dec_id = self._dec_seq
        heapq.heappush(self._heap, (self._D + r.O - r.gen, r.dec_id, r))

    def _dec_remove(self, r: _Req) -> None:
        B = self.block_size
        self._dres.remove(r.u % B)
        self._dQ -= r.u // B
        self._dU -= r.u
        self._dn -= 1
        r.decoding = False

    def _heap_top(self) -> int:
        heap = self._heap
        while heap:
            _, dec_id, r = heap[0]
            if r.decoding and r.dec_id == dec_id:
                return heap[0][0]
            heapq.heappop(heap)
        raise RuntimeError("no decoder")  # pragma: no cover - callers check _dn

    def _plan_run(self, t: float) -> bool:
        """Plan k identical-shape decode steps at once, up to the next finish; False if not even one
        fits in free blocks. A run that must evict cached blocks ends with the first step that does,
        so evictions are announced when that step ends rather than at the end of a longer run."""
        D = self._D
        kfin = self._heap_top() - D
        anon = self._anon
        base = self._need(D)
        if self._need(D + kfin) - base <= anon:
            k = kfin  # no eviction on the way
        else:
            # k0: the last step served by blocks without a key; step k0 + 1 evicts.
            lo, hi = 0, kfin
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._need(D + mid) - base <= anon:
                    lo = mid
                else:
                    hi = mid
            k = lo + 1
            if self._need(D + k) - base > anon + len(self._free):
                k = lo  # that step needs a preemption: stop before it
        if k < 1:
            return False
        n = self._dn
        st = _Step(t)
        st.run = True
        st.k = k
        st.alpha = self._a + self._d * n + self._e * (self._dU + n * (D + 1))
        st.beta = self._e * n
        st.end = self._run_end(st, k)
        self._step = st
        return True

    @staticmethod
    def _run_end(st: _Step, m: int) -> float:
        return st.start + (m * st.alpha + st.beta * m * (m - 1) / 2) / 1000.0

    def _steps_done(self, st: _Step, now: float) -> int:
        """Steps of the run ``st`` that end at or before ``now``."""
        x = (now - st.start) * 1000.0
        if x <= 0:
            return 0
        a, b = st.alpha, st.beta
        if b <= 0:
            m = int(x // a)
        else:
            h = a - b / 2
            m = int((-h + math.sqrt(h * h + 2 * b * x)) / b)
        m = max(0, min(m, st.k))
        while m < st.k and self._run_end(st, m + 1) <= now:
            m += 1
        while m > 0 and self._run_end(st, m) > now:
            m -= 1
        return m

    def _truncate(self, st: _Step, now: float) -> None:
        """A request arrived during a decode run: the run ends with the step in progress at ``now``."""
        m = self._steps_done(st, now)
        if self._run_end(st, m) < now:
            m += 1  # that step is under way; the newcomer joins the one after it
        if m == 0:  # the run starts exactly now: plan again with the newcomer
            self._step = None
            return
        st.k = m
        st.end = self._run_end(st, m)

    # -- blocks -------------------------------------------------------------------------------

    def _take_anonymous(self, n: int) -> int:
        """Take up to ``n`` free blocks that hold no key; how many more must be evicted."""
        if n <= 0:
            return 0
        a = self._anon
        if n <= a:
            self._anon = a - n
            return 0
        self._anon = 0
        return n - a

    def _alloc(self, n: int) -> None:
        """Take ``n`` free blocks (callers checked they exist): blocks without a key first, then the
        least recently used cached ones, which are evicted (and offloaded in "evict" mode)."""
        n = self._take_anonymous(n)
        if n <= 0:
            return
        free = self._free
        gpu = self._gpu
        evicted = [free.popitem(last=False)[0] for _ in range(n)]
        for k in evicted:
            del gpu[k]
        self.stats.gpu_evictions += n
        if self.sink is not None:
            self.sink.removed(evicted, "gpu")
        if self._offload is not None and self.cfg.offload == "evict":
            self._offload.put(evicted)

    def _release(self, r: _Req, nblocks: int) -> None:
        """Free a request's blocks, tail first: its last cached block becomes the next to be evicted."""
        held = r.keys_held
        self._anon += nblocks - len(held)
        gpu = self._gpu
        free = self._free
        for k in reversed(held):
            c = gpu[k] - 1
            gpu[k] = c
            if c == 0:
                free[k] = None
        r.keys_held = []

    def _register(self, r: _Req, lo: int, hi: int, written: list[tuple[list[int], int | None]]) -> None:
        """Prompt blocks lo..hi-1 of ``r`` become full: cache them (a key already cached elsewhere
        stays an uncached duplicate, as in vLLM) and announce them as chains with their parent."""
        keys = r.req.keys
        gpu = self._gpu
        held = r.keys_held
        sink = self.sink
        run: list[int] = []
        parent = keys[lo - 1] if lo > 0 else None
        for i in range(lo, hi):
            k = keys[i]
            if k in gpu:
                if run and sink is not None:
                    sink.stored(run, "gpu", parent)
                run = []
                parent = k
                continue
            gpu[k] = 1
            held.append(k)
            run.append(k)
        if run and sink is not None:
            sink.stored(run, "gpu", parent)
        written.append((keys[lo:hi], keys[lo - 1] if lo > 0 else None))

    def _lookup(self, r: _Req) -> tuple[int, list[int]]:
        """Consecutive cached prompt blocks from the start, each on its fastest tier: (GPU hits sitting
        in the free queue, tier code per hit block). At most (n_tokens - 1) // B blocks: the last
        token is always computed."""
        B = self.block_size
        keys = r.req.keys
        maxb = (r.n_tokens - 1) // B
        if maxb > len(keys):
            maxb = len(keys)
        gpu = self._gpu
        cpu = self._cpu.lru if self._cpu is not None else None
        disk = self._disk.lru if self._disk is not None else None
        pool = self.pool.lru if self.pool is not None else None
        remote = r.req.remote_blocks
        codes: list[int] = []
        touch = 0
        for i in range(maxb):
            k = keys[i]
            c = gpu.get(k)
            if c is not None:
                codes.append(_GPU)
                if c == 0:
                    touch += 1
            elif cpu is not None and k in cpu:
                codes.append(_CPU)
            elif disk is not None and k in disk:
                codes.append(_DISK)
            elif pool is not None and k in pool:
                codes.append(_SHARED)
            elif i < remote:
                codes.append(_REMOTE)
            else:
                break
        return touch, codes

    # -- scheduling ---------------------------------------------------------------------------

    def _head_admissible(self) -> bool:
        if len(self._running) >= self.cfg.max_running:
            return False
        budget = self.cfg.max_batched_tokens - self._dn
        if budget <= 0:
            return False
        B = self.block_size
        r = self._waiting[0]
        touch, codes = self._lookup(r)
        hit_tok = len(codes) * B
        chunk = min(r.n_tokens - hit_tok, budget)
        new = -(-(hit_tok + chunk) // B) - codes.count(_GPU)
        free = self._anon + len(self._free) - (self._need(self._D + 1) - self._need(self._D))
        return new + touch <= free

    def _plan_step(self, t: float) -> None:
        """Plan one step: decoders, the running prefill, then admissions (vLLM v1 order)."""
        cfg = self.cfg
        B = self.block_size
        G = self._G
        D = self._D
        st = _Step(t)
        self._step_fetch_ms = 0.0
        budget = cfg.max_batched_tokens - self._dn
        dec_alloc = self._need(D + 1) - self._need(D) if self._dn else 0
        plan: list[tuple[_Req, int, int]] = []
        total = dec_alloc
        b = budget
        for r in self._prefilling:
            if b <= 0:
                break
            chunk = min(r.n_tokens - r.n_computed, b)
            need = -(-(r.n_computed + chunk) // B) - r.blocks
            plan.append((r, chunk, need))
            total += need * G
            b -= chunk
        preempted = False
        if total <= self._anon + len(self._free):
            self._alloc(total)
            for r, chunk, need in plan:
                self._schedule_chunk(r, chunk, need, st)
            budget = b
        else:
            budget = self._schedule_with_preemption(st, budget)
            preempted = True
        if not preempted:
            waiting = self._waiting
            running = self._running
            while waiting and budget > 0 and len(running) < cfg.max_running:
                chunk = self._admit(waiting[0], budget, t, st)
                if not chunk:
                    break
                budget -= chunk
        n = self._dn
        if not st.sched and not n:
            raise RuntimeError(f"{self.name}: a step with nothing to do")  # pragma: no cover
        ms = self._a
        if n:
            ms += self._d * n + self._e * (self._dU + n * (D + 1))
        b_, c_ = self._b, self._c
        for _, chunk, start in st.sched:
            ms += chunk * (b_ + c_ * (start + (chunk + 1) / 2))
        fetch = self._step_fetch_ms
        if fetch:
            ms = max(ms, fetch) if cfg.fetch_overlap else ms + fetch
            self.stats.fetch_s += fetch / 1000.0
        st.end = t + ms / 1000.0
        self._step = st

    def _schedule_chunk(self, r: _Req, chunk: int, need: int, st: _Step) -> None:
        B = self.block_size
        r.blocks += need
        lo = r.n_computed // B
        hi = min(len(r.req.keys), (r.n_computed + chunk) // B)
        if hi > lo:
            self._register(r, lo, hi, st.written)
        st.sched.append((r, chunk, r.n_computed))
        self.stats.computed_tokens += chunk

    def _schedule_with_preemption(self, st: _Step, budget: int) -> int:
        """Slow path when the running requests need more blocks than are free: walk them in order,
        preempting the newest running request until the current one fits (vLLM v1)."""
        B = self.block_size
        G = self._G
        D = self._D
        running = self._running
        order = [r for r in running if r.decoding] + list(self._prefilling)
        for r in order:
            if r not in running:
                continue  # preempted meanwhile
            if r.decoding:
                need = 1 if (r.u + D) % B == 0 else 0
                chunk = 0
            else:
                if budget <= 0:
                    continue
                chunk = min(r.n_tokens - r.n_computed, budget)
                need = -(-(r.n_computed + chunk) // B) - r.blocks
            fits = True
            while need * G > self._anon + len(self._free):
                victim = next(reversed(running))
                if victim.decoding:
                    budget += 1  # its decode token is not spent
                self._preempt(victim)
                if victim is r:
                    fits = False
                    break
            if not fits:
                continue
            if r.decoding:
                self._alloc(need * G)
            else:
                self._alloc(need * G)
                self._schedule_chunk(r, chunk, need, st)
                budget -= chunk
        return budget

    def _preempt(self, r: _Req) -> None:
        """Recompute-mode preemption: free the request's blocks and put it first in the queue."""
        B = self.block_size
        del self._running[r]
        if r.decoding:
            D = self._D
            r.gen = r.g0 + D - r.d0
            blocks = -(-(r.u + D) // B)
            self._dec_remove(r)
            r.n_tokens = r.P + r.gen
        else:
            blocks = r.blocks
            self._prefilling.remove(r)
        self._release(r, blocks)
        r.n_computed = 0
        r.blocks = 0
        r.preemptions += 1
        r.est = len(self._lookup(r)[1]) * B
        self._wait_tokens += r.n_tokens - r.est
        self._waiting.appendleft(r)
        self.stats.preemptions += 1

    def _admit(self, r: _Req, budget: int, t: float, st: _Step) -> int:
        """Admit the head of the queue if its first chunk's blocks fit; returns the chunk (0: no)."""
        B = self.block_size
        touch, codes = self._lookup(r)
        hit = len(codes)
        hit_tok = hit * B
        chunk = min(r.n_tokens - hit_tok, budget)
        total = -(-(hit_tok + chunk) // B)
        n_gpu = codes.count(_GPU)
        new = total - n_gpu
        if new + touch > self._anon + len(self._free):
            return 0
        self._waiting.popleft()
        self._wait_tokens -= r.n_tokens - r.est
        keys = r.req.keys
        gpu = self._gpu
        free = self._free
        loads = [0, 0, 0, 0, 0]
        for i in range(hit):  # take the GPU hits out of the free queue before allocating
            code = codes[i]
            if code == _GPU:
                k = keys[i]
                c = gpu[k]
                if c == 0:
                    del free[k]
                gpu[k] = c + 1
            else:
                loads[code] += 1
        held = keys[:hit]
        if hit > n_gpu:
            tiers = (None, self._cpu, self._disk, self.pool, None)
            for i in range(hit):
                code = codes[i]
                if code != _GPU and code != _REMOTE:
                    tier = tiers[code]
                    assert tier is not None
                    if keys[i] in tier:
                        tier.hit(keys[i])
        self._alloc(new)
        if hit > n_gpu:
            # Loaded blocks are cached on GPU as they arrive; announce them as chains.
            sink = self.sink
            run: list[int] = []
            parent: int | None = None
            for i in range(hit):
                k = keys[i]
                if codes[i] == _GPU:
                    if run and sink is not None:
                        sink.stored(run, "gpu", parent)
                    run = []
                    continue
                if not run:
                    parent = keys[i - 1] if i > 0 else None
                gpu[k] = 1
                run.append(k)
            if run and sink is not None:
                sink.stored(run, "gpu", parent)
            fetch = self._fetch
            self._step_fetch_ms += (
                loads[1] * fetch[1] + loads[2] * fetch[2] + loads[3] * fetch[3] + loads[4] * fetch[4]
            )
            self.stats.transferred_blocks += loads[4]
            lb = self.stats.loaded_blocks
            lb["cpu"] += loads[1]
            lb["disk"] += loads[2]
            lb["shared"] += loads[3]
        r.keys_held = held
        r.blocks = hit
        r.n_computed = hit_tok
        self._running[r] = None
        self._prefilling.append(r)
        first = r.first_sched is None
        if first:
            r.first_sched = t
        if r.first_token_at is None:
            r.cached = {
                "gpu": n_gpu * B,
                "cpu": loads[1] * B,
                "disk": loads[2] * B,
                "shared": loads[3] * B,
            }
            if first:
                r.first_cached = r.cached
        s = self.stats
        s.admissions += 1
        s.queried_tokens += r.n_tokens
        ht = s.hit_tokens
        ht["gpu"] += n_gpu * B
        ht["cpu"] += loads[1] * B
        ht["disk"] += loads[2] * B
        ht["shared"] += loads[3] * B
        self._schedule_chunk(r, chunk, total - hit, st)
        return chunk

    # -- completions --------------------------------------------------------------------------

    def _prefill_done(self, r: _Req, t: float) -> None:
        self._prefilling.remove(r)
        kv = r.n_tokens
        r.gen += 1
        if r.first_token_at is None:
            r.first_token_at = t
            first_sched = r.first_sched if r.first_sched is not None else t
            hit = sum(r.cached.values())
            self._samples.append((r.P, hit, (t - first_sched) * 1000.0))
            self._out.append(self._completion(r, "first_token", None))
            self.stats.first_tokens += 1
        if r.gen >= r.O:
            self._finish(r, t, r.blocks)
        else:
            self._dec_add(r, kv)

    def _finish_decoders(self, t: float) -> None:
        D = self._D
        heap = self._heap
        B = self.block_size
        while heap and heap[0][0] <= D:
            _, dec_id, r = heapq.heappop(heap)
            if not (r.decoding and r.dec_id == dec_id):
                continue
            blocks = -(-(r.u + D) // B)
            r.gen = r.g0 + D - r.d0
            self._dec_remove(r)
            self._finish(r, t, blocks)

    def _finish(self, r: _Req, t: float, blocks: int) -> None:
        del self._running[r]
        self._release(r, blocks)
        self._out.append(self._completion(r, "finished", t))
        self.stats.finished += 1

    def _completion(self, r: _Req, kind: Literal["first_token", "finished"], t: float | None) -> Completion:
        assert r.first_token_at is not None and r.first_sched is not None
        return Completion(
            request=r.req,
            engine=self.name,
            kind=kind,
            first_token_at=r.first_token_at,
            cached_tokens=r.cached,
            computed_tokens=r.computed,
            queued_s=r.first_sched - r.submitted,
            prefill_s=r.first_token_at - r.first_sched,
            finished_at=t,
            preemptions=r.preemptions,
            first_cached_tokens=r.first_cached,
        )

    # -- checks (tests) -----------------------------------------------------------------------

    def check(self) -> None:
        """Assert the internal invariants (block accounting, ref counts); for tests."""
        B = self.block_size
        # A planned (not a run) step has already allocated its decoders' next blocks.
        D = self._D + 1 if self._step is not None and not self._step.run else self._D
        refs: dict[int, int] = {}
        used = 0  # physical blocks: each request's blocks without a key, plus every key in use once
        for r in self._running:
            blocks = -(-(r.u + D) // B) if r.decoding else r.blocks
            assert len(r.keys_held) <= blocks, (r.req.id, len(r.keys_held), blocks)
            used += blocks - len(r.keys_held)
            for k in r.keys_held:
                refs[k] = refs.get(k, 0) + 1
        used += len(refs)
        assert used == self.cfg.gpu_blocks - self._anon - len(self._free), "block accounting"
        assert self._need(D) == sum(-(-(r.u + D) // B) for r in self._running if r.decoding)
        for k, c in self._gpu.items():
            assert c == refs.get(k, 0), ("ref count", k, c, refs.get(k, 0))
            assert (c == 0) == (k in self._free), ("free queue", k)
        assert len(self._free) <= self.cfg.gpu_blocks
        assert self._dn == sum(1 for r in self._running if r.decoding)
        assert self._anon >= 0
