"""How many threads a forward pass uses, and how they wait.

Two pools run the engine's math: numba's (the compiled kernels) and the BLAS
library numpy links (f32 matmuls, prefill tiles). Both split every call evenly
over their threads, so one call takes as long as its slowest thread. On a
desktop another program often holds a core: a thread that shares that core gets
half of it in scheduler slices of milliseconds, while a decode step makes about
150 calls of 50-100 microseconds each. Measured on 2 cores beside one CPU-bound
process (SmolLM2 q8, docs/performance.md): 2 spinning threads decoded 0.6-13
tok/s where one thread decoded 31.

What keeps the default (every usable core) fast there:

* BLAS runs single-threaded: prefill is split into row slices that the
  threads of the engine's own pool pull one at a time (kernels/fast.py), so a
  thread that loses its core delays one slice, not half of every call.
* OpenMP workers wait passively (``OMP_WAIT_POLICY=PASSIVE``, set before the
  runtime starts unless the user set it): a worker that sleeps between calls is
  woken with priority over a CPU hog by the kernel scheduler, where a spinning
  one competes with it slice by slice. ``OMP_WAIT_POLICY=ACTIVE`` is the
  documented override.
"""

from __future__ import annotations

import ctypes
import glob
import os

from formats.errors import CortiqError

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def prefer_passive_waiting() -> None:
    """Ask the OpenMP runtime for sleeping (not spinning) idle workers, unless the
    user chose otherwise. Effective only before numba starts its threading layer."""
    os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def max_threads() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def _start_layer(n: int) -> None:
    """Start numba's pool with ``n`` threads; a missing layer is a one-line error."""
    import numba

    prefer_passive_waiting()
    try:
        numba.set_num_threads(n)
    except (ValueError, RuntimeError, ImportError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        layer = os.environ.get("NUMBA_THREADING_LAYER", "default")
        raise CortiqError(f"numba could not start its threading layer ({layer}): {first}") from None


def usable_cpus() -> int:
    """Cores this process may run on (taskset / cgroup cpusets narrow it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    return max(1, min(max_threads(), usable_cpus()))


def set_threads(n: int | None) -> int:
    """Use ``n`` threads (None = every usable core) in numba's pool and in BLAS; returns n."""
    top = max_threads()
    if n is None:
        n = default_threads()
    if not 1 <= n <= top:
        raise CortiqError(f"--threads {n}: choose 1..{top} (numba was started with {top}; set NUMBA_NUM_THREADS for more)")
    _start_layer(n)
    # BLAS runs single-threaded inside the engine's own prefill pool (kernels/fast.py),
    # whose threads pull row slices: OpenBLAS's static split collapsed 4-5x beside a
    # busy process.
    _set_blas_threads(1)
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
