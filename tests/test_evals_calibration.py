"""Calibration metrics against plainly written loops; the temperature fit against a known temperature."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evals.calibrate import calibration_report, split_rows
from evals.calibration import CalibrationMetrics, brier_top1, ece, equal_mass_bins, equal_width_bins, mce
from evals.temperature import (
    TemperatureGrid,
    confidence_at,
    fit_temperature,
    nll_at,
    row_features,
    row_features_reference,
)
from formats.errors import CortiqError


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    conf = rng.beta(5, 2, n)
    correct = rng.random(n) < conf**1.3  # over-confident
    return conf, correct


def hand_ece_mce(conf, correct, n_bins):
    """Equal-width bins (lo, hi], the first bin also holding 0; ECE and MCE by a loop."""
    total, worst = 0.0, 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [i for i in range(len(conf)) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0)]
        if not members:
            continue
        acc = sum(1.0 for i in members if correct[i]) / len(members)
        avg = sum(conf[i] for i in members) / len(members)
        total += len(members) / len(conf) * abs(acc - avg)
        worst = max(worst, abs(acc - avg))
    return total, worst


def hand_ece_equal_mass(conf, correct, n_bins):
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    n = len(conf)
    total, start = 0.0, 0
    for b in range(n_bins):
        size = n // n_bins + (1 if b < n % n_bins else 0)
        members = order[start : start + size]
        start += size
        acc = sum(1.0 for i in members if correct[i]) / len(members)
        avg = sum(conf[i] for i in members) / len(members)
        total += len(members) / n * abs(acc - avg)
    return total


@pytest.mark.parametrize("n,n_bins,seed", [(2000, 10, 0), (997, 15, 1), (50, 7, 2)])
def test_ece_mce_equal_hand_loop(n, n_bins, seed):
    conf, correct = synthetic(n, seed)
    want_ece, want_mce = hand_ece_mce(conf, correct, n_bins)
    bins = equal_width_bins(conf, correct, n_bins)
    assert ece(bins) == pytest.approx(want_ece, abs=1e-9)
    assert mce(bins) == pytest.approx(want_mce, abs=1e-9)
    assert ece(equal_mass_bins(conf, correct, n_bins)) == pytest.approx(
        hand_ece_equal_mass(conf, correct, n_bins), abs=1e-9
    )
    assert sum(b.count for b in bins) == n
    assert want_ece > 0.01  # the data are miscalibrated: the check is not vacuous


def test_bin_edges_are_right_closed():
    conf = np.array([0.1, 0.2, 0.25, 1.0, 0.0])
    bins = equal_width_bins(conf, np.array([1, 0, 1, 1, 0]), 10)
    assert [b.count for b in bins] == [2, 1, 1, 0, 0, 0, 0, 0, 0, 1]


def test_brier_and_metrics():
    conf, correct = synthetic(500, 3)
    want = sum((c - (1.0 if k else 0.0)) ** 2 for c, k in zip(conf, correct)) / len(conf)
    assert brier_top1(conf, correct) == pytest.approx(want, abs=1e-12)
    m = CalibrationMetrics.of(conf, correct, -np.log(np.where(correct, conf, 1 - conf)), 10)
    assert m.accuracy == pytest.approx(correct.mean())
    assert m.confidence == pytest.approx(conf.mean())
    assert m.brier == pytest.approx(want)


def test_perfectly_calibrated_has_small_ece():
    rng = np.random.default_rng(5)
    conf = rng.random(200_000)
    correct = rng.random(conf.size) < conf
    assert ece(equal_width_bins(conf, correct, 10)) < 0.005


def test_metric_errors():
    with pytest.raises(CortiqError):
        equal_width_bins(np.array([]), np.array([]), 10)
    with pytest.raises(CortiqError):
        equal_width_bins(np.array([0.5]), np.array([1, 0]), 10)
    with pytest.raises(CortiqError):
        split_rows(1, 0.5)
    with pytest.raises(CortiqError):
        split_rows(10, 1.0)


# ------------------------------------------------------------------ temperature


def sample_labels(z: np.ndarray, T: float, rng) -> np.ndarray:
    p = np.exp((z - z.max(axis=1, keepdims=True)) / T)
    p /= p.sum(axis=1, keepdims=True)
    return (p.cumsum(axis=1) > rng.random((len(z), 1))).argmax(axis=1)


@pytest.mark.parametrize("t_star", [0.6, 1.0, 1.45, 2.5])
def test_fit_recovers_known_temperature(t_star):
    rng = np.random.default_rng(int(t_star * 100))
    z = rng.standard_normal((40_000, 50)) * 2.5
    y = sample_labels(z, t_star, rng)
    grid = TemperatureGrid.make()
    fit = fit_temperature(row_features(z, y, grid), grid)
    assert not fit.at_edge
    assert fit.temperature == pytest.approx(t_star, rel=0.01)


def test_fit_is_the_nll_minimiser():
    rng = np.random.default_rng(11)
    z = rng.standard_normal((3000, 40)) * 3
    y = sample_labels(z, 1.3, rng)
    grid = TemperatureGrid.make()
    f = row_features(z, y, grid)
    t_hat = fit_temperature(f, grid).temperature

    def exact_nll(T):
        s = z / T
        s = s - s.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(axis=1)) - s[np.arange(len(y)), y]))

    # a brute-force search on the exact NLL lands on the same T
    ts = np.linspace(t_hat * 0.97, t_hat * 1.03, 601)
    t_brute = ts[np.argmin([exact_nll(t) for t in ts])]
    assert t_hat == pytest.approx(t_brute, rel=2e-4)
    assert exact_nll(t_hat) <= exact_nll(1.0)


def test_fit_at_grid_edge():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((5000, 30)) * 3
    y = sample_labels(z, 9.0, rng)  # hotter than the grid reaches
    grid = TemperatureGrid.make(0.5, 2.0)
    fit = fit_temperature(row_features(z, y, grid), grid)
    assert fit.at_edge and fit.temperature == pytest.approx(2.0)


def test_fast_features_match_reference():
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((37, 3001)) * 3).astype(np.float32)
    z[:, :5] += 9  # a few dominant logits: the hard case for interpolation
    z[3, 17] = -1e4  # a masked-out token exercises the clamp
    y = rng.integers(0, 3001, 37)
    grid = TemperatureGrid.make()
    fast, ref = row_features(z, y, grid), row_features_reference(z, y, grid)
    np.testing.assert_array_equal(fast.correct, ref.correct)
    np.testing.assert_allclose(fast.gap, ref.gap, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.L, ref.L, rtol=0, atol=1e-10)
    np.testing.assert_allclose(fast.D, ref.D, rtol=0, atol=1e-9)


@pytest.mark.parametrize("T", [0.31, 0.8, 1.0, 1.37, 2.2, 3.9])
def test_interpolated_confidence_and_nll(T):
    rng = np.random.default_rng(8)
    z = rng.standard_normal((64, 500)) * 3
    z[:, :3] += 6
    y = rng.integers(0, 500, 64)
    grid = TemperatureGrid.make()
    f = row_features(z, y, grid)
    s = z / T
    s = s - s.max(axis=1, keepdims=True)
    lse = np.log(np.exp(s).sum(axis=1))
    np.testing.assert_allclose(confidence_at(f, grid, T), np.exp(-lse), rtol=2e-3)
    np.testing.assert_allclose(nll_at(f, grid, T), lse - s[np.arange(64), y], rtol=0, atol=2e-3)


def test_grid_contains_one_and_spans_range():
    g = TemperatureGrid.make(0.25, 4.0)
    assert g.betas[g.index_of_one] == 1.0
    assert g.temperatures.min() == pytest.approx(0.25) and g.temperatures.max() == pytest.approx(4.0)
    with pytest.raises(CortiqError):
        TemperatureGrid.make(1.5, 4.0)


def test_report_before_after():
    rng = np.random.default_rng(21)
    z = (rng.standard_normal((20_000, 50)) * 3).astype(np.float32).astype(np.float64)  # engines give f32 logits
    y = sample_labels(z, 1.8, rng)  # the logits are 1.8x too sharp: over-confident
    grid = TemperatureGrid.make()
    rep = calibration_report("synthetic", row_features(z, y, grid), grid, n_bins=10, fit_fraction=0.5)
    assert rep.temperature == pytest.approx(1.8, rel=0.02)
    assert rep.after.ece < rep.before.ece / 3
    assert rep.after.nll < rep.before.nll
    assert rep.fit_tokens == rep.eval_tokens == 10_000
    # T = 1 metrics are exact (no interpolation): compare with a direct softmax
    s = z - z.max(axis=1, keepdims=True)
    p = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    conf = p.max(axis=1)
    assert rep.overall.confidence == pytest.approx(conf.mean(), abs=1e-12)
    assert rep.overall.nll == pytest.approx(float(np.mean(-np.log(p[np.arange(len(y)), y]))), abs=1e-12)
    assert rep.overall.ece == pytest.approx(hand_ece_mce(conf, p.argmax(axis=1) == y, 10)[0], abs=1e-9)
    temps = [c.temperature for c in rep.curve]
    assert temps == sorted(temps)
    best = min(rep.curve, key=lambda c: c.nll_fit)
    assert abs(math.log(best.temperature / rep.temperature)) < 0.07
    js = rep.to_json()
    assert js["temperature"] == rep.temperature and len(js["reliability"]) == 10
