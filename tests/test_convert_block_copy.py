"""GGUF blocks copied bit for bit where the layouts match (Q4_1 -> q4, Q8_0 -> q8),
``--quant keep``, and a CMF file as a conversion source (re-quantizing).

Oracles: the GGUF's own bytes (each block's f16 scale and min read at its offset in
the file) and gguf-py's dequantization of the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from formats.gguf_import import unpermute_rope_rows
from formats.quants import get_dtype
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def smollm2_q4_direct(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("blk") / "s.q4.cmf"
    report = convert_checkpoint(smollm2_gguf, out, quant="q4")
    return out, report


def _gguf_tensors(path: Path) -> dict:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_smollm2_q4_1_blocks_are_copied_bit_for_bit(smollm2_gguf, smollm2_q4_direct):
    import gguf

    out, report = smollm2_q4_direct
    tensors = _gguf_tensors(smollm2_gguf)
    assert len(report.block_copied) == 211  # 210 Q4_1 matrices -> q4, the Q8_0 embedding -> q8
    assert report.by_dtype["q4"].rms_rel_error == 0.0
    with CmfFile(out) as f:
        checked = 0
        for gname, hname, heads in [
            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
            ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight", None),
            ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),  # llama.cpp's rotary row order
            ("token_embd.weight", "model.embed_tokens.weight", None),
        ]:
            t = tensors[gname]
            raw = np.asarray(t.data, dtype=np.uint8)
            rows = raw.shape[0]
            parts = f.tensor_parts(hname)
            size = 20 if t.tensor_type.name == "Q4_1" else 34
            blocks = raw.reshape(rows, -1, size)
            if heads:
                blocks = unpermute_rope_rows(blocks, heads)
            # The f16 scale of every block, byte for byte, read at its offset.
            assert np.array_equal(parts["d"].view(np.uint8).reshape(rows, -1, 2), blocks[:, :, 0:2])
            if size == 20:
                assert f.info(hname).dtype == "q4"
                assert np.array_equal(parts["m"].view(np.uint8).reshape(rows, -1, 2), blocks[:, :, 2:4])
                assert np.array_equal(parts["qs"].reshape(rows, -1, 16), blocks[:, :, 4:])
            else:
                assert f.info(hname).dtype == "q8"
                assert np.array_equal(parts["qs"].view(np.uint8).reshape(rows, -1, 32), blocks[:, :, 2:])
            # And the values decode exactly as gguf-py dequantizes the source.
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            if heads:
                ref = unpermute_rope_rows(ref, heads)
            assert np.array_equal(f.tensor_f32(hname), ref)
            checked += 1
    assert checked == 4


@pytest.mark.slow
def test_quant_keep_keeps_source_types(smollm2_gguf, tmp_path):
    report = convert_checkpoint(smollm2_gguf, tmp_path / "k.cmf", quant="keep")
    with CmfFile(tmp_path / "k.cmf") as f:
        assert f.header["quant"]["default"] == "keep"
        assert f.info("model.embed_tokens.weight").dtype == "q8"
        assert f.info("model.layers.4.mlp.up_proj.weight").dtype == "q4"
        assert f.info("model.layers.4.input_layernorm.weight").dtype == "f32"
    assert set(report.by_dtype) == {"q4", "q8", "f32"} and len(report.block_copied) == 211


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    """A tiny random llama as q4 (its embedding and head q8, as SmolLM2's GGUF has them)."""
    root = tmp_path_factory.mktemp("blk-tiny")
    out = root / "a.q4.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf"), out, quant="q4")
    return out


def _requantize_chain(a: Path, tmp_path: Path) -> None:
    """a.q4.cmf -> b.q8.cmf -> c.q4.cmf: each step re-encodes the decoded values; a dtype
    that stays is copied byte for byte."""
    from cortiq_engine import Engine

    r8 = convert_checkpoint(a, tmp_path / "b.q8.cmf", quant="q8")
    name = "model.layers.1.mlp.gate_proj.weight"
    with CmfFile(a) as fa, CmfFile(tmp_path / "b.q8.cmf") as fb:
        assert fb.info(name).dtype == "q8"
        want = get_dtype("q8").encode(fa.tensor_f32(name))
        assert np.array_equal(fb.tensor_parts(name)["qs"], want[1]) and np.array_equal(
            fb.tensor_parts(name)["d"], want[0]
        )
        # the q8 embedding stays q8: the same bytes
        assert fb.raw_bytes("model.embed_tokens.weight") == fa.raw_bytes("model.embed_tokens.weight")
        assert fb.header["tokenizer"] == fa.header["tokenizer"] and fb.header["arch"] == fa.header["arch"]
        assert fb.header["source"]["format"] == "cmf"
    assert "model.embed_tokens.weight" in r8.block_copied and 0 < r8.by_dtype["q8"].rms_rel_error < 0.01
    convert_checkpoint(tmp_path / "b.q8.cmf", tmp_path / "c.q4.cmf", quant="q4")
    with Engine.load(tmp_path / "c.q4.cmf") as eng:
        ids = eng.tokenizer.encode("The capital of France is")
        assert eng.logits(ids).shape == (len(ids), eng.vocab_size)
    with pytest.raises(CortiqError, match="is the source itself"):
        convert_checkpoint(a, a, quant="q4", force=True)


def test_cmf_source_requantizes(tiny_q4, tmp_path):
    _requantize_chain(tiny_q4, tmp_path)


@pytest.mark.slow  # the same chain on a tiny llama above; here twice SmolLM2's 135M weights
def test_smollm2_cmf_source_requantizes(smollm2_q4_direct, tmp_path):
    _requantize_chain(smollm2_q4_direct[0], tmp_path)
