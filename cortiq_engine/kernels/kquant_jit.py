"""Compiled (numba) kernels of the K-quant dtypes q6k, q5k, q4k (ggml's Q6_K, Q5_K,
Q4_K super-blocks of 256 values, stored planar: ``formats.quants``), and of q4_0
(ggml's Q4_0, blocks of 32: the 4.5-bit type for rows no K-quant fits).

Two kernels per dtype, beside their numpy twins (``formats.quants.dequantize_q*k``):
``*_dequant`` turns rows r0..r1 into f32 exactly as the twin does (same f32
operations, no fast-math: bit for bit), for prefill tiles; ``*_matmul_small`` is the
decode matvec over 1..small_n input rows and up to three fused matrices, in the
shape of ``jit.q4_matmul_small``: each (weight row, input row) is summed on its own
in 32 lanes, so a row's result does not depend on how many rows share the call.

Scales and mins unpack per super-block: value = (d * sc) * q - (dmin * m) for
q5k/q4k, (d * sc) * (q - 32) for q6k. The min term factors out of the dot product:
``xsum[i, g]`` is the sum of input row i over 32-value group g.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cortiq_engine.kernels.jit import PREFETCH_ROWS, f16_to_f32, prefetch_row

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


# ------------------------------------------------------------ q4k


@njit(parallel=False, nogil=True, cache=True)
def q4k_dequant(d, dmin, sc, qs, r0, r1, out):
    nsb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nsb):
            dd = f16_to_f32(d[r, b])
            dm = f16_to_f32(dmin[r, b])
            for k in range(4):
                s0, m0 = _scale_min(sc[r], 12 * b, 2 * k)
                s1, m1 = _scale_min(sc[r], 12 * b, 2 * k + 1)
                d0 = dd * s0
                d1 = dd * s1
                n0 = dm * m0
                n1 = dm * m1
                o = QK * b + 64 * k
                ob = 128 * b + 32 * k
                for l in range(32):
                    byte = qs[r, ob + l]
                    out[r - r0, o + l] = d0 * np.float32(byte & 15) - n0
                    out[r - r0, o + 32 + l] = d1 * np.float32(byte >> 4) - n1


@njit(parallel=True, fastmath=True, cache=True)
def q4k_matmul_small(ds, dmins, scs, qss, count, offs, X, xsum, out):
    n, cols = X.shape
    nsb = cols // QK
    for m in range(count):
        d = ds[m]
        dmin = dmins[m]
        sc = scs[m]
        q = qss[m]
        base = offs[m]
        for r in prange(q.shape[0]):
            prefetch_row(q, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(32, np.float32)
                macc = _F0
                for b in range(nsb):
                    dd = f16_to_f32(d[r, b])
                    dm = f16_to_f32(dmin[r, b])
                    for k in range(4):
                        s0, m0 = _scale_min(sc[r], 12 * b, 2 * k)
                        s1, m1 = _scale_min(sc[r], 12 * b, 2 * k + 1)
                        d0 = dd * s0
                        d1 = dd * s1
                        o = QK * b + 64 * k
                        ob = 128 * b + 32 * k
                        for l in range(32):
                            byte = q[r, ob + l]
                            acc[l] += d0 * (np.float32(byte & 15) * X[i, o + l]) + d1 * (
                                np.float32(byte >> 4) * X[i, o + 32 + l]
                            )
                        g = 8 * b + 2 * k
                        macc += dm * (m0 * xsum[i, g] + m1 * xsum[i, g + 1])
                out[i, base + r] = acc.sum() - macc


# ------------------------------------------------------------ q5k


@njit(parallel=False, nogil=True, cache=True)
def q5k_dequant(d, dmin, sc, qh, qs, r0, r1, out):
    nsb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nsb):
            dd = f16_to_f32(d[r, b])
            dm = f16_to_f32(dmin[r, b])
            for k in range(4):
                s0, m0 = _scale_min(sc[r], 12 * b, 2 * k)
                s1, m1 = _scale_min(sc[r], 12 * b, 2 * k + 1)
                d0 = dd * s0
                d1 = dd * s1
                n0 = dm * m0
                n1 = dm * m1
                o = QK * b + 64 * k
                ob = 128 * b + 32 * k
                for l in range(32):
                    byte = qs[r, ob + l]
                    h = qh[r, 32 * b + l] >> (2 * k)
                    out[r - r0, o + l] = d0 * np.float32((byte & 15) | ((h & 1) << 4)) - n0
                    out[r - r0, o + 32 + l] = d1 * np.float32((byte >> 4) | ((h & 2) << 3)) - n1


@njit(parallel=True, fastmath=True, cache=True)
def q5k_matmul_small(ds, dmins, scs, qhs, qss, count, offs, X, xsum, out):
    n, cols = X.shape
    nsb = cols // QK
    for m in range(count):
        d = ds[m]
        dmin = dmins[m]
        sc = scs[m]
        qh = qhs[m]
        q = qss[m]
        base = offs[m]
        for r in prange(q.shape[0]):
            prefetch_row(q, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(32, np.float32)
                macc = _F0
                for b in range(nsb):
                    dd = f16_to_f32(d[r, b])
                    dm = f16_to_f32(dmin[r, b])
                    for k in range(4):
                        s0, m0 = _scale_min(sc[r], 12 * b, 2 * k)
                        s1, m1 = _scale_min(sc[r], 12 * b, 2 * k + 1)
                        d0 = dd * s0
                        d1 = dd * s1
                        o = QK * b + 64 * k
                        ob = 128 * b + 32 * k
                        for l in range(32):
                            byte = q[r, ob + l]
                            h = qh[r, 32 * b + l] >> (2 * k)
                            v0 = np.float32((byte & 15) | ((h & 1) << 4))
                            v1 = np.float32((byte >> 4) | ((h & 2) << 3))
                            acc[l] += d0 * (v0 * X[i, o + l]) + d1 * (v1 * X[i, o + 32 + l])
                        g = 8 * b + 2 * k
                        macc += dm * (m0 * xsum[i, g] + m1 * xsum[i, g + 1])
                out[i, base + r] = acc.sum() - macc


# ------------------------------------------------------------ q6k


@njit(inline="always")
def _q6(ql, qh, r, b, h, g, l):
    """The 6-bit value (0..63) of element 128 h + 32 g + l of super-block b."""
    byte = np.int32(ql[r, 128 * b + 64 * h + 32 * (g & 1) + l])
    lo = (byte >> 4) if g >= 2 else (byte & 15)
    hi = (np.int32(qh[r, 64 * b + 32 * h + l]) >> (2 * g)) & 3
    return lo | (hi << 4)


@njit(parallel=False, nogil=True, cache=True)
def q6k_dequant(ql, qh, sc, d, r0, r1, out):
    nsb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nsb):
            dd = f16_to_f32(d[r, b])
            for h in range(2):
                for g in range(4):
                    s = 16 * b + 8 * h + 2 * g
                    da = dd * np.float32(sc[r, s])
                    db = dd * np.float32(sc[r, s + 1])
                    o = QK * b + 128 * h + 32 * g
                    for l in range(16):
                        out[r - r0, o + l] = da * np.float32(np.int32(_q6(ql, qh, r, b, h, g, l)) - 32)
                    for l in range(16, 32):
                        out[r - r0, o + l] = db * np.float32(np.int32(_q6(ql, qh, r, b, h, g, l)) - 32)


@njit(parallel=True, fastmath=True, cache=True)
def q6k_matmul_small(qls, qhs, scs, ds, count, offs, X, out):
    n, cols = X.shape
    nsb = cols // QK
    for m in range(count):
        ql = qls[m]
        qh = qhs[m]
        sc = scs[m]
        d = ds[m]
        base = offs[m]
        for r in prange(ql.shape[0]):
            prefetch_row(ql, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(32, np.float32)
                for b in range(nsb):
                    dd = f16_to_f32(d[r, b])
                    for h in range(2):
                        qo = 128 * b + 64 * h
                        ho = 64 * b + 32 * h
                        xo = QK * b + 128 * h
                        s = 16 * b + 8 * h
                        # the four 32-value groups share the bytes: ql[qo + l] holds groups 0 and 2,
                        # ql[qo + 32 + l] groups 1 and 3, qh[ho + l] the top bits of all four
                        for half in range(2):
                            d0 = dd * np.float32(sc[r, s + half])
                            d1 = dd * np.float32(sc[r, s + 2 + half])
                            d2 = dd * np.float32(sc[r, s + 4 + half])
                            d3 = dd * np.float32(sc[r, s + 6 + half])
                            for l in range(16 * half, 16 * half + 16):
                                a = ql[r, qo + l]
                                c = ql[r, qo + 32 + l]
                                hb = qh[r, ho + l]
                                v0 = np.float32(np.int32((a & 15) | ((hb & 3) << 4)) - 32)
                                v1 = np.float32(np.int32((c & 15) | (((hb >> 2) & 3) << 4)) - 32)
                                v2 = np.float32(np.int32((a >> 4) | (((hb >> 4) & 3) << 4)) - 32)
                                v3 = np.float32(np.int32((c >> 4) | (((hb >> 6) & 3) << 4)) - 32)
                                acc[l] += (
                                    d0 * (v0 * X[i, xo + l])
                                    + d1 * (v1 * X[i, xo + 32 + l])
                                    + d2 * (v2 * X[i, xo + 64 + l])
                                    + d3 * (v3 * X[i, xo + 96 + l])
                                )
                out[i, base + r] = acc.sum()


# ------------------------------------------------------------ q4_0 (blocks of 32)

QB = 32


@njit(parallel=False, nogil=True, cache=True)
def q4_0_dequant(d, qs, r0, r1, out):
    nb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nb):
            sc = f16_to_f32(d[r, b])
            o = QB * b
            ob = 16 * b
            for j in range(16):
                byte = np.int32(qs[r, ob + j])
                out[r - r0, o + j] = sc * np.float32((byte & 15) - 8)
                out[r - r0, o + j + 16] = sc * np.float32((byte >> 4) - 8)


@njit(parallel=True, fastmath=True, cache=True)
def q4_0_matmul_small(ds, qss, count, offs, X, out):
    """value = d * (q - 8): each (weight row, input row) summed on its own in 32 lanes."""
    n, cols = X.shape
    nb = cols // QB
    for m in range(count):
        d = ds[m]
        q = qss[m]
        base = offs[m]
        for r in prange(q.shape[0]):
            prefetch_row(q, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(QB, np.float32)
                for b in range(nb):
                    sc = f16_to_f32(d[r, b])
                    o = QB * b
                    ob = 16 * b
                    for j in range(16):
                        byte = np.int32(q[r, ob + j])
                        acc[j] += sc * (np.float32((byte & 15) - 8) * X[i, o + j])
                        acc[j + 16] += sc * (np.float32((byte >> 4) - 8) * X[i, o + j + 16])
                out[i, base + r] = acc.sum()
