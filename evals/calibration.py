"""Calibration of top-1 confidence: reliability bins, ECE, MCE, Brier score.

Inputs are per prediction: ``conf`` = the probability the model gives its argmax
token, ``correct`` = whether that argmax is the true next token.

* Equal-width bins split [0, 1] into B intervals (lo, hi] (the first also holds 0).
* Equal-mass bins sort the predictions by confidence and cut them into B runs of
  sizes as equal as possible (``np.array_split``), so each bin has ~n/B points.
* ECE = sum_b (n_b / n) |acc_b - conf_b|;  MCE = max_b |acc_b - conf_b| over
  non-empty equal-width bins;  Brier (top-1) = mean (conf - correct)^2.
* A bin's gap is conf_b - acc_b: positive means over-confident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.errors import CortiqError

DEFAULT_BINS = 10


@dataclass(frozen=True)
class Bin:
    lo: float
    hi: float
    count: int
    confidence: float  # mean top-1 probability in the bin (nan when empty)
    accuracy: float  # fraction correct in the bin (nan when empty)

    @property
    def gap(self) -> float:
        return self.confidence - self.accuracy

    def to_json(self) -> dict[str, Any]:
        nan = self.count == 0
        return {
            "lo": self.lo,
            "hi": self.hi,
            "count": self.count,
            "confidence": None if nan else self.confidence,
            "accuracy": None if nan else self.accuracy,
            "gap": None if nan else self.gap,
        }


def _check(conf: np.ndarray, correct: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(conf, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    if conf.shape != correct.shape or conf.ndim != 1:
        raise CortiqError(f"confidence and correctness must be 1-D of one length (got {conf.shape}, {correct.shape})")
    if n_bins < 1:
        raise CortiqError(f"--bins must be at least 1 (got {n_bins})")
    if conf.size == 0:
        raise CortiqError("no predictions to bin")
    return conf, correct


def _bin(lo: float, hi: float, c: np.ndarray, k: np.ndarray) -> Bin:
    if c.size == 0:
        return Bin(lo, hi, 0, float("nan"), float("nan"))
    return Bin(lo, hi, int(c.size), float(c.mean()), float(k.mean()))


def equal_width_bins(conf: np.ndarray, correct: np.ndarray, n_bins: int = DEFAULT_BINS) -> list[Bin]:
    conf, correct = _check(conf, correct, n_bins)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    # side="left": a value equal to an edge belongs to the bin that edge closes, i.e. (lo, hi].
    idx = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
    return [_bin(float(edges[b]), float(edges[b + 1]), conf[idx == b], correct[idx == b]) for b in range(n_bins)]


def equal_mass_bins(conf: np.ndarray, correct: np.ndarray, n_bins: int = DEFAULT_BINS) -> list[Bin]:
    conf, correct = _check(conf, correct, n_bins)
    order = np.argsort(conf, kind="stable")
    out = []
    for part in np.array_split(order, min(n_bins, conf.size)):
        c, k = conf[part], correct[part]
        out.append(_bin(float(c.min()), float(c.max()), c, k))
    return out


def ece(bins: list[Bin]) -> float:
    n = sum(b.count for b in bins)
    return float(sum(b.count / n * abs(b.accuracy - b.confidence) for b in bins if b.count))


def mce(bins: list[Bin]) -> float:
    return float(max(abs(b.accuracy - b.confidence) for b in bins if b.count))


def brier_top1(conf: np.ndarray, correct: np.ndarray) -> float:
    conf, correct = _check(conf, correct, 1)
    return float(np.mean((conf - correct) ** 2))


@dataclass(frozen=True)
class CalibrationMetrics:
    """Every scalar of one set of predictions at one temperature."""

    n: int
    accuracy: float
    confidence: float
    ece: float  # equal-width bins
    ece_mass: float  # equal-mass bins
    mce: float  # equal-width bins
    brier: float
    nll: float

    @classmethod
    def of(
        cls, conf: np.ndarray, correct: np.ndarray, nll: np.ndarray, n_bins: int = DEFAULT_BINS
    ) -> "CalibrationMetrics":
        width = equal_width_bins(conf, correct, n_bins)
        return cls(
            n=int(len(conf)),
            accuracy=float(np.mean(correct)),
            confidence=float(np.mean(conf)),
            ece=ece(width),
            ece_mass=ece(equal_mass_bins(conf, correct, n_bins)),
            mce=mce(width),
            brier=brier_top1(conf, correct),
            nll=float(np.mean(nll)),
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)
