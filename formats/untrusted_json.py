"""The one parser for JSON that comes from a file: CMF headers and directories,
sidecars, safetensors headers, config.json and the tokenizer files.

Python's ``json`` recurses once per nesting level (a header nested 100,000 deep is a
RecursionError), turns a 5,000-digit integer into a ValueError about digit limits,
and accepts ``NaN``/``Infinity`` and ``1e999``. Here every failure is a one-line
``CortiqError`` naming the file: the size and the nesting depth are bounded before
``json`` sees the text, integers are bounded to 64 bits, and non-finite numbers are
refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of JSON text, strings excluded: vectorized passes over
    chunks, no regex, no recursion (a backtracking string pattern is quadratic on a
    header of escaped quotes).

    A quote opens or closes a string unless an odd run of backslashes precedes it;
    a bracket counts when an even number of such quotes precede it. Text that is not
    JSON may get a wrong depth, but ``json`` then refuses it anyway.
    """
    data = memoryview(raw).cast("B")
    deepest = depth = quotes = backslashes = 0  # carried from one chunk to the next
    for start in range(0, len(data), _CHUNK):
        b = np.frombuffer(data[start : start + _CHUNK], np.uint8)
        idx = np.arange(b.size, dtype=np.int64)
        # The last byte at or before i that is not a backslash (a carried run sits before 0).
        last_plain = np.maximum.accumulate(np.where(b != _BACKSLASH, idx, -1 - backslashes))
        run_before = np.empty(b.size, np.int64)  # backslashes right before byte i
        run_before[0] = backslashes
        run_before[1:] = idx[:-1] - last_plain[:-1]
        quote = (b == _QUOTE) & (run_before % 2 == 0)
        seen = np.cumsum(quote) + quotes  # structural quotes up to and including byte i
        outside = (seen % 2 == 0) & ~quote
        opens = (b == ord("[")) | (b == ord("{"))
        closes = (b == ord("]")) | (b == ord("}"))
        step = np.where(outside, opens.astype(np.int64) - closes.astype(np.int64), 0)
        levels = np.cumsum(step) + depth
        deepest = max(deepest, int(levels.max()))
        depth, quotes = int(levels[-1]), int(seen[-1])
        backslashes = int(b.size - 1 - last_plain[-1])
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


def read_text(path: Path, max_bytes: int = MAX_BYTES) -> str:
    """A UTF-8 text file, bounded in size, as one CortiqError on anything unreadable."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CortiqError(f"{path}: {size} bytes exceeds the limit of {max_bytes} for a text file")
        raw = path.read_bytes()
    except IsADirectoryError:
        raise CortiqError(f"{path}: is a folder, expected a file") from None
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
