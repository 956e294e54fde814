"""The one parser for JSON that comes from a file: CMF headers and directories,
sidecars, safetensors headers, config.json and the tokenizer files; and the one way
such a file is opened (``open_regular``) and mapped (``map_regular``, ``close_map``).

Python's ``json`` recurses once per nesting level (a header nested 100,000 deep is a
RecursionError), turns a 5,000-digit integer into a ValueError about digit limits,
and accepts ``NaN``/``Infinity`` and ``1e999``. Here every failure is a one-line
``CortiqError`` naming the file: the size and the nesting depth are bounded before
``json`` sees the text, integers are bounded to 64 bits, and non-finite numbers are
refused.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from formats.errors import CortiqError

MAX_DEPTH = 64
# Larger than any real config/tokenizer file (tokenizer.json of a 256k vocabulary is ~30 MB).
MAX_BYTES = 256 << 20
_INT_DIGITS = 20  # a u64 has 20 digits; anything longer cannot be a size, offset or id
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > _INT_DIGITS:
        raise ValueError(f"integer with {len(s)} digits")
    return int(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {s[:20]} overflows a double")
    return v


def _parse_constant(s: str) -> Any:
    raise ValueError(f"{s} is not a JSON number")


_CHUNK = 1 << 22  # bytes scanned at once: bounded memory for a 256 MB tokenizer.json
# Byte classes: 0 other, 1 opening bracket, 2 closing bracket, 3 quote, 4 backslash.
_CLASS = np.zeros(256, np.uint8)
_CLASS[[ord("["), ord("{")]] = 1
_CLASS[[ord("]"), ord("}")]] = 2
_CLASS[_QUOTE] = 3
_CLASS[_BACKSLASH] = 4


def nesting_depth(raw: bytes, chunk: int = _CHUNK) -> int:
    """The deepest bracket nesting of JSON text, strings excluded: vectorized passes over
    chunks, no regex, no recursion (a backtracking string pattern is quadratic on a
    header of escaped quotes).

    A quote opens or closes a string unless an odd run of backslashes precedes it;
    a bracket counts when an even number of such quotes precede it. Only the bytes of
    those four kinds are looked at after one table look-up. Text that is not JSON may
    get a wrong depth, but ``json`` then refuses it anyway.
    """
    data = memoryview(raw).cast("B")
    deepest = depth = quotes = backslashes = 0  # carried from one chunk to the next
    for start in range(0, len(data), chunk):
        cls = _CLASS[np.frombuffer(data[start : start + chunk], np.uint8)]
        size = cls.size
        pos = np.flatnonzero(cls)
        if not pos.size:
            backslashes = 0
            continue
        c = cls[pos]
        is_bs = c == 4
        # A backslash continues the run of the entry before it when it sits right after it.
        cont = np.empty(pos.size, bool)
        cont[0] = backslashes > 0 and pos[0] == 0
        cont[1:] = is_bs[:-1] & (pos[1:] == pos[:-1] + 1)
        run_start = np.where(is_bs & ~cont, pos, np.iinfo(np.int64).min)
        if is_bs[0] and cont[0]:
            run_start[0] = -backslashes
        run_start = np.maximum.accumulate(run_start)  # for a backslash: where its run began
        # Backslashes right before each entry.
        before = np.zeros(pos.size, np.int64)
        before[0] = backslashes if pos[0] == 0 else 0
        after_bs = is_bs[:-1] & (pos[1:] == pos[:-1] + 1)
        before[1:] = np.where(after_bs, pos[1:] - run_start[:-1], 0)
        quote = (c == 3) & (before % 2 == 0)
        seen = np.cumsum(quote) + quotes  # structural quotes up to and including each entry
        bracket = (c == 1) | (c == 2)
        outside = bracket & (seen % 2 == 0)
        step = np.where(outside, np.where(c == 1, 1, -1), 0)
        levels = np.cumsum(step) + depth
        deepest = max(deepest, int(levels.max()))
        depth, quotes = int(levels[-1]), int(seen[-1])
        backslashes = int(size - run_start[-1]) if is_bs[-1] and pos[-1] == size - 1 else 0
    return deepest


def loads(data: bytes | str, what: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` (UTF-8 JSON from ``what``, a file name for messages) or raise one CortiqError."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise CortiqError(f"{what}: JSON of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CortiqError(f"{what}: not UTF-8 text (byte {e.start})") from None
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise CortiqError(f"{what}: JSON nested {depth} deep (limit {max_depth})")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CortiqError(f"{what}: invalid JSON ({str(e).splitlines()[0][:200]})") from None


def load_object(data: bytes | str, what: str, **limits: int) -> dict[str, Any]:
    """``loads`` that also requires a JSON object at the top."""
    obj = loads(data, what, **limits)
    if not isinstance(obj, dict):
        raise CortiqError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for reading when it is a regular file (not a FIFO, device, socket,
    folder, or a /proc or /sys entry) of at most ``max_bytes``; else one CortiqError.

    It is opened with O_NONBLOCK so a FIFO cannot block the open, then checked with
    fstat on the open descriptor (no window between the check and the use)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CortiqError(f"{path}: no such {what}") from None
    except OSError as e:
        try:  # a socket cannot be opened at all: name what it is
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise CortiqError(f"{path}: is {_kind(mode)}, expected a regular {what}") from None
        raise CortiqError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CortiqError(f"{path}: is {_kind(st.st_mode)}, expected a regular {what}")
        if any(_same_device(st, root) for root in ("/proc", "/sys")):
            raise CortiqError(f"{path}: is a kernel pseudo-file, expected a regular {what}")
        if max_bytes is not None and st.st_size > max_bytes:
            raise CortiqError(f"{path}: {st.st_size} bytes exceeds the limit of {max_bytes} for a {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def map_regular(path: str | os.PathLike, what: str, size: int) -> mmap.mmap | None:
    """``path`` opened as ``open_regular`` opens it and mapped read-only, refused when it is
    no longer ``size`` bytes (the size its header was checked against); None when empty
    (zero bytes cannot be mapped)."""
    with open_regular(path, what) as f:
        if os.fstat(f.fileno()).st_size != size:
            raise CortiqError(f"{path}: the file changed while it was being opened")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None


def close_map(mm: mmap.mmap | None) -> None:
    """Unmap ``mm`` unless numpy views still reference it: then it closes when they go."""
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        pass


def _same_device(st: os.stat_result, root: str) -> bool:
    try:
        return os.stat(root).st_dev == st.st_dev
    except OSError:
        return False


def read_text(path: Path, max_bytes: int = MAX_BYTES, what: str = "text file") -> str:
    """A UTF-8 text file, bounded in size, as one CortiqError on anything unreadable
    (a FIFO, a device or a /proc entry included: see ``open_regular``)."""
    with open_regular(path, what, max_bytes) as f:
        try:
            raw = f.read(max_bytes + 1)
        except OSError as e:
            raise CortiqError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise CortiqError(f"{path}: over {max_bytes} bytes, the limit for a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CortiqError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_object(path: Path, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, tokenizer_config.json, ...)."""
    return load_object(read_text(path, max_bytes), str(path), max_bytes=max_bytes)


def is_int(v: Any) -> bool:
    """A JSON integer: ``true``/``false`` parse to Python bools, which are ints too."""
    return isinstance(v, int) and not isinstance(v, bool)


def section(header: dict[str, Any], key: str, where: str = "header") -> dict[str, Any]:
    """``header[key]`` when it is an object, {} when absent or null; anything else is bad input."""
    v = header.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise CortiqError(f"{where} {key} section is {str(v)[:40]!r}, expected an object")
    return v
