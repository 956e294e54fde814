"""Compiled (numba) kernels of q3k (llama.cpp's Q3_K, ``formats/q3_k.py``) and its
kernel record.

``q3k_dequant`` turns rows r0..r1 into f32 as the numpy twin
(``formats.q3_k.dequantize_q3k``) does, bit for bit (the same f32 operations);
``q3k_matmul_small`` is the decode matvec over 1..small_n input rows and up to three
fused matrices, in the shape of ``kquant_jit``'s: each (weight row, input row) summed on
its own in 32 lanes, so a row's result does not depend on how many rows share the call.
Element 128 h + 32 s + l of a super-block: low bits (qs[32 h + l] >> 2 s) & 3, high bit
bit 4 h + s of hmask[l] (clear: minus 4), scale 8 h + 2 s + l / 16. Decode and verify
take the integer-activation kernel of ``qdot.py`` (the record's ``kthree``) where the CPU
has AVX2; these float ones elsewhere and under ``numba-float``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cortiq_engine.kernels.dtype_ops import DtypeOps
from cortiq_engine.kernels.jit import PREFETCH_ROWS, f16_to_f32, prefetch_row

QK = 256


@njit(inline="always")
def _scale(sc, r, b, j):
    """The 6-bit scale of sub-block j (of 16) of super-block b, minus 32."""
    o = 12 * b
    lo = (np.int32(sc[r, o + j]) & 15) if j < 8 else (np.int32(sc[r, o + j - 8]) >> 4)
    hi = (np.int32(sc[r, o + 8 + j % 4]) >> (2 * (j // 4))) & 3
    return np.float32((lo | (hi << 4)) - 32)


@njit(inline="always")
def _q3(hm, qs, r, b, h, s, l):
    """The signed 3-bit value (-4..3) of element 128 h + 32 s + l of super-block b."""
    low = (np.int32(qs[r, 64 * b + 32 * h + l]) >> (2 * s)) & 3
    high = (np.int32(hm[r, 32 * b + l]) >> (4 * h + s)) & 1
    return np.float32(low - 4 + 4 * high)


@njit(parallel=False, nogil=True, cache=True)
def q3k_dequant(hm, qs, sc, d, r0, r1, out):
    nsb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nsb):
            dd = f16_to_f32(d[r, b])
            for h in range(2):
                for s in range(4):
                    da = dd * _scale(sc, r, b, 8 * h + 2 * s)
                    db = dd * _scale(sc, r, b, 8 * h + 2 * s + 1)
                    o = QK * b + 128 * h + 32 * s
                    for l in range(16):
                        out[r - r0, o + l] = da * _q3(hm, qs, r, b, h, s, l)
                    for l in range(16, 32):
                        out[r - r0, o + l] = db * _q3(hm, qs, r, b, h, s, l)


@njit(parallel=True, fastmath=True, cache=True)
def q3k_matmul_small(hms, qss, scs, ds, count, offs, X, out):
    n, cols = X.shape
    nsb = cols // QK
    for m in range(count):
        hm = hms[m]
        qs = qss[m]
        sc = scs[m]
        d = ds[m]
        base = offs[m]
        for r in prange(qs.shape[0]):
            prefetch_row(qs, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(32, np.float32)
                for b in range(nsb):
                    dd = f16_to_f32(d[r, b])
                    for h in range(2):
                        # the four 32-value groups of a half share the bytes: qs[32 h + l] holds
                        # their low bits at shifts 0, 2, 4, 6, hmask[l] their high bits
                        xo = QK * b + 128 * h
                        for half in range(2):
                            d0 = dd * _scale(sc, r, b, 8 * h + half)
                            d1 = dd * _scale(sc, r, b, 8 * h + 2 + half)
                            d2 = dd * _scale(sc, r, b, 8 * h + 4 + half)
                            d3 = dd * _scale(sc, r, b, 8 * h + 6 + half)
                            for l in range(16 * half, 16 * half + 16):
                                a = np.int32(qs[r, 64 * b + 32 * h + l])
                                hb = np.int32(hm[r, 32 * b + l]) >> (4 * h)
                                v0 = np.float32((a & 3) - 4 + 4 * (hb & 1))
                                v1 = np.float32(((a >> 2) & 3) - 4 + 2 * (hb & 2))
                                v2 = np.float32(((a >> 4) & 3) - 4 + (hb & 4))
                                v3 = np.float32(((a >> 6) & 3) - 4 + ((hb & 8) >> 1))
                                acc[l] += (
                                    d0 * (v0 * X[i, xo + l])
                                    + d1 * (v1 * X[i, xo + 32 + l])
                                    + d2 * (v2 * X[i, xo + 64 + l])
                                    + d3 * (v3 * X[i, xo + 96 + l])
                                )
                out[i, base + r] = acc.sum()


class Q3KOps(DtypeOps, dtype="q3k"):
    # Integer decode kernels (qdot._kbody): |q * (sc - 32)| <= 128, so int16 activations
    # keep their full range.
    int_widths, act_bits = (8, 16), 8
    kbody, kthree = True, True

    def small(self, parts, count, offs, X, out):
        q3k_matmul_small(parts[0], parts[1], parts[2], parts[3], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        q3k_dequant(parts[0], parts[1], parts[2], parts[3], r0, r1, out)
