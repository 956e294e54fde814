"""iq4_xs (llama.cpp's IQ4_XS): its bytes against gguf-py, its kernels against their
numpy twin and float64, its encoder against float64 error bounds (gguf-py has no IQ4_XS
encoder; llama.cpp's own library where installed: the llamacpp marker), GGUF blocks copied bit for bit,
``cortiq convert --quant iq4_xs`` and the engine on the result."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from cortiq_engine.convert import convert_checkpoint
from formats.iq4_xs import KVALUES_IQ4NL, scales_iq4_xs
from formats.quants import get_dtype
from tests import superblocks as sb
from tests.tiny import save_tiny

DT = get_dtype("iq4_xs")


def test_layout_is_ggml_block_iq4_xs():
    assert DT.block_bytes == 136 and DT.bits == 4.25 and DT.ggml_type == "IQ4_XS"
    sb.check_ggml_layout(DT, GT.IQ4_XS)


def test_kernels_against_numpy_and_float64():
    sb.check_kernels(DT)


def test_integer_kernels_against_float64_twin():
    sb.check_int_kernels(DT)


def test_encoder_error_and_grid():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    named = DT.named(DT.encode(x), x.shape)
    # every value is d * (ls - 32) * a grid level
    d = named["d"].astype(np.float32).reshape(-1, 1)
    ls = scales_iq4_xs(named["scales_h"], named["scales_l"]).astype(np.float32)
    levels = DT.decode(named, x.shape).reshape(-1, 8, 32) / (d * ls)[:, :, None]
    assert np.isin(np.round(levels), KVALUES_IQ4NL).all()
    # N(0, 1): IQ4_XS's error sits between Q4_K's and Q3_K's at its 4.25 bits
    err = sb.relative_rms(DT, x)
    assert 0.05 < err < 0.085
    assert sb.relative_rms(get_dtype("q3k"), x) > err
    # zeros encode as zeros; rows are independent
    z = np.zeros((2, 256), np.float32)
    assert not DT.decode(DT.named(DT.encode(z), z.shape), z.shape).any()
    both = DT.encode(x)
    halves = [DT.encode(x[:10]), DT.encode(x[10:])]
    assert all(np.array_equal(a, np.concatenate([h0, h1])) for a, h0, h1 in zip(both, *halves))


@pytest.mark.llamacpp
def test_encoder_is_llama_cpp_byte_for_byte():
    sb.check_llama_cpp_bytes(DT, GT.IQ4_XS)


def test_imatrix_lowers_the_weighted_error():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    imp = (rng.random(512) ** 6 * 100).astype(np.float32)  # a few columns matter most
    assert sb.relative_rms(DT, x, imp) < sb.weighted_rms_of_plain(DT, x, imp)


def test_gguf_blocks_copy_bit_for_bit_and_run(tmp_path):
    from cortiq_engine import Engine, forward

    out = sb.check_gguf_keep("iq4_xs", "IQ4_XS", DT, tmp_path)
    ids = np.random.default_rng(2).integers(0, 256, 12)
    logits = {}
    for k in ("numba", "numba-float", "numpy"):
        eng = Engine.load(out, kernels=k)
        st = eng.new_state(32)
        h = np.concatenate([forward(st, ids[:8])] + [forward(st, ids[i : i + 1]) for i in range(8, 12)])
        logits[k] = eng.model.lm_head(eng.model.final_norm(h))
    scale = np.abs(logits["numpy"]).max()
    assert np.abs(logits["numba-float"] - logits["numpy"]).max() <= 1e-4 * scale
    # decode rounds activations to int8 per block of 32 (qdot.py), as for q4k: on this
    # random model's small logits, every matrix (embeddings too) of the dtype
    rel = np.linalg.norm(logits["numba"] - logits["numpy"]) / np.linalg.norm(logits["numpy"])
    assert rel <= 3e-2


def test_convert_quant_writes_the_dtype(tmp_path):
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, head_dim=64)
    rep = convert_checkpoint(src, tmp_path / "m.cmf", quant="iq4_xs")
    chosen = {t.name: t.dtype for t in rep.tensors}
    assert chosen["model.layers.0.mlp.down_proj.weight"] == "iq4_xs"
    assert chosen["lm_head.weight"] == "q6k" and chosen["model.layers.0.input_layernorm.weight"] == "f32"
    assert 0.05 < rep.by_dtype["iq4_xs"].rms_rel_error < 0.09
