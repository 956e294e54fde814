"""Compiled (numba) kernels of iq4_xs (llama.cpp's IQ4_XS, ``formats/iq4_xs.py``) and
its kernel record.

``iq4_xs_dequant`` turns rows r0..r1 into f32 as the numpy twin
(``formats.iq4_xs.dequantize_iq4_xs``) does, bit for bit (the same f32 operations);
``iq4_xs_matmul_small`` is the decode matvec over 1..small_n input rows and up to three
fused matrices, in the shape of ``kquant_jit``'s: each (weight row, input row) summed on
its own in 32 lanes, so a row's result does not depend on how many rows share the call.
Per sub-block of 32: value = (d * (ls - 32)) * KVALUES_IQ4NL[q]. Decode and verify take
the integer-activation kernel of ``qdot.py`` (the record's ``kgrid``) where the CPU has
AVX2; these float ones elsewhere and under ``numba-float``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cortiq_engine.kernels.dtype_ops import DtypeOps
from cortiq_engine.kernels.jit import PREFETCH_ROWS, f16_to_f32, prefetch_row
from formats.iq4_xs import KVALUES_IQ4NL

QK = 256
_KV = KVALUES_IQ4NL.astype(np.float32)


@njit(inline="always")
def _sub_scale(sh, sl, r, b, ib):
    """The 6-bit scale of sub-block ib of super-block b, minus 32."""
    lo = (np.int32(sl[r, 4 * b + ib // 2]) >> (4 * (ib % 2))) & 15
    hi = (np.int32(sh[r, b]) >> (2 * ib)) & 3
    return np.float32((lo | (hi << 4)) - 32)


@njit(parallel=False, nogil=True, cache=True)
def iq4_xs_dequant(d, sh, sl, qs, r0, r1, out):
    kv = _KV
    nsb = d.shape[1]
    for r in range(r0, r1):
        for b in range(nsb):
            dd = f16_to_f32(d[r, b])
            for ib in range(8):
                dl = dd * _sub_scale(sh, sl, r, b, ib)
                o = QK * b + 32 * ib
                ob = 128 * b + 16 * ib
                for j in range(16):
                    byte = qs[r, ob + j]
                    out[r - r0, o + j] = dl * kv[byte & 15]
                    out[r - r0, o + 16 + j] = dl * kv[byte >> 4]


@njit(parallel=True, fastmath=True, cache=True)
def iq4_xs_matmul_small(ds, shs, sls, qss, count, offs, X, out):
    kv = _KV
    n, cols = X.shape
    nsb = cols // QK
    for m in range(count):
        d = ds[m]
        sh = shs[m]
        sl = sls[m]
        q = qss[m]
        base = offs[m]
        for r in prange(q.shape[0]):
            prefetch_row(q, r + PREFETCH_ROWS)
            for i in range(n):
                acc = np.zeros(32, np.float32)
                for b in range(nsb):
                    dd = f16_to_f32(d[r, b])
                    for ib in range(8):
                        dl = dd * _sub_scale(sh, sl, r, b, ib)
                        o = QK * b + 32 * ib
                        ob = 128 * b + 16 * ib
                        for j in range(16):
                            byte = q[r, ob + j]
                            acc[j] += dl * (kv[byte & 15] * X[i, o + j])
                            acc[j + 16] += dl * (kv[byte >> 4] * X[i, o + 16 + j])
                out[i, base + r] = acc.sum()


class IQ4XSOps(DtypeOps, dtype="iq4_xs"):
    # Integer decode kernels (qdot._kbody): the levels by vpshufb, ggml's sign trick on
    # int8 activations, as its IQ4_XS dot product does.
    int_widths, act_bits = (8, 16), 8
    kbody, kgrid = True, tuple(int(v) for v in KVALUES_IQ4NL)

    def small(self, parts, count, offs, X, out):
        iq4_xs_matmul_small(parts[0], parts[1], parts[2], parts[3], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        iq4_xs_dequant(parts[0], parts[1], parts[2], parts[3], r0, r1, out)
