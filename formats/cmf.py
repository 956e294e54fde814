"""The CMF container: one mmap-able file, a JSON header, tensor blobs, a directory.

Byte layout (all integers little-endian; the full spec is docs/cmf.md):

    0   8  magic  b"CORTIQMF"
    8   2  u16    format major version (FORMAT_VERSION)
    10  2  u16    format minor version (FORMAT_MINOR)
    12  4  u32    flags (0; reserved)
    16  8  u64    header offset (always PREAMBLE = 64)
    24  8  u64    header length (bytes of UTF-8 JSON)
    32  8  u64    data offset (first blob, multiple of 64)
    40  8  u64    directory offset (after the last blob)
    48  8  u64    directory length (bytes of UTF-8 JSON)
    56  8  u64    checksum: CRC-32 of bytes 0..56, the header JSON and the directory JSON
                  (format 2; 0 in format 1, which this reader refuses)
    64  .  header JSON, padded with spaces up to the data offset (slack for in-place edits)
    ... blobs, each starting on a 64-byte boundary
    ... directory JSON: [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...]

The directory sits at the end so the writer can stream tensors one at a time and
only then record offsets and checksums.

Every byte is covered by a checksum: the preamble, header and directory by the
preamble's CRC (checked on open), each tensor blob by its directory CRC and the
padding between blobs by ``verify`` (zeros, spaces after the header). Files are
untrusted: lengths are bounded, JSON goes through ``formats.untrusted_json`` and every
directory field is type- and range-checked before a byte of data is mapped.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from formats.errors import CortiqError
from formats.quants import ALIGN, DTYPES, align_up, get_dtype
from formats.staging import Staged, hold, new_temp, place, refuse_special, remove_stale, staged_file
from formats.tensor_span import TensorSpan
from formats.untrusted_json import close_map, is_int, loads as untrusted_loads, map_regular, open_regular

MAGIC = b"CORTIQMF"
# Readers reject a newer major version; a newer minor version only adds things an
# older reader may ignore (new header keys). See docs/cmf.md, "Versioning".
FORMAT_VERSION = 2
FORMAT_MINOR = 0
# Bounds on what a reader accepts (the largest real headers are ~1 MB with a chat
# template, the largest directories ~15 MB for 512-expert MoE models).
MAX_HEADER = 16 << 20
MAX_DIRECTORY = 256 << 20
MAX_ELEMENTS = 1 << 48  # per tensor: past any real model, far from 64-bit overflow
MAX_NAME = 1024
PREAMBLE = 64
_PREAMBLE_FMT = "<8sHHIQQQQQQ"
assert struct.calcsize(_PREAMBLE_FMT) == PREAMBLE
# Room left after the header JSON for later in-place edits (a calibration temperature).
HEADER_SLACK = 4096
# The writer starts the disk writes of every WRITEBACK_STEP new bytes and drops pages
# written WRITEBACK_LAG bytes ago from the page cache (``CmfWriter._write_back``).
WRITEBACK_STEP = 8 << 20
WRITEBACK_LAG = 32 << 20
_ZEROS = bytes(ALIGN)


@dataclass(frozen=True)
class TensorInfo(TensorSpan):
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


@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    header_offset: int
    header_length: int
    data_offset: int
    dir_offset: int
    dir_length: int

    def pack(self) -> bytes:
        return struct.pack(
            _PREAMBLE_FMT,
            MAGIC,
            self.major,
            self.minor,
            0,
            self.header_offset,
            self.header_length,
            self.data_offset,
            self.dir_offset,
            self.dir_length,
            0,
        )


def _preamble(hlen: int, data_off: int, dir_off: int, dir_len: int, hjson: bytes, dir_json: bytes) -> bytes:
    """The 64 preamble bytes with the checksum over themselves, the header and the directory."""
    head = Preamble(FORMAT_VERSION, FORMAT_MINOR, PREAMBLE, hlen, data_off, dir_off, dir_len).pack()[:56]
    return head + struct.pack("<Q", _checksum(head, hjson, dir_json))


def _checksum(head: bytes, hjson: bytes, dir_json: bytes) -> int:
    return zlib.crc32(dir_json, zlib.crc32(hjson, zlib.crc32(head)))


def _header_bytes(header: dict[str, Any]) -> bytes:
    if not isinstance(header, dict):
        raise TypeError("a CMF header is a JSON object (dict)")
    return json.dumps(header, ensure_ascii=False, sort_keys=True).encode("utf-8")


class CmfWriter(Staged):
    """Streams tensors into ``path`` through a temporary file in the same folder.

    Use as a context manager: on a clean exit the file is renamed into place; on an
    exception (Ctrl-C included) the temporary file is removed and nothing appears
    under ``path``. To publish several files together, call ``seal()`` on each and
    then ``publish()``.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], *, force: bool = False):
        self.path = Path(path)
        refuse_special(self.path)
        if self.path.is_dir():
            raise CortiqError(f"{self.path} is a folder; give a file name such as model.cmf")
        if self.path.exists() and not force:
            raise CortiqError(f"{self.path} exists (use --force to overwrite)")
        if not self.path.parent.is_dir():
            raise CortiqError(f"output folder {self.path.parent} does not exist")
        self.header = header
        self._dir: list[TensorInfo] = []
        self._names: set[str] = set()
        self._sealed = False
        hjson = _header_bytes(header)
        self._data_off = align_up(PREAMBLE + len(hjson) + HEADER_SLACK)
        remove_stale(self.path)
        fd, self._tmp = new_temp(self.path)
        self._held = hold(self._tmp)  # a later run removes it only once this process is gone
        self._f = os.fdopen(fd, "wb")
        try:
            self._f.write(b"\0" * self._data_off)
        except BaseException:
            self.abort()
            raise
        self._pos = self._data_off
        self._flushed = self._dropped = 0  # _write_back's marks

    @property
    def tensors(self) -> list[TensorInfo]:
        return list(self._dir)

    def add(self, name: str, dtype: str, array: np.ndarray) -> TensorInfo:
        """Encode ``array`` as ``dtype`` and append it; returns its directory entry."""
        return self.add_encoded(name, dtype, tuple(array.shape), get_dtype(dtype).encode(array))

    def add_encoded(
        self, name: str, dtype: str, shape: tuple[int, ...], parts: list[np.ndarray | Iterable[np.ndarray]]
    ) -> TensorInfo:
        """Append a tensor already encoded by ``formats.quants``: its planar parts, in order.

        Each part is an array, or an iterable of arrays whose bytes, concatenated,
        make the part (so a single-part tensor can be streamed slice by slice).
        """
        if self._sealed:
            raise AssertionError("writer already sealed")
        if name in self._names:
            raise CortiqError(f"duplicate tensor {name!r}")
        dt = get_dtype(dtype)
        shape = tuple(int(s) for s in shape)
        layout = dt.parts(shape)
        if len(parts) != len(layout):
            raise AssertionError(f"{name}: {dtype} has {len(layout)} parts, got {len(parts)}")
        crc = 0
        start = self._pos
        for i, (spec, part) in enumerate(zip(layout, parts)):
            n = 0
            for chunk in [part] if isinstance(part, np.ndarray) else part:
                raw = memoryview(np.ascontiguousarray(chunk)).cast("B")
                self._f.write(raw)
                crc = zlib.crc32(raw, crc)
                n += raw.nbytes
            if n != spec.nbytes:
                raise AssertionError(
                    f"{name}: part {spec.name} has {n} bytes, {dtype}{list(shape)} needs {spec.nbytes}"
                )
            if i < len(layout) - 1:  # parts after the first start aligned too
                pad = _ZEROS[: align_up(n) - n]
                self._f.write(pad)
                crc = zlib.crc32(pad, crc)
                n += len(pad)
            self._pos += n
        nbytes = self._pos - start
        pad = align_up(self._pos) - self._pos
        self._f.write(_ZEROS[:pad])
        self._pos += pad
        info = TensorInfo(name, dtype, shape, start, nbytes, crc)
        self._dir.append(info)
        self._names.add(name)
        self._write_back()
        return info

    def _write_back(self) -> None:
        """Start the disk writes of what the last tensors added, and drop from the page
        cache what was written WRITEBACK_LAG bytes ago: a converter's output is not read
        again, and on a VM whose new page-cache pages are slow, letting a gigabyte of dirty
        pages pile up until ``seal``'s fsync cost a 1.1B q8 convert about a second."""
        if not hasattr(os, "posix_fadvise") or self._pos - self._flushed < WRITEBACK_STEP:
            return
        self._f.flush()
        fd = self._f.fileno()
        try:
            # DONTNEED starts writeback of dirty pages and drops the clean ones
            os.posix_fadvise(fd, self._flushed, self._pos - self._flushed, os.POSIX_FADV_DONTNEED)
            old = self._pos - WRITEBACK_LAG
            if old > self._dropped:
                os.posix_fadvise(fd, self._dropped, old - self._dropped, os.POSIX_FADV_DONTNEED)
                self._dropped = old
        except OSError:
            pass  # advice only: a filesystem that refuses it loses nothing
        self._flushed = self._pos

    def add_bytes(self, name: str, data: bytes) -> TensorInfo:
        return self.add(name, "u8", np.frombuffer(data, dtype=np.uint8))

    # ------------------------------------------------------------ finishing
    def seal(self) -> None:
        """Write the directory and the final header, flush to disk; not yet visible."""
        if self._sealed:
            return
        dir_json = json.dumps([t.to_json() for t in self._dir]).encode("utf-8")
        dir_off = self._pos
        self._f.write(dir_json)
        hjson = _header_bytes(self.header)
        if PREAMBLE + len(hjson) > self._data_off:
            raise AssertionError("header grew past its reserved area during conversion")
        self._f.seek(0)
        self._f.write(_preamble(len(hjson), self._data_off, dir_off, len(dir_json), hjson, dir_json))
        self._f.write(hjson)
        self._f.write(b" " * (self._data_off - PREAMBLE - len(hjson)))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._sealed = True

    def publish(self) -> None:
        """Rename the sealed file into place (atomic on one filesystem)."""
        if not self._sealed:
            raise AssertionError("seal() before publish()")
        place(self._tmp, self.path)

    def commit(self) -> None:
        self.seal()
        self.publish()

    def abort(self) -> None:
        """Remove the staging file. Closing flushes what the writer still buffers, which
        fails again on the full disk that brought us here: the file goes regardless."""
        try:
            if not self._f.closed:
                self._f.close()
        except OSError:
            pass
        finally:
            self._tmp.unlink(missing_ok=True)


