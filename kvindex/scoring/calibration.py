"""Online calibration of the prefill model from the samples workers report in their heartbeats.

Each sample is (prompt tokens L, cached tokens, measured prefill ms). The fit is least squares of
``ms ~ a + b*miss + c*miss*L`` with exponential forgetting (recent samples weigh more, so the model
follows load and software changes) kept as 3x3 normal equations: bounded memory however many
samples arrive. A weak ridge prior toward the default model keeps early fits sane, and coefficients
are kept non-negative. The state serialises to a small dict so it can be persisted and shared
(a NATS KV bucket; see kvindex/service) and a restarted index or a second replica starts calibrated.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvindex.scoring.costs import DEFAULT_PREFILL, PrefillModel

# Feature scales so that the normal equations are well conditioned: miss in thousands of tokens,
# miss*L in tens of millions.
_SCALE = np.array([1.0, 1e-3, 1e-7])


@dataclass
class ModelCalibration:
    forgetting: float = 0.998  # per sample: ~500 samples of memory
    prior_weight: float = 0.1  # in samples' worth, toward the prior model (just enough to stay solvable)
    min_samples: int = 20
    prior: PrefillModel = DEFAULT_PREFILL
    ata: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    atb: np.ndarray = field(default_factory=lambda: np.zeros(3))
    samples: int = 0
    updated: float = 0.0
    _fit: PrefillModel | None = None

    def add(self, prompt_tokens: float, cached_tokens: float, ms: float) -> bool:
        """Add one sample; False (ignored) when it is not usable."""
        miss = prompt_tokens - cached_tokens
        if not (prompt_tokens > 0 and 0 <= miss <= prompt_tokens and 0 < ms < 3_600_000):
            return False
        x = np.array([1.0, miss, miss * prompt_tokens]) * _SCALE
        lam = self.forgetting
        self.ata = self.ata * lam + np.outer(x, x)
        self.atb = self.atb * lam + x * ms
        self.samples += 1
        self.updated = time.time()
        self._fit = None
        return True

    def model(self) -> PrefillModel:
        """The calibrated model, or the prior until enough samples arrived."""
        if self.samples < self.min_samples:
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

    def to_dict(self) -> dict:
        return {
            "ata": self.ata.tolist(),
            "atb": self.atb.tolist(),
            "samples": self.samples,
            "updated": self.updated,
        }

    def load(self, data: dict) -> None:
        self.ata = np.array(data["ata"], dtype=float).reshape(3, 3)
        self.atb = np.array(data["atb"], dtype=float).reshape(3)
        self.samples = int(data["samples"])
        self.updated = float(data.get("updated", 0.0))
        self._fit = None


class Calibrator:
    """Calibrations per model."""

    def __init__(self, prior: PrefillModel = DEFAULT_PREFILL) -> None:
        self.prior = prior
        self.models: dict[str, ModelCalibration] = {}
        self.dirty: set[str] = set()

    def _get(self, model: str) -> ModelCalibration:
        cal = self.models.get(model)
        if cal is None:
            cal = self.models[model] = ModelCalibration(prior=self.prior)
        return cal

    def add(self, model: str, samples: Iterable[tuple[float, float, float]]) -> int:
        cal = self._get(model)
        added = sum(1 for tokens, cached, ms in samples if cal.add(tokens, cached, ms))
        if added:
            self.dirty.add(model)
        return added

    def prefill(self, model: str) -> PrefillModel:
        cal = self.models.get(model)
        return self.prior if cal is None else cal.model()

    def export(self, model: str) -> dict:
        return self._get(model).to_dict()

    def restore(self, model: str, data: dict) -> None:
        """Adopt a persisted calibration unless this process already has more samples."""
        cal = self._get(model)
        if int(data.get("samples", 0)) > cal.samples:
            cal.load(data)
