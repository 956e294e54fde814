"""The quantization benchmarks' own arithmetic (benchmarks/quant_bits.py, kld_vs_llamacpp.py):
exact bits/weight counted alike for CMF and GGUF, and llama.cpp's imatrix quantization
re-made tensor by tensor against llama.cpp's library."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader, GGUFWriter
from gguf import quants as gq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kld_vs_llamacpp  # noqa: E402
import quant_bits  # noqa: E402

from tests.ggml_oracle import ggml_library_quantize  # noqa: E402


def _gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GT]]) -> Path:
    w = GGUFWriter(str(path), "llama")
    for name, (x, t) in tensors.items():
        if t == GT.F32:
            w.add_tensor(name, x)
        else:  # llama.cpp's own bytes (gguf-py cannot quantize the K-quants)
            w.add_tensor(name, ggml_library_quantize(x, t) if t == GT.Q4_K else gq.quantize(x, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cmf_and_gguf_bits_count_the_same_way(tmp_path):
    from cortiq_engine.convert import convert_checkpoint
    from tests.tiny import save_tiny

    hf = save_tiny(
        "llama",
        tmp_path / "hf",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    out = tmp_path / "m.cmf"
    convert_checkpoint(hf, out, quant="q4_0")
    r = quant_bits.bits(out)
    # q4_0 matrices: 18 bytes per 32; the 256 x 64 tied embeddings: q6k -> q8 (34 per 32); norms f32
    n_mat = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 256)
    n_norm = 2 * 2 * 64 + 64
    assert r["by_type"]["q4_0"] == {"tensors": 14, "params": n_mat, "bytes": n_mat * 18 // 32, "bits_per_weight": 4.5}
    assert r["by_type"]["q8"]["bytes"] == 256 * 64 * 34 // 32
    assert r["params"] == n_mat + 256 * 64 + n_norm
    assert r["tensor_bytes"] == n_mat * 18 // 32 + 256 * 64 * 34 // 32 + 4 * n_norm
    assert r["padded_tensor_bytes"] >= r["tensor_bytes"] and r["file_bytes"] > r["padded_tensor_bytes"]
    assert r["bits_per_weight"] == 8 * r["tensor_bytes"] / r["params"]

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    g = quant_bits.bits(_gguf(tmp_path / "g.gguf", {"a.weight": (x, GT.Q4_0), "b.weight": (x[0], GT.F32)}))
    assert g["by_type"]["Q4_0"]["bits_per_weight"] == 4.5
    assert g["params"] == 8 * 64 + 64 and g["tensor_bytes"] == 8 * 64 * 18 // 32 + 4 * 64


@pytest.mark.llamacpp  # llama.cpp's library is the quantizer here
def test_llama_cpp_imatrix_requantization_is_its_library_tensor_by_tensor(tmp_path):
    from formats.imatrix import write_imatrix

    rng = np.random.default_rng(3)
    q = rng.standard_normal((16, 128)).astype(np.float32)
    down = rng.standard_normal((8, 256)).astype(np.float32)
    norm = rng.standard_normal(128).astype(np.float32)
    imp = (rng.random(128) ** 4 * 50).astype(np.float32)
    f32 = _gguf(
        tmp_path / "f32.gguf",
        {
            "blk.0.attn_q.weight": (q, GT.F32),
            "blk.0.ffn_down.weight": (down, GT.F32),
            "blk.0.attn_norm.weight": (norm, GT.F32),
        },
    )
    like = _gguf(
        tmp_path / "q.gguf",
        {
            "blk.0.attn_q.weight": (q, GT.Q4_0),
            "blk.0.ffn_down.weight": (down, GT.Q4_K),
            "blk.0.attn_norm.weight": (norm, GT.F32),
        },
    )
    im = tmp_path / "m.imatrix.safetensors"
    write_imatrix(im, {"model.layers.0.self_attn.q_proj.weight": imp}, 100)
    dst = tmp_path / "qi.gguf"
    info = kld_vs_llamacpp.requantize_with_imatrix(f32, like, dst, im)
    assert info == {"weighted_tensors": 1, "unweighted_tensors": 1}
    assert dst.stat().st_size == like.stat().st_size
    got = {t.name: np.asarray(t.data) for t in GGUFReader(str(dst)).tensors}
    want_q = ggml_library_quantize(q, GT.Q4_0, imp)
    assert np.array_equal(got["blk.0.attn_q.weight"].reshape(want_q.shape), want_q)
    assert not np.array_equal(want_q, ggml_library_quantize(q, GT.Q4_0))
    want_down = ggml_library_quantize(down, GT.Q4_K)
    assert np.array_equal(got["blk.0.ffn_down.weight"].reshape(want_down.shape), want_down)
    assert np.array_equal(got["blk.0.attn_norm.weight"], norm)
    assert kld_vs_llamacpp.cmf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert kld_vs_llamacpp.cmf_name("token_embd.weight") == "model.embed_tokens.weight"