def read_preamble(path: Path, f, size: int) -> Preamble:
    """Parse and sanity-check the fixed 64 bytes; every failure is a one-line CortiqError."""
    if size < PREAMBLE:
        raise CortiqError(f"{path}: not a CMF file (only {size} bytes)")
    magic, major, minor, flags, hoff, hlen, data_off, dir_off, dir_len, _ = struct.unpack(
        _PREAMBLE_FMT, f.read(PREAMBLE)
    )
    if magic != MAGIC:
        raise CortiqError(f"{path}: not a CMF file (magic {magic!r}, expected {MAGIC!r})")
    if major > FORMAT_VERSION:
        raise CortiqError(
            f"{path}: CMF format version {major}.{minor} is newer than this cortiq reads ({FORMAT_VERSION}.x); upgrade cortiq"
        )
    if major == 1:
        raise CortiqError(
            f"{path}: CMF format 1.{minor} has no header checksum and is no longer read; reconvert it with this cortiq"
        )
    if major < 1:
        raise CortiqError(f"{path}: bad CMF format version {major}.{minor}")
    if flags:
        raise CortiqError(f"{path}: unknown CMF flags {flags:#x} (corrupt file)")
    if hlen > MAX_HEADER or dir_len > MAX_DIRECTORY:
        raise CortiqError(
            f"{path}: CMF header ({hlen} bytes) or directory ({dir_len} bytes) exceeds its limit (corrupt file)"
        )
    if hoff != PREAMBLE or hoff + hlen > data_off or data_off % ALIGN or dir_off < data_off:
        raise CortiqError(f"{path}: corrupt CMF preamble")
    if data_off > size or dir_off + dir_len > size:
        end = max(data_off, dir_off + dir_len)
        raise CortiqError(f"{path}: truncated CMF file (needs {end} bytes, has {size})")
    if dir_off + dir_len != size:
        raise CortiqError(f"{path}: {size - dir_off - dir_len} bytes after the CMF directory (corrupt file)")
    return Preamble(major, minor, hoff, hlen, data_off, dir_off, dir_len)


