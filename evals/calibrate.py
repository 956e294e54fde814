"""``cortiq calibrate``'s numbers: one pass over the text, then reliability and a fitted temperature.

The pass (``evals.runs.collect_partial`` in one process, ``evals.cluster.collect_features``
on a cluster) keeps, per scored token, only ``RowFeatures`` (top-1 correctness and the
log-normaliser on the temperature grid), so the logits are never stored. The
scored tokens are split in text order: the first ``fit_fraction`` fits the
temperature, the rest measures ECE/NLL before (T = 1) and after (T = fitted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from evals.calibration import DEFAULT_BINS, Bin, CalibrationMetrics, ece, equal_mass_bins, equal_width_bins
from evals.temperature import (
    RowFeatures,
    TemperatureFit,
    TemperatureGrid,
    confidence_at,
    fit_temperature,
    nll_at,
)
from formats.errors import CortiqError

DEFAULT_FIT_FRACTION = 0.5


@dataclass(frozen=True)
class TemperaturePoint:
    temperature: float
    nll_fit: float
    nll_eval: float
    ece_eval: float
    confidence_eval: float


@dataclass(frozen=True)
class CalibrationReport:
    model: str
    n_bins: int
    overall: CalibrationMetrics  # every scored token, T = 1
    reliability: list[Bin]  # equal-width, every scored token, T = 1
    reliability_mass: list[Bin]  # equal-mass, every scored token, T = 1
    fit: TemperatureFit
    fit_tokens: int
    eval_tokens: int
    before: CalibrationMetrics  # held-out tokens, T = 1
    after: CalibrationMetrics  # held-out tokens, T = fitted
    reliability_after: list[Bin]  # equal-width, held-out tokens, T = fitted
    curve: list[TemperaturePoint]  # every grid temperature

    @property
    def temperature(self) -> float:
        return self.fit.temperature

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tokens_scored": self.overall.n,
            "bins": self.n_bins,
            "overall": self.overall.to_json(),
            "reliability": [b.to_json() for b in self.reliability],
            "reliability_equal_mass": [b.to_json() for b in self.reliability_mass],
            "temperature": self.fit.temperature,
            "temperature_at_grid_edge": self.fit.at_edge,
            "fit_tokens": self.fit_tokens,
            "eval_tokens": self.eval_tokens,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "reliability_after": [b.to_json() for b in self.reliability_after],
            "by_temperature": [p.__dict__ for p in self.curve],
        }


def split_rows(n: int, fit_fraction: float) -> tuple[slice, slice]:
    if not 0 < fit_fraction < 1:
        raise CortiqError(f"--fit-fraction must be between 0 and 1 (got {fit_fraction})")
    if n < 2:
        raise CortiqError(f"only {n} scored token(s); calibration needs at least 2 (one to fit, one to evaluate)")
    k = min(max(int(round(n * fit_fraction)), 1), n - 1)
    return slice(0, k), slice(k, n)


def calibration_report(
    model: str,
    f: RowFeatures,
    grid: TemperatureGrid,
    n_bins: int = DEFAULT_BINS,
    fit_fraction: float = DEFAULT_FIT_FRACTION,
) -> CalibrationReport:
    fit_idx, eval_idx = split_rows(len(f), fit_fraction)
    fit_rows, eval_rows = f.take(fit_idx), f.take(eval_idx)
    tfit = fit_temperature(fit_rows, grid)
    conf1 = confidence_at(f, grid, 1.0)
    overall = CalibrationMetrics.of(conf1, f.correct, nll_at(f, grid, 1.0), n_bins)
    before = CalibrationMetrics.of(conf1[eval_idx], eval_rows.correct, nll_at(eval_rows, grid, 1.0), n_bins)
    conf_t = confidence_at(eval_rows, grid, tfit.temperature)
    after = CalibrationMetrics.of(conf_t, eval_rows.correct, nll_at(eval_rows, grid, tfit.temperature), n_bins)
    curve = []
    for g in reversed(range(grid.n)):  # ascending temperature
        T = float(grid.temperatures[g])
        # At grid points L is stored exactly: no interpolation.
        c_eval = np.exp(-eval_rows.L[:, g])
        curve.append(
            TemperaturePoint(
                T,
                float(np.mean(fit_rows.gap / T + fit_rows.L[:, g])),
                float(np.mean(eval_rows.gap / T + eval_rows.L[:, g])),
                ece(equal_width_bins(c_eval, eval_rows.correct, n_bins)),
                float(c_eval.mean()),
            )
        )
    return CalibrationReport(
        model=model,
        n_bins=n_bins,
        overall=overall,
        reliability=equal_width_bins(conf1, f.correct, n_bins),
        reliability_mass=equal_mass_bins(conf1, f.correct, n_bins),
        fit=tfit,
        fit_tokens=len(fit_rows),
        eval_tokens=len(eval_rows),
        before=before,
        after=after,
        reliability_after=equal_width_bins(conf_t, eval_rows.correct, n_bins),
        curve=curve,
    )
