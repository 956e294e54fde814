"""The dtype registry: one record per CMF dtype, asked for capabilities, never compared by name."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from formats.errors import CortiqError
from formats.quants import DTYPES, dtype_for_ggml, get_dtype, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent


def test_engine_registers_kernels_on_the_records():
    from cortiq_engine.kernels import dtype_ops, fast, qdot

    for name, dt in DTYPES.items():
        ops = dtype_ops.OPS.get(name)
        assert dt.kernels is ops, name  # None for the non-matrix dtypes
        assert dt.has_int8_kernels == (name in qdot.WIDTHS), name
        assert (name in fast.ACT_BITS) == bool(ops and ops.act_bits), name
    assert all(DTYPES[n].matrix for n in dtype_ops.OPS)
    assert not get_dtype("f32").has_int8_kernels and get_dtype("q8").has_int8_kernels


def test_block_copy_types_and_aliases():
    for name, dt in DTYPES.items():
        if dt.ggml_type:
            assert dtype_for_ggml(dt.ggml_type) is dt
            assert dt.block_bytes * 8 / dt.block == dt.bits, name  # bits/weight is the layout's
        for alias in dt.aliases:
            assert resolve_dtype(alias.upper()) is dt
    assert dtype_for_ggml("IQ2_XXS") is None
    assert resolve_dtype("q6_k").name == "q6k" and resolve_dtype("q3_k").name == "q3k"
    with pytest.raises(CortiqError):
        resolve_dtype("q7")


def test_table_rows():
    rows = {dt.name: dt.table_row() for dt in DTYPES.values()}
    assert rows["iq4_xs"][:4] == ("iq4_xs", "IQ4_XS", "4.25", "yes")
    assert rows["q3k"][:4] == ("q3k", "Q3_K", "3.4375", "yes")
    assert rows["q8"][3] == "" and all(r[4] for r in rows.values())


def test_imatrix_flag_matches_the_encoder():
    """A dtype that says it takes an imatrix encodes differently with one."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    imp = (rng.random(512) ** 4).astype(np.float32)
    for dt in DTYPES.values():
        if not dt.quantized:
            continue
        plain = dt.encode(x)
        weighted = dt.encode(x, imp)
        same = all(np.array_equal(a, b) for a, b in zip(plain, weighted))
        assert same != dt.takes_imatrix, dt.name


# A string literal naming a quantized dtype in a comparison or membership test.
_QNAMES = "|".join(sorted((re.escape(n) for n, d in DTYPES.items() if d.quantized), key=len, reverse=True))
_COMPARE = re.compile(rf"""(==|!=)\s*["']({_QNAMES})["']|["']({_QNAMES})["']\s*(==|!=)|in\s*\(\s*["']({_QNAMES})["']""")


def test_no_dtype_name_compares():
    hits = []
    for folder in ("formats", "cortiq_engine", "evals"):
        for path in (ROOT / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if _COMPARE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
