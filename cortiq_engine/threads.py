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
* OpenMP workers spin briefly, then sleep (``GOMP_SPINCOUNT``, set before the
  runtime starts unless the user set it or ``OMP_WAIT_POLICY``): the gap between
  two kernels of a decode step is tens of microseconds, and waking a sleeping
  worker for each of ~150 calls per token made SmolLM2's 2-thread decode slower
  than one thread (29 vs 63 tok/s); spinning forever (``ACTIVE``) burns a core
  while a chat waits for its user.
* The decode thread count adapts (``DecodeThreads``): when the user did not fix
  ``--threads``, every few steps one step runs on another candidate count, and
  the faster count is kept. Beside a CPU-bound process one thread wins (a
  2-thread step waits at each barrier for the thread that shares the busy
  core); on a quiet machine all cores win.
"""

from __future__ import annotations

import ctypes
import glob
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from formats.errors import CortiqError

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_ENV = "GOMP_SPINCOUNT"
# Tens of microseconds of spinning on a current x86 core: longer than the gap between two
# kernels of a decode step, far shorter than the pause between two chat turns.
DEFAULT_SPINCOUNT = "3000"


def prefer_short_spin() -> None:
    """Ask GNU OpenMP for idle workers that spin briefly, then sleep, unless the user
    chose a wait policy. Effective only before numba starts its threading layer."""
    if WAIT_POLICY_ENV not in os.environ:
        os.environ.setdefault(SPIN_ENV, DEFAULT_SPINCOUNT)


def max_threads() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def _set_numba_threads(n: int) -> None:
    import numba

    numba.set_num_threads(n)


def current_threads() -> int:
    """The calling thread's numba pool size."""
    import numba

    return int(numba.get_num_threads())


def _start_layer(n: int) -> None:
    """Start numba's pool with ``n`` threads; a missing layer is a one-line error."""
    import numba

    prefer_short_spin()
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
        raise CortiqError(
            f"--threads {n}: choose 1..{top} (numba was started with {top}; set NUMBA_NUM_THREADS for more)"
        )
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


class DecodeThreads:
    """The thread count of each decode step, chosen by measuring.

    ``adaptive`` (the user left ``--threads`` unset): the current count runs; every
    ``interval`` steps, ``PROBE`` steps run on the next candidate count. When the
    probe's median time beats the median of the current count's recent times (same
    step key: the number of rows a step forwards) by the factor ``margin``, it becomes the
    current count and probing restarts at ``interval``; otherwise the interval
    doubles up to ``max_interval``. A losing probe costs at most PROBE/interval
    of the steps. Not adaptive: every step uses ``top``.
    Thread counts never change results: every kernel is deterministic per row.
    """

    PROBE = 3
    HISTORY = 8

    def __init__(
        self,
        top: int,
        adaptive: bool = True,
        *,
        interval: int = 16,
        max_interval: int = 256,
        margin: float = 0.9,
        set_count: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.top = top
        self.interval, self.max_interval, self.margin = interval, max_interval, margin
        self._set_count = set_count or _set_numba_threads
        self._clock = clock
        self.adaptive = adaptive and top > 1
        self.candidates = tuple(sorted({1, max(1, top // 2), top})) if self.adaptive else (top,)
        self.current = top
        self.used: Counter[int] = Counter()
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._interval = self.interval
        self._countdown = 4  # the first probe comes early: a busy neighbour is common
        self._probe: int | None = None
        self._probe_left = 0

    def _choose(self) -> int:
        if not self.adaptive:
            return self.top
        if self._probe is None and self._countdown <= 0:
            i = self.candidates.index(self.current)
            others = self.candidates[i + 1 :] + self.candidates[:i]
            self._probe = others[(self.used[self.current] // self.interval) % len(others)]
            self._probe_left = self.PROBE
        return self.current if self._probe is None else self._probe

    def _record(self, n: int, key: int, seconds: float) -> None:
        self.used[n] += 1
        self._times.setdefault((n, key), deque(maxlen=self.HISTORY)).append(seconds)
        if not self.adaptive:
            return
        if self._probe is None:
            self._countdown -= 1
            return
        self._probe_left -= 1
        if self._probe_left > 0:
            return
        probe, self._probe = self._probe, None
        mine = self._times.get((self.current, key))
        # Medians on both sides: interference makes step times skewed, and a probe's
        # best time against the current count's median switched to the worse count.
        # A speculative decode's probe steps forward varying row counts (keys), so this
        # key may have had only one of them: the median of what it has.
        recent = sorted(list(self._times[(probe, key)])[-self.PROBE :])
        trial = recent[len(recent) // 2]
        if mine and trial < self.margin * sorted(mine)[len(mine) // 2]:
            # Switch: the probe's times are fresh, the current count's may be stale.
            self.current = probe
            self._interval = self.interval
        else:
            self._interval = min(2 * self._interval, self.max_interval)
        self._countdown = self._interval

    @contextmanager
    def step(self, key: int = 1) -> Iterator[int]:
        """Run one decode step (``key``: rows it forwards) on the chosen count."""
        n = self._choose()
        if n != self.top:
            self._set_count(n)
        t0 = self._clock()
        try:
            yield n
        finally:
            dt = self._clock() - t0
            if n != self.top:
                self._set_count(self.top)
            self._record(n, key, dt)

    def to_json(self) -> dict:
        return {"adaptive": self.adaptive, "steps": {str(k): v for k, v in sorted(self.used.items())}}
