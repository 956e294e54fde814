"""Non-finite weights: convert refuses a NaN or an infinity with the tensor, row and
column named, on every route (safetensors re-encoded and copied, GGUF blocks copied,
CMF re-quantized and copied), leaves nothing behind, and keeps them only when asked."""

from __future__ import annotations


import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cortiq_engine.convert import convert_checkpoint
from formats.cmf import CmfFile
from formats.errors import CortiqError
from tests.tiny import save_tiny

BAD = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A tiny llama checkpoint with one NaN in BAD (row 3, column 5)."""
    src = save_tiny("llama", tmp_path_factory.mktemp("nan") / "hf")
    tensors = load_file(src / "model.safetensors")
    w = tensors[BAD].copy()
    w[3, 5] = np.nan
    tensors[BAD] = w
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("quant", ["q8", "f32", "keep"])
def test_convert_names_the_nan_and_writes_nothing(poisoned, tmp_path, quant):
    out = tmp_path / "m.cmf"
    with pytest.raises(CortiqError, match=rf"tensor {BAD} holds nan at row 3, column 5"):
        convert_checkpoint(poisoned, out, quant=quant)
    assert not any(tmp_path.iterdir())


def test_allow_nonfinite_keeps_them(poisoned, tmp_path):
    out = tmp_path / "m.cmf"
    convert_checkpoint(poisoned, out, quant="f32", allow_nonfinite=True)
    with CmfFile(out) as f:
        assert np.isnan(f.tensor_f32(BAD)[3, 5])


def test_requantizing_a_cmf_with_an_infinity_is_refused(tmp_path):
    """A CMF file that holds an infinity (kept on purpose) cannot be re-quantized or
    copied into a new file without the same permission."""
    src = save_tiny("llama", tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    w = tensors[BAD].copy()
    w[0, 0] = np.inf
    tensors[BAD] = w
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    f32 = tmp_path / "f32.cmf"
    convert_checkpoint(src, f32, quant="f32", allow_nonfinite=True)
    for quant in ("q8", "keep"):
        with pytest.raises(CortiqError, match=rf"{BAD}.* holds inf"):
            convert_checkpoint(f32, tmp_path / f"{quant}.cmf", quant=quant)
        assert not (tmp_path / f"{quant}.cmf").exists()


def test_gguf_block_copy_with_a_nan_scale_is_refused(tmp_path):
    """A Q8_0 GGUF block whose f16 scale is NaN: the block copy names the tensor and its
    scale part (d)."""
    import gguf

    from tests.test_gguf_import import TINY, write_tiny_gguf
    from tests.tiny import build_tiny

    model = build_tiny("llama", **TINY)
    path = write_tiny_gguf(model, tmp_path / "t.gguf", "llama", qtypes={BAD: "Q8_0"})
    reader = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    t.data.reshape(-1)[0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # the first block's scale
    reader.data.flush()
    del reader
    with pytest.raises(CortiqError, match=rf"tensor {BAD} \(d\) holds nan at row 0"):
        convert_checkpoint(path, tmp_path / "g.cmf", quant="keep")
    assert not (tmp_path / "g.cmf").exists()


def test_generate_stops_on_non_finite_logits(poisoned, tmp_path):
    """A kept NaN weight reaches the logits: generate stops with one clear error instead
    of emitting argmax-of-NaN tokens."""
    from cortiq_engine import Engine

    out = tmp_path / "m.cmf"
    convert_checkpoint(poisoned, out, quant="f32", allow_nonfinite=True)
    with Engine.load(out, warmup=False) as eng:
        with pytest.raises(CortiqError, match="logits became non-finite"):
            eng.generate([1, 2, 3, 4], max_tokens=4, ignore_eos=True)
