"""Importance matrices: per weight matrix, the mean squared activation of each input
column over real text (what ``cortiq imatrix`` collects and ``cortiq convert
--imatrix`` weights the quantization error by; llama.cpp's imatrix idea).

Stored as safetensors (no code in the format): one f32 [cols] tensor per CMF weight
name, plus ``TOKENS_KEY`` (int64 [1]) holding how many token positions were seen.
Read back as untrusted input: every tensor must be 1-D f32, finite and >= 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.errors import CortiqError
from formats.safetensors_reader import SafetensorsFile
from formats.safetensors_writer import SafetensorsStream
from formats.staging import refuse_special, staged_file

TOKENS_KEY = "cortiq.imatrix.tokens"


@dataclass(frozen=True)
class Imatrix:
    means: dict[str, np.ndarray]  # CMF weight name -> f32 [cols]
    tokens: int

    def for_tensor(self, name: str, cols: int) -> np.ndarray | None:
        """The importance of ``name``'s input columns, or None when not collected."""
        v = self.means.get(name)
        if v is None:
            return None
        if v.size != cols:
            raise CortiqError(
                f"imatrix entry {name} has {v.size} columns, the tensor has {cols} (another model's imatrix?)"
            )
        return v


def write_imatrix(path: str | Path, means: dict[str, np.ndarray], tokens: int) -> None:
    """Stage the file beside ``path`` and rename it into place: an interrupted or failed
    write leaves nothing, and only a regular file is ever replaced."""
    path = Path(path)
    refuse_special(path)
    names = sorted(means)
    entries = [(n, "F32", (int(means[n].size),), 4) for n in names] + [(TOKENS_KEY, "I64", (1,), 8)]
    with staged_file(path) as (fd, tmp):
        os.close(fd)
        st = SafetensorsStream(tmp, entries)
        try:
            for n in names:
                st.write(n, np.ascontiguousarray(means[n], dtype=np.float32).reshape(-1))
            st.write(TOKENS_KEY, np.array([tokens], np.int64))
        finally:
            st.close()


def read_imatrix(path: str | Path) -> Imatrix:
    path = Path(path)
    if not path.is_file():
        raise CortiqError(f"{path}: no such imatrix file")
    f = SafetensorsFile(path)
    try:
        if TOKENS_KEY not in f.entries:
            raise CortiqError(f"{path}: not a cortiq imatrix (no {TOKENS_KEY})")
        tok = f.entries[TOKENS_KEY]
        if tok.dtype != "I64" or tok.shape != (1,):
            raise CortiqError(f"{path}: corrupt imatrix ({TOKENS_KEY} is {tok.dtype}{list(tok.shape)})")
        tokens = int(f.raw(TOKENS_KEY)[0])
        means = {}
        for name, e in f.entries.items():
            if name == TOKENS_KEY:
                continue
            if e.dtype != "F32" or len(e.shape) != 1:
                raise CortiqError(f"{path}: imatrix entry {name} is {e.dtype}{list(e.shape)}, expected F32 [cols]")
            v = np.array(f.raw(name), dtype=np.float32)
            if not np.isfinite(v).all() or (v < 0).any():
                raise CortiqError(f"{path}: imatrix entry {name} holds negative or non-finite values")
            means[name] = v
    finally:
        f.close()
    return Imatrix(means, tokens)
