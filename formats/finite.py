"""Non-finite weights: a NaN or an infinity in a source tensor is bad input, named once.

A quantizer fed a NaN writes NaN scales (every later logit is NaN), and a block copy
carries NaN scales across unchanged; both are refused before anything is written.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from formats.errors import CortiqError


def _all_finite(a: np.ndarray) -> bool:
    """min and max propagate NaN and show an infinity: two passes, no temporary array,
    no overflow (a sum or a dot product of large finite values can reach inf)."""
    if a.size == 0 or not np.issubdtype(a.dtype, np.floating):
        return True
    return bool(np.isfinite(a.min()) and np.isfinite(a.max()))


def check_finite(name: str, rows: np.ndarray, first_row: int = 0) -> None:
    """Raise one ``CortiqError`` naming tensor ``name``, the row and column of the first
    NaN or infinity in ``rows`` (a float slice that starts at row ``first_row``) and its
    value; return quietly when every value is finite."""
    a = np.asarray(rows)
    if _all_finite(a):
        return
    flat = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(1, -1)
    r, c = (int(i[0]) for i in np.nonzero(~np.isfinite(flat)))
    row = first_row + r if a.ndim > 1 else first_row
    col = c if a.ndim > 1 else r * flat.shape[1] + c
    raise CortiqError(f"tensor {name} holds {flat[r, c]} at row {row}, column {col}: weights must be finite numbers")


def check_finite_parts(name: str, parts: Mapping[str, np.ndarray]) -> None:
    """``check_finite`` on every floating-point part of an encoded tensor (the f16/f32
    scales and minimums of block types, the data of float types): what a block copy
    carries over unchanged."""
    for part, a in parts.items():
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating) and not _all_finite(a):
            check_finite(f"{name} ({part})", a.reshape(a.shape[0], -1) if a.ndim > 1 else a)
