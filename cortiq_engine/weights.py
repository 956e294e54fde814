"""Weight matrices as zero-copy views into a CMF memory map.

A ``Weight`` is data only (dtype, shape, planar parts); the kernel sets in
``cortiq_engine.kernels`` know how to multiply by it. Half-precision parts are
re-viewed as ``uint16`` bit patterns so compiled kernels can read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.quants import DType, get_dtype


@dataclass(frozen=True, eq=False)
class Weight:
    name: str
    dtype: str
    rows: int
    cols: int
    parts: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        # The matmul kernels trust these shapes: check them once, here.
        rows, cols = self.rows, self.cols
        kind = get_dtype(self.dtype)
        if not kind.matrix or rows < 1 or cols < 1 or not kind.supports((rows, cols)):
            raise CortiqError(f"tensor {self.name}: {self.dtype}[{rows}, {cols}] is not a matrix the kernels can use")
        for k, shape in kind.matrix_parts(rows, cols).items():
            if k not in self.parts or tuple(self.parts[k].shape) != shape:
                raise CortiqError(f"tensor {self.name}: part {k} does not have shape {list(shape)}")

    @property
    def kind(self) -> DType:
        """The dtype object: layout, decoding and the arrays its kernels take."""
        return get_dtype(self.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def kernel_parts(self) -> tuple[np.ndarray, ...]:
        """The parts a kernel of this dtype takes, in its argument order."""
        return tuple(self.parts[n] for n in self.kind.kernel_parts)

    def dequantize(self, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """f32 copy of rows r0..r1 (numpy; tests and the reference path)."""
        r1 = self.rows if r1 is None else r1
        return self.kind.decode({k: v[r0:r1] for k, v in self.parts.items()}, (r1 - r0, self.cols))

    def rows_f32(self, ids: np.ndarray) -> np.ndarray:
        """f32 copy of the rows ``ids`` (embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise CortiqError(f"token id out of range 0..{self.rows - 1}")
        return self.kind.decode({k: v[ids] for k, v in self.parts.items()}, (len(ids), self.cols))


def load_weight(cmf: CmfFile, name: str) -> Weight:
    info = cmf.info(name)
    if not get_dtype(info.dtype).matrix or len(info.shape) != 2:
        raise CortiqError(f"{cmf.path}: tensor {name} is {info.dtype}{list(info.shape)}, expected a 2-D matrix")
    parts = {}
    for k, v in cmf.tensor_parts(name).items():
        if v.dtype == np.float16:
            v = v.view(np.uint16)
        parts[k] = v
    return Weight(name, info.dtype, int(info.shape[0]), int(info.shape[1]), parts)


def load_vector(cmf: CmfFile, name: str, size: int | None = None) -> np.ndarray:
    """A small 1-D tensor (norm weight, bias) as contiguous f32."""
    v = np.ascontiguousarray(cmf.tensor_f32(name).reshape(-1), dtype=np.float32)
    if size is not None and v.size != size:
        raise CortiqError(f"{cmf.path}: tensor {name} has {v.size} values, expected {size}")
    return v
