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

Each sub-block is an IQ4_NL block (``formats/iq4_nl.py``) under a 6-bit scale: the
grid, the encoder (ggml's ``quantize_row_iq4_nl_impl``, as ``quantize_iq4_xs`` calls
it) and the level lookup are IQ4_NL's. Where a row is not a multiple of 256 the type
falls back to IQ4_NL, as llama.cpp's does: the same grid and scale search per 32, at
4.5 bits per weight.
"""

from __future__ import annotations

import numpy as np

from formats.iq4_nl import IQ4_NL, KVALUES_IQ4NL, grid_values, iq4_rows
from formats.quants import QK_K


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
    return (dl * grid_values(qs, n)).reshape(rows, -1)


class IQ4_XS(IQ4_NL):
    """ggml IQ4_XS: 4-bit indices into a 16-level non-linear grid in 8 groups of 32, a
    6-bit scale per group, one f16 super-scale: 136 bytes per 256 values = 4.25 bits/weight."""

    name = "iq4_xs"
    block = QK_K
    subblocks = 8
    fields = (("d", "<f2", 1), ("scales_h", "<u2", 1), ("scales_l", "u1", 4), ("qs", "u1", 128))
    bits = 4.25
    ggml_type = "IQ4_XS"
    fallback = IQ4_NL.name

    dequantize = staticmethod(dequantize_iq4_xs)

    def compiled_encoder(self):
        return iq4_rows, (KVALUES_IQ4NL, self.subblocks)  # the scales are parts of its own
