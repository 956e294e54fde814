"""Thread counts for the two pools a forward pass uses: numba's (quantized kernels)
and the BLAS library numpy links (f32 matmuls, prefill tiles)."""

from __future__ import annotations

import ctypes
import glob
import os

from formats.errors import CortiqError


def max_threads() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def set_threads(n: int | None) -> int:
    """Use ``n`` threads (None = every core numba was started with); returns n."""
    import numba

    top = max_threads()
    if n is None:
        n = top
    if not 1 <= n <= top:
        raise CortiqError(f"--threads {n}: choose 1..{top} (numba was started with {top}; set NUMBA_NUM_THREADS for more)")
    numba.set_num_threads(n)
    _set_blas_threads(n)
    return n


def _set_blas_threads(n: int) -> None:
    """Best effort: numpy's bundled OpenBLAS exposes a setter; other BLAS builds keep their default."""
    import numpy as np

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return
