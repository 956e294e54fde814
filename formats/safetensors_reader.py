"""A zero-copy safetensors reader over mmap that also reads bf16.

(safetensors' own numpy loader has no bf16; its format is simple enough to read
directly: u64 header length, a JSON header, then raw little-endian data.)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

from formats.errors import CortiqError
from formats.quants import bf16_to_f32, rows_cols
from formats.tensor_span import TensorSpan
from formats.untrusted_json import close_map, load_object, map_regular, open_regular

_ST_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_PAGE = mmap.PAGESIZE
MAX_HEADER = 100_000_000


def _uint(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(v)
    return v


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open_regular(self.path, "safetensors file") as f:  # a FIFO or device is refused unread
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CortiqError(f"{self.path}: not a safetensors file")
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                raise CortiqError(f"{self.path}: truncated safetensors file")
            if n > MAX_HEADER:  # the limit safetensors itself applies
                raise CortiqError(f"{self.path}: safetensors header of {n} bytes exceeds {MAX_HEADER}")
            meta = load_object(f.read(n), f"{self.path} (safetensors header)")
        self._base = 8 + n
        md = meta.pop("__metadata__", {}) or {}
        self.metadata = md if isinstance(md, dict) else {}
        self.entries: dict[str, TensorSpan] = {}
        for name, e in meta.items():
            try:
                b, en = (_uint(v) for v in e["data_offsets"])
                shape = tuple(_uint(s) for s in e["shape"])
                if len(shape) > 8 or math.prod(shape) > 1 << 48:
                    raise ValueError
                entry = TensorSpan(name, str(e["dtype"]), shape, b, en - b)
            except (KeyError, TypeError, ValueError):
                raise CortiqError(f"{self.path}: corrupt safetensors entry for {name}") from None
            if not 0 <= b <= en or self._base + en > size:
                raise CortiqError(f"{self.path}: tensor {name} lies past the end of the file (truncated)")
            dt = _ST_DTYPES.get(entry.dtype)
            count = int(np.prod(entry.shape)) if entry.shape else 1
            if dt is not None and count * dt.itemsize != en - b:
                raise CortiqError(
                    f"{self.path}: tensor {name} has {en - b} bytes for shape {list(entry.shape)} {entry.dtype}"
                )
            self.entries[name] = entry
        self._mmap = map_regular(self.path, "safetensors file", size)
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap else np.zeros(0, np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16), a view into the map."""
        e = self.entries[name]
        dt = _ST_DTYPES.get(e.dtype)
        if dt is None:
            raise CortiqError(f"{self.path}: tensor {name} has unsupported dtype {e.dtype}")
        count = int(np.prod(e.shape)) if e.shape else 1
        return np.frombuffer(self._buf, dtype=dt, count=count, offset=self._base + e.offset).reshape(e.shape)

    def f32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a copy unless it is stored as f32)."""
        e = self.entries[name]
        a = self.raw(name)
        if e.dtype == "BF16":
            return bf16_to_f32(a)
        return a.astype(np.float32, copy=False)

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        """The tensor as f32[rows, cols] slices (rows = all dims but the last), in order.

        Pages already consumed are handed back to the OS, so reading a large
        tensor this way keeps only one slice resident.
        """
        e = self.entries[name]
        a = self.raw(name)
        rows, cols = rows_cols(e.shape)
        a2 = a.reshape(rows, cols)
        step = max(1, max_elems // max(cols, 1))
        row_bytes = cols * a.dtype.itemsize
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            chunk = a2[r0:r1]
            yield bf16_to_f32(chunk) if e.dtype == "BF16" else chunk.astype(np.float32, copy=False)
            self._release(self._base + e.offset + r0 * row_bytes, self._base + e.offset + r1 * row_bytes)

    def release(self, name: str) -> None:
        """Hand the pages of one tensor back to the OS."""
        e = self.entries[name]
        self._release(self._base + e.offset, self._base + e.end)

    def release_all(self) -> None:
        """Hand every mapped page back to the OS (reads fault them in again)."""
        if self._mmap is not None:
            self._release(0, len(self._mmap))

    def _release(self, start: int, end: int) -> None:
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start // _PAGE * _PAGE
        if end > lo:
            # File-backed and read-only: dropping the pages only unmaps them; a later
            # read faults them back in from the page cache.
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, end - lo)

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        close_map(self._mmap)
