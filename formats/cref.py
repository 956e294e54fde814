"""The ``.cref`` file: a reference model's next-token distributions over one text,
saved so later comparisons need no reference model (``cortiq ppl --save-ref/--ref``).

Byte layout (little-endian; the spec with every field is docs/evals.md, "Saved references"):

    0   8  magic  b"CORTIQRF"
    8   2  u16    major version (VERSION)
    10  2  u16    minor version
    12  4  u32    flags (0)
    16  8  u64    header offset (after the last array)
    24  8  u64    header length (UTF-8 JSON)
    32  4  u32    CRC-32 of bytes 0..32 and the header JSON
    36 28         zeros
    64  .  arrays, each on a 64-byte boundary, in the order of ARRAYS
    ... header JSON: {"format": "cortiq-ref", "rows": N, "vocab_size": V, "top_k": K, "tail_samples": M,
                      "text_tokens": T, "windows": W, "arrays": {name: {dtype, shape, offset, nbytes, crc32}},
                      "meta": {...}}

Arrays (N scored positions in plan order, W windows, T text tokens):

    tokens     int32  [T]      the text's token ids
    windows    int64  [W, 5]   begin, end, row_from, row_to, bos (-1: none) per window
    nll        float64 [N]     −log P(target)
    top1       int32  [N]      argmax P (first index on ties)
    top_ids    int32  [N, K]   compact form (K > 0): P's K most probable ids, most probable first
    top_logp   float32 [N, K]  their log P
    tail_logp  float32 [N]     log of P's mass outside top_ids (−inf if none)
    sample_ids int32  [N, M]   M > 0 ("tail_samples"): ids drawn from P restricted to the tail
    sample_logp float32 [N, M] their log P
    logp       float32 [N, V]  full form (K = 0): log P of every id

The writer fills the arrays through a memory map of a temporary file beside the
output (memory stays one block of rows), then appends the header and renames the
file into place; an interrupted write leaves nothing. The file is untrusted input:
the preamble, header JSON (``formats.untrusted_json``), every array's dtype, shape,
offset and CRC are checked on open, the window plan against the token and row
counts, and each block of values (ids in range, finite log-probabilities <= 0) as
it is read. Nothing in it is executed.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import CortiqError
from formats.staging import Staged, hold, new_temp, place, preallocate, refuse_special, remove_stale
from formats.untrusted_json import load_object, open_regular

MAGIC = b"CORTIQRF"
VERSION = 1
MINOR = 0
PREAMBLE = 64
ALIGN = 64
_PRE = "<8sHHIQQI28x"
assert struct.calcsize(_PRE) == PREAMBLE
MAX_HEADER = 16 << 20
MAX_DIM = 1 << 40
_CRC_STEP = 64 << 20  # bytes per CRC read: bounded memory for multi-GB full references
# Log-probabilities are <= 0; float32 rounding of log_softmax can give a few ulps above.
_LOGP_SLACK = 1e-4

ARRAYS = ("tokens", "windows", "nll", "top1", "top_ids", "top_logp", "tail_logp", "sample_ids", "sample_logp", "logp")
DTYPES = {
    "tokens": "int32",
    "windows": "int64",
    "nll": "float64",
    "top1": "int32",
    "top_ids": "int32",
    "top_logp": "float32",
    "tail_logp": "float32",
    "sample_ids": "int32",
    "sample_logp": "float32",
    "logp": "float32",
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shapes(
    rows: int, vocab: int, top_k: int, text_tokens: int, windows: int, samples: int = 0
) -> dict[str, tuple[int, ...]]:
    """Every array's shape; ``top_k`` 0 means the full form; ``samples`` tail samples per row (compact form)."""
    out: dict[str, tuple[int, ...]] = {
        "tokens": (text_tokens,),
        "windows": (windows, 5),
        "nll": (rows,),
        "top1": (rows,),
    }
    if top_k:
        out.update(top_ids=(rows, top_k), top_logp=(rows, top_k), tail_logp=(rows,))
        if samples:
            out.update(sample_ids=(rows, samples), sample_logp=(rows, samples))
    else:
        out["logp"] = (rows, vocab)
    return out


def _nbytes(name: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[name]).itemsize


