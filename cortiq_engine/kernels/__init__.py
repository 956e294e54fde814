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

Compiling the numba set's kernels for a CPU takes seconds (SmolLM2 q8: 10-25 s on 2
cores); numba's on-disk cache (``cache=True``: ``$NUMBA_CACHE_DIR``, else beside the
package) and ``llvm_jit``'s object cache (``$CORTIQ_KERNEL_CACHE``) make every later
process load them instead. ``Engine.load`` compiles them all up front (``warmup``),
so a first run's prefill and decode speeds are the next run's; ``CompileMeter``
measures what that compiled, and a stamp in the object cache (``is_warm`` /
``mark_warm``) tells before it starts whether this machine has compiled them already.
"""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

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


# A cold compile of one model's kernels, the estimate announced before the first one on a
# machine (later ones announce the median this machine took): SmolLM2 q8 and q4, 2
# threads on a Zen 4 EPYC shared with other work, measured 10-40 s.
COLD_COMPILE_SECONDS = 20.0
# Under ``llvm_jit``'s cache directory: one empty file per warmed (kernel set, model kind).
STAMP_DIR = "warm"


def compiles(kernels) -> bool:
    """Whether this kernel set compiles anything (the numpy reference does not)."""
    return getattr(kernels, "name", "numpy") != "numpy"


@dataclass(frozen=True)
class CompileReport:
    """What ``Engine.load``'s warm-up compiled: ``seconds`` its wall time when it compiled
    anything (0.0 when every kernel came from the on-disk caches), ``kernels`` the
    functions and IR modules compiled, ``announced`` whether the caches were known to be
    cold before it started."""

    seconds: float
    kernels: int
    announced: bool

    def to_json(self) -> dict:
        return {"compile_seconds": self.seconds, "compiled_kernels": self.kernels}


@dataclass(frozen=True)
class WarmupEvent:
    """Progress of ``Engine.warmup`` for a renderer: ``kind`` "cold" (compiles lie ahead,
    about ``estimate`` seconds, over ``total`` steps), "step" (step ``done`` of ``total``,
    ``name``, starts), "kernel" (a compile of ``name`` starts) or "done"."""

    kind: str
    name: str = ""
    done: int = 0
    total: int = 0
    estimate: float = 0.0


class CompileMeter:
    """Counts the compiles inside ``measure()``: numba's (its ``numba:compile`` event
    fires on cache misses only; nested compiles count once) and new entries in
    ``llvm_jit``'s object cache. ``on_kernel(name)`` hears each numba compile start."""

    def __init__(self, on_kernel: Callable[[str], None] | None = None) -> None:
        self.on_kernel = on_kernel
        self.kernels = 0
        self._depth = 0
        self._lock = threading.Lock()

    @contextmanager
    def measure(self) -> Iterator["CompileMeter"]:
        from numba.core import event

        meter = self

        class _Listener(event.Listener):
            def on_start(self, ev: event.Event) -> None:
                with meter._lock:
                    meter._depth += 1
                    outer = meter._depth == 1
                if outer and meter.on_kernel is not None:
                    disp = (ev.data or {}).get("dispatcher")
                    meter.on_kernel(getattr(getattr(disp, "py_func", None), "__name__", "kernel"))

            def on_end(self, ev: event.Event) -> None:
                with meter._lock:
                    meter._depth -= 1
                    if meter._depth == 0:
                        meter.kernels += 1

        before = _objects()
        with event.install_listener("numba:compile", _Listener()):
            yield self
        self.kernels += len(_objects() - before)


def _objects() -> set[str]:
    from cortiq_engine.kernels import llvm_jit

    d = llvm_jit.default_cache_dir()
    try:
        return {p.name for p in d.glob("*.o")} if d is not None else set()
    except OSError:
        return set()


def _stamp(kernels, model_kind: Sequence[str]) -> Path | None:
    """The stamp file of this kernel set and model kind on this CPU, with these compilers,
    kernel sources and cache locations; None where the object cache is off."""
    import llvmlite
    import llvmlite.binding as llvm
    import numba
    from numba.core import config as numba_config

    from cortiq_engine.kernels import llvm_jit

    d = llvm_jit.default_cache_dir()
    if d is None:
        return None
    llvm.initialize_native_target()
    h = hashlib.sha256()
    parts = [
        numba.__version__,
        llvmlite.__version__,
        llvm.get_host_cpu_name(),
        llvm.get_host_cpu_features().flatten(),
        str(numba_config.CACHE_DIR),
        str(d),
        repr(getattr(kernels, "name", "")),
        repr(getattr(kernels, "act_bits", "")),
        repr(getattr(kernels, "tile_unit", "")),
        *model_kind,
    ]
    # numba keys its cache entries by each source file's modification time and size
    for src in sorted(Path(__file__).parent.glob("*.py")):
        st = src.stat()
        parts.append(f"{src.name}:{st.st_mtime_ns}:{st.st_size}")
    for part in parts:
        h.update(part.encode() + b"\0")
    return d / STAMP_DIR / h.hexdigest()[:32]


def is_warm(kernels, model_kind: Sequence[str]) -> bool:
    """Whether ``mark_warm`` ran for this kernel set and model kind with the same caches."""
    path = _stamp(kernels, model_kind)
    return path is not None and path.exists()


def mark_warm(kernels, model_kind: Sequence[str], seconds: float = 0.0) -> None:
    """Record that this kernel set and model kind are compiled (``seconds``: what it took)."""
    path = _stamp(kernels, model_kind)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(f"{seconds:.1f}\n" if seconds > 0 else "")
    except OSError:
        pass  # a cache that cannot be written only costs the announcement


def cold_estimate() -> float:
    """Seconds a cold compile is expected to take: the median of the ones this machine's
    stamps recorded, else COLD_COMPILE_SECONDS."""
    from cortiq_engine.kernels import llvm_jit

    d = llvm_jit.default_cache_dir()
    seen: list[float] = []
    try:
        for p in (d / STAMP_DIR).iterdir() if d is not None else ():
            try:
                seen.append(float(p.read_text().strip()))
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    seen.sort()
    return seen[len(seen) // 2] if seen else COLD_COMPILE_SECONDS


__all__ = [
    "COLD_COMPILE_SECONDS",
    "CompileMeter",
    "CompileReport",
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "NumpyKernels",
    "RowExact",
    "WarmupEvent",
    "cold_estimate",
    "compiles",
    "get_kernels",
    "is_warm",
    "mark_warm",
]
