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


def ggml_library_quantize(x: np.ndarray, gtype: GT, imatrix: np.ndarray | None = None) -> np.ndarray:
    """x f32[rows, cols] quantized by llama.cpp's own C library (``ggml_quantize_chunk``,
    shipped with llama-cpp-python): uint8[rows, cols / block * block bytes]."""
    import ctypes
    import os

    # llama-cpp-python (the `bench` extra, built from source) carries the C library:
    # the tests that call this are marked `llamacpp`.
    import llama_cpp
    from gguf.constants import GGML_QUANT_SIZES

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    x = np.ascontiguousarray(x, np.float32)
    rows, cols = x.shape
    block, size = GGML_QUANT_SIZES[gtype]
    out = np.zeros((rows, cols // block * size), np.uint8)
    imp = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    n = fn(int(gtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None if imp is None else imp.ctypes.data)
    assert n == out.nbytes
    return out
