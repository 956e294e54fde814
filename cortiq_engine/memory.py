"""Handing freed heap back to the OS.

Loading compiled kernels and parsing the tokenizer allocate scratch that glibc
keeps mapped after it is freed; ``malloc_trim`` returns it, so the resident size
after ``Engine.load`` reflects what the engine actually holds. A no-op elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def release_free_heap() -> None:
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return  # not glibc
    trim(ctypes.c_size_t(0))
