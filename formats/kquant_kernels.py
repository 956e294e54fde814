"""Compiled (numba) encoders of the K-quant dtypes (q6k, q5k, q4k): ggml's reference
quantizers, ported operation for operation.

``quantize_row_q{4,5,6}_K_ref`` of ggml-quants.c (llama.cpp), with its searches:
``make_qkx2_quants`` (a scale and a min per 32 values: try ``nstep + 1`` inverse
scales around ``nmax / (max - min)``, refit each by weighted least squares, keep the
best) and ``make_qx_quants`` (a signed scale per 16 values, 18 trial scales, keep
the one with the largest ``sum(w x l)^2 / sum(w l^2)``). The same f32 operations in
the same order, no fused multiply-add: without importance weights the bytes equal
ggml's (tests/test_kquants.py checks them against llama.cpp's own library).

With ``importance`` (f32[cols], per input column: the mean squared activation an
imatrix collects) the searches weight each value by ``importance * sqrt(sigma2 +
x^2)`` (ggml's imatrix weighting, sigma2 = 2 * mean(x^2) over the super-block);
the scale quantization and the packing stay the same.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from formats.quant_kernels import LANES, NSUM, _f16_round, lanes_best, lanes_start

QK = 256
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS


@njit(inline="always")
def _nearest(v):
    """ggml's nearest_int: round half to even (its 1.5 * 2^23 trick)."""
    return np.int32(np.rint(v))


@njit(cache=True, nogil=True)
def _make_qkx2(x, w, L, Laux, nmax, rmin, rdelta, nstep):  # pragma: no cover - compiled
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        ww = w[i]
        sum_w += ww
        sum_x += ww * x[i]
    if mn > _F0:
        mn = _F0
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return _F0, -mn
    iscale = np.float32(nmax) / (mx - mn)
    scale = _F1 / iscale
    best_error = _F0
    for i in range(n):
        l = min(max(_nearest(iscale * (x[i] - mn)), 0), nmax)
        L[i] = l
        diff = scale * np.float32(l) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for st in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(st) + np.float32(nmax)) / (mx - mn)
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            l = min(max(_nearest(iscale * (x[i] - mn)), 0), nmax)
            Laux[i] = l
            ww = w[i]
            lf = np.float32(l)
            sum_l += ww * lf
            sum_l2 += ww * lf * lf
            sum_xl += ww * lf * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F0:
                this_min = _F0
                this_scale = sum_xl / sum_l2
            cur_error = _F0
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                cur_error += w[i] * (diff * diff)
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(inline="always")
def _signed_max(x):
    """(max |x|, the value that has it): the first of equal magnitudes, as ggml's strict >."""
    amax = _F0
    mx = _F0
    for i in range(x.shape[0]):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    return amax, mx


@njit(inline="always")
def _fit_levels(x, iscale, nmax, qw, use_qw, L, store):
    """Levels nearest(iscale x) in [-nmax, nmax - 1] (into L when ``store``) and their
    (sum w x l, sum w l^2), w = qw or, without ``use_qw``, x^2."""
    sumlx = _F0
    suml2 = _F0
    for i in range(x.shape[0]):
        l = max(-nmax, min(nmax - 1, _nearest(iscale * x[i])))
        if store:
            L[i] = l
        w = qw[i] if use_qw else x[i] * x[i]
        lf = np.float32(l)
        sumlx += w * x[i] * lf
        suml2 += w * lf * lf
    return sumlx, suml2


@njit(cache=True, nogil=True)
def _make_qx(x, L, nmax, qw, use_qw):  # pragma: no cover - compiled
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): weights x^2 unless ``use_qw``."""
    amax, mx = _signed_max(x)
    if amax < _EPS:
        L[:] = 0
        return _F0
    sumlx, suml2 = _fit_levels(x, np.float32(-nmax) / mx, nmax, qw, use_qw, L, True)
    scale = sumlx / suml2 if suml2 != _F0 else _F0
    best = scale * sumlx
    for st in range(-9, 10):
        if st == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(st)) / mx
        sumlx, suml2 = _fit_levels(x, iscale, nmax, qw, use_qw, L, False)
        if suml2 > _F0 and sumlx * sumlx > best * suml2:
            _fit_levels(x, iscale, nmax, qw, use_qw, L, True)
            scale = sumlx / suml2
            best = scale * sumlx
    for i in range(x.shape[0]):
        L[i] += nmax
    return scale


@njit(inline="always")
def _importance_weights(x, o, imp, weights):
    """ggml's imatrix weighting of one 32-value group at offset o of a super-block."""
    sum_x2 = _F0
    base = o // QK * QK
    for l in range(QK):
        sum_x2 += x[base + l] * x[base + l]
    sigma2 = np.float32(2) * sum_x2 / np.float32(QK)
    for l in range(weights.shape[0]):
        weights[l] = imp[o + l] * np.sqrt(sigma2 + x[o + l] * x[o + l])


