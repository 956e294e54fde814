"""A zero-copy safetensors reader over mmap that also reads bf16.

(safetensors' own numpy loader has no bf16; its format is simple enough to read
directly: u64 header length, a JSON header, then raw little-endian data.)
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.errors import CortiqError
from formats.quants import bf16_to_f32

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


@dataclass(frozen=True)
class StEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                size = self.path.stat().st_size
                if n > size - 8:
                    raise CortiqError(f"{self.path}: truncated safetensors file")
                meta = json.loads(f.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
            raise CortiqError(f"{self.path}: not a safetensors file") from None
        self._base = 8 + n
        self.metadata = meta.pop("__metadata__", {}) or {}
        self.entries: dict[str, StEntry] = {}
        for name, e in meta.items():
            b, en = e["data_offsets"]
            if self._base + en > size:
                raise CortiqError(f"{self.path}: tensor {name} lies past the end of the file (truncated)")
            self.entries[name] = StEntry(name, e["dtype"], tuple(e["shape"]), b, en)
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap else np.zeros(0, np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16), a view into the map."""
        e = self.entries[name]
        dt = _ST_DTYPES.get(e.dtype)
        if dt is None:
            raise CortiqError(f"{self.path}: tensor {name} has unsupported dtype {e.dtype}")
        count = int(np.prod(e.shape)) if e.shape else 1
        if count * dt.itemsize != e.end - e.begin:
            raise CortiqError(f"{self.path}: tensor {name} has {e.end - e.begin} bytes for shape {list(e.shape)} {e.dtype}")
        return np.frombuffer(self._buf, dtype=dt, count=count, offset=self._base + e.begin).reshape(e.shape)

    def f32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a copy unless it is stored as f32)."""
        e = self.entries[name]
        a = self.raw(name)
        if e.dtype == "BF16":
            return bf16_to_f32(a)
        return a.astype(np.float32, copy=False)

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
