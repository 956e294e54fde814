"""Ctrl-C during a compile: held, then delivered to the handler from before (interrupts.py).

The end-to-end check (a cold start interrupted while numba and LLVM compile, "interrupted"
and code 130) is tests/test_hostile_files.py::test_ctrl_c_while_the_libraries_load_is_one_line.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from numba import njit
from numba.core import event

from cortiq_engine.kernels import interrupts


@pytest.fixture
def recording_handler():
    got: list[str] = []
    before = signal.signal(signal.SIGINT, lambda *_: got.append("handled"))
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, before)


def test_held_delivers_once_when_the_outermost_hold_ends(recording_handler):
    got = recording_handler
    handler = signal.getsignal(signal.SIGINT)
    with interrupts.held():
        with interrupts.held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        assert got == []  # the inner end delivers nothing: a compile is still running
    assert got == ["handled"]  # two Ctrl-C inside, one delivery: one interrupt
    assert signal.getsignal(signal.SIGINT) is handler  # the handler from before is back
    with interrupts.held():
        pass
    assert got == ["handled"]  # nothing held, nothing delivered


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test: a run started in the background (``pytest &``,
    a script's ``... &``) inherits SIGINT ignored, and Python then installs none."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_interrupt_inside_a_numba_compile_lands_after_it(python_sigint):
    """A KeyboardInterrupt raised inside LLVM's ctypes callbacks is dropped and leaves numba
    a half-made library; held, it is raised after the compile, which completed."""
    interrupts.hold_during_numba_compiles()

    @njit(cache=False)
    def twice(x):
        return x * 2

    class CtrlC(event.Listener):  # a Ctrl-C at the moment the compile starts
        def on_start(self, ev):
            signal.raise_signal(signal.SIGINT)

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", CtrlC()):
        with pytest.raises(KeyboardInterrupt):
            twice(np.int64(3))
    assert len(twice.overloads) == 1  # compiled whole before the interrupt was delivered
    assert twice(np.int64(3)) == 6
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
