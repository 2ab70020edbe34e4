"""Online calibration of the prefill model, per model and per instance, from measured prefills.

Each sample is (prompt tokens L, cached tokens, measured prefill ms). Samples come from workers'
heartbeats (engines' own prefill times: the simulator, ``kvshim vllm`` from vLLM's prefill-time
histogram) and from routers' reports (measured TTFT minus the wait the index predicted). The fit is
least squares of ``ms ~ a + b*miss + c*miss*L`` with exponential forgetting (recent samples weigh
more, so the model follows load and software changes) kept as 3x3 normal equations: bounded memory
however many samples arrive. A weak ridge prior toward the default model keeps early fits sane, and
coefficients are kept non-negative.

Two levels: every sample feeds the model's shared fit (all its instances) and the instance's own.
Which one ranks an instance (``Calibrator.status``):

- the configured default until the shared fit has ``min_samples`` samples and, over the samples
  after them, a root mean squared error below ``accept_ratio`` x the default's on the same samples,
  by more than noise (a paired test of the per-sample differences);
- then the shared fit, unless the instance's own fit passes the same test against the shared fit
  and the default with ``INSTANCE_ACCEPT_RATIO`` (a worker on other hardware, another engine
  version): then its own.

Errors are prequential (each sample is predicted before it is added), judged in squared ms (the
fit's own objective) averaged over about the fit's memory (``error_alpha``); a fit in use is given
up only when clearly worse (``_worse``), so the choice does not flip with the load. Operators see
the mean ``|ln(predicted / measured)|``. A fit that predicts worse than what it would replace is
never used, however many samples it has.

The state serialises to small dicts so it can be persisted and shared (a NATS KV bucket; see
kvindex/service) and a restarted index or a second replica starts calibrated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvindex.scoring.costs import DEFAULT_PREFILL, CostConfig, PrefillModel

# Feature scales so that the normal equations are well conditioned: miss in thousands of tokens,
# miss*L in tens of millions.
_SCALE = np.array([1.0, 1e-3, 1e-7])

# Routers' reports are prefill samples when the wait the index predicted is at most this share of the
# measured TTFT (Calibrator.add_reported).
REPORT_WAIT_SHARE = 0.1

# An instance's own fit must halve the shared fit's error on its samples: an engine that differs
# (other hardware, another version) does that easily, while the instances of a homogeneous fleet
# differ mostly by their load, which the wait term already prices (a fit per busy instance would
# count it twice: measured in the routing simulation, it unbalanced the fleet).
INSTANCE_ACCEPT_RATIO = 0.5

# Where the model ranking an instance comes from (InstanceInfo.prefill.source).
DEFAULT = "default"
SHARED = "model"
OWN = "instance"


def log_error(model: PrefillModel, miss: float, prompt: float, ms: float) -> float | None:
    """|ln(predicted / measured)|; None when the model predicts nothing (no missed token)."""
    predicted = model.ms(miss, prompt)
    if predicted <= 0 or ms <= 0:
        return None
    return abs(math.log(predicted / ms))


@dataclass
class ModelCalibration:
    forgetting: float = 0.998  # per sample: ~500 samples of memory
    prior_weight: float = 0.1  # in samples' worth, toward the prior model (just enough to stay solvable)
    min_samples: int = 20
    prior: PrefillModel = DEFAULT_PREFILL
    # The comparison with the model this fit would replace: errors of both on the same samples,
    # counted from min_samples on (a fit on fewer is not a candidate): a plain mean over the first
    # 1 / error_alpha, then exponentially weighted with about the fit's own memory (the fit is judged
    # on what it learned from; a short window follows every change of load and flips the choice).
    error_alpha: float = 0.005
    min_scored: int = 10
    accept_ratio: float = 0.9  # the fit must be this much better to replace the other
    z: float = 2.0  # ... and its per-sample advantage this many standard errors below 0
    ata: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    atb: np.ndarray = field(default_factory=lambda: np.zeros(3))
    samples: int = 0
    updated: float = 0.0
    # Shown to operators: recent mean |ln(pred/measured)|, of this fit, of the model it is judged
    # against and of the prior (the default), on the same samples.
    error_fit: float = 0.0
    error_base: float = 0.0
    error_prior: float = 0.0
    scored: int = 0  # samples both were judged on
    # The judgement uses the fit's own objective, squared errors in ms: mean squares of the three,
    # and the per-sample difference (fit's - base's), its mean and mean square: a paired test, so
    # that noise between two similar fits (the instances of a homogeneous fleet) decides nothing.
    square_fit: float = 0.0
    square_base: float = 0.0
    square_prior: float = 0.0
    diff_mean: float = 0.0
    diff_square: float = 0.0
    # Whether the fit is used: taken up by ``_better``, given up only when it is clearly worse than
    # what it replaced (``_worse``); between the two it stays as it is, so that the model in use does
    # not flip with every sample (measured: 41 flips in one simulated run without this band).
    in_use: bool = False
    _fit: PrefillModel | None = None

    def add(
        self, prompt_tokens: float, cached_tokens: float, ms: float, base: PrefillModel | None = None
    ) -> bool:
        """Add one sample; False (ignored) when it is not usable. ``base``: the model this fit is
        judged against besides the prior (default: the prior alone)."""
        miss = prompt_tokens - cached_tokens
        if not (prompt_tokens > 0 and 0 <= miss <= prompt_tokens and 0 < ms < 3_600_000):
            return False
        if self.samples >= self.min_samples:
            fit, other = self.fit(), base or self.prior
            mine = log_error(fit, miss, prompt_tokens, ms)
            prior = log_error(self.prior, miss, prompt_tokens, ms)
            theirs = log_error(other, miss, prompt_tokens, ms)
            if mine is not None and theirs is not None and prior is not None:
                sq_fit = (fit.ms(miss, prompt_tokens) - ms) ** 2
                sq_base = (other.ms(miss, prompt_tokens) - ms) ** 2
                sq_prior = (self.prior.ms(miss, prompt_tokens) - ms) ** 2
                d = sq_fit - sq_base
                # A plain mean over the first 1 / error_alpha samples, then exponential weights.
                alpha = max(self.error_alpha, 1 / (self.scored + 1))
                self.error_fit += alpha * (mine - self.error_fit)
                self.error_base += alpha * (theirs - self.error_base)
                self.error_prior += alpha * (prior - self.error_prior)
                self.square_fit += alpha * (sq_fit - self.square_fit)
                self.square_base += alpha * (sq_base - self.square_base)
                self.square_prior += alpha * (sq_prior - self.square_prior)
                self.diff_mean += alpha * (d - self.diff_mean)
                self.diff_square += alpha * (d * d - self.diff_square)
                self.scored += 1
                self.in_use = not self._worse() if self.in_use else self._better()
        x = np.array([1.0, miss, miss * prompt_tokens]) * _SCALE
        lam = self.forgetting
        self.ata = self.ata * lam + np.outer(x, x)
        self.atb = self.atb * lam + x * ms
        self.samples += 1
        self.updated = time.time()
        self._fit = None
        return True

    @property
    def accepted(self) -> bool:
        """Whether the fit ranks (see ``in_use``)."""
        return self.in_use and self.samples >= self.min_samples

    def _spread(self) -> float:
        """``z`` standard errors of the paired differences' mean (exponential weights: about
        (2 - alpha) / alpha samples' worth of evidence at most)."""
        n = min(self.scored, (2 - self.error_alpha) / self.error_alpha)
        variance = max(self.diff_square - self.diff_mean * self.diff_mean, 0.0)
        return self.z * math.sqrt(variance / n)

    def _better(self) -> bool:
        """Enough judged samples, and recently better than the models it is judged against: by the
        margin, and by more than noise (the differences' mean ``z`` standard errors below 0)."""
        ratio = self.accept_ratio**2  # on root mean squares
        return (
            self.scored >= self.min_scored
            and self.square_fit < ratio * self.square_base
            and self.square_fit < ratio * self.square_prior
            and self.diff_mean + self._spread() < 0
        )

    def _worse(self) -> bool:
        """Clearly worse than the model it replaced: worse than the default, or worse than the base
        by more than noise."""
        return self.square_fit > self.square_prior or self.diff_mean - self._spread() > 0

    def model(self) -> PrefillModel:
        """The calibrated model when accepted, else the prior."""
        return self.fit() if self.accepted else self.prior

    def fit(self) -> PrefillModel:
        """The least-squares fit, accepted or not (the prior without samples)."""
        if not self.samples:
            return self.prior
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> PrefillModel:
        p = self.prior
        theta0 = np.array([p.a_ms, p.b_ms_per_token, p.c_ms_per_token2]) / _SCALE
        # The prior's pull is relative to the data's own scale on each feature.
        reg = self.prior_weight * np.maximum(np.diag(self.ata), 1e-12) / max(self.samples, 1)
        fixed: dict[int, float] = {}  # coefficients clamped to 0 because the fit wanted them negative
        theta = theta0.copy()
        while len(fixed) < 3:
            free = [j for j in range(3) if j not in fixed]
            a = self.ata[np.ix_(free, free)] + np.diag(reg[free])
            rhs = self.atb[free] + reg[free] * theta0[free]
            try:
                solution = np.linalg.solve(a, rhs)
            except np.linalg.LinAlgError:
                return self.prior
            theta[free] = solution
            negative = [j for j, v in zip(free, solution, strict=True) if v < 0]
            if not negative:
                break
            for j in negative:
                fixed[j] = 0.0
                theta[j] = 0.0
        a_ms, b, c = (theta * _SCALE).tolist()
        return PrefillModel(max(a_ms, 0.0), max(b, 0.0), max(c, 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ata": self.ata.tolist(),
            "atb": self.atb.tolist(),
            "samples": self.samples,
            "updated": self.updated,
            "error_fit": self.error_fit,
            "error_base": self.error_base,
            "error_prior": self.error_prior,
            "scored": self.scored,
            "square_fit": self.square_fit,
            "square_base": self.square_base,
            "square_prior": self.square_prior,
            "diff_mean": self.diff_mean,
            "diff_square": self.diff_square,
            "in_use": self.in_use,
        }

    def load(self, data: dict[str, Any]) -> None:
        self.ata = np.array(data["ata"], dtype=float).reshape(3, 3)
        self.atb = np.array(data["atb"], dtype=float).reshape(3)
        self.samples = int(data["samples"])
        self.updated = float(data.get("updated", 0.0))
        # Stored before errors were kept: judged again from the next samples on.
        self.error_fit = float(data.get("error_fit", 0.0))
        self.error_base = float(data.get("error_base", 0.0))
        self.error_prior = float(data.get("error_prior", 0.0))
        self.scored = int(data.get("scored", 0))
        self.square_fit = float(data.get("square_fit", 0.0))
        self.square_base = float(data.get("square_base", 0.0))
        self.square_prior = float(data.get("square_prior", 0.0))
        self.diff_mean = float(data.get("diff_mean", 0.0))
        self.diff_square = float(data.get("diff_square", 0.0))
        self.in_use = bool(data.get("in_use", False))
        self._fit = None


@dataclass(frozen=True, slots=True)
class FitStatus:
    """What ranks one instance: the model, where it comes from, the instance's sample count and the
    recent error of the model in use on the instance's samples (None: not measured yet)."""

    source: str
    model: PrefillModel
    samples: int
    error: float | None


class Calibrator:
    """Calibrations per model (shared by its instances) and per instance."""

    def __init__(self, prior: PrefillModel = DEFAULT_PREFILL, learn: bool = True) -> None:
        self.prior = prior
        self.learn = learn  # False: samples are counted (``ignored``), the prior ranks everyone
        self.models: dict[str, ModelCalibration] = {}
        self.instances: dict[str, dict[str, ModelCalibration]] = {}  # model -> instance id -> own fit
        # (model, "") for a shared fit, (model, instance id) for an instance's: to be persisted.
        self.dirty: set[tuple[str, str]] = set()
        # Per model, the instances whose own fit is accepted and what it is (a cache of the
        # instances' ``accepted``, kept current by ``add``): rankings look it up per instance.
        self._own: dict[str, dict[str, PrefillModel]] = {}
        self.rejected = 0  # samples not usable (counted, ignored)
        self.ignored = 0  # samples not learned from: calibration off
        self.queued = 0  # routers' reports not learned from: the index predicted a wait (add_reported)

    @classmethod
    def of(cls, costs: CostConfig) -> Calibrator:
        """The calibration ``costs`` price with: its default prefill model as the prior, learning
        unless calibration is off."""
        return cls(costs.default_prefill, learn=costs.calibrate)

    def _get(self, model: str) -> ModelCalibration:
        cal = self.models.get(model)
        if cal is None:
            cal = self.models[model] = ModelCalibration(prior=self.prior)
        return cal

    def _instance(self, model: str, instance: str) -> ModelCalibration:
        per = self.instances.setdefault(model, {})
        cal = per.get(instance)
        if cal is None:
            cal = per[instance] = ModelCalibration(prior=self.prior, accept_ratio=INSTANCE_ACCEPT_RATIO)
        return cal

    def add(self, model: str, samples: Iterable[tuple[float, float, float]], instance: str = "") -> int:
        """Add samples of ``model`` (measured on ``instance``, when known); how many were usable."""
        if not self.learn:
            self.ignored += sum(1 for _ in samples)
            return 0
        shared = self._get(model)
        own = self._instance(model, instance) if instance else None
        added = 0
        for tokens, cached, ms in samples:
            # The instance's own fit is judged against the shared fit (and, as every fit, the default).
            base = shared.fit() if own is not None and own.samples >= own.min_samples else None
            if not shared.add(tokens, cached, ms):
                self.rejected += 1
                continue
            added += 1
            if own is not None:
                own.add(tokens, cached, ms, base)
        if added:
            self.dirty.add((model, ""))
            if own is not None:
                self.dirty.add((model, instance))
                self._judge(model, instance, own)
        return added

    def add_reported(
        self,
        model: str,
        instance: str,
        prompt_tokens: int,
        cached_tokens: int,
        ttft_ms: float,
        predicted_wait_ms: float,
    ) -> bool:
        """A router's report: the TTFT it measured minus the wait the index predicted is the
        request's prefill, with the tokens the engine found cached. Learned from only when the
        predicted wait is at most ``REPORT_WAIT_SHARE`` of the TTFT: a predicted wait is an estimate
        made with the model being fitted, and subtracting a large one would feed the model's own
        errors back into it (a fit that overestimates waits sees short prefills, is judged worse than
        the default, gives way, and the default's short waits make it look right again)."""
        if not (math.isfinite(ttft_ms) and math.isfinite(predicted_wait_ms)) or predicted_wait_ms < 0:
            self.rejected += 1
            return False
        if predicted_wait_ms > REPORT_WAIT_SHARE * ttft_ms:
            self.queued += 1
            return False
        return self.add(model, [(prompt_tokens, cached_tokens, ttft_ms - predicted_wait_ms)], instance) == 1

    def _judge(self, model: str, instance: str, own: ModelCalibration) -> None:
        per = self._own.get(model)
        if own.accepted:
            if per is None:
                per = self._own[model] = {}
            per[instance] = own.fit()
        elif per is not None and instance in per:
            del per[instance]
            if not per:
                del self._own[model]

    def prefill(self, model: str) -> PrefillModel:
        """The model's shared model in use: its fit when accepted, else the default."""
        cal = self.models.get(model)
        return self.prior if cal is None else cal.model()

    def own_models(self, model: str) -> dict[str, PrefillModel]:
        """The instances of ``model`` ranked with their own fit (usually none): instance id -> fit."""
        return self._own.get(model, _NONE)

    def prefill_of(self, model: str, instance: str) -> PrefillModel:
        own = self._own.get(model)
        if own is not None:
            fit = own.get(instance)
            if fit is not None:
                return fit
        return self.prefill(model)

    def status(self, model: str, instance: str) -> FitStatus:
        shared = self.models.get(model)
        own = self.instances.get(model, {}).get(instance)
        samples = own.samples if own is not None else 0
        if own is not None and own.accepted:
            return FitStatus(OWN, own.fit(), samples, own.error_fit)
        # Otherwise the error on this instance's samples of the shared fit or the default, whichever
        # ranks it; before they are judged, the model's over all its instances' samples.
        in_use_shared = shared is not None and shared.accepted
        if own is not None and own.scored:
            error: float | None = own.error_base if in_use_shared else own.error_prior
        elif shared is not None and shared.scored:
            error = shared.error_fit if in_use_shared else shared.error_prior
        else:
            error = None
        if in_use_shared:
            return FitStatus(SHARED, shared.fit(), samples, error)  # type: ignore[union-attr]
        return FitStatus(DEFAULT, self.prior, samples, error)

    def forget(self, model: str, instance: str) -> None:
        """An instance gone for good: its own fit goes (the shared one keeps what it learned)."""
        per = self.instances.get(model)
        if per is not None and per.pop(instance, None) is not None:
            self._judge(model, instance, ModelCalibration(prior=self.prior))
            if not per:
                del self.instances[model]

    # -- persistence ----------------------------------------------------------------------------

    def export(self, model: str, instance: str = "") -> dict[str, Any]:
        return (self._instance(model, instance) if instance else self._get(model)).to_dict()

    def restore(self, model: str, data: dict[str, Any], instance: str = "") -> None:
        """Adopt a persisted calibration unless this process already has more samples."""
        cal = self._instance(model, instance) if instance else self._get(model)
        if int(data.get("samples", 0)) > cal.samples:
            cal.load(data)
            if instance:
                self._judge(model, instance, cal)

    def snapshot(self) -> dict[str, Any]:
        """Everything, for a capture: {"models": {model: state}, "instances": {model: {id: state}}}."""
        return {
            "models": {m: c.to_dict() for m, c in self.models.items()},
            "instances": {m: {i: c.to_dict() for i, c in per.items()} for m, per in self.instances.items()},
        }

    def load_snapshot(self, data: dict[str, Any]) -> None:
        """``snapshot``'s state, replacing this one's (a capture's replay)."""
        for model, state in data.get("models", {}).items():
            cal = self.models[model] = ModelCalibration(prior=self.prior)
            cal.load(state)
        for model, per in data.get("instances", {}).items():
            for instance, state in per.items():
                cal = ModelCalibration(prior=self.prior, accept_ratio=INSTANCE_ACCEPT_RATIO)
                cal.load(state)
                self.instances.setdefault(model, {})[instance] = cal
                self._judge(model, instance, cal)


_NONE: dict[str, PrefillModel] = {}
