"""The CMF container: one mmap-able file, a JSON header, tensor blobs, a directory.

Byte layout (all integers little-endian; spec in docs/cmf.md):

    0   8  magic  b"CORTIQMF"
    8   4  u32    format version (FORMAT_VERSION)
    12  4  u32    flags (0; reserved)
    16  8  u64    header offset (always PREAMBLE = 64)
    24  8  u64    header length (bytes of UTF-8 JSON)
    32  8  u64    data offset (first blob, multiple of 64)
    40  8  u64    directory offset (after the last blob)
    48  8  u64    directory length (bytes of UTF-8 JSON)
    56  8  u64    reserved (0)
    64  .  header JSON, padded with spaces up to the data offset (slack for in-place edits)
    ... blobs, each starting on a 64-byte boundary
    ... directory JSON: [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...]

The directory sits at the end so the writer can stream tensors one at a time and
only then record offsets and checksums.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from formats.errors import CortiqError
from formats.quants import ALIGN, align_up, get_dtype

MAGIC = b"CORTIQMF"
FORMAT_VERSION = 1
PREAMBLE = 64
_PREAMBLE_FMT = "<8sIIQQQQQQ"
assert struct.calcsize(_PREAMBLE_FMT) == PREAMBLE
# Room left after the header JSON for later in-place edits (a calibration temperature).
HEADER_SLACK = 4096


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "crc32": self.crc32,
        }


def _pack_preamble(hlen: int, data_off: int, dir_off: int, dir_len: int) -> bytes:
    return struct.pack(_PREAMBLE_FMT, MAGIC, FORMAT_VERSION, 0, PREAMBLE, hlen, data_off, dir_off, dir_len, 0)


class CmfWriter:
    """Streams tensors into ``path`` through a temporary file in the same folder.

    Use as a context manager: on a clean exit the file is renamed into place; on an
    exception the temporary file is removed and nothing appears under ``path``.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], *, force: bool = False):
        self.path = Path(path)
        if self.path.exists() and not force:
            raise CortiqError(f"{self.path} exists (use --force to overwrite)")
        if not self.path.parent.is_dir():
            raise CortiqError(f"output folder {self.path.parent} does not exist")
        self.header = header
        self._dir: list[TensorInfo] = []
        self._names: set[str] = set()
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        hjson = self._header_bytes(header)
        self._data_off = align_up(PREAMBLE + len(hjson) + HEADER_SLACK)
        self._f.write(b"\0" * self._data_off)
        self._pos = self._data_off

    @staticmethod
    def _header_bytes(header: dict[str, Any]) -> bytes:
        return json.dumps(header, ensure_ascii=False, sort_keys=True).encode("utf-8")

    def add(self, name: str, dtype: str, array: np.ndarray) -> TensorInfo:
        """Encode ``array`` as ``dtype`` and append it; returns its directory entry."""
        return self.add_encoded(name, dtype, tuple(array.shape), get_dtype(dtype).encode(array))

    def add_encoded(self, name: str, dtype: str, shape: tuple[int, ...], parts: list[np.ndarray]) -> TensorInfo:
        """Append a tensor already encoded by ``formats.quants`` (its planar parts, in order)."""
        if name in self._names:
            raise CortiqError(f"duplicate tensor {name!r}")
        dt = get_dtype(dtype)
        shape = tuple(int(s) for s in shape)
        crc = 0
        start = self._pos
        for i, p in enumerate(parts):
            raw = memoryview(np.ascontiguousarray(p)).cast("B")
            self._f.write(raw)
            crc = zlib.crc32(raw, crc)
            n = raw.nbytes
            if i < len(parts) - 1:
                pad = align_up(n) - n
                self._f.write(b"\0" * pad)
                crc = zlib.crc32(b"\0" * pad, crc)
                n += pad
            self._pos += n
        nbytes = self._pos - start
        assert nbytes == dt.nbytes(shape), (name, nbytes, dt.nbytes(shape))
        pad = align_up(self._pos) - self._pos
        self._f.write(b"\0" * pad)
        self._pos += pad
        info = TensorInfo(name, dtype, shape, start, nbytes, crc)
        self._dir.append(info)
        self._names.add(name)
        return info

    def add_bytes(self, name: str, data: bytes) -> TensorInfo:
        return self.add(name, "u8", np.frombuffer(data, dtype=np.uint8))

    def _finish(self) -> None:
        dir_json = json.dumps([t.to_json() for t in self._dir]).encode("utf-8")
        dir_off = self._pos
        self._f.write(dir_json)
        hjson = self._header_bytes(self.header)
        if PREAMBLE + len(hjson) > self._data_off:
            raise AssertionError("header grew past its reserved area during conversion")
        self._f.seek(0)
        self._f.write(_pack_preamble(len(hjson), self._data_off, dir_off, len(dir_json)))
        self._f.write(hjson)
        self._f.write(b" " * (self._data_off - PREAMBLE - len(hjson)))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "CmfWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._finish()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