@njit(inline="always")
def _scale_min_k4(j, sc):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        return sc[j] & 63, sc[j + 4] & 63
    return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)


@njit(inline="always")
def _qkx_block(x, o, imp, use_imp, nmax, rmin, rdelta, nstep, d_out, dmin_out, sc, L):
    """Scales, mins and levels of the super-block at x[o:o+256] (Q4_K and Q5_K)."""
    weights = np.empty(32, np.float32)
    Laux = np.empty(32, np.int32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    max_scale = _F0
    max_min = _F0
    for j in range(8):
        s = o + 32 * j
        if use_imp:
            _importance_weights(x, s, imp, weights)
        else:
            sum_x2 = _F0
            for l in range(32):
                sum_x2 += x[s + l] * x[s + l]
            av_x = np.sqrt(sum_x2 / np.float32(32))
            for l in range(32):
                weights[l] = av_x + abs(x[s + l])
        a, b = _make_qkx2(x[s : s + 32], weights, L[32 * j : 32 * j + 32], Laux, nmax, rmin, rdelta, nstep)
        scales[j] = a
        mins[j] = b
        if a > max_scale:
            max_scale = a
        if b > max_min:
            max_min = b
    inv_scale = np.float32(63) / max_scale if max_scale > _F0 else _F0
    inv_min = np.float32(63) / max_min if max_min > _F0 else _F0
    for j in range(12):
        sc[j] = 0
    for j in range(8):
        ls = min(63, _nearest(inv_scale * scales[j]) & 0xFF)
        lm = min(63, _nearest(inv_min * mins[j]) & 0xFF)
        if j < 4:
            sc[j] = ls
            sc[j + 4] = lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    dd = _f16_round(max_scale / np.float32(63))
    dm = _f16_round(max_min / np.float32(63))
    d_out[0] = dd
    dmin_out[0] = dm
    for j in range(8):
        s, m = _scale_min_k4(j, sc)
        d = dd * np.float32(s)
        if d == _F0:
            continue
        dmj = dm * np.float32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, _nearest((x[o + 32 * j + ii] + dmj) / d)))


