"""``--quant`` presets: the mixed K-quant recipes choose what llama.cpp chooses."""

from __future__ import annotations

import pytest

from formats.errors import CortiqError
from formats.policy import QUANT_CHOICES, RECIPES, QuantPolicy, use_more_bits
from formats.quants import get_dtype

_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"


@pytest.mark.slow
def test_q4km_is_llama_cpps_q4_k_m_tensor_by_tensor(gemma3_gguf):
    """Gemma 3 270M's published Q4_K_M file (llama.cpp's choices, with its fallbacks
    for 640-wide rows) against our q4km preset, every matrix."""
    from gguf import GGUFReader

    reader = GGUFReader(gemma3_gguf)
    layers = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    policy = QuantPolicy("q4km", layers=layers)
    ggml_to_cmf = {get_dtype(n).ggml_type: n for n in ("q8", "q6k", "q5", "q4k")}
    checked = 0
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
        assert policy.dtype_for(_hf_name(t.name), shape) == ggml_to_cmf[t.tensor_type.name], t.name
        checked += 1
    assert checked == 7 * layers + 1


def test_q4_0_preset_is_llama_cpps_q4_0_choice():
    """llama.cpp's Q4_0 file: Q4_0 matrices, the output (here the tied embeddings) Q6_K,
    Q8_0 where its rows are not a multiple of 256 (SmolLM2's 576, Gemma's 640)."""
    p = QuantPolicy("q4_0", layers=30)
    assert p.choose("model.embed_tokens.weight", (49152, 576)) == ("q8", False)
    assert p.choose("model.embed_tokens.weight", (262144, 640)) == ("q8", False)
    assert p.choose("lm_head.weight", (32000, 4096)) == ("q6k", False)
    for name, shape in (
        ("self_attn.q_proj", (576, 576)),
        ("self_attn.v_proj", (192, 576)),
        ("mlp.down_proj", (576, 1536)),
    ):
        assert p.choose(f"model.layers.0.{name}.weight", shape) == ("q4_0", False)
    assert p.choose("model.layers.0.mlp.up_proj.weight", (64, 48)) == ("f16", True)


def test_mixed_presets_and_fallbacks():
    p = QuantPolicy("q4km", layers=30)
    more = [i for i in range(30) if use_more_bits(i, 30)]
    assert more[:6] == [0, 1, 2, 5, 8, 11] and more[-4:] == [26, 27, 28, 29]
    down = (576, 1536)  # SmolLM2: only the down projection's rows are a multiple of 256
    assert p.choose("model.layers.0.mlp.down_proj.weight", down) == ("q6k", False)
    assert p.choose("model.layers.4.mlp.down_proj.weight", down) == ("q4k", False)
    assert p.choose("model.layers.4.self_attn.q_proj.weight", (576, 576)) == ("q5", False)
    # llama.cpp's fallbacks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0
    assert QuantPolicy("q5km", layers=30).choose("model.layers.4.self_attn.q_proj.weight", (576, 576)) == (
        "q5_1",
        False,
    )
    assert p.choose("model.layers.0.self_attn.v_proj.weight", (192, 576)) == ("q8", False)
    assert p.choose("model.embed_tokens.weight", (49152, 576)) == ("q8", False)
    assert p.choose("model.embed_tokens.weight", (49152, 1024)) == ("q6k", False)
    assert p.choose("model.layers.0.mlp.gate.weight", (8, 1024)) == ("f32", False)
    assert p.choose("model.layers.0.mlp.up_proj.weight", (64, 48)) == ("f16", True)  # not even 32
    assert QuantPolicy("q4km", keep=[("*down_proj*", "q5k")]).choose("model.layers.4.mlp.down_proj.weight", down) == (
        "q5k",
        False,
    )
    assert QuantPolicy("q6k").choose("model.layers.4.mlp.down_proj.weight", down) == ("q6k", False)
    assert QuantPolicy("q4").choose("lm_head.weight", (100, 64)) == ("q8", False)  # unchanged: q4 keeps q8 embeddings
    assert set(QUANT_CHOICES) >= {"q8", "q6k", "q5km", "q5k", "q5", "q4", "q4km", "q4k", "f16", "bf16", "f32"}
    assert all(get_dtype(r.base).matrix and get_dtype(r.embed).matrix for r in RECIPES.values())
    with pytest.raises(CortiqError, match="unknown --quant 'q2k'"):
        QuantPolicy("q2k")
    with pytest.raises(CortiqError, match="unknown dtype 'u8'"):
        QuantPolicy("q8", keep=[("*", "u8")])
