"""The llama.cpp comparison scripts' own parts (benchmarks/kld_vs_llamacpp.py,
decode_vs_llamacpp.py): llama.cpp's quantizer fed an already quantized source,
llama-perplexity's KL-divergence report read back, and the weight bytes a decode step reads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import decode_vs_llamacpp  # noqa: E402
import kld_vs_llamacpp  # noqa: E402

pytestmark = pytest.mark.llamacpp


def test_a_quantized_source_is_requantized_with_llama_cpps_fallbacks(tmp_path, smollm2_gguf):
    dst = tmp_path / "smol-q3_k_s.gguf"
    kld_vs_llamacpp.quantize(smollm2_gguf, dst, "q3_k_s", threads=2)
    types = kld_vs_llamacpp.gguf_types(dst)
    # SmolLM2's 576-wide rows are no multiple of 256: llama.cpp gives them Q4_0, while the
    # 1536-wide rows (FFN down) take Q3_K; the tied embedding, its output, falls back to Q8_0.
    assert types == {"F32": types["F32"], "Q3_K": 30 * 576 * 1536, "Q4_0": types["Q4_0"], "Q8_0": 49152 * 576}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol-q3_k_s.gguf"]


def test_llama_perplexity_kl_report_is_read_back():
    # The lines as tools/perplexity prints them (its LOG formats), amid other output.
    report = "\n".join(
        [
            "kl_divergence: computing over 11 chunks, n_ctx=512, first 256 tokens of each",
            "Mean PPL(Q)                   :  17.901234 ±   0.912345",
            "Mean PPL(Q)/PPL(base)         :   1.032877 ±   0.004321",
            "Mean    KLD:   0.034567 ±   0.000789",
            "Maximum KLD:   1.234567",
            "99.0%   KLD:   0.345678",
            "Mean    Δp: -0.123 ± 0.045 %",
            "RMS Δp    :  4.567 ± 0.123 %",
            "Same top p: 93.456 ± 0.467 %",
        ]
    )
    got = kld_vs_llamacpp.parse_llama_kld(report)
    assert got == pytest.approx(
        {
            "ppl_ratio": 1.032877,
            "kl_mean": 0.034567,
            "kl_se": 0.000789,
            "kl_p99": 0.345678,
            "delta_p_rms": 0.04567,
            "top1_agreement": 0.93456,
        }
    )


def _gguf(path: Path, names: list[str]) -> Path:
    w = GGUFWriter(str(path), "llama")
    for i, name in enumerate(names):
        w.add_tensor(name, np.zeros((4 + i, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_decode_step_reads_a_tied_embedding_whole_and_one_row_of_an_untied_one(tmp_path):
    embd, out, q = 4 * 32 * 4, 5 * 32 * 4, 6 * 32 * 4  # f32 bytes of the three tensors below
    untied = _gguf(tmp_path / "untied.gguf", ["token_embd.weight", "output.weight", "blk.0.attn_q.weight"])
    assert decode_vs_llamacpp.step_bytes(untied) == out + q
    # No output matrix: the embedding is the output, read whole (the third tensor is 5 rows here).
    tied = _gguf(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    assert decode_vs_llamacpp.step_bytes(tied) == embd + 5 * 32 * 4
