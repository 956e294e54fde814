"""Per-dtype compiled operations of the fast kernel set, one class per CMF dtype.

``formats.quants`` owns each dtype's bytes (its parts and which of them a kernel
takes, ``DType.kernel_parts``); a class here owns the two compiled operations the
fast kernel set needs of it, and registers itself for that dtype by subclassing
(``class Q8Ops(DtypeOps, dtype="q8")``), as gguf-py's quant classes do:

- ``small(parts, count, offs, X, out)``: decode-size matmul of up to ``FUSE_MAX``
  fused matrices; ``parts[k]`` is the 3-tuple of kernel part ``k`` of each matrix
  (padded with empty arrays), ``offs`` their output column offsets.
- ``dequant(parts, r0, r1, out)``: rows r0..r1 of one matrix to f32 ``out`` (prefill
  tiles, then BLAS).

Each class also declares what the integer kernels need to know of its dtype
(``int_widths``, ``act_bits``, the part roles of the IR bodies in ``qdot.py``, the
tile form of ``amx.py``): those modules ask the record, they never compare dtype
names. Registering a class attaches it to its ``formats.quants.DType``
(``DType.kernels``), so the formats record answers ``has_int8_kernels`` without
importing engine code.

A new dtype brings a ``formats.quants.DType`` subclass and a ``DtypeOps`` subclass;
no kernel set code changes. An integer-activation decode kernel, if it has one, is
an IR body in ``qdot.py`` selected by the record's flags.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from formats.errors import CortiqError
from formats.quants import get_dtype
from cortiq_engine.kernels import jit
from cortiq_engine.kernels import kquant_jit as kq

OPS: dict[str, "DtypeOps"] = {}
# The small-batch kernels' unused part slots (``jit.NPARTS``): an empty read-only matrix
# for each fused slot (more than ``fast.FUSE_MAX``), as one array whose ``[m]`` is the
# matrix: numba types an array faster than a tuple on every call.
_NO_PART = np.zeros((8, 0, 0), np.uint8)
_NO_PART.flags.writeable = False


class DtypeOps:
    dtype: ClassVar[str]
    # Integer-activation decode and verify kernels (qdot.py): the activation widths
    # they exist for, and the one the default kernel set uses (0: float kernels).
    int_widths: ClassVar[tuple[int, ...]] = ()
    act_bits: ClassVar[int] = 0
    # The largest int16 activation, where it is not 32767 (qdot.qmax).
    qmax16: ClassVar[int | None] = None
    # The 32-block IR bodies: kernel-part index of (scale, min, fifth bits, quants),
    # None where the dtype has no such part; ``zero``: the zero point of a symmetric
    # dtype (value = d * (q - zero), the min derived from the scale); ``nibbles``:
    # quants packed two a byte (16 bytes a block), with a min term unless ``kgrid``.
    roles: ClassVar[tuple[int | None, ...] | None] = None
    zero: ClassVar[int] = 0
    nibbles: ClassVar[bool] = False
    # The K-quant super-block IR body (``qdot._kbody``): ``ksigned``: Q6_K's signed
    # 6-bit quants with 8-bit scales and no mins, else Q4_K's packed 6-bit scales and
    # mins; ``kfifth``: a fifth quant bit per value (Q5_K).
    kbody: ClassVar[bool] = False
    ksigned: ClassVar[bool] = False
    kfifth: ClassVar[bool] = False
    # A grid: 4-bit indices into these signed levels (a table lookup), no mins; with
    # ``kbody`` IQ4_XS's 6-bit scales per 32, with ``nibbles`` IQ4_NL's f16 scale per 32.
    kgrid: ClassVar[tuple[int, ...]] = ()
    # Q3_K: signed 3-bit quants (2 bits in qs, the third in hmask), sixteen 6-bit scales
    # met in the integer domain (one per 16 values).
    kthree: ClassVar[bool] = False
    # Activation widths with the 512-bit 3- and 4-row bodies: input rows side by side
    # (``qdot._zbody``) or weight rows side by side (``qdot._wbody``).
    zbody_widths: ClassVar[tuple[int, ...]] = ()
    wbody_widths: ClassVar[tuple[int, ...]] = ()
    # The prefill tile products (amx.py), else dequantize + sgemm; ``tile_unpacked``:
    # unsigned quants unpacked to bytes with a min term, else signed bytes read in place.
    tiles: ClassVar[bool] = False
    tile_unpacked: ClassVar[bool] = False

    def __init_subclass__(cls, dtype: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if dtype is not None:
            cls.dtype = dtype
            OPS[dtype] = ops = cls()
            get_dtype(dtype).register_kernels(ops)

    @property
    def tile_form(self) -> str:
        """The tile kernels' entry family (``amx.FORMS``): "u8" unpacked, "q8" in place."""
        return "u8" if self.tile_unpacked else "q8"

    @property
    def k4_scales(self) -> bool:
        """Q4_K's 12 bytes of packed 6-bit scales and mins per super-block (q4k, q5k)."""
        return self.kbody and not self.ksigned

    def qmax(self, act: int) -> int:
        """The largest activation integer at ``act`` bits."""
        return self.qmax16 if act == 16 and self.qmax16 is not None else (1 << (act - 1)) - 1

    # The compiled kernels (``jit.matmul_small`` and a ``*_dequant``, as staticmethods),
    # the small-batch one's runtime ``flag`` and whether it takes the input's group sums
    # (a min term).
    small_kernel: ClassVar = None
    dequant_kernel: ClassVar = None
    flag: ClassVar[bool] = False
    min_sums: ClassVar[bool] = False

    def kernel_args(self, parts: tuple[np.ndarray, ...]) -> tuple:
        """The kernel parts as this dtype's kernels take them."""
        return tuple(parts)

    def small(self, parts, count: int, offs: np.ndarray, X: np.ndarray, out: np.ndarray) -> None:
        parts = self.kernel_args(parts)
        pad = (_NO_PART,) * (jit.NPARTS - len(parts))
        xsum = _group_sums(X) if self.min_sums else X
        self.small_kernel(*parts, *pad, self.flag, count, offs, X, xsum, out)

    def dequant(self, parts: tuple[np.ndarray, ...], r0: int, r1: int, out: np.ndarray) -> None:
        self.dequant_kernel(*self.kernel_args(parts), r0, r1, out)