# Q4_K: nmax 15, ggml's search from -1.0 in 20 steps of 0.1; Q5_K: nmax 31, from -0.5 in
# 15 steps, the fifth bits to ``qh``. The packing is one: a Q4_K level never has one.
@njit(cache=True, nogil=True, parallel=True)
def qkx_rows(x, imp, use_imp, nmax, rmin, rdelta, nstep, d, dmin, scales, qs, qh=None):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(QK, np.int32)
        h = np.empty(32, np.uint8)
        xr = x[r]
        for b in range(cols // QK):
            _qkx_block(
                xr,
                b * QK,
                imp,
                use_imp,
                nmax,
                rmin,
                rdelta,
                nstep,
                d[r, b : b + 1],
                dmin[r, b : b + 1],
                scales[r, 12 * b : 12 * b + 12],
                L,
            )
            q = qs[r, 128 * b : 128 * b + 128]
            h[:] = 0
            m1 = 1
            m2 = 2
            for k in range(4):
                for j in range(32):
                    l1 = L[64 * k + j]
                    if l1 > 15:
                        l1 -= 16
                        h[j] |= m1
                    l2 = L[64 * k + j + 32]
                    if l2 > 15:
                        l2 -= 16
                        h[j] |= m2
                    q[32 * k + j] = l1 | (l2 << 4)
                m1 <<= 2
                m2 <<= 2
            if qh is not None:
                qh[r, 32 * b : 32 * b + 32] = h


@njit(cache=True, nogil=True, parallel=True)
def q6k_rows(x, imp, use_imp, ql, qh, scales, d):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        L = np.empty(QK, np.int32)
        sc = np.empty(16, np.float32)
        qw = np.empty(16, np.float32)
        xr = x[r]
        for b in range(cols // QK):
            o = b * QK
            max_scale = _F0
            max_abs = _F0
            for ib in range(16):
                s = o + 16 * ib
                if use_imp:
                    _importance_weights(xr, s, imp, qw)
                a = _make_qx(xr[s : s + 16], L[16 * ib : 16 * ib + 16], 32, qw, use_imp)
                sc[ib] = a
                if abs(a) > max_abs:
                    max_abs = abs(a)
                    max_scale = a
            qlb = ql[r, 128 * b : 128 * b + 128]
            qhb = qh[r, 64 * b : 64 * b + 64]
            scb = scales[r, 16 * b : 16 * b + 16]
            if max_abs < _EPS:
                qlb[:] = 0
                qhb[:] = 0
                scb[:] = 0
                d[r, b] = _F0
                continue
            iscale = np.float32(-128) / max_scale
            dd = _f16_round(_F1 / iscale)
            d[r, b] = dd
            for ib in range(16):
                scb[ib] = min(127, _nearest(iscale * sc[ib]))
            for j in range(16):
                dj = dd * np.float32(scb[j])
                if dj == _F0:
                    continue
                for ii in range(16):
                    L[16 * j + ii] = max(-32, min(31, _nearest(xr[o + 16 * j + ii] / dj))) + 32
            for h in range(2):
                for l in range(32):
                    j = 128 * h
                    q1 = L[j + l] & 0xF
                    q2 = L[j + l + 32] & 0xF
                    q3 = L[j + l + 64] & 0xF
                    q4 = L[j + l + 96] & 0xF
                    qlb[64 * h + l] = q1 | (q3 << 4)
                    qlb[64 * h + l + 32] = q2 | (q4 << 4)
                    qhb[32 * h + l] = (
                        (L[j + l] >> 4)
                        | ((L[j + l + 32] >> 4) << 2)
                        | ((L[j + l + 64] >> 4) << 4)
                        | ((L[j + l + 96] >> 4) << 6)
                    )


# ---------------------------------------------------------------- q4_0 and q5 (blocks of 32)
# Symmetric blocks: value = d * l, l in [lo, hi] (Q4_0: -8..7, Q5_0: -16..15), one f16 d
# per 32 values. ggml's reference picks d = (the signed value of largest |x|) / lo; the
# search below tries that choice and 16 more scales (``sym_divisors``: scalings of it
# towards either end of the range), refits the best by (weighted) least squares, and
# keeps whatever has the least weighted squared error as decoded (f16 d, f32
# products): never more than ggml's own choice, which is one of the candidates.

QB = 32
# (end of the level range, scaling) of the 16 searched scales, d = f16(mx / (end * scaling)):
# the 12 scalings of the low end and 4 of the high end that won most often among 28
# (14 per end, 0.75..1.156) on N(0, 1) and SmolLM2's weights.
SYM_LOW = np.array([0.78125, 0.84375, 0.875, 0.90625, 0.9375, 0.96875, 1.0, 1.03125, 1.0625, 1.09375, 1.125, 1.15625])
SYM_HIGH = np.array([0.9375, 0.96875, 1.0, 1.03125])
SYM_REFITS = 1  # a second refit gains 0.05% of the squared error on N(0, 1) for 15% of the time


def sym_divisors(lo: int, hi: int) -> np.ndarray:
    """The divisors of the signed max-|x| value that give the searched scales of levels [lo, hi]."""
    out = np.concatenate([np.float32(lo) * SYM_LOW.astype(np.float32), np.float32(hi) * SYM_HIGH.astype(np.float32)])
    assert out.shape == (LANES,)
    return out.astype(np.float32)


# The candidates are lanes, as q8's (``formats.quant_kernels.lanes_start``): weighted
# f32 errors in partial sums. Not inlined, so that its scratch arrays are arguments
# LLVM can vectorize over.
@njit(nogil=True)
def _sym_lanes(xb, w, mx, divs, lo, hi, cd, cinv, s0, s1, s2, s3):  # pragma: no cover - compiled
    """The candidate scale (f16-exact) of least weighted squared error, 0 if none."""
    flo = np.float32(lo)
    fhi = np.float32(hi)
    lanes_start(mx, divs, cd, cinv, s0, s1, s2, s3)
    for j in range(0, QB, NSUM):
        x0, x1, x2, x3 = xb[j], xb[j + 1], xb[j + 2], xb[j + 3]
        w0, w1, w2, w3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        for k in range(LANES):
            e0 = x0 - cd[k] * min(max(np.rint(x0 * cinv[k]), flo), fhi)
            e1 = x1 - cd[k] * min(max(np.rint(x1 * cinv[k]), flo), fhi)
            e2 = x2 - cd[k] * min(max(np.rint(x2 * cinv[k]), flo), fhi)
            e3 = x3 - cd[k] * min(max(np.rint(x3 * cinv[k]), flo), fhi)
            s0[k] += w0 * (e0 * e0)
            s1[k] += w1 * (e1 * e1)
            s2[k] += w2 * (e2 * e2)
            s3[k] += w3 * (e3 * e3)
    return lanes_best(cd, s0, s1, s2, s3)


@njit(inline="always")
def _levels(xb, w, dd, mm, lo, hi, L):
    """Levels of xb for the stored scale dd and min mm (nearest, clamped to [lo, hi]) and
    their weighted squared error (f64). A symmetric block has mm = 0, which changes no
    value: x - 0 and d l + 0 are x and d l."""
    inv = _F1 / dd if dd != _F0 else _F0
    err = 0.0
    for j in range(QB):
        l = min(max(_nearest((xb[j] - mm) * inv), lo), hi)
        L[j] = l
        e = np.float64(xb[j] - (dd * np.float32(l) + mm))  # the decoder's f32 operations
        err += np.float64(w[j]) * e * e
    return err


@njit(inline="always")
def _sym_block(xb, w, lo, hi, divs, L, Lt, lanes):
    """The stored (f16-exact) scale of one block; its levels (in [lo, hi]) go to L."""
    amax, mx = _signed_max(xb)
    if amax == _F0:
        L[:] = 0
        return _F0
    # ggml's own choice, with its own rounding: trunc(x / d + off + 0.5), capped
    off = -lo
    d0 = mx / np.float32(lo)
    id0 = _F1 / d0
    dd = _f16_round(d0)
    best = 0.0
    for j in range(QB):
        l = min(np.int32(xb[j] * id0 + np.float32(off + 0.5)), hi + off) - off
        L[j] = l
        e = np.float64(xb[j] - dd * np.float32(l))
        best += np.float64(w[j]) * e * e
    c = _sym_lanes(xb, w, mx, divs, lo, hi, *lanes)
    if c != _F0:  # measured again as the other candidates are, in f64
        err = _levels(xb, w, c, _F0, lo, hi, Lt)
        if err < best:
            best = err
            dd = c
            for j in range(QB):
                L[j] = Lt[j]
    for _ in range(SYM_REFITS):
        sxl = 0.0
        sll = 0.0
        for j in range(QB):
            lf = np.float64(L[j])
            sxl += np.float64(w[j]) * np.float64(xb[j]) * lf
            sll += np.float64(w[j]) * lf * lf
        if sll <= 0.0:
            break
        c = _f16_round(np.float32(sxl / sll))
        if c == _F0 or c == dd:
            break
        err = _levels(xb, w, c, _F0, lo, hi, Lt)
        if not err < best:
            break
        best = err
        dd = c
        for j in range(QB):
            L[j] = Lt[j]
    return dd


@njit(inline="always")
def _sym_weights(xr, o, imp, use_imp, sigma2, w):
    """ggml's Q4_0/Q5_0 imatrix weighting: importance * sqrt(sigma2 + x^2), sigma2 = mean x^2 of the row."""
    for j in range(QB):
        if use_imp:
            w[j] = imp[o + j] * np.sqrt(sigma2 + xr[o + j] * xr[o + j])
        else:
            w[j] = _F1


@njit(inline="always")
def _row_sigma2(xr):
    s = _F0
    for j in range(xr.shape[0]):
        s += xr[j] * xr[j]
    return s / np.float32(xr.shape[0])


# ---------------------------------------------------------------- q5_1 (blocks of 32, scale and min)
# value = d * l + m, l in 0..31, d and m f16. The block's (d, m) is the best, by
# squared error as decoded (importance-weighted with an imatrix), of: ggml's reference choice
# (d = (max - min) / 31, m = min), ggml's own imatrix search (make_qkx3's grid:
# ``nmax / (max - min)`` stepped by 0.05 from -0.9, each refit by weighted least
# squares) and ``ASYM_REFITS`` least-squares refits of the best; each candidate is
# rounded to f16 first and its levels are the nearest to it, so never worse than
# ggml's reference, which is one of the candidates.

ASYM_REFITS = 2


@njit(inline="always")
def _asym_block(xb, w, nmax, L, Lt, Laux):
    """The stored (f16-exact) scale and min of one block; its levels go to L."""
    mn = xb[0]
    mx = xb[0]
    for j in range(1, QB):
        mn = min(mn, xb[j])
        mx = max(mx, xb[j])
    dd = _f16_round((mx - mn) / np.float32(nmax))
    mm = _f16_round(mn)
    best = _levels(xb, w, dd, mm, 0, nmax, L)
    if mx == mn:
        return dd, mm
    # ggml's imatrix grid (make_qkx3_quants(32, nmax, ..., -0.9, 0.05, 36))
    s, negmin = _make_qkx2(xb, w, Lt, Laux, nmax, np.float32(-0.9), np.float32(0.05), 36)
    cands = 1 + ASYM_REFITS
    for it in range(cands):
        if it > 0:  # weighted least squares on the best levels so far
            sw = 0.0
            sl = 0.0
            sll = 0.0
            sx = 0.0
            sxl = 0.0
            for j in range(QB):
                wj = np.float64(w[j])
                lf = np.float64(L[j])
                xj = np.float64(xb[j])
                sw += wj
                sl += wj * lf
                sll += wj * lf * lf
                sx += wj * xj
                sxl += wj * xj * lf
            det = sw * sll - sl * sl
            if det <= 0.0:
                break
            s = np.float32((sw * sxl - sl * sx) / det)
            negmin = -np.float32((sll * sx - sl * sxl) / det)
        c = _f16_round(s)
        cm = _f16_round(-negmin)
        if c <= _F0:
            continue
        err = _levels(xb, w, c, cm, 0, nmax, Lt)
        if err < best:
            best = err
            dd = c
            mm = cm
            for j in range(QB):
                L[j] = Lt[j]
    return dd, mm


# Q4_0 (levels -8..7), Q5_0 (-16..15, the fifth bits to ``qh``) and Q5_1 (a min ``m``,
# levels 0..31): one row loop and one packing, each block's scale searched as above.
@njit(cache=True, nogil=True, parallel=True)
def rows32(x, imp, use_imp, divs, lo, hi, d, qs, m=None, qh=None):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in prange(rows):
        lanes = (
            np.empty(LANES, np.float32),
            np.empty(LANES, np.float32),
            np.empty(LANES, np.float32),
            np.empty(LANES, np.float32),
            np.empty(LANES, np.float32),
            np.empty(LANES, np.float32),
        )
        L = np.empty(QB, np.int32)
        Lt = np.empty(QB, np.int32)
        Laux = np.empty(QB, np.int32)
        w = np.empty(QB, np.float32)
        xr = x[r]
        sigma2 = _row_sigma2(xr) if use_imp else _F0
        for b in range(cols // QB):
            o = QB * b
            # ggml's Q4_0, Q5_0 and Q5_1 weigh alike
            _sym_weights(xr, o, imp, use_imp, sigma2, w)
            if m is None:
                d[r, b] = _sym_block(xr[o : o + QB], w, lo, hi, divs, L, Lt, lanes)
            else:
                d[r, b], m[r, b] = _asym_block(xr[o : o + QB], w, hi, L, Lt, Laux)
            h = np.uint32(0)
            for j in range(16):
                a = L[j] - lo
                c = L[j + 16] - lo
                qs[r, 16 * b + j] = np.uint8((a & 15) | ((c & 15) << 4))
                h |= np.uint32((a >> 4) & 1) << np.uint32(j)
                h |= np.uint32((c >> 4) & 1) << np.uint32(j + 16)
            if qh is not None:
                qh[r, b] = h
