"""Simulated engines of hybrid-attention models: one block set per KV-cache group, as vLLM 0.32 keeps them.

A hybrid model (Gemma 3, gpt-oss, Llama 4, Qwen3-Next, ...) has one KV-cache *group* per attention
type, all in one pool of blocks (docs/hybrid-vllm-findings.md has what the real engine does, with the
source references). ``HybridSimEngine`` is ``SimEngine`` with its blocks kept per group:

- **Pool.** ``EngineConfig.gpu_blocks`` counts (block, group) pairs. A running request holds a pair per
  group for every block it computes (vLLM allocates every group's blocks of a chunk; it frees a sliding
  window's older blocks as the request goes on, which this model does not: see README.md, Limits). Of
  a prefix hit it references what each group's lookup returned: full attention every block, a sliding
  window the blocks of its window, chunked local attention those of the chunk, Mamba the state block
  (the rest are vLLM's null blocks, no memory). Free pairs are reused without a key first, then cached
  ones least recently freed first; a request frees its groups in group order, each tail first, so
  group 0 loses its blocks first under pressure (as the real engine does).
- **Retention** (``prefix_cache_retention_interval`` 0, vLLM's default). Full attention and chunked local
  attention cache every full block. A sliding-window group caches only the ``ceil((window - 1) / B)``
  blocks ending at each of the request's boundaries, a Mamba group the one block ending there. The
  boundaries: the replay boundary (the prompt's last token, floored to a block) and, when the
  lookup found a longer hit in the first group looked up (full attention) than the final one, that
  longer hit (the shared-prefix junction: where a later prompt sharing this one's start resumes).
- **Hits** are ``kvindex.index.hybrid.hit_tokens`` over the engine's own group sets, the rule the index
  applies: the engine's truth and the index's prediction are computed the same way, from different
  data (the engine's blocks here, the events there).
- **Events** go to the sink per group (``stored(..., group=g)``); ``layout_wire(cfg)`` is what the
  worker announces in heartbeats (``Publisher.groups``).

GPU only: no CPU/disk tier, shared pool or disaggregated transfer (``ValueError`` when configured).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvindex.index.hybrid import CHUNKED, MAMBA, SLIDING, GroupLayout, hit_limit, hit_tokens, rule_hit
from kvindex.keys import group_mask
from kvindex.wire.groups import KIND_RULES, GroupSpec, LayoutError
from workers_shim.sim.engine import _GPU, EngineConfig, SimEngine, SimRequest, _Req, _Step
from workers_shim.sim.tiers import EventSink, SharedPool

__all__ = [
    "KV_GROUP_PRESETS",
    "HybridSimEngine",
    "OneGroupSink",
    "check_layout",
    "engine_lookup",
    "kept_blocks",
    "kept_span",
    "layout_wire",
    "new_engine",
    "parse_kv_groups",
    "referenced_from",
]

# Layouts by model family (``--kv-groups NAME``): the attention types in vLLM's group order, with
# the windows and chunks of the public configs. Groups of one spec are one group per run of layers
# in vLLM; one group per type and layer ratio here (the ratio is what matters for the pool).
KV_GROUP_PRESETS: dict[str, str] = {
    # Gemma 3: five sliding-window layers (1,024 tokens) per global layer.
    "gemma3": "sliding_window:1024x5,full_attention",
    # The tiny random Gemma 3 of the real-engine captures (3 sliding layers, window 64, + 1 global).
    "gemma3-tiny": "sliding_window:64x3,full_attention",
    # gpt-oss: sliding (128) and full attention alternating.
    "gpt-oss": "sliding_window:128,full_attention",
    # Llama 4: three chunked-local layers (8,192-token chunks) per global NoPE layer.
    "llama4": "chunked_local_attention:8192x3,full_attention",
    # Qwen3-Next: three gated-delta-net (linear attention, published as mamba) layers per full one.
    "qwen3-next": "mambax3,full_attention",
}

_ENTRY = re.compile(r"^([a-z_]+?)(?::(\d+))?(?:x(\d+))?$")


def parse_kv_groups(text: str, block_size: int) -> tuple[GroupSpec, ...]:
    """A preset name (``KV_GROUP_PRESETS``) or comma-separated groups ``KIND[:N][xCOUNT]``: N is a
    sliding window's or an attention chunk's tokens, COUNT how many groups of that spec (in order),
    e.g. ``sliding_window:64x3,full_attention``. ValueError says what is wrong."""
    spec = KV_GROUP_PRESETS.get(text.strip(), text)
    groups: list[GroupSpec] = []
    for raw in spec.split(","):
        entry = raw.strip()
        m = _ENTRY.match(entry)
        if m is None:
            raise ValueError(
                f"KV-cache group {entry!r}: expected KIND[:TOKENS][xCOUNT], e.g. sliding_window:64x3, "
                f"or a preset ({', '.join(sorted(KV_GROUP_PRESETS))})"
            )
        kind, param, count = m.group(1), int(m.group(2) or 0), int(m.group(3) or 1)
        rule = KIND_RULES.get(kind)
        if rule is None:
            raise ValueError(f"KV-cache group kind {kind!r}: one of {', '.join(sorted(KIND_RULES))}")
        if rule in (SLIDING, CHUNKED) and param < 1:
            what = "a window" if rule == SLIDING else "a chunk size"
            raise ValueError(f"KV-cache group {entry!r} needs {what}: {kind}:TOKENS")
        if rule not in (SLIDING, CHUNKED) and param:
            raise ValueError(f"KV-cache group {entry!r}: {kind} takes no token count")
        if count < 1:
            raise ValueError(f"KV-cache group {entry!r}: count must be >= 1")
        window = param if rule == SLIDING else 0
        chunk = param if rule == CHUNKED else 0
        groups.extend(GroupSpec(kind, block_size, window, chunk) for _ in range(count))
    try:
        GroupLayout(groups, block_size)
    except LayoutError as exc:
        raise ValueError(f"KV-cache groups {text!r}: {exc}") from None
    return tuple(groups)


def check_layout(cfg: EngineConfig, layout: GroupLayout) -> None:
    """ValueError when a hybrid engine cannot simulate ``cfg``."""
    if not layout.understood:
        raise ValueError(f"KV-cache groups: {layout.why}")
    if cfg.cpu_blocks or cfg.disk_blocks:
        raise ValueError("a hybrid engine (kv_groups) has no CPU or disk tier")


def layout_wire(cfg: EngineConfig) -> list[dict[str, Any]] | None:
    """What the engine's worker announces in heartbeats (``Publisher.groups``); None when not hybrid."""
    layout = cfg.layout()
    return None if layout is None else layout.to_wire()


