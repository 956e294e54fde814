"""``--quant`` presets: the mixed K-quant recipes choose what llama.cpp chooses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from formats.errors import CortiqError
from formats.policy import QUANT_CHOICES, RECIPES, QuantPolicy, use_more_bits
from formats.quants import get_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kld_vs_llamacpp  # noqa: E402

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


@pytest.mark.parametrize(
    "layers, gqa, shapes, more",
    [
        # SmolLM2-135M (30 layers, 9 heads over 3 KV heads, 576-wide rows): llama.cpp's
        # IQ4_XS file has Q5_K in layers 0-2's FFN down only, IQ4_NL where rows are 576.
        (30, 3, {"v_proj": (192, 576), "down_proj": (576, 1536)}, {"down_proj": {0, 1, 2}}),
        # Gemma 3 270M (18 layers, 4 heads over 1 KV head, 640-wide rows): Q5_K V in every
        # layer, which falls back to Q5_1 on 640-wide rows, and Q5_K down in layers 0-1.
        (18, 4, {"v_proj": (256, 640), "down_proj": (640, 2048)}, {"v_proj": set(range(18)), "down_proj": {0, 1}}),
    ],
)
def test_iq4_presets_are_llama_cpps_iq4_choices(layers, gqa, shapes, more):
    for quant in ("iq4_xs", "iq4_nl"):
        p = QuantPolicy(quant, layers=layers, gqa=gqa)
        for module, shape in shapes.items():
            kind = "self_attn" if module == "v_proj" else "mlp"
            for layer in range(layers):
                got = p.dtype_for(f"model.layers.{layer}.{kind}.{module}.weight", shape)
                if layer in more.get(module, ()):
                    want = "q5k" if shape[1] % 256 == 0 else "q5_1"
                else:
                    want = quant if shape[1] % 256 == 0 else "iq4_nl"
                assert got == want, (quant, module, layer, got)
        assert p.dtype_for("model.layers.0.self_attn.q_proj.weight", shape) in ("iq4_nl", quant)


def test_iq4_down_rule_is_off_with_an_imatrix():
    """llama.cpp gives the first layers' FFN down Q5_K only when no imatrix guides IQ4_XS."""
    from formats.imatrix import Imatrix

    p = QuantPolicy("iq4_xs", layers=16, gqa=2, imatrix=Imatrix({}, 1))
    assert p.dtype_for("model.layers.0.mlp.down_proj.weight", (512, 1024)) == "iq4_xs"
    assert (
        QuantPolicy("iq4_xs", layers=16, gqa=2).dtype_for("model.layers.0.mlp.down_proj.weight", (512, 1024)) == "q5k"
    )


@pytest.mark.llamacpp
def test_iq4_xs_preset_is_llama_cpps_file_tensor_by_tensor(tmp_path):
    """llama.cpp's quantizer writes an IQ4_XS file of a tiny 8-layer llama whose four
    heads share one KV head; the iq4_xs preset chooses its type for every matrix."""
    import gguf

    from tests.superblocks import _hf_name
    from tests.test_gguf_import import TINY, write_tiny_gguf
    from tests.tiny import build_tiny

    model = build_tiny(
        "llama",
        **dict(
            TINY,
            hidden_size=256,
            intermediate_size=512,
            head_dim=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,  # as SmolLM2's and Gemma's: token_embd is the output
        ),
    )
    f32 = write_tiny_gguf(model, tmp_path / "f32.gguf", "llama")
    out = tmp_path / "iq4_xs.gguf"
    kld_vs_llamacpp.quantize(f32, out, "iq4_xs", threads=1)
    by_ggml = {get_dtype(n).ggml_type: n for n in ("q8", "q6k", "q5k", "q5_1", "iq4_xs", "iq4_nl")}
    policy = QuantPolicy("iq4_xs", layers=8, gqa=4)
    seen = set()
    for t in gguf.GGUFReader(out).tensors:
        if len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))
        assert policy.dtype_for(_hf_name(t.name), shape) == by_ggml[t.tensor_type.name], t.name
        seen.add(t.tensor_type.name)
    assert {"IQ4_XS", "Q5_K"} <= seen
