"""Kernel sets: the numeric operations of a forward pass, in two implementations.

``numba`` (default) is the fast path; ``numpy`` is the readable reference that
tests hold the fast path against. The documented override ``CORTIQ_KERNELS``
selects one without code changes: ``numba`` (integer decode kernels, ``qdot.py``:
q8 and q6k on int16 activations; q4, q4_0, q5, q5_1, q4k, q5k, iq4_xs, q3k on int8), ``numba-i16`` /
``numba-i8`` (one width for all: int8 has 4x q8's KL; the K-quants have int8
kernels only and take the float ones under ``numba-i16``), ``numba-float`` (float
activations everywhere) or ``numpy``.

Every set has ``matmul``, ``rms_norm``, ``add_rms_norm``, ``silu_mul``,
``gelu_tanh_mul``, ``rope``, ``attend(..., sinks=None)`` (softmax attention over a
KV cache) and ``delta_rule`` (Gated DeltaNet's recurrence), and declares
``row_exact_rows`` (``row_exact.py``). Compiled kernels live in ``jit.py``, each
beside its numpy twin in ``reference.py``.
"""

from __future__ import annotations

import os

from formats.errors import CortiqError
from cortiq_engine.kernels.reference import NumpyKernels
from cortiq_engine.kernels.row_exact import RowExact

KERNEL_ENV = "CORTIQ_KERNELS"
KERNEL_CHOICES = ("numba", "numba-i16", "numba-i8", "numba-float", "numpy")
_WIDTHS = {"numba-i16": 16, "numba-i8": 8, "numba-float": 0}
# Rows up to which the reference set is made row-exact (numba's set declares its own
# bound): the longest speculative verify it runs; past it, prefill batches through BLAS.
NUMPY_ROW_EXACT_ROWS = 16


def get_kernels(name: str | None = None):
    """The kernel set named ``name``, else ``$CORTIQ_KERNELS``, else numba."""
    name = (name or os.environ.get(KERNEL_ENV) or "numba").strip().lower()
    if name == "numpy":
        return RowExact(NumpyKernels(), NUMPY_ROW_EXACT_ROWS)
    if name == "numba":
        from cortiq_engine.kernels.fast import NumbaKernels

        return NumbaKernels()
    if name in _WIDTHS:
        from cortiq_engine.kernels.fast import NumbaKernels

        return NumbaKernels(act_bits=_WIDTHS[name])
    raise CortiqError(f"unknown kernel set {name!r} ({KERNEL_ENV}); choose one of {', '.join(KERNEL_CHOICES)}")


__all__ = ["KERNEL_CHOICES", "KERNEL_ENV", "NumpyKernels", "RowExact", "get_kernels"]