def _group_sums(X: np.ndarray) -> np.ndarray:
    """Sum of each input row over each 32-value group: the min term's factor (q4, q5, the K-quants)."""
    return X.reshape(X.shape[0], -1, 32).sum(axis=2, dtype=np.float32)


def ops_for(dtype: str) -> DtypeOps:
    try:
        return OPS[dtype]
    except KeyError:
        raise CortiqError(f"the numba kernels have no matmul for dtype {dtype!r}") from None


class F32Ops(DtypeOps, dtype="f32"):
    small_kernel = staticmethod(jit.f32_matmul_small)

    def dequant(self, parts, r0, r1, out):
        out[:] = parts[0][r0:r1]


class F16Ops(DtypeOps, dtype="f16"):
    bf16: ClassVar[bool] = False
    small_kernel = staticmethod(jit.f16_matmul_small)

    def dequant(self, parts, r0, r1, out):
        jit.half_dequant(parts[0], self.bf16, r0, r1, out)


class BF16Ops(F16Ops, dtype="bf16"):
    bf16 = True
    small_kernel = staticmethod(jit.bf16_matmul_small)


class Q8Ops(DtypeOps, dtype="q8"):
    int_widths, act_bits = (8, 16), 16
    roles = (0, None, None, 1)
    wbody_widths = (16,)
    tiles = True
    small_kernel = staticmethod(jit.q8_matmul_small)
    dequant_kernel = staticmethod(jit.q8_dequant)


class Q4Ops(DtypeOps, dtype="q4"):
    int_widths, act_bits = (8, 16), 8
    roles, nibbles = (0, 1, None, 2), True
    zbody_widths = (8,)
    tiles, tile_unpacked = True, True
    small_kernel, min_sums = staticmethod(jit.q4_matmul_small), True
    dequant_kernel = staticmethod(jit.q4_dequant)


class Q5Ops(DtypeOps, dtype="q5"):
    """Q5_0: the Q5_1 kernels with the min derived from the scale (-16 d)."""

    int_widths, act_bits = (8, 16), 8
    roles, zero, nibbles = (0, None, 1, 2), 16, True
    tiles, tile_unpacked = True, True
    small_kernel, min_sums = staticmethod(jit.q5_matmul_small), True

    def kernel_args(self, parts):
        """(d, min, qh, qs): Q5_0's min slot is its scale, unread."""
        return tuple(parts) if self.flag else (parts[0], *parts)

    def dequant(self, parts, r0, r1, out):
        d, m, qh, qs = self.kernel_args(parts)
        jit.q5_dequant(d, m, self.flag, qh, qs, r0, r1, out)


class Q5_1Ops(Q5Ops, dtype="q5_1"):
    flag = True  # the min is stored
    roles, zero = (0, 1, 2, 3), 0


class Q4_0Ops(DtypeOps, dtype="q4_0"):
    int_widths, act_bits = (8, 16), 8
    roles, zero, nibbles = (0, None, None, 1), 8, True
    zbody_widths = (8,)
    tiles, tile_unpacked = True, True
    small_kernel = staticmethod(kq.q4_0_matmul_small)
    dequant_kernel = staticmethod(kq.q4_0_dequant)


class Q4KOps(DtypeOps, dtype="q4k"):
    int_widths, act_bits = (8, 16), 8
    kbody = True
    tiles, tile_unpacked = True, True
    small_kernel, min_sums = staticmethod(kq.q4k_matmul_small), True
    dequant_kernel = staticmethod(kq.q4k_dequant)


class Q5KOps(DtypeOps, dtype="q5k"):
    int_widths, act_bits = (8, 16), 8
    kbody, kfifth = True, True
    tiles, tile_unpacked = True, True
    small_kernel, min_sums = staticmethod(kq.q5k_matmul_small), True
    dequant_kernel = staticmethod(kq.q5k_dequant)


class Q6KOps(DtypeOps, dtype="q6k"):
    # int16 activations to 15 bits: a group sums 32 products of |q - 32| <= 32,
    # |scale| <= 128 and the activation; at 16383 the worst case (2,147,352,576) fits an i32.
    int_widths, act_bits, qmax16 = (8, 16), 16, 16383
    kbody, ksigned = True, True
    small_kernel = staticmethod(kq.q6k_matmul_small)
    dequant_kernel = staticmethod(kq.q6k_dequant)


# Dtypes whose kernels live in their own module register on import (each subclasses
# ``DtypeOps`` above).
from cortiq_engine.kernels import iq4_xs_jit as _iq4_xs_jit, q3k_jit as _q3k_jit  # noqa: E402,F401
