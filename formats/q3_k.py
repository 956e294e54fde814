"""q3k: llama.cpp's Q3_K, 3.4375 bits per weight.

A super-block of 256 values is 16 sub-blocks of 16; each value is 3 bits (two low
bits in ``qs``, a high bit in ``hmask``), each sub-block has a 6-bit scale, the
super-block one f16 ``d``:

    value = d * (sc - 32) * (q - 4),  q = low | high << 2 in 0..7

ggml's ``block_q3_K`` is ``hmask`` (32 bytes: element 32 k + l's high bit is bit k
of byte l), ``qs`` (64 bytes: per half of 128, element 32 s + l's low bits at shift
2 s of byte l), ``scales`` (12 bytes: scale j's low nibble in byte j (j < 8) or the
high nibble of byte j - 8, its top two bits at shift 2 (j / 4) of byte 8 + j % 4) and
``d``: 110 bytes. CMF stores those fields as planar parts in that order, so a GGUF
tensor's blocks copy bit for bit.

The encoder is ggml's: ``quantize_row_q3_K_ref`` without an imatrix
(``make_q3_quants`` per sub-block, 6-bit scales relative to the largest), and
``quantize_row_q3_K_impl`` with one (``make_qx_quants`` weighted by ``importance *
sqrt(sigma2 + x^2)``, the scales themselves fitted by weighted least squares),
operation for operation in f32.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from formats.kquant_kernels import _EPS, _F0, _F1, _fit_levels, _importance_weights, _make_qx, _nearest, _signed_max
from formats.quant_kernels import _f16_round
from formats.quants import QK_K, SuperBlocked


def scales_q3k(scales: np.ndarray) -> np.ndarray:
    """The sixteen 6-bit sub-block scales minus 32, int8 [n, 16], from the 12 packed bytes."""
    s = scales.reshape(-1, 12)
    n = s.shape[0]
    lo = (s[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (s[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    return ((lo & np.uint8(15)) | ((hi & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)


def dequantize_q3k(hmask, qs, scales, d) -> np.ndarray:
    """value = (d * (sc - 32)) * (q - 4): gguf-py's f32 operations, so its bits."""
    rows = qs.shape[0]
    n = d.size
    dl = (d.reshape(n, 1).astype(np.float32) * scales_q3k(scales).astype(np.float32)).reshape(n, 16, 1)
    ql = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)
    ql = ql.reshape(n, 16, 16) & np.uint8(3)
    qh = (qh.reshape(n, 16, 16) & np.uint8(1)) ^ np.uint8(1)  # a clear high bit subtracts 4
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(rows, -1)


# ---------------------------------------------------------------- the encoder


@njit(cache=True, nogil=True)
def _make_q3(x, L):  # pragma: no cover - compiled
    """make_q3_quants(16, 4, x, L, do_rmse=true): L in 0..7, returns the scale."""
    n = x.shape[0]
    nmax = 4
    amax, mx = _signed_max(x)
    if amax < _EPS:
        L[:] = 0
        return _F0
    sumlx, suml2 = _fit_levels(x, np.float32(-nmax) / mx, nmax, x, False, L, True)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = np.float32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > _F0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, _nearest(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    nf = np.float32(new_l)
                    slx += w * x[i] * nf
                    sl2 += w * nf * nf
                    if sl2 > _F0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2


@njit(inline="always")
def _pack_scale(scb, j, l):
    """Scale code l (0..63) of sub-block j into the 12 bytes ``scb`` (zeroed first)."""
    l = np.int32(l)
    if j < 8:
        scb[j] = l & 0xF
    else:
        scb[j - 8] = np.int32(scb[j - 8]) | ((l & 0xF) << 4)
    scb[j % 4 + 8] = np.int32(scb[j % 4 + 8]) | ((l >> 4) << (2 * (j // 4)))


@njit(cache=True, nogil=True, parallel=True)
def q3k_rows(x, imp, use_imp, hmask, qs, scales, d):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(QK_K, np.int32)
        Ls = np.empty(16, np.int32)
        sc = np.empty(16, np.float32)
        sw = np.empty(16, np.float32)
        w = np.empty(16, np.float32)
        xr = x[r]
        for b in range(cols // QK_K):
            o = QK_K * b
            scb = scales[r, 12 * b : 12 * b + 12]
            scb[:] = 0
            if use_imp:  # quantize_row_q3_K_impl
                for j in range(16):
                    _importance_weights(xr, o + 16 * j, imp, w)
                    sumw = _F0
                    for l in range(16):
                        sumw += w[l]
                    sw[j] = sumw
                    sc[j] = _make_qx(xr[o + 16 * j : o + 16 * j + 16], L[16 * j : 16 * j + 16], 4, w, True)
                d_block = _make_qx(sc, Ls, 32, sw, True)
                for j in range(16):
                    _pack_scale(scb, j, Ls[j])
                dd = _f16_round(d_block)
            else:  # quantize_row_q3_K_ref
                max_scale = _F0
                amax = _F0
                for j in range(16):
                    sc[j] = _make_q3(xr[o + 16 * j : o + 16 * j + 16], L[16 * j : 16 * j + 16])
                    if abs(sc[j]) > amax:
                        amax = abs(sc[j])
                        max_scale = sc[j]
                if max_scale != _F0:
                    iscale = np.float32(-32) / max_scale
                    for j in range(16):
                        _pack_scale(scb, j, max(-32, min(31, _nearest(iscale * sc[j]))) + 32)
                    dd = _f16_round(_F1 / iscale)
                else:
                    dd = _F0
            d[r, b] = dd
            for j in range(16):
                lo = (np.int32(scb[j]) & 0xF) if j < 8 else (np.int32(scb[j - 8]) >> 4)
                s6 = (lo | (((np.int32(scb[8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
                dj = dd * np.float32(s6)
                if dj == _F0:
                    continue
                for ii in range(16):
                    L[16 * j + ii] = max(-4, min(3, _nearest(xr[o + 16 * j + ii] / dj))) + 4
            hm = hmask[r, 32 * b : 32 * b + 32]
            hm[:] = 0
            for j in range(QK_K):
                if L[j] > 3:
                    hm[j % 32] = np.int32(hm[j % 32]) | (1 << (j // 32))
                    L[j] -= 4
            for h in range(2):
                for l in range(32):
                    j = 128 * h + l
                    qs[r, 64 * b + 32 * h + l] = L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)


class Q3K(SuperBlocked):
    """ggml Q3_K: 3-bit values in 16 groups of 16, a 6-bit scale per group, one f16
    super-scale: 110 bytes per 256 values = 3.4375 bits/weight."""

    name = "q3k"
    fields = (("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2", 1))
    bits = 3.4375
    ggml_type = "Q3_K"
    # llama.cpp's fallback for Q3_K (llama-quant.cpp).
    fallback = "q4_0"

    dequantize = staticmethod(dequantize_q3k)

    def compiled_encoder(self):
        return q3k_rows, ()
