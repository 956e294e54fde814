"""Kernel sets: the numeric operations of a forward pass, in two implementations.

``numba`` (default) is the fast path; ``numpy`` is the readable reference that
tests hold the fast path against. The documented override ``CORTIQ_KERNELS=numpy``
selects the reference path without code changes.
"""

from __future__ import annotations

import os

from formats.errors import CortiqError
from cortiq_engine.kernels.reference import NumpyKernels

KERNEL_ENV = "CORTIQ_KERNELS"
KERNEL_CHOICES = ("numba", "numba-i8", "numba-float", "numpy")


def get_kernels(name: str | None = None) -> NumpyKernels:
    """The kernel set named ``name``, else ``$CORTIQ_KERNELS``, else numba."""
    name = (name or os.environ.get(KERNEL_ENV) or "numba").strip().lower()
    if name == "numpy":
        return NumpyKernels()
    if name == "numba":
        from cortiq_engine.kernels.fast import NumbaKernels

        return NumbaKernels()
    if name in ("numba-i8", "numba-float"):
        from cortiq_engine.kernels.fast import NumbaKernels

        return NumbaKernels(act_bits=8 if name == "numba-i8" else 0)
    raise CortiqError(f"unknown kernel set {name!r} ({KERNEL_ENV}); choose one of {', '.join(KERNEL_CHOICES)}")


__all__ = ["KERNEL_CHOICES", "KERNEL_ENV", "NumpyKernels", "get_kernels"]
