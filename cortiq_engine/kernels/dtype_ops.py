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

A new dtype brings a ``formats.quants.DType`` subclass and a ``DtypeOps`` subclass;
no kernel set code changes. Its integer-activation decode kernel, if it has one, is
an IR body in ``qdot.py`` listed in ``qdot.WIDTHS`` (the one place that says which
dtypes have one).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.kernels import jit
from cortiq_engine.kernels import kquant_jit as kq

OPS: dict[str, "DtypeOps"] = {}


class DtypeOps:
    dtype: ClassVar[str]

    def __init_subclass__(cls, dtype: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if dtype is not None:
            cls.dtype = dtype
            OPS[dtype] = cls()

    def small(self, parts, count: int, offs: np.ndarray, X: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def dequant(self, parts: tuple[np.ndarray, ...], r0: int, r1: int, out: np.ndarray) -> None:
        raise NotImplementedError


def ops_for(dtype: str) -> DtypeOps:
    try:
        return OPS[dtype]
    except KeyError:
        raise CortiqError(f"the numba kernels have no matmul for dtype {dtype!r}") from None


class F32Ops(DtypeOps, dtype="f32"):
    def small(self, parts, count, offs, X, out):
        jit.f32_matmul_small(parts[0], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        out[:] = parts[0][r0:r1]


class F16Ops(DtypeOps, dtype="f16"):
    bf16: ClassVar[bool] = False

    def small(self, parts, count, offs, X, out):
        jit.half_matmul_small(parts[0], self.bf16, count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        jit.half_dequant(parts[0], self.bf16, r0, r1, out)


class BF16Ops(F16Ops, dtype="bf16"):
    bf16 = True


class Q8Ops(DtypeOps, dtype="q8"):
    def small(self, parts, count, offs, X, out):
        jit.q8_matmul_small(parts[0], parts[1], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        jit.q8_dequant(parts[0], parts[1], r0, r1, out)


def _group_sums(X: np.ndarray) -> np.ndarray:
    """Sum of each input row over each 32-value group: the min term's factor (q4, q5, the K-quants)."""
    return X.reshape(X.shape[0], -1, 32).sum(axis=2, dtype=np.float32)


class Q4Ops(DtypeOps, dtype="q4"):
    def small(self, parts, count, offs, X, out):
        # The Q4_1 min term factors out of the dot: sum of X over each block.
        jit.q4_matmul_small(parts[0], parts[1], parts[2], count, offs, X, _group_sums(X), out)

    def dequant(self, parts, r0, r1, out):
        jit.q4_dequant(parts[0], parts[1], parts[2], r0, r1, out)


class Q5Ops(DtypeOps, dtype="q5"):
    """Q5_0: the Q5_1 kernels with the min derived from the scale (-16 d)."""

    stored_min: ClassVar[bool] = False

    def _split(self, parts):
        if self.stored_min:
            return parts[0], parts[1], parts[2], parts[3]
        return parts[0], parts[0], parts[1], parts[2]  # the min slot is unread

    def small(self, parts, count, offs, X, out):
        d, m, qh, qs = self._split(parts)
        jit.q5_matmul_small(d, m, self.stored_min, qh, qs, count, offs, X, _group_sums(X), out)

    def dequant(self, parts, r0, r1, out):
        d, m, qh, qs = self._split(parts)
        jit.q5_dequant(d, m, self.stored_min, qh, qs, r0, r1, out)


class Q5_1Ops(Q5Ops, dtype="q5_1"):
    stored_min = True


class Q4_0Ops(DtypeOps, dtype="q4_0"):
    def small(self, parts, count, offs, X, out):
        kq.q4_0_matmul_small(parts[0], parts[1], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        kq.q4_0_dequant(parts[0], parts[1], r0, r1, out)


class Q4KOps(DtypeOps, dtype="q4k"):
    def small(self, parts, count, offs, X, out):
        kq.q4k_matmul_small(parts[0], parts[1], parts[2], parts[3], count, offs, X, _group_sums(X), out)

    def dequant(self, parts, r0, r1, out):
        kq.q4k_dequant(parts[0], parts[1], parts[2], parts[3], r0, r1, out)


class Q5KOps(DtypeOps, dtype="q5k"):
    def small(self, parts, count, offs, X, out):
        kq.q5k_matmul_small(parts[0], parts[1], parts[2], parts[3], parts[4], count, offs, X, _group_sums(X), out)

    def dequant(self, parts, r0, r1, out):
        kq.q5k_dequant(parts[0], parts[1], parts[2], parts[3], parts[4], r0, r1, out)


class Q6KOps(DtypeOps, dtype="q6k"):
    def small(self, parts, count, offs, X, out):
        kq.q6k_matmul_small(parts[0], parts[1], parts[2], parts[3], count, offs, X, out)

    def dequant(self, parts, r0, r1, out):
        kq.q6k_dequant(parts[0], parts[1], parts[2], parts[3], r0, r1, out)
