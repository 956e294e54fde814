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

# iq4_nl's module: the sub-block kernels, and the kernel record of iq4_xs's fallback (the
# module, not its names: either module may be imported first)
from cortiq_engine.kernels import iq4_nl_jit as nl
from cortiq_engine.kernels.jit import f16_to_f32, matmul_small
from formats.iq4_xs import KVALUES_IQ4NL

QK = 256


@njit(inline="always")
def _scale(sh, sl, r, b, ib):
    """The 6-bit scale of sub-block ib of super-block b, minus 32."""
    lo = (np.int32(sl[r, 4 * b + ib // 2]) >> (4 * (ib % 2))) & 15
    hi = (np.int32(sh[r, b]) >> (2 * ib)) & 3
    return np.float32((lo | (hi << 4)) - 32)


@njit(parallel=False, nogil=True, cache=True)
def iq4_xs_dequant(d, sh, sl, qs, r0, r1, out):
    for r in range(r0, r1):
        for s in range(8 * d.shape[1]):  # sub-blocks of 32
            b, ib = s >> 3, s & 7
            nl.grid_dequant(out, r - r0, f16_to_f32(d[r, b]) * _scale(sh, sl, r, b, ib), qs, r, s)


@njit(inline="always")
def _iq4_xs_dot(d, sh, sl, qs, _4, _flag, r, X, xsum, i):
    acc = np.zeros(32, np.float32)
    for b in range(d.shape[1]):
        dd = f16_to_f32(d[r, b])
        for ib in range(8):
            nl.grid_dot(acc, dd * _scale(sh, sl, r, b, ib), qs, r, 8 * b + ib, X, i)
    return acc.sum()


iq4_xs_matmul_small = matmul_small("iq4_xs_matmul_small", __file__, _iq4_xs_dot, lead=3)


class IQ4XSOps(DtypeOps, dtype="iq4_xs"):
    # Integer decode kernels (qdot._kbody): the levels by vpshufb, ggml's sign trick on
    # int8 activations, as its IQ4_XS dot product does.
    int_widths, act_bits = (8, 16), 8
    kbody, kgrid = True, tuple(int(v) for v in KVALUES_IQ4NL)
    small_kernel = staticmethod(iq4_xs_matmul_small)
    dequant_kernel = staticmethod(iq4_xs_dequant)
