"""MXFP4 (OCP microscaling FP4) blocks: the bytes, decoded to float32.

A tensor stored as MXFP4 is two uint8 tensors: ``blocks`` [..., G, 16] holding two
4-bit E2M1 codes per byte (the low nibble is the even element, the high nibble the
odd one) and ``scales`` [..., G], one E8M0 exponent per 32 elements: element
``v = FP4[code] * 2**(scale - 127)``. A row of G groups decodes to G * 32 values.
This is the order transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``)
decodes. Every E2M1 value times a power of two is exact in bfloat16 and float32.
"""

from __future__ import annotations

import numpy as np

from formats.errors import CortiqError

# E2M1 codes 0..15: sign bit 3, then two exponent bits and one mantissa bit.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
BLOCK = 32  # values per scale
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127
SCALE_NAN = 255  # E8M0's one non-number code


def check_pair(
    blocks_name: str,
    blocks_shape: tuple[int, ...],
    blocks_dtype: str,
    scales_name: str,
    scales_shape: tuple[int, ...],
    scales_dtype: str,
) -> tuple[int, ...]:
    """The decoded shape of a (blocks, scales) pair: ``blocks_shape[:-2] + (G * 32,)``;
    a CortiqError naming the tensor when the pair is not MXFP4."""
    if blocks_dtype != "U8" or scales_dtype != "U8":
        raise CortiqError(f"MXFP4 tensors {blocks_name} ({blocks_dtype}) and {scales_name} ({scales_dtype}) must be U8")
    if len(blocks_shape) < 3 or blocks_shape[-1] != BLOCK_BYTES:
        raise CortiqError(
            f"MXFP4 tensor {blocks_name} has shape {list(blocks_shape)}: expected [..., groups, {BLOCK_BYTES}]"
        )
    if tuple(scales_shape) != tuple(blocks_shape[:-1]):
        raise CortiqError(
            f"MXFP4 scales {scales_name} have shape {list(scales_shape)}, their blocks {blocks_name} need {list(blocks_shape[:-1])}"
        )
    if min(blocks_shape) < 1:
        raise CortiqError(f"MXFP4 tensor {blocks_name} has an empty dimension: {list(blocks_shape)}")
    return (*blocks_shape[:-2], blocks_shape[-2] * BLOCK)


def decode(blocks: np.ndarray, scales: np.ndarray, name: str = "MXFP4 tensor") -> np.ndarray:
    """``blocks`` uint8 [..., G, 16] and ``scales`` uint8 [..., G] -> float32 [..., G * 32].

    Refuses the NaN scale code and any value beyond float32 (a corrupt or hostile file)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1:] != (BLOCK_BYTES,):
        raise CortiqError(f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree")
    if scales.size and int(scales.max()) == SCALE_NAN:
        raise CortiqError(f"{name}: MXFP4 scale code {SCALE_NAN} (NaN) is not a weight scale")
    out = np.empty((*blocks.shape, 2), dtype=np.float32)
    out[..., 0] = FP4_VALUES[blocks & 0x0F]
    out[..., 1] = FP4_VALUES[blocks >> 4]
    exp = scales.astype(np.int32) - SCALE_BIAS
    with np.errstate(over="ignore"):
        out = np.ldexp(out.reshape(*scales.shape, BLOCK), exp[..., None]).astype(np.float32, copy=False)
    if scales.size and int(scales.max()) > SCALE_BIAS + 125 and not np.isfinite(out).all():
        raise CortiqError(f"{name}: MXFP4 scale exponent {int(scales.max()) - SCALE_BIAS} overflows float32")
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)