def new_engine(
    name: str, cfg: EngineConfig, sink: EventSink | None = None, pool: SharedPool | None = None
) -> SimEngine:
    """The engine ``cfg`` describes: hybrid when it has KV-cache groups, else the plain one."""
    if cfg.layout() is not None:
        return HybridSimEngine(name, cfg, sink, pool)
    return SimEngine(name, cfg, sink, pool)


def kept_span(spec: GroupSpec, block_size: int) -> int | None:
    """The blocks a group caches ending at each boundary (retention interval 0): a sliding window's
    ``ceil((window - 1) / B)``, a Mamba state's one; None: every full block (full attention, chunked
    local attention)."""
    if spec.rule == SLIDING:
        return -(-(spec.window - 1) // block_size)
    if spec.rule == MAMBA:
        return 1
    return None


def kept_blocks(span: int, bounds: tuple[int, ...], lo: int, hi: int) -> set[int]:
    """Of blocks lo..hi-1, those a group of ``span`` caches: the ``span`` blocks ending at each
    boundary (a block count: the replay boundary, the shared-prefix junction)."""
    return {j for b in bounds for j in range(max(lo, b - span), min(hi, b))}


def referenced_from(spec: GroupSpec, block_size: int, hit: int) -> int:
    """The first block of a hit of ``hit`` blocks that a group of ``spec`` references (what its
    lookup returned: a window, a chunk, a state; the blocks before it are vLLM's null blocks)."""
    span = kept_span(spec, block_size)
    if span is not None:
        return max(0, hit - span)
    if spec.rule == CHUNKED:
        return hit * block_size // spec.chunk * spec.chunk // block_size
    return 0


def engine_lookup(layout: GroupLayout, held: Callable[[int, int], bool], limit: int) -> tuple[int, int]:
    """(blocks the engine reuses of a prompt whose hit may reach ``limit`` tokens, blocks of the first
    group looked up's own hit: full attention's leading run, or the first rule's), ``held(group,
    block)`` saying what each group holds. The second is the shared-prefix junction when longer."""
    B = layout.block_size
    if limit < B:
        return 0, 0
    hit = hit_tokens(layout, held, limit) // B
    if layout.primary is None:
        first_rule = layout.rules[0]
        members = first_rule.members
        first = rule_hit(first_rule, lambda j: all(held(g, j) for g in members), limit, B) // B
    else:
        primary = layout.primary
        n = limit // B
        first = 0
        while first < n and held(primary, first):
            first += 1
    return hit, first


class OneGroupSink:
    """Forwards one KV-cache group's events as group 0 and drops the others: what an index that
    follows a single group sees (``kvshim --kv-group N`` before hybrid support, e.g. only the
    full-attention group, which promises hits the sliding-window groups cannot serve)."""

    def __init__(self, sink: EventSink, group: int) -> None:
        self.sink = sink
        self.group = group

    def stored(self, keys: list[int], tier: str = "gpu", parent: int | None = None, group: int = 0) -> int:
        return self.sink.stored(keys, tier, parent) if group == self.group else 0

    def removed(self, keys: list[int], tier: str = "gpu", group: int = 0) -> int:
        return self.sink.removed(keys, tier) if group == self.group else 0

    def cleared(self, tier: str | None = None) -> int:
        return self.sink.cleared(tier)


class HybridSimEngine(SimEngine):
    """``SimEngine`` with one block set per KV-cache group (the module's doc)."""

    def __init__(
        self, name: str, cfg: EngineConfig, sink: EventSink | None = None, pool: SharedPool | None = None
    ) -> None:
        layout = cfg.layout()
        if layout is None:
            raise ValueError("HybridSimEngine needs a config with hybrid KV-cache groups")
        if pool is not None:
            raise ValueError("a hybrid engine has no shared pool")
        super().__init__(name, cfg, sink, None)
        self.layout = layout
        B = cfg.block_size
        G = len(layout.groups)
        self._G = G
        self._hg: list[dict[int, int]] = [{} for _ in range(G)]  # per group: key -> ref count
        self._free: OrderedDict[tuple[int, int], None] = OrderedDict()  # type: ignore[assignment]
        self._dnull = 0  # the decoders' null pairs (SimEngine._need counts blocks of every group)
        self._masks = [group_mask(g) for g in range(G)]
        # Per group: the blocks it keeps ending at each boundary (None: every block), and what it
        # references of a hit of h blocks: the blocks from ref_start(h).
        self._span = tuple(kept_span(spec, B) for spec in layout.groups)
        # Groups that free a running request's older blocks, with the blocks left behind once n
        # tokens are computed (vLLM's get_num_skipped_tokens; a Mamba state as a one-token window).
        skips: list[tuple[int, Any]] = []
        for g, spec in enumerate(layout.groups):
            if spec.rule == SLIDING:
                skips.append((g, lambda n, w=spec.window: max(0, n - w + 1) // B))
            elif spec.rule == MAMBA:
                skips.append((g, lambda n: n // B))
            elif spec.rule == CHUNKED:
                skips.append((g, lambda n, c=spec.chunk: n // c * c // B))
        self._skips = tuple(skips)

    # -- hits ---------------------------------------------------------------------------------

    def cached_tokens(self, req: SimRequest) -> int:
        """The prefix (tokens) of ``req``'s prompt the engine would reuse now (its truth)."""
        return self._hits(req.keys, req.prompt_tokens)[0] * self.block_size

    def _match(self, r: _Req) -> tuple[int, int]:
        return self._hits(r.req.keys, r.n_tokens)

    def _hits(self, keys: list[int], n_tokens: int) -> tuple[int, int]:
        """(blocks the engine reuses of a prompt of ``n_tokens`` with these block keys, blocks of
        the first group's own hit)."""
        limit = min(hit_limit(n_tokens), len(keys) * self.block_size)
        hg = self._hg
        return engine_lookup(self.layout, lambda g, j: keys[j] in hg[g], limit)

    def _hit(self, r: _Req) -> tuple[int, int, list[int], int]:
        """(hit blocks, junction blocks (0: none), each group's first referenced block, how many
        referenced pairs are free)."""
        h, first = self._match(r)
        B = self.block_size
        starts = [referenced_from(spec, B, h) for spec in self.layout.groups]
        touch = 0
        if h:
            keys = r.req.keys
            for d, lo in zip(self._hg, starts, strict=True):
                for j in range(lo, h):
                    if d[keys[j]] == 0:
                        touch += 1
        return h, (first if first > h else 0), starts, touch

    def _lookup(self, r: _Req) -> tuple[int, list[int]]:
        # Only the hit's length is asked of it here (queued requests' estimates).
        return 0, [_GPU] * self._match(r)[0]

    # -- admission and blocks -----------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        if req.remote_blocks:
            raise ValueError(f"request {req.id}: a hybrid engine takes no transferred blocks")
        super().submit(req, now)

    def _head_admissible(self) -> bool:
        cfg = self.cfg
        if len(self._running) >= cfg.max_running:
            return False
        budget = cfg.max_batched_tokens - self._dn
        if budget <= 0:
            return False
        B = self.block_size
        r = self._waiting[0]
        h, _junction, _starts, touch = self._hit(r)
        chunk = min(r.n_tokens - h * B, budget)
        new = (-(-(h * B + chunk) // B) - h) * self._G
        free = self._anon + len(self._free) - (self._need(self._D + 1) - self._need(self._D))
        return new + touch <= free

    def _admit(self, r: _Req, budget: int, t: float, st: _Step) -> int:
        B = self.block_size
        G = self._G
        h, junction, starts, touch = self._hit(r)
        hit_tok = h * B
        chunk = min(r.n_tokens - hit_tok, budget)
        total = -(-(hit_tok + chunk) // B)
        new = (total - h) * G
        if new + touch > self._anon + len(self._free):
            return 0
        self._waiting.popleft()
        self._wait_tokens -= r.n_tokens - r.est
        free = self._free
        keys = r.req.keys
        for g, (d, lo) in enumerate(zip(self._hg, starts, strict=True)):
            for j in range(lo, h):  # out of the free queue before allocating
                k = keys[j]
                c = d[k]
                if c == 0:
                    del free[(g, k)]
                d[k] = c + 1
        self._alloc(new)
        r.gheld = [list(range(lo, h)) for lo in starts]
        r.lo = starts
        r.null = sum(starts)
        r.blocks = h
        r.n_computed = hit_tok
        replay = (r.P - 1) // B
        r.bounds = (replay, junction) if junction and junction != replay else (replay,)
        self._running[r] = None
        self._prefilling.append(r)
        first = r.first_sched is None
        if first:
            r.first_sched = t
        if r.first_token_at is None:
            r.cached = {"gpu": hit_tok, "cpu": 0, "disk": 0, "shared": 0}
            if first:
                r.first_cached = r.cached
        s = self.stats
        s.admissions += 1
        s.queried_tokens += r.n_tokens
        s.hit_tokens["gpu"] += hit_tok
        self._schedule_chunk(r, chunk, total - h, st)
        return chunk

    def _register(self, r: _Req, lo: int, hi: int, written: list[tuple[list[int], int | None]]) -> None:
        """Prompt blocks lo..hi-1 of ``r`` become full: each group caches those it keeps (a key the
        group already holds stays an uncached duplicate) and announces them with their parent."""
        keys = r.req.keys
        sink = self.sink
        kept: dict[int, set[int]] = {}
        for g, (d, held, span) in enumerate(zip(self._hg, r.gheld, self._span, strict=True)):
            if span is not None:
                keep = kept.get(span)
                if keep is None:
                    keep = kept[span] = kept_blocks(span, r.bounds, lo, hi)
                if not keep:
                    continue
            run: list[int] = []
            parent = keys[lo - 1] if lo > 0 else None
            for j in range(lo, hi):
                k = keys[j]
                if (span is not None and j not in keep) or k in d:  # type: ignore[operator]
                    if run and sink is not None:
                        sink.stored(run, "gpu", parent, group=g)
                    run = []
                    parent = k
                    continue
                d[k] = 1
                held.append(j)
                run.append(k)
            if run and sink is not None:
                sink.stored(run, "gpu", parent, group=g)

    def _release(self, r: _Req, nblocks: int) -> None:
        """Free a request's pairs: its groups in group order, each tail first (vLLM's order)."""
        held = r.gheld
        self._anon += self._G * nblocks - r.null - sum(len(js) for js in held)
        free = self._free
        keys = r.req.keys
        for g, (d, js) in enumerate(zip(self._hg, held, strict=True)):
            for j in reversed(js):
                k = keys[j]
                c = d[k] - 1
                d[k] = c
                if c == 0:
                    free[(g, k)] = None
        r.gheld = [[] for _ in range(self._G)]
        r.lo = [0] * self._G
        r.null = 0

    def _skip(self, r: _Req, computed: int) -> None:
        """vLLM's ``remove_skipped_blocks``: the blocks a sliding window (or a chunk, or a Mamba
        state) has left behind once ``computed`` tokens are computed go back to the pool, the
        cached ones to the free queue (last first), the others reused first."""
        keys = r.req.keys
        free = self._free
        lo = r.lo
        for g, skips in self._skips:
            upto = min(skips(computed), r.blocks)
            start = lo[g]
            if upto <= start:
                continue
            held = r.gheld[g]
            n = 0
            while n < len(held) and held[n] < upto:
                n += 1
            d = self._hg[g]
            for j in reversed(held[:n]):
                k = keys[j]
                c = d[k] - 1
                d[k] = c
                if c == 0:
                    free[(g, k)] = None
            del held[:n]
            self._anon += upto - start - n
            lo[g] = upto
            r.null += upto - start

    def _plan_step(self, t: float) -> None:
        if self._skips:
            for r in self._prefilling:
                if r.n_computed:
                    self._skip(r, r.n_computed)
        super()._plan_step(t)

    def _alloc(self, n: int) -> None:
        """Take ``n`` free pairs: those without a key first, then the least recently freed cached
        ones, evicted (announced per group, in eviction order)."""
        n = self._take_anonymous(n)
        if n <= 0:
            return
        free = self._free
        hg = self._hg
        evicted = [free.popitem(last=False)[0] for _ in range(n)]
        self.stats.gpu_evictions += n
        sink = self.sink
        run: list[int] = []
        run_g = -1
        for g, k in evicted:
            del hg[g][k]
            if g != run_g and run and sink is not None:
                sink.removed(run, "gpu", group=run_g)
                run = []
            run_g = g
            run.append(k)
        if run and sink is not None:
            sink.removed(run, "gpu", group=run_g)

    # -- decoders: their pairs are G per block less their null pairs --------------------------

    def _need(self, D: int) -> int:
        return self._G * SimEngine._need(self, D) - self._dnull

    def _dec_add(self, r: _Req, kv: int) -> None:
        if self._skips:
            self._skip(r, kv)  # (vLLM: at the first decode step's allocation)
        super()._dec_add(r, kv)
        self._dnull += r.null

    def _dec_remove(self, r: _Req) -> None:
        super()._dec_remove(r)
        self._dnull -= r.null

    # -- state --------------------------------------------------------------------------------

    def holds(self, tier: str = "gpu") -> set[int]:
        """Ground truth as group keys (``kvindex.keys.group_key``: what the publisher and the index
        keep); ``holds_groups()`` has the plain keys per group."""
        if tier == "gpu":
            return {k ^ mask for d, mask in zip(self._hg, self._masks, strict=True) for k in d}
        if tier in ("cpu", "disk", "shared"):
            return set()
        raise ValueError(f"unknown tier {tier!r}")

    def holds_groups(self) -> list[set[int]]:
        """The block keys each KV-cache group holds, in group order."""
        return [set(d) for d in self._hg]

    def reset_prefix_cache(self, tiers: tuple[str, ...] = ("gpu",)) -> bool:
        if self._running:
            return False
        if "gpu" in tiers:
            self._anon += len(self._free)
            self._free.clear()
            for d in self._hg:
                d.clear()
            if self.sink is not None:
                self.sink.cleared("gpu")
        return True

    def check(self) -> None:
        B = self.block_size
        G = self._G
        D = self._D + 1 if self._step is not None and not self._step.run else self._D
        refs: list[dict[int, int]] = [{} for _ in range(G)]
        used = 0
        for r in self._running:
            blocks = -(-(r.u + D) // B) if r.decoding else r.blocks
            pairs = G * blocks - r.null
            n_held = sum(len(js) for js in r.gheld)
            assert n_held <= pairs and r.null == sum(r.lo), (r.req.id, n_held, pairs)
            used += pairs - n_held
            for g, js in enumerate(r.gheld):
                assert js == sorted(js) and (not js or js[0] >= r.lo[g]), ("held blocks", r.req.id, g)
                for j in js:
                    k = r.req.keys[j]
                    refs[g][k] = refs[g].get(k, 0) + 1
        used += sum(len(x) for x in refs)
        assert used == self.cfg.gpu_blocks - self._anon - len(self._free), "pair accounting"
        assert self._need(D) == sum(G * -(-(r.u + D) // B) - r.null for r in self._running if r.decoding), (
            "decoders' pairs"
        )
        zero = 0
        for g, d in enumerate(self._hg):
            for k, c in d.items():
                assert c == refs[g].get(k, 0), ("ref count", g, k, c, refs[g].get(k, 0))
                assert (c == 0) == ((g, k) in self._free), ("free queue", g, k)
                zero += c == 0
        assert zero == len(self._free)
        assert self._dn == sum(1 for r in self._running if r.decoding)
        assert self._anon >= 0
