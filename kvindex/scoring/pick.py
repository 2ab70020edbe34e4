"""The pick: which of a ranking's candidates a request is sent to, applied after the ranking.

A policy ranks (``Ranker.score``); the pick turns the ranking into a probability per candidate and
draws one. ``best`` is the policy's first choice (deterministic). ``softmax`` spreads requests over
the candidates whose estimated TTFT is close to it:

    w_i = exp(-(est_i - est_0) / (T * max(work_0, 1 ms)))     p_i = w_i / sum(w)

``est_0`` is the estimate of the policy's first choice, ``work_0`` its own prefill + fetch time (the
compute the request needs there) and ``T`` the temperature: a candidate slower by ``T`` x that work
gets 1/e of the first choice's share, ``T`` = 0 is the first choice. The scale is the request's work,
not its whole estimate: under load the estimate is mostly queue, and a fraction of it would be
several prefills, so a draw would hand cache hits away for misses and cut the fleet's throughput
(measured: benchmarks/README.md "Picking"). Candidates the policy ranked below its first choice
although their estimate is lower (a placement rule preferred a cache holder over a faster instance
without the prefix) are not eligible: the pick spreads load, it does not undo a placement. NVIDIA
Dynamo's ``--router-temperature`` divides by the candidates' spread (max - min) instead; here one
very slow candidate does not flatten everyone else's weights, a candidate several prefills slower
never gets a fixed share just for being in the list, and the weights do not depend on how many
candidates are listed (a top_k cut only drops the tail's small weights).

Warm-up ramp (``warmup`` seconds > 0): an instance first seen ``age`` seconds ago, in a fleet whose
oldest instance is ``age_0`` old, keeps ``r = min(1, age / warmup) / min(1, age_0 / warmup)`` of the
probability it would have; what it gives up goes to the fully warm candidates in proportion to their
probabilities (to the first warm one in rank order when they have none: the ``best`` pick). A new
instance's share so grows linearly from 0 to its full share over ``warmup`` seconds, in both pick
modes; a fleet that starts together (an index restart) is not ramped.

The draw is reproducible: one uniform ``u`` from a 64-bit seed (``u = splitmix64(seed) >> 11 /
2^53``); the seed is the request's ``pick_seed`` when given, else derived from the router's seed and
the request id (``blake2b-64("<seed>/<request_id>")``: the same on every replica and in a replay of
an event log), else drawn from the router's own seeded generator. The candidate picked is the first
whose cumulative probability (in rank order) exceeds ``u``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvindex.fleet.registry import Registry
from kvindex.scoring.base import Choice

BEST = "best"
SOFTMAX = "softmax"
PICKS = (BEST, SOFTMAX)

MIN_SCALE_MS = 1.0  # the softmax's scale never drops below this (an estimate of ~0: a full hit, idle)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class PickOptions:
    """How one request's candidate is drawn; ``seed`` None: derived (module docstring)."""

    mode: str = BEST
    temperature: float = 0.0
    seed: int | None = None


@dataclass(slots=True)
class PickResult:
    mode: str
    temperature: float
    seed: int  # the draw's seed (0 when nothing was drawn)
    draw: float  # u in [0, 1) (0 when nothing was drawn)
    # Per choice of the returned ranking (picked first), its probability of being picked.
    probabilities: list[float] = field(default_factory=list)
    drawn: bool = False  # a random draw decided (not every probability was 0 or 1)
    rank: int = 0  # the picked choice's position in the policy's ranking


def check_options(mode: str, temperature: float) -> None:
    """ValueError naming what is wrong (the API turns it into INVALID_ARGUMENT)."""
    if mode not in PICKS:
        raise ValueError(f"pick must be one of {', '.join(PICKS)}; got {mode!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0; got {temperature!r}")


