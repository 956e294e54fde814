"""A fast GGUF parser: metadata as Python values, tensors as numpy views of a memory map.

gguf-py's ``GGUFReader`` builds numpy views for every element of every metadata
array; for a 262k-token vocabulary that alone takes over half a minute.
This reads the same file in about a second and exposes what ``gguf_import`` uses
of ``GGUFReader``: ``fields[key].contents()`` and ``tensors`` (name, shape in ggml
order, tensor_type, n_bytes, data_offset, data shaped as gguf-py shapes it).
Dequantization stays with gguf-py (``gguf.quants``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import CortiqError
from formats.untrusted_json import close_map

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass(frozen=True)
class Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: np.ndarray  # ggml order (fastest dimension first), as gguf-py's ReaderTensor
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        try:
            s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise CortiqError(f"GGUF metadata string at byte {self.pos} is not valid UTF-8") from None
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype])
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(itype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALARS[vtype])


class GgufFile:
    """The parsed file; ``fields`` and ``tensors`` as described in the module doc."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise ValueError("empty file")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        cur = _Cursor(memoryview(self._map))
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError("bad magic")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = Field(cur.value(cur.unpack("<I")))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = (cur.pos + align - 1) // align * align
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, type_id, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
                block, size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise CortiqError(f"GGUF tensor {name} has type id {type_id}, which gguf-py does not know") from None
            n = int(np.prod(dims)) if dims else 1
            if n % block:
                raise CortiqError(f"GGUF tensor {name}: {n} elements are not whole {qtype.name} blocks of {block}")
            n_bytes = n // block * size
            at = start + offset
            if at + n_bytes > self._map.size:
                raise CortiqError(f"truncated GGUF (tensor {name} runs past the end of the file)")
            np_dims = tuple(reversed(dims)) or (1,)
            if qtype.name in _PLAIN:
                data = self._map[at : at + n_bytes].view(_PLAIN[qtype.name]).reshape(np_dims)
            else:
                data = self._map[at : at + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * size)
            self.tensors.append(Tensor(name, np.array(dims, dtype=np.uint64), qtype, n, n_bytes, at, data))

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Hand the mapped pages of bytes [start, end) back to the OS (all by default).

        File-backed and read-only: dropping them only unmaps them; a later read faults
        them back in from the page cache. A conversion calls this as it goes, so the
        pages it has read do not add up to the whole file in its RSS."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = len(self._mmap) if end is None else min(end, len(self._mmap))
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        if end > lo:
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, end - lo)

    def close(self) -> None:
        """Unmap the file once no tensor view is left (views keep it mapped otherwise)."""
        self._map = None  # type: ignore[assignment]
        close_map(self._mmap)