def _crc_of(buf: np.ndarray) -> int:
    flat = buf.reshape(-1).view(np.uint8)
    crc = 0
    for a in range(0, len(flat), _CRC_STEP):
        crc = zlib.crc32(flat[a : a + _CRC_STEP], crc)
    return crc & 0xFFFFFFFF


class CrefWriter(Staged):
    """Create a ``.cref``: ``tokens``/``windows`` given up front, rows written block by block
    with ``write_rows``, then ``commit`` (or ``abort``). A context manager commits on a
    clean exit and aborts on an exception (Ctrl-C included)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rows: int,
        vocab: int,
        top_k: int,
        tokens: np.ndarray,
        windows: np.ndarray,
        meta: dict[str, Any],
        samples: int = 0,
        force: bool = True,
    ):
        self.path = Path(path)
        refuse_special(self.path)
        if self.path.is_dir():
            raise CortiqError(f"{self.path} is a folder; give a file name such as ref.cref")
        if not self.path.parent.is_dir():
            raise CortiqError(f"output folder {self.path.parent} does not exist")
        if self.path.exists() and not force:
            raise CortiqError(f"{self.path} exists")
        self.rows, self.vocab, self.top_k = int(rows), int(vocab), int(top_k)
        self.samples = int(samples) if self.top_k else 0
        self.meta = meta
        self.shapes = shapes(self.rows, self.vocab, self.top_k, len(tokens), len(windows), self.samples)
        self.offsets: dict[str, int] = {}
        pos = PREAMBLE
        for name, shape in self.shapes.items():
            self.offsets[name] = pos
            pos = _align(pos + _nbytes(name, shape))
        self._end = pos
        remove_stale(self.path)
        fd, self._tmp = new_temp(self.path)
        self._held = hold(self._tmp)
        self._done = False
        try:
            try:
                # Every page of the map gets its disk blocks now: a full disk is one error
                # here, never a SIGBUS when a page is stored.
                preallocate(fd, self._end, self.path)
            finally:
                os.close(fd)
            self._map = np.memmap(self._tmp, dtype=np.uint8, mode="r+", shape=(self._end,))
            self.view("tokens")[:] = np.asarray(tokens, np.int32)
            self.view("windows")[:] = np.asarray(windows, np.int64)
        except BaseException:
            self.abort()
            raise
        self._next = 0

    def view(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        off = self.offsets[name]
        return self._map[off : off + _nbytes(name, shape)].view(DTYPES[name]).reshape(shape)

    def write_rows(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Rows ``start .. start + n`` of every per-row array (in order: no gaps)."""
        if start != self._next:
            raise ValueError(f"rows must be written in order: expected {self._next}, got {start}")
        n = len(arrays["nll"])
        for name, a in arrays.items():
            if name in ("tokens", "windows"):
                continue
            self.view(name)[start : start + n] = a
        self._next = start + n

    def commit(self) -> None:
        if self._next != self.rows:
            raise ValueError(f"{self._next} of {self.rows} rows written")
        self._map.flush()
        entries = {}
        for name, shape in self.shapes.items():
            entries[name] = {
                "dtype": DTYPES[name],
                "shape": list(shape),
                "offset": self.offsets[name],
                "nbytes": _nbytes(name, shape),
                "crc32": _crc_of(self.view(name)),
            }
        del self._map
        header = {
            "format": "cortiq-ref",
            "rows": self.rows,
            "vocab_size": self.vocab,
            "top_k": self.top_k,
            "tail_samples": self.samples,
            "text_tokens": self.shapes["tokens"][0],
            "windows": self.shapes["windows"][0],
            "arrays": entries,
            "meta": self.meta,
        }
        hjson = json.dumps(header, sort_keys=True).encode("utf-8")
        head = struct.pack("<8sHHIQQ", MAGIC, VERSION, MINOR, 0, self._end, len(hjson))
        crc = zlib.crc32(hjson, zlib.crc32(head)) & 0xFFFFFFFF
        with open(self._tmp, "r+b") as f:
            f.write(struct.pack(_PRE, MAGIC, VERSION, MINOR, 0, self._end, len(hjson), crc))
            f.seek(self._end)
            f.write(hjson)
            f.flush()
            os.fsync(f.fileno())
        place(self._tmp, self.path)
        self._done = True
        self._held.release()

    def abort(self) -> None:
        if hasattr(self, "_map"):
            del self._map
        if not self._done:
            self._tmp.unlink(missing_ok=True)
        self._held.release()