def seed_for(router_seed: int, request_id: str) -> int:
    """The draw's seed for a request id: a hash, so every replica and a replay derive the same."""
    digest = hashlib.blake2b(f"{router_seed}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(seed: int) -> float:
    """u in [0, 1) from a 64-bit seed (splitmix64's output function: any tool can recompute it)."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def softmax(est: Sequence[float], temperature: float, work: float | None = None) -> list[float]:
    """Probabilities over candidates in rank order (``est[0]``: the policy's first choice), on the
    scale ``temperature`` x ``work`` (the first choice's own prefill + fetch; default its estimate)."""
    n = len(est)
    if n == 0:
        return []
    out = [0.0] * n
    if temperature <= 0 or n == 1:
        out[0] = 1.0
        return out
    ref = est[0]
    scale = temperature * max(ref if work is None else work, MIN_SCALE_MS)
    for i, e in enumerate(est):
        if i == 0 or e >= ref:  # a lower estimate ranked below the first choice: a placement rule
            out[i] = math.exp(-(e - ref) / scale)
    total = sum(out)
    return [w / total for w in out]


def ramp_weight(age: float, fleet_age: float, warmup: float) -> float:
    """The share an instance ``age`` seconds old keeps, in a fleet whose oldest is ``fleet_age``."""
    if warmup <= 0:
        return 1.0
    full = min(1.0, fleet_age / warmup)
    if full <= 0:
        return 1.0
    return max(0.0, min(1.0, min(1.0, age / warmup) / full))


def ramped(probabilities: Sequence[float], ramp: Sequence[float]) -> list[float]:
    """``probabilities`` with each warming candidate keeping ``ramp[i]`` of its own; the rest goes to
    the warm ones (``ramp`` 1) in proportion to theirs, or to the first warm one in rank order."""
    p = list(probabilities)
    lost = 0.0
    for i, r in enumerate(ramp):
        if r < 1.0 and p[i] > 0.0:
            lost += p[i] * (1.0 - r)
            p[i] *= r
    if lost <= 0.0:
        return p
    warm = [i for i, r in enumerate(ramp) if r >= 1.0]
    if not warm:  # every candidate is warming: their relative shares, or as they were
        total = sum(p)
        return [x / total for x in p] if total > 0 else list(probabilities)
    mass = sum(p[i] for i in warm)
    if mass > 0.0:
        for i in warm:
            p[i] += lost * p[i] / mass
    else:
        p[warm[0]] += lost
    return p


def choose(probabilities: Sequence[float], u: float) -> int:
    """The first candidate whose cumulative probability exceeds ``u`` (the last with any, past it)."""
    acc = 0.0
    last = 0
    for i, p in enumerate(probabilities):
        if p <= 0.0:
            continue
        last = i
        acc += p
        if u < acc:
            return i
    return last


class FleetAge:
    """Per model, when its instances were first seen (sorted), for the ramp: recomputed only when
    the registry's membership changed (an instance added or removed), never per request."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._seen: dict[str, tuple[int, list[float]]] = {}  # model -> (membership, first_seen sorted)

    def first_seen(self, model: str) -> list[float]:
        membership = self.registry.membership
        cached = self._seen.get(model)
        if cached is None or cached[0] != membership:
            seen = sorted(s.first_seen for s in self.registry.members(model).values())
            cached = self._seen[model] = (membership, seen)
        return cached[1]

    def oldest(self, model: str) -> float | None:
        seen = self.first_seen(model)
        return seen[0] if seen else None

    def warming(self, model: str, now: float, warmup: float) -> int:
        """How many of the model's instances a ramp of ``warmup`` s holds back now."""
        seen = self.first_seen(model)
        if not seen or warmup <= 0:
            return 0
        # ramp_weight < 1 exactly when age < min(warmup, the fleet's age).
        horizon = now - min(warmup, now - seen[0])
        return len(seen) - bisect.bisect_right(seen, horizon)


class Picker:
    """The pick step of one router: options resolved against its defaults, seeds, the ramp."""

    def __init__(self, registry: Registry, seed: int, mode: str, temperature: float, warmup: float) -> None:
        check_options(mode, temperature)
        if not math.isfinite(warmup) or warmup < 0:
            raise ValueError(f"warm-up must be a finite number of seconds >= 0; got {warmup!r}")
        self.registry = registry
        self.seed = seed
        self.default = PickOptions(mode, temperature)
        self.warmup = warmup
        self.fleet = FleetAge(registry)
        # Requests without an id or a seed: drawn from here (seeded, but order-dependent).
        self._rng = random.Random(seed ^ 0x5EED)

    def getstate(self) -> object:
        """The generator's state (``setstate`` puts it back: an Explain draws without consuming)."""
        return self._rng.getstate()

    def setstate(self, state: object) -> None:
        self._rng.setstate(state)  # type: ignore[arg-type]

    def options(self, mode: str | None, temperature: float | None, seed: int | None) -> PickOptions:
        """The request's options over the defaults (ValueError when they make no sense)."""
        mode = mode or self.default.mode
        if temperature is None:
            temperature = self.default.temperature if mode == SOFTMAX else 0.0
        elif mode != SOFTMAX:
            raise ValueError(f"temperature applies to pick {SOFTMAX!r}, not {mode!r}")
        check_options(mode, temperature)
        return PickOptions(mode, temperature, seed)

    def extra(self, model: str, now: float) -> int:
        """Candidates to rank beyond a ``top_k`` so that the share a warming instance gives up has a
        warm candidate to go to (the ``top_k`` could all be new, idle instances): one per instance
        warming up."""
        return self.fleet.warming(model, now, self.warmup) if self.warmup > 0 else 0

    def needed(self, options: PickOptions) -> bool:
        """Whether the pick can differ from the policy's first choice."""
        return (options.mode == SOFTMAX and options.temperature > 0) or self.warmup > 0

    def pick(
        self, model: str, request_id: str, choices: list[Choice], options: PickOptions, now: float
    ) -> tuple[list[Choice], PickResult]:
        """``choices`` with the picked one first (the others in rank order) and how it was drawn."""
        est = [c.candidate.est_ttft_ms for c in choices]
        if options.mode == SOFTMAX:
            first = choices[0].candidate
            probabilities = softmax(est, options.temperature, first.prefill_ms + first.fetch_ms)
        else:
            probabilities = [1.0] + [0.0] * (len(choices) - 1)
        if self.warmup > 0:
            oldest = self.fleet.oldest(model)
            fleet_age = now - oldest if oldest is not None else 0.0
            ramp = [ramp_weight(now - c.candidate.state.first_seen, fleet_age, self.warmup) for c in choices]
            if any(r < 1.0 for r in ramp):
                probabilities = ramped(probabilities, ramp)
        result = PickResult(options.mode, options.temperature, 0, 0.0)
        picked = 0
        if sum(1 for p in probabilities if p > 0.0) > 1:
            seed = options.seed
            if seed is None:
                seed = seed_for(self.seed, request_id) if request_id else self._rng.getrandbits(64)
            result.seed = seed
            result.draw = uniform(seed)
            result.drawn = True
            picked = choose(probabilities, result.draw)
        else:
            picked = next((i for i, p in enumerate(probabilities) if p > 0.0), 0)
        if picked:
            choices = [choices[picked], *choices[:picked], *choices[picked + 1 :]]
            probabilities = [probabilities[picked], *probabilities[:picked], *probabilities[picked + 1 :]]
        result.probabilities = probabilities
        result.rank = picked
        return choices, result
