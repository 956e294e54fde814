"""Temperature scaling from one pass over the logits.

For a row of logits z with maximum z* and true token y, let d = z - z* (all <= 0)
and b = 1/T. Under temperature T

    L(b)      = log sum_v exp(b d_v)             (so the top-1 probability is exp(-L(b)))
    NLL(b)    = b (z* - z_y) + L(b)
    dL/db     = sum_v d_v softmax(b d)_v         (<= 0; L is convex in b)

and the argmax, hence top-1 correctness, does not depend on T. ``row_features``
records L and dL/db on a uniform grid of b, once per row while the logits stream
by; L between grid points comes from cubic Hermite interpolation (values and
slopes at both ends), exact at the grid points. ``fit_temperature`` minimises the
summed NLL over some rows; NLL is convex in b, so the minimiser is the root of
its derivative, bracketed on the grid and refined by bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from formats.errors import CortiqError

DEFAULT_T_MIN = 0.25
DEFAULT_T_MAX = 4.0
DEFAULT_DIVISIONS = 16  # grid step in b = 1/T is 1/16
_TILE = 256  # vocabulary entries per inner block: d, e, r of one tile stay in L1


@dataclass(frozen=True)
class TemperatureGrid:
    """b = k * step for k = k0 .. k0 + n - 1, with step = 1/divisions.

    b = 1 (T = 1) is always a grid point, and every grid b is an integer multiple
    of the step, so exp(b d) = exp(step d)^k costs one exp per logit.
    """

    k0: int
    n: int
    divisions: int = DEFAULT_DIVISIONS

    @classmethod
    def make(
        cls, t_min: float = DEFAULT_T_MIN, t_max: float = DEFAULT_T_MAX, divisions: int = DEFAULT_DIVISIONS
    ) -> "TemperatureGrid":
        if not 0 < t_min < 1 < t_max:
            raise CortiqError(f"the temperature range must satisfy 0 < min < 1 < max (got {t_min}, {t_max})")
        k_lo = max(1, int(math.floor(divisions / t_max + 1e-9)))
        k_hi = int(math.ceil(divisions / t_min - 1e-9))
        return cls(k_lo, k_hi - k_lo + 1, divisions)

    @property
    def step(self) -> float:
        return 1.0 / self.divisions

    @property
    def b0(self) -> float:
        return self.k0 * self.step

    @property
    def b_max(self) -> float:
        return (self.k0 + self.n - 1) * self.step

    @property
    def betas(self) -> np.ndarray:
        return (self.k0 + np.arange(self.n, dtype=np.float64)) * self.step

    @property
    def temperatures(self) -> np.ndarray:
        return 1.0 / self.betas

    @property
    def index_of_one(self) -> int:
        return self.divisions - self.k0

    def clamp_floor(self) -> float:
        """Shifted logits below this contribute < e^-600 at every grid b; clamping them avoids subnormals."""
        return -600.0 / self.b_max


@dataclass
class RowFeatures:
    """Per scored row: what calibration and the temperature fit need, logits discarded."""

    gap: np.ndarray  # z* - z_y >= 0, float64 [n]
    correct: np.ndarray  # argmax == y, bool [n]
    L: np.ndarray  # L(b_g), float64 [n, G]
    D: np.ndarray  # dL/db at b_g, float64 [n, G]

    @staticmethod
    def empty(grid: TemperatureGrid, n: int = 0) -> "RowFeatures":
        return RowFeatures(np.zeros(n), np.zeros(n, np.bool_), np.zeros((n, grid.n)), np.zeros((n, grid.n)))

    @staticmethod
    def concat(parts: list["RowFeatures"], grid: TemperatureGrid) -> "RowFeatures":
        if not parts:
            return RowFeatures.empty(grid)
        return RowFeatures(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("gap", "correct", "L", "D")))

    def take(self, idx: np.ndarray | slice) -> "RowFeatures":
        return RowFeatures(self.gap[idx], self.correct[idx], self.L[idx], self.D[idx])

    def __len__(self) -> int:
        return len(self.gap)


# ------------------------------------------------------------------ features


def row_features_reference(z: np.ndarray, y: np.ndarray, grid: TemperatureGrid) -> RowFeatures:
    """Plain numpy, one temperature at a time: the oracle for ``row_features``."""
    z = np.asarray(z, dtype=np.float64)
    rows = np.arange(len(y))
    mx = z.max(axis=1)
    d = z - mx[:, None]
    L = np.empty((len(y), grid.n))
    D = np.empty((len(y), grid.n))
    for g, b in enumerate(grid.betas):
        w = np.exp(b * d)
        s = w.sum(axis=1)
        L[:, g] = np.log(s)
        D[:, g] = (w * d).sum(axis=1) / s
    return RowFeatures(mx - z[rows, y], z.argmax(axis=1) == y, L, D)


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _features_kernel(z, y, k0, step, n_grid, floor, gap, correct, L, D):  # pragma: no cover - compiled
    rows, V = z.shape
    for i in numba.prange(rows):
        mx = z[i, 0]
        am = 0
        for j in range(1, V):
            if z[i, j] > mx:
                mx = z[i, j]
                am = j
        gap[i] = np.float64(mx) - np.float64(z[i, y[i]])
        correct[i] = am == y[i]
        S = np.zeros(n_grid)
        M = np.zeros(n_grid)
        d = np.empty(_TILE)
        e = np.empty(_TILE)
        r = np.empty(_TILE)
        for t0 in range(0, V, _TILE):
            nt = min(_TILE, V - t0)
            for j in range(nt):
                dj = max(np.float64(z[i, t0 + j]) - np.float64(mx), floor)
                d[j] = dj
                rj = math.exp(step * dj)
                r[j] = rj
                ej = rj
                for _ in range(k0 - 1):
                    ej *= rj
                e[j] = ej
            # exp(k*step*d) = exp(step*d)^k: one multiply per grid point, not one exp.
            for g in range(n_grid):
                s = 0.0
                m = 0.0
                for j in range(nt):
                    ej = e[j]
                    s += ej
                    m += ej * d[j]
                    e[j] = ej * r[j]
                S[g] += s
                M[g] += m
        for g in range(n_grid):
            L[i, g] = math.log(S[g])
            D[i, g] = M[g] / S[g]


def row_features(z: np.ndarray, y: np.ndarray, grid: TemperatureGrid) -> RowFeatures:
    """``row_features_reference`` fused into one compiled pass per row (float64 accumulation)."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.int64)
    if len(y) and (y.min() < 0 or y.max() >= z.shape[1]):
        raise CortiqError(f"target id out of range for a vocabulary of {z.shape[1]}")
    out = RowFeatures(
        np.empty(len(y)), np.empty(len(y), np.bool_), np.empty((len(y), grid.n)), np.empty((len(y), grid.n))
    )
    if len(y):
        _features_kernel(z, y, grid.k0, grid.step, grid.n, grid.clamp_floor(), out.gap, out.correct, out.L, out.D)
    return out


