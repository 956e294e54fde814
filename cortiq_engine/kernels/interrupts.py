"""Ctrl-C while a compiler runs: held, then delivered when the compile ends.

LLVM calls back into Python through ctypes while it finalizes machine code (the object
cache's store and load callbacks: ours in ``llvm_jit.compile_ir``, numba's in its
codegen). A KeyboardInterrupt raised inside such a callback is printed as "Exception
ignored on calling ctypes callback function" and dropped: a Ctrl-C landing there was
lost, and numba then failed on the half-made library with a 90-line RuntimeError
traceback ("no compiled object yet"). Both seen on a cold kernel cache, where a first
command spends seconds in LLVM.

So while any compile runs in the main thread, SIGINT is recorded instead of handled
and re-raised to the handler from before as soon as the outermost compile ends: the
delay is one kernel's compile, and whatever the handler does (KeyboardInterrupt, the
CLI's start-up exit) happens outside LLVM. Numba's compiles are seen through its
documented event API (``numba:compiler_lock``, whose end event fires after the lock
is released, so an exception from it leaves no lock held); ours through ``held()``.
"""

from __future__ import annotations

import functools
import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class _SigintHold:
    """A re-entrant hold for the main thread (the only one Python delivers signals to).

    One per process, because a signal disposition is one per process."""

    def __init__(self) -> None:
        self.depth = 0
        self.previous: object = None
        self.held = False

    def _record(self, signum: int, frame: object) -> None:
        self.held = True

    def enter(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            self.held = False
            self.previous = signal.signal(signal.SIGINT, self._record)
        self.depth += 1

    def exit(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth:
            return
        # a handler installed from C reads back as None: the default then
        signal.signal(signal.SIGINT, signal.SIG_DFL if self.previous is None else self.previous)
        if self.held:
            self.held = False
            signal.raise_signal(signal.SIGINT)  # to the restored handler (ignored stays ignored)


_HOLD = _SigintHold()


@contextmanager
def held() -> Iterator[None]:
    """SIGINT arriving inside the block is delivered when the block (and any enclosing
    hold) ends."""
    _HOLD.enter()
    try:
        yield
    finally:
        _HOLD.exit()


@functools.cache
def hold_during_numba_compiles() -> None:
    """Register (once per process) the numba listener that holds SIGINT for the length
    of each compile or cache load."""
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            _HOLD.enter()

        def on_end(self, ev: event.Event) -> None:
            _HOLD.exit()

    event.register("numba:compiler_lock", _Listener())
