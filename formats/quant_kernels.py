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


@njit(inline="always")
def _amax(x, r, o):
    """max |x| of the block of 32 at row r, column o."""
    amax = _F0
    for j in range(QB):
        a = abs(x[r, o + j])
        if a > amax:
            amax = a
    return amax


@njit(cache=True, nogil=True)
def _q8_rows(x, d, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            dd = _amax(x, r, o) / _F127
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


_HALF_BELOW = np.float32(0.49999997)  # the f32 just below 0.5


@njit(inline="always")
def _q8_level(v):
    """C roundf(v) clamped to +-127. floor(|v| + 0.49999997) is roundf(|v|) for every
    f32 (checked exhaustively): one add and one floor, where v + 0.5 would round up
    the values just below a half."""
    q = np.floor(abs(v) + _HALF_BELOW)
    return min(max(-q if v < _F0 else q, -_F127), _F127)


# The scale searches (q8 here, q4_0 and q5 in ``formats.kquant_kernels``) score LANES
# candidate scales of a block side by side: one vector of f32 errors, each candidate's
# kept as NSUM partial sums (value j of a block adds to sum j % NSUM, in order; the sums
# add up as (s0 + s1) + (s2 + s3)). Independent sums keep the adds from waiting on each
# other, and a fixed order keeps the numpy reference's sums equal to these.
LANES = 16
NSUM = 4


@njit(inline="always")
def lanes_start(m, divs, cd, cinv, s0, s1, s2, s3):
    """The candidate scales f16(m / divs[k]) into cd, their inverses (0 for a zero
    scale) into cinv, the partial sums zeroed."""
    for k in range(LANES):
        c = _f16_round(m / divs[k])
        cd[k] = c
        cinv[k] = _F1 / c if c != _F0 else _F0
        s0[k] = _F0
        s1[k] = _F0
        s2[k] = _F0
        s3[k] = _F0


@njit(inline="always")
def lanes_best(cd, s0, s1, s2, s3):
    """The first nonzero candidate scale of least error, 0 if every one is 0."""
    best = _F0
    best_err = np.float32(np.inf)
    for k in range(LANES):
        ek = (s0[k] + s1[k]) + (s2[k] + s3[k])
        if cd[k] != _F0 and ek < best_err:
            best_err = ek
            best = cd[k]
    return best


# Q8_DIVISORS are the lanes; a level and its error are those of |x|: the decoder's
# products and differences are symmetric in the sign. The scratch arrays come from the
# caller: arrays allocated in here keep LLVM from proving they do not alias, and the
# candidate loop then stays scalar (4x slower).
@njit(cache=True, nogil=True)
def _q8_rows_search(x, divs, d, qs, dd, inv, s0, s1, s2, s3):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            lanes_start(_amax(x, r, o), divs, dd, inv, s0, s1, s2, s3)
            for j in range(0, QB, NSUM):
                a0 = abs(x[r, o + j])
                a1 = abs(x[r, o + j + 1])
                a2 = abs(x[r, o + j + 2])
                a3 = abs(x[r, o + j + 3])
                for k in range(LANES):
                    e0 = a0 - min(np.floor(a0 * inv[k] + _HALF_BELOW), _F127) * dd[k]
                    e1 = a1 - min(np.floor(a1 * inv[k] + _HALF_BELOW), _F127) * dd[k]
                    e2 = a2 - min(np.floor(a2 * inv[k] + _HALF_BELOW), _F127) * dd[k]
                    e3 = a3 - min(np.floor(a3 * inv[k] + _HALF_BELOW), _F127) * dd[k]
                    s0[k] += e0 * e0
                    s1[k] += e1 * e1
                    s2[k] += e2 * e2
                    s3[k] += e3 * e3
            best = lanes_best(dd, s0, s1, s2, s3)
            d[r, b] = best
            iv = _F1 / best if best != _F0 else _F0
            for j in range(QB):
                qs[r, o + j] = np.int8(_q8_level(x[r, o + j] * iv))


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
def _affine_error(x, d, m, qs, nibbles, offset):  # pragma: no cover - compiled
    """(sum of squared errors, sum of squared values) of blocks of 32 decoding to
    (q + offset) * d + m: q8's levels are qs itself (m = 0), q4's and q4_0's the nibbles
    of qs (element j in the low nibble of byte j, j + 16 in its high nibble; q4_0's
    offset -8, m = 0)."""
    rows, cols = x.shape
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(cols // QB):
            dd = d[r, b]
            mm = m[r, b]
            for j in range(QB):
                if nibbles:
                    q = np.float32(((qs[r, b * 16 + j % 16] >> (4 * (j // 16))) & 15) + offset)
                else:
                    q = np.float32(qs[r, b * QB + j])
                v = x[r, b * QB + j]
                e = np.float64(q * dd + mm - v)
                err += e * e
                ref += np.float64(v) * np.float64(v)
    return err, ref


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q8`` (the searched scale)."""
    from formats.quants import Q8_DIVISORS

    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    d = np.empty((rows, cols // QB), np.float32)
    qs = np.empty((rows, cols), np.int8)
    assert Q8_DIVISORS.shape == (LANES,)
    _q8_rows_search(x, Q8_DIVISORS, d, qs, *(np.empty(LANES, np.float32) for _ in range(2 + NSUM)))
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
    d32 = d.astype(np.float32)
    return _affine_error(np.ascontiguousarray(x, np.float32), d32, np.zeros_like(d32), qs, False, 0)


def q4_error(x: np.ndarray, d: np.ndarray, m: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    return _affine_error(np.ascontiguousarray(x, np.float32), d.astype(np.float32), m.astype(np.float32), qs, True, 0)


def q4_0_error(x: np.ndarray, d: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    """As ``q8_error``, of a q4_0 encoding (value = d * (q - 8): + 0 changes no product)."""
    d32 = d.astype(np.float32)
    return _affine_error(np.ascontiguousarray(x, np.float32), d32, np.zeros_like(d32), qs, True, -8)


@njit(cache=True, parallel=True)
def _launch(a):  # pragma: no cover - compiled
    for i in prange(a.shape[0]):
        a[i] = i


def parallel_calls_safe() -> bool:
    """Whether numba's threading layer takes parallel kernels from several threads at
    once (tbb and omp do; workqueue aborts the process)."""
    import numba

    _launch(np.zeros(1))  # the layer is chosen at the first parallel launch
    return numba.threading_layer() != "workqueue"
