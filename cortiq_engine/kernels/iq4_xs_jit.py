"""Compiled (numba) kernels of iq4_xs (llama.cpp's IQ4_XS, ``formats/iq4_xs.py``) and
its kernel record.

``iq4_xs_dequant`` turns rows r0..r1 into f32 as the numpy twin
(``formats.iq4_xs.dequantize_iq4_xs``) does, bit for bit (the same f32 operations);
``iq4_xs_matmul_small`` is the decode matvec over 1..small_n input rows and up to three
fused matrices, ``jit.matmul_small`` with this dtype's row dot: each (weight row, input
row) summed on its own in 32 lanes, so a row's result does not depend on how many rows share the call.
Per sub-block of 32: value = (d * (ls - 32)) * KVALUES_IQ4NL[q]. Decode and verify take
the integer-activation kernel of ``qdot.py`` (the record's ``kgrid``) where the CPU has
AVX2; these float ones elsewhere and under ``numba-float``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cortiq_engine.kernels.dtype_ops import DtypeOps
from cortiq_engine.kernels.jit import f16_to_f32, matmul_small
from formats.iq4_xs import KVALUES_IQ4NL

QK = 256
_KV = KVALUES_IQ4NL.astype(np.float32)


@njit(inline="always")
def _sub_block(d, sh, sl, r, s):
    """Sub-block s (of 32 values) of row r: its scale d * (ls - 32) and first column."""
    b, ib = s // 8, s % 8
    lo = (np.int32(sl[r, 4 * b + ib // 2]) >> (4 * (ib % 2))) & 15
    hi = (np.int32(sh[r, b]) >> (2 * ib)) & 3
    return f16_to_f32(d[r, b]) * np.float32((lo | (hi << 4)) - 32), 32 * s


@njit(inline="always")
def _levels(qs, r, s, j):
    """The levels of byte j of sub-block s: values j (low nibble) and 16 + j (high)."""
    byte = qs[r, 16 * s + j]
    return _KV[byte & 15], _KV[byte >> 4]


@njit(parallel=False, nogil=True, cache=True)
def iq4_xs_dequant(d, sh, sl, qs, r0, r1, out):
    for r in range(r0, r1):
        for s in range(8 * d.shape[1]):
            dl, o = _sub_block(d, sh, sl, r, s)
            for j in range(16):
                v0, v1 = _levels(qs, r, s, j)
                out[r - r0, o + j] = dl * v0
                out[r - r0, o + 16 + j] = dl * v1


@njit(inline="always")
def _iq4_xs_dot(d, sh, sl, qs, _4, _flag, r, X, xsum, i):
    acc = np.zeros(32, np.float32)
    for s in range(8 * d.shape[1]):
        dl, o = _sub_block(d, sh, sl, r, s)
        for j in range(16):
            v0, v1 = _levels(qs, r, s, j)
            acc[j] += dl * (v0 * X[i, o + j])
            acc[j + 16] += dl * (v1 * X[i, o + 16 + j])
    return acc.sum()


iq4_xs_matmul_small = matmul_small("iq4_xs_matmul_small", __file__, _iq4_xs_dot, lead=3)


class IQ4XSOps(DtypeOps, dtype="iq4_xs"):
    # Integer decode kernels (qdot._kbody): the levels by vpshufb, ggml's sign trick on
    # int8 activations, as its IQ4_XS dot product does.
    int_widths, act_bits = (8, 16), 8
    kbody, kgrid = True, tuple(int(v) for v in KVALUES_IQ4NL)
    small_kernel = staticmethod(iq4_xs_matmul_small)
    dequant_kernel = staticmethod(iq4_xs_dequant)
