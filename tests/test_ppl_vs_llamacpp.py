"""benchmarks/ppl_vs_llamacpp.py on Gemma 3: cortiq's perplexity against llama.cpp's
chunked method (llama-perplexity's loop over llama-cpp-python), same token ids.

The oracle runs the same numbers: make_gguf.py's F32 GGUF of the Q4_K_M file's
dequantized weights, which cortiq converts from the Q4_K_M file itself (f32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.slow
@pytest.mark.llamacpp
def test_gemma3_ppl_matches_llama_cpp_on_the_same_weights(gemma3_gguf, tmp_path, capsys):
    import llama_cpp  # noqa: F401  # the oracle, built from source; cortiq itself never imports it
    import make_gguf
    import ppl_vs_llamacpp

    f32 = tmp_path / "gemma3-f32.gguf"
    make_gguf.write_f32_gguf(gemma3_gguf, f32)
    rc = ppl_vs_llamacpp.main(
        [
            "--source",
            str(gemma3_gguf),
            "--llama-model",
            str(f32),
            "--chunks",
            "2",
            "--cache-dir",
            str(tmp_path),
            "--json",
        ]
    )
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same ids, over the whole text (its whitespace runs included), not only the scored chunks.
    assert rep["same_tokens"] and rep["tokenizers_first_difference"] is None and rep["tokens_scored"] == 2 * 255
    # The bound is 1%; on the same f32 weights the two agree far closer (measured
    # over 4 chunks: +0.003%, KL 1e-6 nats/token, top-1 100%).
    assert rc == 0 and abs(rep["ppl_rel_diff"]) <= 1e-3, rep
    assert rep["kl_llamacpp_to_cortiq"]["mean"] < 1e-4 and rep["top1_agreement"] >= 0.99, rep
