"""Means with their standard errors and normal-approximation intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


@dataclass(frozen=True)
class MeanEstimate:
    """Mean of ``n`` per-token values, SE = sample std / sqrt(n), CI = mean +- 1.96 SE.

    The SE treats tokens as independent; neighbouring tokens are correlated, so it
    understates the real uncertainty (as llama.cpp's does).
    """

    mean: float
    se: float
    n: int

    @classmethod
    def of(cls, values: np.ndarray) -> "MeanEstimate":
        v = np.asarray(values, dtype=np.float64)
        n = int(v.size)
        if n == 0:
            return cls(float("nan"), float("nan"), 0)
        mean = float(v.mean())
        se = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        return cls(mean, se, n)

    @property
    def ci95(self) -> tuple[float, float]:
        return (self.mean - Z95 * self.se, self.mean + Z95 * self.se)

    def to_json(self) -> dict[str, float | int | list[float]]:
        return {"mean": self.mean, "se": self.se, "ci95": list(self.ci95), "n": self.n}
