"""Compiled (numba) kernels of the K-quant dtypes q6k, q5k, q4k (ggml's Q6_K, Q5_K,
Q4_K super-blocks of 256 values, stored planar: ``formats.quants``), and of q4_0
(ggml's Q4_0, blocks of 32: the 4.5-bit type for rows no K-quant fits).

Two kernels per dtype, beside their numpy twins (``formats.quants.dequantize_q*k``):
``*_dequant`` turns rows r0..r1 into f32 exactly as the twin does (same f32
operations, no fast-math: bit for bit), for prefill tiles; ``*_matmul_small`` is the
decode matvec over 1..small_n input rows and up to three fused matrices,
``jit.matmul_small`` with the dtype's row dot: each (weight row, input row) is summed on
its own in 32 lanes, so a row's result does not depend on how many rows share the call.

Scales and mins unpack per super-block: value = (d * sc) * q - (dmin * m) for
q5k/q4k, (d * sc) * (q - 32) for q6k. The min term factors out of the dot product:
``xsum[i, g]`` is the sum of input row i over 32-value group g.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cortiq_engine.kernels.jit import f16_to_f32, matmul_small, scaled_kernels, specialise

QK = 256
_F0 = np.float32(0.0)


@njit(inline="always")
def _scale_min(sc, o, j):
    """The 6-bit scale and min of sub-block j from the 12 bytes at sc[o:o+12] (get_scale_min_k4)."""
    if j < 4:
        return np.float32(sc[o + j] & 63), np.float32(sc[o + j + 4] & 63)
    s = (sc[o + j + 4] & 0xF) | ((sc[o + j - 4] >> 6) << 4)
    m = (sc[o + j + 4] >> 4) | ((sc[o + j] >> 6) << 4)
    return np.float32(s), np.float32(m)


# ------------------------------------------------------------ q4k and q5k
# Both pack 6-bit scales and mins in 12 bytes per super-block and 4-bit quants by
# 64-value halves (byte l of sub-block pair k: value 64 k + l low nibble, 64 k + 32 + l
# high); q5k adds a fifth bit per value (``fifth``; q4k passes its quants as ``qh``,
# unread).


@njit(inline="always")
def _k4_pair(dd, sc, r, b, k):
    """Sub-blocks 2k and 2k+1 of super-block b (scale dd): their scales dd * sc and mins."""
    s0, m0 = _scale_min(sc[r], 12 * b, 2 * k)
    s1, m1 = _scale_min(sc[r], 12 * b, 2 * k + 1)
    return dd * s0, dd * s1, m0, m1


@njit(inline="always")
def _k4_quants(qh, qs, fifth, r, b, k, l):
    """The two quants of byte l of sub-block pair k: values 64 k + l and 64 k + 32 + l."""
    byte = qs[r, 128 * b + 32 * k + l]
    if not fifth:
        return np.float32(byte & 15), np.float32(byte >> 4)
    h = qh[r, 32 * b + l] >> (2 * k)
    return np.float32((byte & 15) | ((h & 1) << 4)), np.float32((byte >> 4) | ((h & 2) << 3))


@njit(inline="always")
def _k4_dequant(d, dmin, sc, qh, qs, fifth, r0, r1, out):
    for r in range(r0, r1):
        for b in range(d.shape[1]):
            dd = f16_to_f32(d[r, b])
            dm = f16_to_f32(dmin[r, b])
            for k in range(4):
                d0, d1, m0, m1 = _k4_pair(dd, sc, r, b, k)
                n0 = dm * m0
                n1 = dm * m1
                o = QK * b + 64 * k
                for l in range(32):
                    v0, v1 = _k4_quants(qh, qs, fifth, r, b, k, l)
                    out[r - r0, o + l] = d0 * v0 - n0
                    out[r - r0, o + 32 + l] = d1 * v1 - n1


@njit(inline="always")
def _k4_dot(d, dmin, sc, qh, qs, fifth, r, X, xsum, i):
    acc = np.zeros(32, np.float32)
    macc = _F0
    for b in range(d.shape[1]):
        dd = f16_to_f32(d[r, b])
        dm = f16_to_f32(dmin[r, b])
        for k in range(4):
            d0, d1, m0, m1 = _k4_pair(dd, sc, r, b, k)
            o = QK * b + 64 * k
            for l in range(32):
                v0, v1 = _k4_quants(qh, qs, fifth, r, b, k, l)
                acc[l] += d0 * (v0 * X[i, o + l]) + d1 * (v1 * X[i, o + 32 + l])
            g = 8 * b + 2 * k
            macc += dm * (m0 * xsum[i, g] + m1 * xsum[i, g + 1])
    return acc.sum() - macc


@njit(parallel=False, nogil=True, cache=True)
def q4k_dequant(d, dmin, sc, qs, r0, r1, out):
    _k4_dequant(d, dmin, sc, qs, qs, False, r0, r1, out)


@njit(parallel=False, nogil=True, cache=True)
def q5k_dequant(d, dmin, sc, qh, qs, r0, r1, out):
    _k4_dequant(d, dmin, sc, qh, qs, True, r0, r1, out)


@njit(inline="always")
def _q4k_dot(d, dmin, sc, qs, _4, _flag, r, X, xsum, i):
    return _k4_dot(d, dmin, sc, qs, qs, False, r, X, xsum, i)


@njit(inline="always")
def _q5k_dot(d, dmin, sc, qh, qs, _flag, r, X, xsum, i):
    return _k4_dot(d, dmin, sc, qh, qs, True, r, X, xsum, i)


q4k_matmul_small = matmul_small("q4k_matmul_small", __file__, _q4k_dot, lead=3)
q5k_matmul_small = matmul_small("q5k_matmul_small", __file__, _q5k_dot, lead=4)


# ------------------------------------------------------------ q6k


@njit(inline="always")
def _q6(ql, qh, r, b, h, g, l):
    """The signed 6-bit value (-32..31) of element 128 h + 32 g + l of super-block b."""
    byte = np.int32(ql[r, 128 * b + 64 * h + 32 * (g & 1) + l])
    lo = (byte >> 4) if g >= 2 else (byte & 15)
    hi = (np.int32(qh[r, 64 * b + 32 * h + l]) >> (2 * g)) & 3
    return np.float32(np.int32(lo | (hi << 4)) - 32)


def _sixteen_scales_dequant(q0, q1, sc, d, r0, r1, out):
    """The template of q6k's and q3k's dequantization (``_sixteen_scales_dot``'s layout):
    VALUE(q0, q1, r, b, h, g, l) is element 128 h + 32 g + l of super-block b, signed."""
    for r in range(r0, r1):
        for b in range(d.shape[1]):
            dd = f16_to_f32(d[r, b])
            for h in range(2):
                for g in range(4):
                    da = dd * SCALE(sc, r, b, 8 * h + 2 * g)  # noqa: F821 - bound by specialise
                    db = dd * SCALE(sc, r, b, 8 * h + 2 * g + 1)  # noqa: F821
                    o = QK * b + 128 * h + 32 * g
                    for l in range(16):
                        out[r - r0, o + l] = da * VALUE(q0, q1, r, b, h, g, l)  # noqa: F821
                    for l in range(16, 32):
                        out[r - r0, o + l] = db * VALUE(q0, q1, r, b, h, g, l)  # noqa: F821


def _sixteen_scales_dot(q0, q1, sc, d, _4, _flag, r, X, xsum, i):
    """The template of q6k's and q3k's row dots: a super-block is two 128-value halves of
    four 32-value groups whose quants share their bytes (VALUES: lane l of the four
    groups of half h) with sixteen scales of 16 values (SCALE: scale j, signed)."""
    acc = np.zeros(32, np.float32)
    for b in range(d.shape[1]):
        dd = f16_to_f32(d[r, b])
        for h in range(2):
            xo = QK * b + 128 * h
            for half in range(2):
                d0 = dd * SCALE(sc, r, b, 8 * h + half)  # noqa: F821 - bound by specialise
                d1 = dd * SCALE(sc, r, b, 8 * h + 2 + half)  # noqa: F821
                d2 = dd * SCALE(sc, r, b, 8 * h + 4 + half)  # noqa: F821
                d3 = dd * SCALE(sc, r, b, 8 * h + 6 + half)  # noqa: F821
                for l in range(16 * half, 16 * half + 16):
                    v0, v1, v2, v3 = VALUES(q0, q1, r, b, h, l)  # noqa: F821
                    acc[l] += (
                        d0 * (v0 * X[i, xo + l])
                        + d1 * (v1 * X[i, xo + 32 + l])
                        + d2 * (v2 * X[i, xo + 64 + l])
                        + d3 * (v3 * X[i, xo + 96 + l])
                    )
    return acc.sum()


def sixteen_scales_kernels(dtype: str, source: str, scale, value, values):
    """The dequantization kernel and the small-batch row dot of a dtype of
    ``_sixteen_scales_dot``'s layout, from its inline helpers (in ``source``): ``scale``
    (scale j), ``value`` (one element) and ``values`` (lane l of a half's four groups)."""
    dequant = specialise(_sixteen_scales_dequant, f"{dtype}_dequant", source, SCALE=scale, VALUE=value)
    row_dot = specialise(_sixteen_scales_dot, f"_{dtype}_dot", source, SCALE=scale, VALUES=values)
    return njit(parallel=False, nogil=True, cache=True)(dequant), njit(inline="always")(row_dot)


@njit(inline="always")
def _q6_scale(sc, r, b, j):
    return np.float32(sc[r, 16 * b + j])


@njit(inline="always")
def _q6_values(ql, qh, r, b, h, l):
    """ql[qo + l] holds groups 0 and 2, ql[qo + 32 + l] groups 1 and 3, qh[ho + l] the top
    bits of all four."""
    qo = 128 * b + 64 * h
    a = ql[r, qo + l]
    c = ql[r, qo + 32 + l]
    hb = qh[r, 64 * b + 32 * h + l]
    return (
        np.float32(np.int32((a & 15) | ((hb & 3) << 4)) - 32),
        np.float32(np.int32((c & 15) | (((hb >> 2) & 3) << 4)) - 32),
        np.float32(np.int32((a >> 4) | (((hb >> 4) & 3) << 4)) - 32),
        np.float32(np.int32((c >> 4) | (((hb >> 6) & 3) << 4)) - 32),
    )


q6k_dequant, _q6k_dot = sixteen_scales_kernels("q6k", __file__, _q6_scale, _q6, _q6_values)
q6k_matmul_small = matmul_small("q6k_matmul_small", __file__, _q6k_dot, lead=0)


# ------------------------------------------------------------ q4_0 (blocks of 32)


@njit(inline="always")
def _q4_0_pair(q, r, b, j):
    """value = d * (q - 8): elements j and j + 16 share byte j of the block."""
    byte = np.int32(q[r, 16 * b + j])
    return np.float32((byte & 15) - 8), np.float32((byte >> 4) - 8)


q4_0_dequant, q4_0_matmul_small = scaled_kernels("q4_0", __file__, _q4_0_pair)
