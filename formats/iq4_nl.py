"""iq4_nl: llama.cpp's IQ4_NL, 4.5 bits per weight on a non-linear grid.

A block of 32 values has one f16 ``d``; each value is a 4-bit index into
``KVALUES_IQ4NL`` (16 levels, denser near zero, as trained weights are):

    value = d * KVALUES_IQ4NL[q]

ggml's ``block_iq4_nl`` is ``d`` (f16) and ``qs`` (16 bytes: element j in the low
nibble of byte j, j + 16 in the high nibble): 18 bytes. CMF stores those fields as
planar parts in that order, so a GGUF tensor's blocks copy bit for bit. IQ4_XS
(``formats/iq4_xs.py``) puts eight of these blocks under one f16 and 6-bit scales;
it falls back to this type where a row is not a multiple of 256, as llama.cpp's does.

The encoder of both is ggml's ``quantize_row_iq4_nl_impl`` (``ntry`` = 7, as
``quantize_iq4_nl`` and ``quantize_iq4_xs`` call it), operation for operation in f32:
per block of 32 the scale that maximizes ``sum(w x q)^2 / sum(w q^2)`` over 15 trial
inverse scales, weights ``x^2`` or, with an imatrix, ``importance * sqrt(sigma2 +
x^2)`` (sigma2 over the super-block); IQ4_NL stores that scale as it is, IQ4_XS
quantizes the eight to 6 bits relative to the largest; then the indices are re-picked
for the stored scale.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from formats.kquant_kernels import _EPS, _F0, _F1, _nearest, _signed_max
from formats.quants import QBLOCK, Blocked

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
NTRY = 7  # ggml's quantize_iq4_nl and quantize_iq4_xs


def grid_values(qs: np.ndarray, n: int) -> np.ndarray:
    """The levels of ``n`` blocks' packed indices, f32 [n, blocks of 32 each, 32]."""
    q = (qs.reshape(n, -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return KVALUES_IQ4NL.astype(np.float32)[q.reshape(n, -1, 32)]


def dequantize_iq4_nl(d, qs) -> np.ndarray:
    """value = d * KVALUES_IQ4NL[q]: gguf-py's f32 operations, so its bits."""
    rows = qs.shape[0]
    n = d.size
    return (d.reshape(n, 1, 1).astype(np.float32) * grid_values(qs, n)).reshape(rows, -1)


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


@njit(inline="always")
def _pick(values, iD, x, s, L, o):
    """Indices of x[s:s+32] at inverse scale ``iD`` into L[o:o+32]."""
    for j in range(QBLOCK):
        L[o + j] = _best_index(values, iD * x[s + j])


@njit(cache=True, nogil=True)
def _block_scale(x, s, w, values, ntry, L, o):  # pragma: no cover - compiled
    """ggml's search of one block, x[s:s+32] weighted by ``w``: its scale (0 for a block of
    zeros); L[o:o+32] gets the first guess's indices."""
    amax, mx = _signed_max(x[s : s + QBLOCK])
    if amax < _EPS:
        return _F0
    v0 = np.float32(values[0])
    d = -mx / v0 if ntry > 0 else mx / v0
    iD = _F1 / d
    sumqx = _F0
    sumq2 = _F0
    for j in range(QBLOCK):
        l = _best_index(values, iD * x[s + j])
        L[o + j] = l
        q = np.float32(values[l])
        sumqx += w[j] * q * x[s + j]
        sumq2 += w[j] * q * q
    d = sumqx / sumq2 if sumq2 > _F0 else _F0
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        iD = (np.float32(itry) + v0) / mx
        sumqx = _F0
        sumq2 = _F0
        for j in range(QBLOCK):
            q = np.float32(values[_best_index(values, iD * x[s + j])])
            sumqx += w[j] * q * x[s + j]
            sumq2 += w[j] * q * q
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True, nogil=True)
def _six_bit_scales(x, o, values, sc, L, nsub):  # pragma: no cover - compiled
    """IQ4_XS: the super-scale d = -(the largest sub-block scale) / 32, each sub-block's
    scale as a 6-bit code (into ``sc``, 0..63) and its indices re-picked for it; returns
    (d as f32, scales_h)."""
    max_scale = _F0
    amax_scale = _F0
    for ib in range(nsub):
        if abs(sc[ib]) > amax_scale:
            amax_scale = abs(sc[ib])
            max_scale = sc[ib]
    d = -max_scale / np.float32(32)
    iD = _F1 / d if d != _F0 else _F0
    sh = 0
    for ib in range(nsub):
        l = max(-32, min(31, _nearest(iD * sc[ib])))
        dl = d * np.float32(l)
        _pick(values, _F1 / dl if dl != _F0 else _F0, x, o + QBLOCK * ib, L, QBLOCK * ib)
        l += 32
        sc[ib] = np.float32(l)
        sh |= (l >> 4) << (2 * ib)
    return d, sh


@njit(cache=True, nogil=True)
def _iq4_row(x, r, imp, use_imp, values, nsub, d, scales_h, scales_l, qs):  # pragma: no cover - compiled
    """quantize_row_iq4_nl_impl(32 nsub, 32, ...) of each block of row r: IQ4_NL's one
    sub-block (``nsub`` 1) or IQ4_XS's eight under 6-bit scales (``scales_h``, ``scales_l``)."""
    n = QBLOCK * nsub
    L = np.zeros(n, np.int32)
    w = np.empty(QBLOCK, np.float32)
    sc = np.empty(nsub, np.float32)
    xr = x[r]
    for b in range(x.shape[1] // n):
        o = n * b
        sigma2 = _F0
        for j in range(n):
            sigma2 += xr[o + j] * xr[o + j]
        sigma2 *= np.float32(2.0) / np.float32(n)
        for ib in range(nsub):
            s = o + QBLOCK * ib
            for j in range(QBLOCK):
                w[j] = imp[s + j] * np.sqrt(sigma2 + xr[s + j] * xr[s + j]) if use_imp else xr[s + j] * xr[s + j]
            sc[ib] = _block_scale(xr, s, w, values, NTRY, L, QBLOCK * ib)
        if nsub > 1:
            dd, sh = _six_bit_scales(xr, o, values, sc, L, nsub)
            scales_h[r, b] = sh
            for k in range(nsub // 2):
                scales_l[r, 4 * b + k] = (np.int32(sc[2 * k]) & 15) | ((np.int32(sc[2 * k + 1]) & 15) << 4)
        else:
            dd = sc[0]
            _pick(values, _F1 / dd if dd != _F0 else _F0, xr, o, L, 0)
        d[r, b] = dd
        for i in range(nsub):
            for j in range(16):
                qs[r, 16 * (nsub * b + i) + j] = L[QBLOCK * i + j] | (L[QBLOCK * i + 16 + j] << 4)


@njit(cache=True, nogil=True, parallel=True)
def iq4_rows(x, imp, use_imp, values, nsub, scales_h, scales_l, d, qs):  # pragma: no cover - compiled
    """Every row of x by ``_iq4_row``; IQ4_NL passes empty ``scales_h`` and ``scales_l``."""
    for r in prange(x.shape[0]):
        _iq4_row(x, r, imp, use_imp, values, nsub, d, scales_h, scales_l, qs)


_NO_SCALES = np.zeros((0, 0), np.uint16), np.zeros((0, 0), np.uint8)


class IQ4_NL(Blocked):
    """ggml IQ4_NL: 4-bit indices into a 16-level non-linear grid, one f16 scale per 32
    values: 18 bytes per 32 values = 4.5 bits/weight; IQ4_XS's fallback."""

    name = "iq4_nl"
    fields = (("d", "<f2", 1), ("qs", "u1", QBLOCK // 2))
    bits = 4.5
    ggml_type = "IQ4_NL"
    takes_imatrix = True
    # Blocks of 32 under one stored scale (IQ4_XS: 8, each with a 6-bit scale of its own).
    subblocks = 1

    dequantize = staticmethod(dequantize_iq4_nl)

    def compiled_encoder(self):
        # no sub-block scales: the encoder gets empty ones in their place
        return iq4_rows, (KVALUES_IQ4NL, self.subblocks, *_NO_SCALES)