def _int(v: Any, what: str, path: Path, lo: int = 0, hi: int = MAX_DIM) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CortiqError(
            f"{path}: header {what} is {str(v)[:40]!r}, expected an integer in [{lo}, {hi}] (corrupt reference file)"
        )
    return v


@dataclass(frozen=True)
class CrefWindow:
    begin: int
    end: int
    row_from: int
    row_to: int
    bos: int | None


class CrefFile:
    """A validated, memory-mapped ``.cref``."""

    def __init__(self, path: str | os.PathLike):
        self.path = p = Path(path)
        try:
            with open_regular(p, "reference file") as f:
                size = os.fstat(f.fileno()).st_size
                pre = f.read(PREAMBLE)
                if len(pre) < PREAMBLE:
                    raise CortiqError(f"{p}: not a cortiq reference file (only {size} bytes)")
                magic, major, minor, flags, hoff, hlen, crc = struct.unpack(_PRE, pre)
                if magic != MAGIC:
                    raise CortiqError(f"{p}: not a cortiq reference file (magic {magic!r}, expected {MAGIC!r})")
                if major != VERSION:
                    raise CortiqError(f"{p}: reference format version {major}.{minor}; this cortiq reads {VERSION}.x")
                if flags:
                    raise CortiqError(f"{p}: unknown reference flags {flags:#x} (corrupt file)")
                if hlen > MAX_HEADER or hoff < PREAMBLE or hoff + hlen != size:
                    raise CortiqError(
                        f"{p}: corrupt or truncated reference file (header at {hoff}+{hlen}, file {size} bytes)"
                    )
                f.seek(hoff)
                hjson = f.read(hlen)
        except IsADirectoryError:
            raise CortiqError(f"{p}: is a folder, expected a .cref file") from None
        except FileNotFoundError:
            raise CortiqError(f"{p}: no such reference file") from None
        if zlib.crc32(hjson, zlib.crc32(pre[:32])) & 0xFFFFFFFF != crc:
            raise CortiqError(f"{p}: reference header checksum mismatch (corrupt file)")
        h = load_object(hjson, str(p), max_bytes=MAX_HEADER)
        if h.get("format") != "cortiq-ref":
            raise CortiqError(f"{p}: header format is {str(h.get('format'))[:40]!r}, expected 'cortiq-ref'")
        self.rows = _int(h.get("rows"), "rows", p, 1)
        self.vocab_size = _int(h.get("vocab_size"), "vocab_size", p, 1, 1 << 31)
        self.top_k = _int(h.get("top_k"), "top_k", p, 0, self.vocab_size)
        self.samples = _int(h.get("tail_samples", 0), "tail_samples", p, 0, 1 << 20)
        if self.samples and not self.top_k:
            raise CortiqError(f"{p}: header tail_samples without top_k (corrupt reference file)")
        n_tok = _int(h.get("text_tokens"), "text_tokens", p, 2, 1 << 31)
        n_win = _int(h.get("windows"), "windows", p, 1, 1 << 31)
        meta = h.get("meta")
        if not isinstance(meta, dict):
            raise CortiqError(f"{p}: header meta is not an object (corrupt reference file)")
        self.meta: dict[str, Any] = meta
        want = shapes(self.rows, self.vocab_size, self.top_k, n_tok, n_win, self.samples)
        arrays = h.get("arrays")
        if not isinstance(arrays, dict) or set(arrays) != set(want):
            raise CortiqError(
                f"{p}: header arrays are {sorted(arrays) if isinstance(arrays, dict) else arrays!r:.80}, expected {sorted(want)}"
            )
        self._map = np.memmap(p, dtype=np.uint8, mode="r", shape=(hoff,)) if hoff else None
        self._views: dict[str, np.ndarray] = {}
        spans = []
        for name, shape in want.items():
            e = arrays[name]
            if not isinstance(e, dict) or e.get("dtype") != DTYPES[name] or e.get("shape") != list(shape):
                raise CortiqError(
                    f"{p}: array {name} is {str(e)[:80]}, expected {DTYPES[name]} {list(shape)} (corrupt reference file)"
                )
            off = _int(e.get("offset"), f"{name}.offset", p, PREAMBLE, hoff)
            nb = _int(e.get("nbytes"), f"{name}.nbytes", p, 0, hoff)
            if nb != _nbytes(name, shape) or off % ALIGN or off + nb > hoff:
                raise CortiqError(f"{p}: array {name} at {off}+{nb} does not fit the file (corrupt reference file)")
            spans.append((off, off + nb, name))
            v = self._map[off : off + nb].view(DTYPES[name]).reshape(shape)
            if _crc_of(v) != _int(e.get("crc32"), f"{name}.crc32", p, 0, 0xFFFFFFFF):
                raise CortiqError(f"{p}: array {name} checksum mismatch (corrupt reference file)")
            self._views[name] = v
        spans.sort()
        for (a0, a1, n0), (b0, b1, n1) in zip(spans, spans[1:]):
            if b0 < a1:
                raise CortiqError(f"{p}: arrays {n0} and {n1} overlap (corrupt reference file)")
        self.tokens = np.asarray(self._views["tokens"], dtype=np.int64)
        if self.tokens.min() < 0 or self.tokens.max() >= self.vocab_size:
            raise CortiqError(
                f"{p}: a token id is outside the vocabulary of {self.vocab_size} (corrupt reference file)"
            )
        self.windows = self._check_windows(np.asarray(self._views["windows"]), n_tok)

    def _check_windows(self, w: np.ndarray, n_tok: int) -> list[CrefWindow]:
        out, rows = [], 0
        for i, (b, e, rf, rt, bos) in enumerate(w.tolist()):
            if not (0 <= b < e <= n_tok and 0 <= rf < rt <= e - b - 1 and -1 <= bos < self.vocab_size):
                raise CortiqError(
                    f"{self.path}: window {i} ({b}, {e}, {rf}, {rt}) does not fit {n_tok} tokens (corrupt reference file)"
                )
            out.append(CrefWindow(b, e, rf, rt, None if bos < 0 else bos))
            rows += rt - rf
        if rows != self.rows:
            raise CortiqError(
                f"{self.path}: the windows score {rows} tokens, the file holds {self.rows} rows (corrupt reference file)"
            )
        return out

    def block(self, a: int, b: int) -> dict[str, np.ndarray]:
        """Rows ``a .. b`` of every per-row array (copies), their values checked."""
        out = {n: np.array(v[a:b]) for n, v in self._views.items() if n not in ("tokens", "windows")}
        bad = None
        nll = out["nll"]
        if not np.all(np.isfinite(nll)) or nll.min(initial=0) < -_LOGP_SLACK:
            bad = "nll"
        elif out["top1"].min(initial=0) < 0 or out["top1"].max(initial=0) >= self.vocab_size:
            bad = "top1"
        elif self.top_k:
            ids, lp, tail = out["top_ids"], out["top_logp"], out["tail_logp"]
            if ids.min(initial=0) < 0 or ids.max(initial=0) >= self.vocab_size:
                bad = "top_ids"
            elif not np.all(np.isfinite(lp)) or lp.max(initial=-1) > _LOGP_SLACK:
                bad = "top_logp"
            elif np.any(np.isnan(tail)) or np.any(tail == np.inf) or tail.max(initial=-1) > _LOGP_SLACK:
                bad = "tail_logp"
            elif self.samples and (
                out["sample_ids"].min(initial=0) < 0 or out["sample_ids"].max(initial=0) >= self.vocab_size
            ):
                bad = "sample_ids"
            elif self.samples and (
                np.any(np.isnan(out["sample_logp"]))
                or np.any(out["sample_logp"] == np.inf)
                or out["sample_logp"].max(initial=-1) > _LOGP_SLACK
            ):
                bad = "sample_logp"
        else:
            lp = out["logp"]
            if np.any(np.isnan(lp)) or np.any(lp == np.inf) or lp.max(initial=-1) > _LOGP_SLACK:
                bad = "logp"
        if bad:
            raise CortiqError(f"{self.path}: {bad} values out of range in rows {a}..{b} (corrupt reference file)")
        return out

    def close(self) -> None:
        self._views.clear()
        self._map = None

    def __enter__(self) -> "CrefFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CrefWriter", "CrefFile", "CrefWindow", "shapes", "MAGIC", "VERSION", "ARRAYS", "DTYPES"]
