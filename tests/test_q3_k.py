"""q3k (llama.cpp's Q3_K): its bytes against gguf-py, its kernels against their numpy
twin and float64, its encoder against float64 error bounds (gguf-py has no Q3_K
encoder; llama.cpp's own library where installed: the llamacpp marker), GGUF blocks copied bit for bit,
``cortiq convert --quant q3k`` and the engine on the result."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from cortiq_engine.convert import convert_checkpoint
from formats.q3_k import scales_q3k
from formats.quants import get_dtype
from tests import superblocks as sb
from tests.tiny import save_tiny

DT = get_dtype("q3k")


def test_layout_is_ggml_block_q3_k():
    assert DT.block_bytes == 110 and DT.bits == 3.4375 and DT.ggml_type == "Q3_K"
    sb.check_ggml_layout(DT, GT.Q3_K)


def test_kernels_against_numpy_and_float64():
    sb.check_kernels(DT)


def test_integer_kernels_against_float64_twin():
    sb.check_int_kernels(DT)


def test_integer_kernels_on_every_bit_pattern():
    """Random bytes (every 6-bit scale code, every hmask and qs bit; the encoder's
    scales sit near the top of the range) through the integer decode kernels of 1..4
    input rows, both activation widths and both dot-product forms, against the float64
    twin, and each row bit for bit its one-row result."""
    from cortiq_engine.kernels import qdot
    from cortiq_engine.kernels.fast import NumbaKernels
    from cortiq_engine.weights import Weight

    rows, nb = 37, 4
    shape = (rows, nb * DT.block)
    named = DT.named(DT.from_ggml(sb.random_blocks(DT, rows, nb, seed=3)), shape)
    parts = {n: a.view(np.uint16) if a.dtype == np.float16 else a for n, a in named.items()}
    assert set(scales_q3k(named["scales"]).ravel()) == set(range(-32, 32))
    w = Weight("w", DT.name, rows, shape[1], parts)
    X = np.random.default_rng(4).standard_normal((4, shape[1])).astype(np.float32)
    for bits in (8, 16):
        results = []
        for vnni in (False, True) if qdot.host_vnni() else (False,):
            ks = NumbaKernels(act_bits=bits, vnni=vnni)
            if not qdot.host_supports():
                assert ks._plans_for([w])[0][0].fn is None
                return
            for n in range(1, 5):
                got = ks.matmul([w], X[:n])
                twin = qdot.qdot_ref(DT.name, named, X[:n], bits)
                assert np.abs(got - twin).max() / np.abs(twin).max() < 2e-6
                assert all(np.array_equal(ks.matmul([w], X[i : i + 1])[0], got[i]) for i in range(n))
            results.append(got)
        assert all(np.array_equal(r, results[0]) for r in results)


def test_encoder_error_and_grid():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    named = DT.named(DT.encode(x), x.shape)
    # every value is d * (sc - 32) * q, q in -4..3
    d = named["d"].astype(np.float32).reshape(-1, 1)
    sc = scales_q3k(named["scales"]).astype(np.float32)
    q = DT.decode(named, x.shape).reshape(-1, 16, 16) / (d * sc)[:, :, None]
    assert np.array_equal(q, np.round(q)) and q.min() >= -4 and q.max() <= 3
    err = sb.relative_rms(DT, x)
    assert 0.1 < err < 0.17  # N(0, 1) at 3.44 bits
    assert err > sb.relative_rms(get_dtype("q4k"), x)
    z = np.zeros((2, 256), np.float32)
    assert not DT.decode(DT.named(DT.encode(z), z.shape), z.shape).any()
    both = DT.encode(x)
    halves = [DT.encode(x[:10]), DT.encode(x[10:])]
    assert all(np.array_equal(a, np.concatenate([h0, h1])) for a, h0, h1 in zip(both, *halves))


@pytest.mark.llamacpp
def test_encoder_is_llama_cpp_byte_for_byte():
    sb.check_llama_cpp_bytes(DT, GT.Q3_K)


def test_imatrix_lowers_the_weighted_error():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    imp = (rng.random(512) ** 6 * 100).astype(np.float32)  # a few columns matter most
    assert sb.relative_rms(DT, x, imp) < sb.weighted_rms_of_plain(DT, x, imp)


def test_gguf_blocks_copy_bit_for_bit_and_run(tmp_path):
    from cortiq_engine import Engine, forward

    out = sb.check_gguf_keep("q3k", "Q3_K", DT, tmp_path)
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
    rep = convert_checkpoint(src, tmp_path / "m.cmf", quant="q3_k")  # the dtype's alias names the preset
    chosen = {t.name: t.dtype for t in rep.tensors}
    assert chosen["model.layers.0.mlp.down_proj.weight"] == "q3k"
    assert chosen["lm_head.weight"] == "q6k" and chosen["model.layers.0.input_layernorm.weight"] == "f32"
    assert 0.1 < rep.by_dtype["q3k"].rms_rel_error < 0.18
