"""Compiled (numba) q8/q4 quantizers and error meters for the converter.

They compute exactly what the numpy reference in ``formats.quants`` computes (and
so what ggml computes): the same f32 operations in the same order, no fused
multiply-add (numba leaves fastmath off), scales returned in f32 and rounded to
f16 by numpy. ``tests/test_formats_quants.py`` checks all three agree bit for bit.
The reference needs ~10 passes over a tensor; these need one.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

QB = 32  # formats.quants.QBLOCK
_F0 = np.float32(0.0)
_F05 = np.float32(0.5)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_F15 = np.float32(15.0)
_F127 = np.float32(127.0)


@njit(cache=True, nogil=True)
def _q8_rows(x, d, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            amax = _F0
            for j in range(QB):
                a = abs(x[r, o + j])
                if a > amax:
                    amax = a
            dd = amax / _F127
            inv = _F1 / dd if dd != _F0 else _F0
            d[r, b] = dd
            for j in range(QB):
                v = x[r, o + j] * inv
                a = abs(v)
                fl = np.floor(a)
                q = fl + np.floor(_F2 * (a - fl))  # C roundf: half away from zero, exactly
                qs[r, o + j] = np.int8(-q if v < _F0 else q)


@intrinsic
def _f16_round(typingctx, x):
    """f32 -> nearest f16 -> f32: the scale as it will be stored."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(inline="always")
def _roundf(v):
    a = abs(v)
    fl = np.floor(a)
    q = fl + np.floor(_F2 * (a - fl))
    return -q if v < _F0 else q


# Rows in parallel: each row's result is independent of the thread count.
@njit(cache=True, nogil=True, parallel=True)
def _q8_rows_search(x, divs, d, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        for b in range(cols // QB):
            o = b * QB
            amax = _F0
            for j in range(QB):
                a = abs(x[r, o + j])
                if a > amax:
                    amax = a
            best = _F0
            best_err = np.inf
            for k in range(divs.shape[0]):
                dd = _f16_round(amax / divs[k])
                if dd == _F0:
                    continue
                inv = _F1 / dd
                err = 0.0
                for j in range(QB):
                    q = min(max(_roundf(x[r, o + j] * inv), -_F127), _F127)
                    e = np.float64(x[r, o + j] - q * dd)
                    err += e * e
                if err < best_err:
                    best_err = err
                    best = dd
            d[r, b] = best
            inv = _F1 / best if best != _F0 else _F0
            for j in range(QB):
                qs[r, o + j] = np.int8(min(max(_roundf(x[r, o + j] * inv), -_F127), _F127))


@njit(cache=True, nogil=True)
def _q4_rows(x, d, m, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            lo = x[r, o]
            hi = x[r, o]
            for j in range(1, QB):
                v = x[r, o + j]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            dd = (hi - lo) / _F15
            inv = _F1 / dd if dd != _F0 else _F0
            d[r, b] = dd
            m[r, b] = lo
            for j in range(QB // 2):
                q0 = min(np.int32((x[r, o + j] - lo) * inv + _F05), 15)
                q1 = min(np.int32((x[r, o + j + 16] - lo) * inv + _F05), 15)
                qs[r, o // 2 + j] = np.uint8(q0 | (q1 << 4))


# Reassociation lets the sums vectorize; the element errors themselves are exact.
@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _q8_error(x, d, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(cols // QB):
            dd = d[r, b]
            for j in range(b * QB, (b + 1) * QB):
                e = np.float64(np.float32(qs[r, j]) * dd - x[r, j])
                err += e * e
                ref += np.float64(x[r, j]) * np.float64(x[r, j])
    return err, ref


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _q4_error(x, d, m, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(cols // QB):
            dd = d[r, b]
            mm = m[r, b]
            o = b * QB
            for j in range(QB // 2):
                p = qs[r, o // 2 + j]
                lo = x[r, o + j]
                hi = x[r, o + j + 16]
                e0 = np.float64(np.float32(p & 15) * dd + mm - lo)
                e1 = np.float64(np.float32(p >> 4) * dd + mm - hi)
                err += e0 * e0 + e1 * e1
                ref += np.float64(lo) * np.float64(lo) + np.float64(hi) * np.float64(hi)
    return err, ref


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q8`` (the searched scale)."""
    from formats.quants import Q8_DIVISORS

    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    d = np.empty((rows, cols // QB), np.float32)
    qs = np.empty((rows, cols), np.int8)
    _q8_rows_search(x, Q8_DIVISORS, d, qs)
    return d.astype(np.float16), qs


def quantize_q8_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q8_ggml``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    d = np.empty((rows, cols // QB), np.float32)
    qs = np.empty((rows, cols), np.int8)
    _q8_rows(x, d, qs)
    return d.astype(np.float16), qs


def quantize_q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q4``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    d = np.empty((rows, cols // QB), np.float32)
    m = np.empty((rows, cols // QB), np.float32)
    qs = np.empty((rows, cols // 2), np.uint8)
    _q4_rows(x, d, m, qs)
    return d.astype(np.float16), m.astype(np.float16), qs


def q8_error(x: np.ndarray, d: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    """(sum of squared errors, sum of squared values) of a q8 encoding of ``x`` [rows, cols]."""
    return _q8_error(np.ascontiguousarray(x, np.float32), d.astype(np.float32), qs)


def q4_error(x: np.ndarray, d: np.ndarray, m: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    return _q4_error(np.ascontiguousarray(x, np.float32), d.astype(np.float32), m.astype(np.float32), qs)