def _parse_entry(path: Path, e: Any) -> TensorInfo:
    keys = ("name", "dtype", "shape", "offset", "nbytes", "crc32")
    if not isinstance(e, dict) or any(k not in e for k in keys):
        raise CortiqError(f"{path}: corrupt CMF directory entry {str(e)[:80]}")
    name, dtype, shape = e["name"], e["dtype"], e["shape"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise CortiqError(f"{path}: corrupt CMF directory entry (tensor name {str(name)[:80]!r})")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CortiqError(f"{path}: tensor {name} has unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(is_int(s) and 0 <= s <= MAX_ELEMENTS for s in shape):
        raise CortiqError(f"{path}: tensor {name} has a bad shape {str(shape)[:80]}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise CortiqError(f"{path}: tensor {name} has shape {shape}, over {MAX_ELEMENTS} elements (corrupt file)")
    if not all(is_int(e[k]) for k in ("offset", "nbytes", "crc32")) or not 0 <= e["crc32"] < 1 << 32:
        raise CortiqError(f"{path}: tensor {name} has a bad offset, size or checksum in the directory")
    dt = get_dtype(dtype)
    if dt.quantized and not dt.supports(tuple(shape)):
        raise CortiqError(f"{path}: tensor {name} is {dtype}{shape}; {dtype} needs {dt.requirement}")
    return TensorInfo(name, dtype, tuple(shape), e["offset"], e["nbytes"], e["crc32"])


class CmfFile:
    """A CMF file opened read-only through a memory map.

    ``tensor_parts(name)`` returns numpy views into the map: the weights are never
    copied into RAM, the OS pages them in as the engine touches them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open_regular(self.path, "file") as f:  # a FIFO, a device or /proc entry is refused unread
            size = os.fstat(f.fileno()).st_size
            raw_pre = f.read(PREAMBLE)
            f.seek(0)
            pre = read_preamble(self.path, f, size)
            f.seek(pre.header_offset)
            hjson = f.read(pre.header_length)
            f.seek(pre.dir_offset)
            dir_json = f.read(pre.dir_length)
        (stored,) = struct.unpack("<Q", raw_pre[56:64])
        if stored != _checksum(raw_pre[:56], hjson, dir_json):
            raise CortiqError(
                f"{self.path}: CMF header checksum mismatch (the header or directory was changed or is corrupt)"
            )
        header = untrusted_loads(hjson, f"{self.path} (header)", max_bytes=MAX_HEADER)
        entries = untrusted_loads(dir_json, f"{self.path} (directory)", max_bytes=MAX_DIRECTORY)
        if not isinstance(header, dict) or not isinstance(entries, list):
            raise CortiqError(f"{self.path}: corrupt CMF header or directory (wrong JSON types)")
        self.header: dict[str, Any] = header
        self.preamble = pre
        self.version = pre.major
        self.minor_version = pre.minor
        self.size = size
        self.data_offset = pre.data_offset
        self.header_capacity = pre.data_offset - PREAMBLE
        self.tensors: dict[str, TensorInfo] = {}
        for e in entries:
            info = _parse_entry(self.path, e)
            dt = get_dtype(info.dtype)
            if info.name in self.tensors:
                raise CortiqError(f"{self.path}: tensor {info.name} appears twice in the directory")
            if info.offset < pre.data_offset or info.offset + info.nbytes > pre.dir_offset:
                raise CortiqError(
                    f"{self.path}: tensor {info.name} lies past the end of the data (truncated or corrupt file)"
                )
            if info.offset % ALIGN:
                raise CortiqError(f"{self.path}: tensor {info.name} is not {ALIGN}-byte aligned (corrupt file)")
            if info.nbytes != dt.nbytes(info.shape):
                raise CortiqError(
                    f"{self.path}: tensor {info.name} has {info.nbytes} bytes, its shape needs {dt.nbytes(info.shape)}"
                )
            self.tensors[info.name] = info
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise CortiqError(f"{self.path}: tensors {a} and {b} overlap (corrupt file)")
        self._mmap = map_regular(self.path, "file", size)  # never empty: the preamble was read
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8)

    def __repr__(self) -> str:
        return f"CmfFile({str(self.path)!r}, {len(self.tensors)} tensors)"

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
        """Yield (tensor, checksum ok) for every tensor, in file order."""
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            crc = zlib.crc32(self._buf[info.offset : info.offset + info.nbytes])
            yield info, crc == info.crc32

    def padding_problems(self) -> list[str]:
        """The bytes no checksum covers must hold what the writer put there: spaces after
        the header JSON, zeros between blobs. Returns where they do not (``verify`` uses it)."""
        pre, buf = self.preamble, self._buf
        out = []
        slack = buf[pre.header_offset + pre.header_length : pre.data_offset]
        if slack.size and not (slack == 0x20).all():
            out.append("header padding")
        pos = pre.data_offset
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if info.offset > pos and buf[pos : info.offset].any():
                out.append(f"padding before {info.name}")
            pos = info.offset + info.nbytes
        if pre.dir_offset > pos and buf[pos : pre.dir_offset].any():
            out.append("padding before the directory")
        return out

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        close_map(self._mmap)

    def __enter__(self) -> "CmfFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rewrite_header(path: str | os.PathLike, header: dict[str, Any]) -> None:
    """Replace the header JSON of an existing file.

    In place when it fits the reserved area (the usual case: a calibration
    temperature); otherwise the whole file is rewritten through a temporary file.
    Tensor blobs and checksums are untouched either way.
    """
    path = Path(path)
    hjson = _header_bytes(header)
    with CmfFile(path) as old:
        pre = old.preamble
        cap = old.header_capacity
    if len(hjson) > MAX_HEADER:
        raise CortiqError(f"{path}: a header of {len(hjson)} bytes exceeds the limit of {MAX_HEADER}")
    with open(path, "rb") as src:
        src.seek(pre.dir_offset)
        old_dir = src.read(pre.dir_length)
    if len(hjson) <= cap:
        with open(path, "r+b") as f:
            f.write(_preamble(len(hjson), pre.data_offset, pre.dir_offset, pre.dir_length, hjson, old_dir))
            f.write(hjson)
            f.write(b" " * (cap - len(hjson)))
            f.flush()
            os.fsync(f.fileno())
        return
    # Grow: shift every blob by a multiple of ALIGN so alignment is kept.
    new_data_off = align_up(PREAMBLE + len(hjson) + HEADER_SLACK)
    shift = new_data_off - pre.data_offset
    entries = untrusted_loads(old_dir, f"{path} (directory)", max_bytes=MAX_DIRECTORY)
    for e in entries:
        e["offset"] += shift
    dir_json = json.dumps(entries).encode("utf-8")
    with open(path, "rb") as src, staged_file(path) as (fd, tmp):
        os.fchmod(fd, os.stat(path).st_mode & 0o7777)
        with os.fdopen(fd, "wb") as dst:
            dst.write(_preamble(len(hjson), new_data_off, pre.dir_offset + shift, len(dir_json), hjson, dir_json))
            dst.write(hjson)
            dst.write(b" " * (new_data_off - PREAMBLE - len(hjson)))
            src.seek(pre.data_offset)
            remaining = pre.dir_offset - pre.data_offset
            while remaining:
                chunk = src.read(min(remaining, 1 << 24))
                if not chunk:
                    raise CortiqError(f"{path}: truncated while rewriting its header")
                dst.write(chunk)
                remaining -= len(chunk)
            dst.write(dir_json)
            dst.flush()
            os.fsync(dst.fileno())
