"""Byte-level CMF editing for tests: rewrite a file's directory or header as a writer
would (so its checksum matches) to reach the checks behind the checksum."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

_FMT = "<8sHHIQQQQQQ"


def reseal(data: bytearray) -> bytearray:
    """Recompute the preamble checksum of CMF bytes in place (whatever they now hold)."""
    _, _, _, _, hoff, hlen, _, diroff, dirlen, _ = struct.unpack(_FMT, bytes(data[:64]))
    crc = zlib.crc32(
        bytes(data[diroff : diroff + dirlen]), zlib.crc32(bytes(data[hoff : hoff + hlen]), zlib.crc32(bytes(data[:56])))
    )
    data[56:64] = struct.pack("<Q", crc)
    return data


def rewrite_directory(data: bytearray, fn: Callable[[list[dict[str, Any]]], Any], seal: bool = True) -> bytearray:
    """Apply ``fn`` to the parsed directory and write it back (new length, new checksum)."""
    pre = list(struct.unpack(_FMT, bytes(data[:64])))
    diroff, dirlen = pre[7], pre[8]
    entries = json.loads(bytes(data[diroff : diroff + dirlen]))
    fn(entries)
    new = json.dumps(entries).encode()
    pre[8] = len(new)
    out = bytearray(struct.pack(_FMT, *pre) + bytes(data[64:diroff]) + new)
    return reseal(out) if seal else out


def rewrite_header_bytes(data: bytearray, hjson: bytes, seal: bool = True) -> bytearray | None:
    """Put ``hjson`` in the header area if it fits its slack (else None)."""
    pre = list(struct.unpack(_FMT, bytes(data[:64])))
    hoff, doff = pre[4], pre[6]
    if hoff + len(hjson) > doff:
        return None
    pre[5] = len(hjson)
    out = bytearray(data)
    out[:64] = struct.pack(_FMT, *pre)
    out[hoff:doff] = hjson + b" " * (doff - hoff - len(hjson))
    return reseal(out) if seal else out


def edit_file(path: Path, fn: Callable[[bytearray], bytearray | None]) -> None:
    data = bytearray(path.read_bytes())
    out = fn(data)
    path.write_bytes(bytes(data if out is None else out))
