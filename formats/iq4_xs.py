"""iq4_xs: llama.cpp's IQ4_XS, 4.25 bits per weight on a non-linear grid.

A super-block of 256 values is 8 sub-blocks of 32; each value is a 4-bit index into
``KVALUES_IQ4NL`` (16 levels, denser near zero, as trained weights are), each
sub-block has a 6-bit scale, the super-block one f16 ``d``:

    value = d * (ls - 32) * KVALUES_IQ4NL[q]

ggml's ``block_iq4_xs`` is ``d`` (f16), ``scales_h`` (u16: the top two bits of the
eight scales, sub-block ib at bits 2 ib), ``scales_l`` (4 bytes: the low nibbles,
sub-block ib in byte ib / 2, low nibble first) and ``qs`` (128 bytes: per sub-block
16 bytes, element j in the low nibble of byte j, j + 16 in the high nibble): 136
bytes. CMF stores those fields as planar parts in that order, so a GGUF tensor's
blocks copy bit for bit.

The encoder is ggml's ``quantize_row_iq4_nl_impl`` (as ``quantize_iq4_xs`` calls it:
``ntry`` = 7), operation for operation in f32: per sub-block the scale that maximizes
``sum(w x q)^2 / sum(w q^2)`` over 15 trial inverse scales, weights ``x^2`` or, with
an imatrix, ``importance * sqrt(sigma2 + x^2)``; then the 6-bit scales relative to
the largest and the indices re-picked for them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from formats.kquant_kernels import _EPS, _F0, _F1, _nearest, _signed_max
from formats.quants import QK_K, SuperBlocked

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
NTRY = 7  # ggml's quantize_iq4_xs


def scales_iq4_xs(scales_h: np.ndarray, scales_l: np.ndarray) -> np.ndarray:
    """The eight 6-bit sub-block scales minus 32, int8 [n, 8], from the packed parts."""
    n = scales_h.size
    lo = (scales_l.reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(n, 8) & np.uint8(15)
    hi = (scales_h.reshape(n, 1) >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)).astype(np.uint8) & np.uint8(3)
    return (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)


def dequantize_iq4_xs(d, scales_h, scales_l, qs) -> np.ndarray:
    """value = (d * (ls - 32)) * KVALUES_IQ4NL[q]: gguf-py's f32 operations, so its bits."""
    rows = qs.shape[0]
    n = d.size
    dl = (d.reshape(n, 1).astype(np.float32) * scales_iq4_xs(scales_h, scales_l).astype(np.float32)).reshape(n, 8, 1)
    q = (qs.reshape(n, 8, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    v = KVALUES_IQ4NL.astype(np.float32)[q.reshape(n, 8, 32)]
    return (dl * v).reshape(rows, -1)


# ---------------------------------------------------------------- the encoder


@njit(inline="always")
def _best_index(values, x):
    """ggml's best_index_int8: the index of the level nearest ``x`` (ties to the upper)."""
    if x <= np.float32(values[0]):
        return 0
    if x >= np.float32(values[15]):
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < np.float32(values[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - np.float32(values[mu - 1]) < np.float32(values[mu]) - x else mu


@njit(cache=True, nogil=True)
def _superblock(x, o, imp, use_imp, values, ntry, L, w, sc):  # pragma: no cover - compiled
    """quantize_row_iq4_nl_impl(256, 32, ...) of x[o:o+256]: fills L (indices) and
    returns (d as f32, scales_h, the eight 6-bit scale codes via ``sc``)."""
    sigma2 = _F0
    for j in range(QK_K):
        sigma2 += x[o + j] * x[o + j]
    sigma2 *= np.float32(2.0) / np.float32(QK_K)
    v0 = np.float32(values[0])
    max_scale = _F0
    amax_scale = _F0
    for ib in range(8):
        s = o + 32 * ib
        if use_imp:
            for j in range(32):
                w[j] = imp[s + j] * np.sqrt(sigma2 + x[s + j] * x[s + j])
        else:
            for j in range(32):
                w[j] = x[s + j] * x[s + j]
        amax, mx = _signed_max(x[s : s + 32])
        if amax < _EPS:
            sc[ib] = _F0
            continue
        d = -mx / v0 if ntry > 0 else mx / v0
        iD = _F1 / d
        sumqx = _F0
        sumq2 = _F0
        for j in range(32):
            l = _best_index(values, iD * x[s + j])
            L[32 * ib + j] = l
            q = np.float32(values[l])
            sumqx += w[j] * q * x[s + j]
            sumq2 += w[j] * q * q
        d = sumqx / sumq2
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            iD = (np.float32(itry) + v0) / mx
            sumqx = _F0
            sumq2 = _F0
            for j in range(32):
                l = _best_index(values, iD * x[s + j])
                q = np.float32(values[l])
                sumqx += w[j] * q * x[s + j]
                sumq2 += w[j] * q * q
            if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        sc[ib] = d
        if abs(d) > amax_scale:
            amax_scale = abs(d)
            max_scale = d
    d = -max_scale / np.float32(32)
    iD = _F1 / d if d != _F0 else _F0
    sh = 0
    for ib in range(8):
        l = max(-32, min(31, _nearest(iD * sc[ib])))
        dl = d * np.float32(l)
        idl = _F1 / dl if dl != _F0 else _F0
        for j in range(32):
            L[32 * ib + j] = _best_index(values, idl * x[o + 32 * ib + j])
        l += 32
        sc[ib] = np.float32(l)  # the code, 0..63, for the packing
        sh |= (l >> 4) << (2 * ib)
    return d, sh


@njit(cache=True, nogil=True, parallel=True)
def iq4_xs_rows(x, imp, use_imp, values, d, scales_h, scales_l, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        L = np.zeros(QK_K, np.int32)
        w = np.empty(32, np.float32)
        sc = np.empty(8, np.float32)
        xr = x[r]
        for b in range(cols // QK_K):
            dd, sh = _superblock(xr, QK_K * b, imp, use_imp, values, NTRY, L, w, sc)
            d[r, b] = dd
            scales_h[r, b] = sh
            for k in range(4):
                scales_l[r, 4 * b + k] = (np.int32(sc[2 * k]) & 15) | ((np.int32(sc[2 * k + 1]) & 15) << 4)
            for i in range(8):
                for j in range(16):
                    qs[r, 128 * b + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


class IQ4_XS(SuperBlocked):
    """ggml IQ4_XS: 4-bit indices into a 16-level non-linear grid in 8 groups of 32, a
    6-bit scale per group, one f16 super-scale: 136 bytes per 256 values = 4.25 bits/weight."""

    name = "iq4_xs"
    fields = (("d", "<f2", 1), ("scales_h", "<u2", 1), ("scales_l", "u1", 4), ("qs", "u1", 128))
    bits = 4.25
    ggml_type = "IQ4_XS"
    # llama.cpp's fallback is IQ4_NL (the same grid per 32); q4_0 has its size.
    fallback = "q4_0"

    dequantize = staticmethod(dequantize_iq4_xs)

    def compiled_encoder(self):
        return iq4_xs_rows, (KVALUES_IQ4NL,)