# ------------------------------------------------------------------ interpolation


def _hermite(grid: TemperatureGrid, L: np.ndarray, D: np.ndarray, b: float) -> tuple[np.ndarray, np.ndarray]:
    """L(b) and dL/db by cubic Hermite interpolation along the last axis of L, D."""
    if not grid.b0 - 1e-12 <= b <= grid.b_max + 1e-12:
        raise CortiqError(
            f"temperature {1 / b:.4g} is outside the fitted grid [{1 / grid.b_max:.4g}, {1 / grid.b0:.4g}]"
        )
    h = grid.step
    k = min(max(int(math.floor((b - grid.b0) / h)), 0), grid.n - 2)
    t = (b - grid.betas[k]) / h
    t2, t3 = t * t, t * t * t
    h00, h10, h01, h11 = 2 * t3 - 3 * t2 + 1, t3 - 2 * t2 + t, -2 * t3 + 3 * t2, t3 - t2
    d00, d10, d01, d11 = 6 * t2 - 6 * t, 3 * t2 - 4 * t + 1, -6 * t2 + 6 * t, 3 * t2 - 2 * t
    L0, L1, D0, D1 = L[..., k], L[..., k + 1], D[..., k], D[..., k + 1]
    val = h00 * L0 + h10 * h * D0 + h01 * L1 + h11 * h * D1
    slope = (d00 * L0 + d01 * L1) / h + d10 * D0 + d11 * D1
    return val, slope


def log_norm_at(f: RowFeatures, grid: TemperatureGrid, T: float) -> np.ndarray:
    """L(1/T) per row; exact at T = 1."""
    if T == 1.0:
        return f.L[:, grid.index_of_one]
    return _hermite(grid, f.L, f.D, 1.0 / T)[0]


def confidence_at(f: RowFeatures, grid: TemperatureGrid, T: float) -> np.ndarray:
    """Top-1 probability of each row under temperature T."""
    return np.exp(-log_norm_at(f, grid, T))


def nll_at(f: RowFeatures, grid: TemperatureGrid, T: float) -> np.ndarray:
    """NLL of each row's true token under temperature T."""
    return f.gap / T + log_norm_at(f, grid, T)


@dataclass(frozen=True)
class TemperatureFit:
    temperature: float
    at_edge: bool  # the optimum lies at (or past) the end of the grid
    rows: int


def fit_temperature(f: RowFeatures, grid: TemperatureGrid) -> TemperatureFit:
    """The T in the grid's range minimising the summed NLL of the rows in ``f``."""
    if len(f) == 0:
        raise CortiqError("no rows to fit a temperature on")
    A = float(f.gap.sum())
    SL, SD = f.L.sum(axis=0), f.D.sum(axis=0)
    slope = A + SD  # d(sum NLL)/db at each grid point; increasing in b
    if slope[0] >= 0:
        return TemperatureFit(1.0 / grid.b0, True, len(f))
    if slope[-1] <= 0:
        return TemperatureFit(1.0 / grid.b_max, True, len(f))
    k = int(np.argmax(slope >= 0))  # first grid point past the minimum
    lo, hi = float(grid.betas[k - 1]), float(grid.betas[k])
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if A + float(_hermite(grid, SL, SD, mid)[1]) < 0:
            lo = mid
        else:
            hi = mid
    return TemperatureFit(2.0 / (lo + hi), False, len(f))
