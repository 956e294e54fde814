"""ggml's own decoder (gguf-py) as the oracle for CMF q8/q4 bytes.

CMF stores quantized blocks planar (scales, then quants); ggml interleaves them per
block. Packing our parts into ggml's block layout and decoding them with gguf-py
checks that a CMF q8 tensor means what a Q8_0 tensor of the same bytes means.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq


def ggml_decode_q8(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """(d f16[rows, nb], qs int8[rows, cols]) -> f32[rows, cols], decoded by gguf-py as Q8_0 blocks."""
    rows, cols = qs.shape
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[:, :, 2:] = qs.view(np.uint8).reshape(rows, cols // 32, 32)
    return gq.dequantize(blocks.reshape(rows, -1), GT.Q8_0).reshape(rows, cols)


def ggml_q8_0(x: np.ndarray) -> np.ndarray:
    """x encoded and decoded by ggml's own Q8_0 (d = max|x| / 127)."""
    return gq.dequantize(gq.quantize(x, GT.Q8_0), GT.Q8_0).reshape(x.shape)
