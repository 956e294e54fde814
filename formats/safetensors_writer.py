"""A safetensors file written one tensor at a time, so peak memory stays near one tensor.

The layout is the format's own: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw data in that order.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np


class SafetensorsStream:
    """A safetensors file written one tensor at a time, in the order declared up front."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...], int]]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        self._order = []
        for name, st_dtype, shape, itemsize in entries:
            n = math.prod(shape) * itemsize
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            self._order.append((name, n))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, arr: np.ndarray) -> None:
        want, n = self._order[self._next]
        assert name == want and arr.nbytes == n, (name, want, arr.nbytes, n)
        self._f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        self._next += 1

    @property
    def complete(self) -> bool:
        return self._next == len(self._order)

    def close(self) -> None:
        self._f.close()
