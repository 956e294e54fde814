"""Compiled (numba) kernels of q3k (llama.cpp's Q3_K, ``formats/q3_k.py``) and its
kernel record.

``q3k_dequant`` turns rows r0..r1 into f32 as the numpy twin
(``formats.q3_k.dequantize_q3k``) does, bit for bit (the same f32 operations);
``q3k_matmul_small`` is the decode matvec over 1..small_n input rows and up to three
fused matrices, ``jit.matmul_small`` with this dtype's row dot: each (weight row, input
row) summed on its own in 32 lanes, so a row's result does not depend on how many rows share the call.
Element 128 h + 32 s + l of a super-block: low bits (qs[32 h + l] >> 2 s) & 3, high bit
bit 4 h + s of hmask[l] (clear: minus 4), scale 8 h + 2 s + l / 16. Decode and verify
take the integer-activation kernel of ``qdot.py`` (the record's ``kthree``) where the CPU
has AVX2; these float ones elsewhere and under ``numba-float``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cortiq_engine.kernels.dtype_ops import DtypeOps
from cortiq_engine.kernels.jit import matmul_small
from cortiq_engine.kernels.kquant_jit import sixteen_scales_kernels


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


@njit(inline="always")
def _q3_values(hm, qs, r, b, h, l):
    """qs[32 h + l] holds the four groups' low bits at shifts 0, 2, 4, 6, hmask[l] their
    high bits."""
    a = np.int32(qs[r, 64 * b + 32 * h + l])
    hb = np.int32(hm[r, 32 * b + l]) >> (4 * h)
    return (
        np.float32((a & 3) - 4 + 4 * (hb & 1)),
        np.float32(((a >> 2) & 3) - 4 + 2 * (hb & 2)),
        np.float32(((a >> 4) & 3) - 4 + (hb & 4)),
        np.float32(((a >> 6) & 3) - 4 + ((hb & 8) >> 1)),
    )


q3k_dequant, _q3k_dot = sixteen_scales_kernels("q3k", __file__, _scale, _q3, _q3_values)
q3k_matmul_small = matmul_small("q3k_matmul_small", __file__, _q3k_dot, lead=1)


class Q3KOps(DtypeOps, dtype="q3k"):
    # Integer decode kernels (qdot._kbody): |q * (sc - 32)| <= 128, so int16 activations
    # keep their full range.
    int_widths, act_bits = (8, 16), 8
    kbody, kthree = True, True
    small_kernel = staticmethod(q3k_matmul_small)
    dequant_kernel = staticmethod(q3k_dequant)
