"""Every command opens a model through one loader (``cortiq_engine.engine.open_trunk``):
``Engine.load``, ``imatrix``'s collector and ``mtp-train``'s backbone set the thread
pools the same way, build the same trunk and refuse the same files in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import numba
import numpy as np
import pytest

from cortiq_engine import Engine
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.engine import open_trunk
from cortiq_engine.imatrix import collect_imatrix
from cortiq_engine.model import forward
from cortiq_engine.threads import max_threads
from cortiq_train.backbone import open_backbone
from formats.cmf import CmfFile, rewrite_header
from formats.errors import CortiqError
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trunk")
    cmf = root / "tiny.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf"), cmf, quant="f32")
    return cmf


LOADERS = {
    "engine": lambda p, n: Engine.load(p, threads=n, kernels="numpy", warmup=False),
    "imatrix": lambda p, n: collect_imatrix(p, [[1, 2, 3]], threads=n, kernels="numpy"),
    "mtp-train": lambda p, n: open_backbone(p, "numpy", n),
}


@pytest.mark.parametrize("who", sorted(LOADERS))
def test_every_loader_refuses_a_sidecar_and_a_file_without_arch(tiny, tmp_path, who):
    with CmfFile(tiny) as f:
        header = copy.deepcopy(f.header)
    side = tmp_path / "side.cmf"
    side.write_bytes(tiny.read_bytes())
    rewrite_header(side, {**header, "role": "mtp_sidecar"})
    bare = tmp_path / "bare.cmf"
    bare.write_bytes(tiny.read_bytes())
    rewrite_header(bare, {k: v for k, v in header.items() if k != "arch"})
    with pytest.raises(CortiqError, match=r"side\.cmf: not a model file \(role 'mtp_sidecar'\)"):
        LOADERS[who](side, 1)
    with pytest.raises(CortiqError, match=r"bare\.cmf: not a model file \(the header has no arch section\)"):
        LOADERS[who](bare, 1)


@pytest.mark.parametrize("who", sorted(LOADERS))
def test_every_loader_sets_the_pools_through_one_function(tiny, who):
    top = max_threads()
    for n in sorted({1, top}):
        LOADERS[who](tiny, n)
        assert numba.get_num_threads() == n
    with pytest.raises(CortiqError, match=rf"--threads {top + 1}: choose 1\.\.{top}"):
        LOADERS[who](tiny, top + 1)


def test_the_trunks_compute_the_same_rows(tiny):
    ids = [5, 9, 2, 7, 1]
    trunk = open_trunk(tiny, threads=1, kernels="numpy")
    eng = Engine.load(tiny, threads=1, kernels="numpy", warmup=False)
    bb = open_backbone(tiny, "numpy", 1)
    assert trunk.threads == bb.threads == eng.threads == 1 and trunk.tokenizer is not None
    rows = [forward(m.new_state(len(ids)), ids) for m in (trunk.model, eng.model, bb.model)]
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])
    assert open_trunk(tiny, threads=1, kernels="numpy", tokenizer=False).tokenizer is None
