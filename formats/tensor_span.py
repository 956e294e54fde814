"""Where a tensor's bytes lie in a mapped file: the record a CMF directory entry and a
safetensors header entry share (``cmf.TensorInfo`` adds the CRC a CMF entry carries)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: str  # the file's own dtype name
    shape: tuple[int, ...]
    offset: int  # from the start of the file's data section
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes
