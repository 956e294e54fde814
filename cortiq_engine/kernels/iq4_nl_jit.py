"""Compiled (numba) kernels of iq4_nl (llama.cpp's IQ4_NL, ``formats/iq4_nl.py``) and
its kernel record.

``iq4_nl_dequant`` turns rows r0..r1 into f32 as the numpy twin
(``formats.iq4_nl.dequantize_iq4_nl``) does, bit for bit (the same f32 operations);
``iq4_nl_matmul_small`` is the decode matvec over 1..small_n input rows and up to three
fused matrices, ``jit.matmul_small`` with this dtype's row dot: each (weight row, input
row) summed on its own in 32 lanes, so a row's result does not depend on how many rows
share the call. Per block of 32: value = d * KVALUES_IQ4NL[q]. Decode and verify take
the integer-activation kernel of ``qdot.py`` (q4_0's 32-block body with the record's
``kgrid`` looked up) where the CPU has AVX2; these float ones elsewhere, under
``numba-float`` and for prefill. ``grid_dot`` and ``grid_dequant`` serve iq4_xs's
sub-blocks too.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cortiq_engine.kernels.dtype_ops import DtypeOps
from cortiq_engine.kernels.jit import f16_to_f32, matmul_small
from formats.iq4_nl import KVALUES_IQ4NL

# The grid's levels as arithmetic: a degree-4 fit in n - 7.5, exact once rounded (its
# largest miss is 0.48 of a level), so the block loops vectorize where a table lookup is
# a scalar load per value (a 576 x 1536 decode matvec: 122 us by lookup, 50 by the fit).
C4, C3, C2, C1, C0 = (np.float32(c) for c in np.polyfit(np.arange(16) - 7.5, KVALUES_IQ4NL.astype(np.float64), 4))


@njit(inline="always")
def level(n):
    """KVALUES_IQ4NL[n] as f32, for a 4-bit index n."""
    t = np.float32(n) - np.float32(7.5)
    return np.float32(np.rint((((C4 * t + C3) * t + C2) * t + C1) * t + C0))


@njit(inline="always")
def grid_dequant(out, row, dl, qs, r, s):
    """out[row] over block s of 32: dl * level of each index in qs[r, 16 s:16 s + 16]."""
    for j in range(16):
        byte = qs[r, 16 * s + j]
        out[row, 32 * s + j] = dl * level(byte & 15)
        out[row, 32 * s + 16 + j] = dl * level(byte >> 4)


@njit(inline="always")
def grid_dot(acc, dl, qs, r, s, X, i):
    """acc[lane] += dl * (level * x) over block s of 32 against X[i, 32 s:32 s + 32]."""
    for j in range(16):
        byte = qs[r, 16 * s + j]
        acc[j] += dl * (level(byte & 15) * X[i, 32 * s + j])
        acc[j + 16] += dl * (level(byte >> 4) * X[i, 32 * s + 16 + j])


@njit(parallel=False, nogil=True, cache=True)
def iq4_nl_dequant(d, qs, r0, r1, out):
    for r in range(r0, r1):
        for b in range(d.shape[1]):
            grid_dequant(out, r - r0, f16_to_f32(d[r, b]), qs, r, b)


@njit(inline="always")
def _iq4_nl_dot(d, qs, _2, _3, _4, _flag, r, X, xsum, i):
    acc = np.zeros(32, np.float32)
    for b in range(d.shape[1]):
        grid_dot(acc, f16_to_f32(d[r, b]), qs, r, b, X, i)
    return acc.sum()


iq4_nl_matmul_small = matmul_small("iq4_nl_matmul_small", __file__, _iq4_nl_dot, lead=1)


class IQ4NLOps(DtypeOps, dtype="iq4_nl"):
    # Integer decode kernels (qdot._gbody): q4_0's nibbles, the levels by vpshufb and
    # ggml's sign trick on int8 activations, one f16 scale per block, no min.
    int_widths, act_bits = (8, 16), 8
    roles, nibbles = (0, None, None, 1), True
    kgrid = tuple(int(v) for v in KVALUES_IQ4NL)
    small_kernel = staticmethod(iq4_nl_matmul_small)
    dequant_kernel = staticmethod(iq4_nl_dequant)