class CmfFile:
    """A CMF file opened read-only through a memory map.

    ``tensor_parts(name)`` returns numpy views into the map: the weights are never
    copied into RAM, the OS pages them in as the engine touches them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CortiqError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        if size < PREAMBLE:
            raise CortiqError(f"{self.path}: not a CMF file (only {size} bytes)")
        with open(self.path, "rb") as f:
            pre = f.read(PREAMBLE)
            magic, version, _flags, hoff, hlen, data_off, dir_off, dir_len, _ = struct.unpack(_PREAMBLE_FMT, pre)
            if magic != MAGIC:
                raise CortiqError(f"{self.path}: not a CMF file (magic {magic[:8]!r})")
            if version > FORMAT_VERSION:
                raise CortiqError(
                    f"{self.path}: CMF format version {version} is newer than this cortiq reads ({FORMAT_VERSION}); upgrade cortiq"
                )
            if version < 1:
                raise CortiqError(f"{self.path}: bad CMF format version {version}")
            if hoff != PREAMBLE or hoff + hlen > data_off or data_off % ALIGN:
                raise CortiqError(f"{self.path}: corrupt CMF preamble")
            if dir_off + dir_len > size:
                raise CortiqError(
                    f"{self.path}: truncated CMF file (directory ends at byte {dir_off + dir_len}, file has {size})"
                )
            f.seek(hoff)
            try:
                self.header: dict[str, Any] = json.loads(f.read(hlen).decode("utf-8"))
                f.seek(dir_off)
                entries = json.loads(f.read(dir_len).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CortiqError(f"{self.path}: corrupt CMF header or directory ({e})") from None
        self.version = version
        self.size = size
        self.data_offset = data_off
        self.header_capacity = data_off - PREAMBLE
        self.tensors: dict[str, TensorInfo] = {}
        for e in entries:
            info = TensorInfo(e["name"], e["dtype"], tuple(e["shape"]), int(e["offset"]), int(e["nbytes"]), int(e["crc32"]))
            dt = get_dtype(info.dtype)
            if info.offset < data_off or info.offset + info.nbytes > dir_off:
                raise CortiqError(f"{self.path}: tensor {info.name} lies past the end of the data (truncated or corrupt file)")
            if info.nbytes != dt.nbytes(info.shape):
                raise CortiqError(f"{self.path}: tensor {info.name} has {info.nbytes} bytes, its shape needs {dt.nbytes(info.shape)}")
            self.tensors[info.name] = info
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8)

    # ------------------------------------------------------------- access
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CortiqError(f"{self.path}: missing tensor {name}") from None

    def tensor_parts(self, name: str) -> dict[str, np.ndarray]:
        """Zero-copy planar views of a tensor (see formats.quants for the parts)."""
        info = self.info(name)
        return get_dtype(info.dtype).view(self._buf, info.offset, info.shape)

    def tensor_f32(self, name: str) -> np.ndarray:
        """A dequantized f32 copy (for small tensors: norms, biases, tests)."""
        info = self.info(name)
        dt = get_dtype(info.dtype)
        return dt.decode(dt.view(self._buf, info.offset, info.shape), info.shape)

    def raw_bytes(self, name: str) -> bytes:
        info = self.info(name)
        return bytes(self._buf[info.offset : info.offset + info.nbytes])

    def verify(self) -> Iterator[tuple[TensorInfo, bool]]:
        """Yield (tensor, checksum ok) for every tensor."""
        for info in self.tensors.values():
            crc = zlib.crc32(self._buf[info.offset : info.offset + info.nbytes])
            yield info, crc == info.crc32

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            # Live numpy views still reference the map; it closes when they go.
            pass

    def __enter__(self) -> "CmfFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rewrite_header(path: str | os.PathLike, header: dict[str, Any]) -> None:
    """Replace the header JSON of an existing file.

    In place when it fits the reserved area (the usual case: a calibration
    temperature); otherwise the whole file is rewritten through a temporary file.
    """
    path = Path(path)
    old = CmfFile(path)
    hjson = json.dumps(header, ensure_ascii=False, sort_keys=True).encode("utf-8")
    data_off, cap = old.data_offset, old.header_capacity
    with open(path, "rb") as f:
        pre = struct.unpack(_PREAMBLE_FMT, f.read(PREAMBLE))
    dir_off, dir_len = pre[6], pre[7]
    old.close()
    if len(hjson) <= cap:
        with open(path, "r+b") as f:
            f.write(_pack_preamble(len(hjson), data_off, dir_off, dir_len))
            f.write(hjson)
            f.write(b" " * (cap - len(hjson)))
        return
    # Grow: shift every blob by a multiple of ALIGN so alignment is kept.
    new_data_off = align_up(PREAMBLE + len(hjson) + HEADER_SLACK)
    shift = new_data_off - data_off
    with open(path, "rb") as src:
        src.seek(dir_off)
        entries = json.loads(src.read(dir_len))
        for e in entries:
            e["offset"] += shift
        dir_json = json.dumps(entries).encode("utf-8")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as dst:
                dst.write(_pack_preamble(len(hjson), new_data_off, dir_off + shift, len(dir_json)))
                dst.write(hjson)
                dst.write(b" " * (new_data_off - PREAMBLE - len(hjson)))
                src.seek(data_off)
                remaining = dir_off - data_off
                while remaining:
                    chunk = src.read(min(remaining, 1 << 24))
                    dst.write(chunk)
                    remaining -= len(chunk)
                dst.write(dir_json)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
