"""Encoding row slices on several threads writes the same bytes as encoding them on one."""

from __future__ import annotations

import pytest

import formats.convert as conv
from cortiq_engine.models import FAMILIES
from formats.cmf import CmfFile
from formats.policy import RECIPES
from tests.test_convert import _write_llama

# q5_1 is no preset's base type: a --keep rule puts one matrix in it.
KEEP = [("model.layers.0.mlp.down_proj.weight", "q5_1")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("threads") / "llama"
    _write_llama(folder, vocab=512, hidden=256, layers=2)  # rows of 256: the K-quants fit
    return folder


def _bytes(path) -> dict[str, bytes]:
    with CmfFile(path) as f:
        return {n: f.raw_bytes(n) for n in f.names()}


def _convert(src, out, quant: str, threads: int) -> conv.ConvertReport:
    return conv.convert_checkpoint(src, out, families=FAMILIES, quant=quant, keep=KEEP, force=True, threads=threads)


# The pool is the same for every type; the normal suite runs one per kernel family (legacy
# blocks, K-quant super-blocks, the non-linear grid, a float type), the slow suite the rest.
NORMAL = {"q8", "q4_0", "q4km", "iq4_xs", "bf16"}


@pytest.mark.parametrize(
    "quant", [q if q in NORMAL else pytest.param(q, marks=pytest.mark.slow) for q in sorted(RECIPES)]
)
def test_threads_write_the_bytes_one_thread_writes(llama, tmp_path, monkeypatch, quant):
    # Slices of 16 rows, batches of 6 slices on 3 threads: every tensor spans several batches.
    monkeypatch.setattr(conv, "SLICE_ELEMS", 16 * 256)
    one = _convert(llama, tmp_path / "one.cmf", quant, threads=1)
    three = _convert(llama, tmp_path / "three.cmf", quant, threads=3)
    assert _bytes(tmp_path / "one.cmf") == _bytes(tmp_path / "three.cmf")
    assert one.by_dtype.keys() == three.by_dtype.keys()
    for dt, s in one.by_dtype.items():
        assert (s.err_sq, s.ref_sq) == (three.by_dtype[dt].err_sq, three.by_dtype[dt].ref_sq)
    assert "q5_1" in one.by_dtype or quant in ("f16", "bf16", "f32")


def test_threads_requantize_a_cmf_file_as_one_thread_does(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "SLICE_ELEMS", 16 * 256)
    _convert(llama, tmp_path / "q8.cmf", "q8", threads=1)
    _convert(tmp_path / "q8.cmf", tmp_path / "one.cmf", "q4k", threads=1)
    _convert(tmp_path / "q8.cmf", tmp_path / "three.cmf", "q4k", threads=3)
    assert _bytes(tmp_path / "one.cmf") == _bytes(tmp_path / "three.cmf")


def test_threads_must_be_positive(llama, tmp_path):
    with pytest.raises(conv.CortiqError, match="threads must be at least 1"):
        _convert(llama, tmp_path / "none.cmf", "q8", threads=0)


def test_one_part_tensors_written_behind_or_streamed_give_the_same_file(llama, tmp_path, monkeypatch):
    """A one-part tensor up to GATHER_BYTES is gathered and written while the next one is
    encoded; a larger one streams to the file slice by slice. Either way: the same file,
    the same report, the same progress calls."""
    monkeypatch.setattr(conv, "SLICE_ELEMS", 16 * 256)
    runs = {}
    for name, gather in (("behind", conv.GATHER_BYTES), ("streamed", 0)):
        monkeypatch.setattr(conv, "GATHER_BYTES", gather)
        calls: list[tuple[str, int, int]] = []
        out = tmp_path / f"{name}.cmf"
        report = conv.convert_checkpoint(
            llama, out, families=FAMILIES, quant="bf16", force=True, threads=3, progress=lambda *a: calls.append(a)
        )
        runs[name] = (out.read_bytes(), [(t.name, t.dtype, t.nbytes) for t in report.tensors], calls)
    assert runs["behind"] == runs["streamed"]
    assert runs["behind"][2][-1][1] == runs["behind"][2][-1][2]  # the last call reports everything done
