"""The speculative contract for every family: a verify forward of k rows gives each row
bit for bit what its one-row decode gives (so speculative output equals plain greedy
output token for token, near-ties included), on both kernel sets."""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine import Engine, forward
from cortiq_engine.convert import convert_checkpoint
from tests import arch_tiny
from tests.test_arch_cli import FAMILIES, _checkpoint

PREFIX, ROWS = 20, 10


@pytest.mark.parametrize("mt", FAMILIES)
def test_verify_rows_equal_one_row_decode(tmp_path, mt):
    _, src = _checkpoint(mt, tmp_path / "hf")
    cmf = tmp_path / "m.cmf"
    convert_checkpoint(src, cmf, quant="f32", mtp="drop")
    ids = arch_tiny.sample_ids(PREFIX + ROWS, seed=4)
    for kernels in ("numba", "numpy"):
        with Engine.load(cmf, kernels=kernels, warmup=False) as eng:
            m = eng.model
            st = m.new_state(64)
            forward(st, ids[:PREFIX])
            one = np.concatenate([forward(st, [t]) for t in ids[PREFIX:]])
            for k in (2, 4, ROWS):
                st = m.new_state(64)
                forward(st, ids[:PREFIX])
                ver = forward(st, ids[PREFIX : PREFIX + k])
                assert np.array_equal(ver, one[:k]), (mt, kernels, k, float(np.abs(ver - one[:k]).max()))
