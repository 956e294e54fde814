"""Gemma 3 270M (a Q4_K_M GGUF: Q4_K, Q6_K, Q5_0 and Q8_0 tensors) end to end.

Oracles: transformers. The fast tests run transformers' Gemma 3 on the HF folder our
importer wrote; the slow ones load the GGUF itself with transformers' own GGUF
loader (``gguf_file=``, dequantized to f32), so the import (names, the stored 1 + w
norms, the K-quant dequantization, the tokenizer) is checked too: logits over 512
tokens of real text, 64 greedy tokens on three prompts (one through the chat
template), and a 1,500-token input whose positions past the 512-token sliding
window depend on it.
"""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest

PROMPTS = [
    "The old stone bridge over the river",
    "def fibonacci(n):\n",
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def engine(gemma3_cmf):
    from cortiq_engine import Engine

    with Engine.load(gemma3_cmf("f32"), ctx=2048) as eng:
        yield eng


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_import_config_and_norms(gemma3_hf, gemma3_gguf):
    from formats.gguf_reader import GgufFile  # checked against gguf-py in tests/test_gguf_reader.py

    cfg = json.loads((gemma3_hf / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 512
    assert cfg["layer_types"].count("full_attention") == 3 and cfg["layer_types"][5] == "full_attention"
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>
    # llama.cpp stores Gemma's norms as 1 + w; the HF checkpoint holds w.
    from safetensors import safe_open

    reader = GgufFile(gemma3_gguf)
    stored = {
        t.name: np.array(t.data)
        for t in reader.tensors
        if t.name.endswith("norm.weight") and t.name.startswith("blk.3.")
    }
    with safe_open(gemma3_hf / "model.safetensors", "np") as f:
        assert np.array_equal(
            f.get_tensor("model.layers.3.pre_feedforward_layernorm.weight"), stored["blk.3.ffn_norm.weight"] - 1
        )
        assert np.array_equal(
            f.get_tensor("model.layers.3.self_attn.k_norm.weight"), stored["blk.3.attn_k_norm.weight"] - 1
        )


def test_logits_match_transformers_on_the_imported_folder(engine, gemma3_hf, english_text):
    """The representative fast test: 96 tokens of real text through both models."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3_hf, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(english_text)[:96]
    assert ids[0] == 2  # BOS, as the GGUF's add_bos_token says
    assert _rel(engine.logits(ids), _hf_logits(model, ids)) <= 1e-4


def test_chat_template_renders_gemma_turns(engine):
    text = engine.tokenizer.apply_chat_template(CHAT)
    assert text == "<bos><start_of_turn>user\nName three colours of the rainbow.<end_of_turn>\n<start_of_turn>model\n"
    ids = engine.tokenizer.encode(text)
    assert ids[:2] == [2, 105] and ids.count(2) == 1  # one BOS: the template's


# ------------------------------------------------------------------ the GGUF through transformers' loader


@pytest.fixture(scope="module")
def hf_gguf(gemma3_gguf):
    import torch
    import transformers

    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    return tok, model


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(engine, hf_gguf, english_text):
    tok, _ = hf_gguf
    texts = [
        english_text[:5000],
        "naïve café — 12,345 ünïcödé 😀 tokens\n\ttabs   and  spaces",
        "<start_of_turn>user\nhi<end_of_turn>\n",
    ]
    for text in texts:
        ids = engine.tokenizer.encode(text)
        assert ids == tok(text)["input_ids"]
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_logits_512_tokens_match_transformers_gguf_loader(engine, hf_gguf, english_text):
    _, model = hf_gguf
    ids = engine.tokenizer.encode(english_text)[:512]
    assert len(ids) == 512
    got, ref = engine.logits(ids), _hf_logits(model, ids)
    assert _rel(got, ref) <= 1e-4
    assert np.array_equal(got.argmax(1), ref.argmax(1))


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """A plain greedy loop over transformers' KV cache (no min-length or EOS masking)."""
    import torch

    out, past, nxt = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            o = model(nxt, past_key_values=past, use_cache=True)
            past = o.past_key_values
            t = int(o.logits[0, -1].argmax())
            out.append(t)
            nxt = torch.tensor([[t]])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["bridge", "code", "chat"])
def test_greedy_64_tokens_equal_transformers(engine, hf_gguf, which):
    from cortiq_engine import SamplingConfig

    _, model = hf_gguf
    if which == "chat":
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT))
    else:
        ids = engine.tokenizer.encode(PROMPTS[["bridge", "code"].index(which)])
    res = engine.generate(ids, SamplingConfig(temperature=0.0), max_tokens=64, ignore_eos=True)
    assert res.token_ids == _hf_greedy(model, ids, 64)


@pytest.mark.slow
def test_sliding_window_past_512_matches_transformers(engine, hf_gguf, english_text):
    """1,500 tokens: the local layers see only the last 512 keys. Positions past the
    window must match transformers, and must differ from full attention everywhere
    (so the window is really applied)."""
    _, model = hf_gguf
    ids = engine.tokenizer.encode(english_text)[:1500]
    assert len(ids) == 1500
    got, ref = engine.logits(ids), _hf_logits(model, ids)
    assert _rel(got[512:], ref[512:]) <= 1e-4
    assert _rel(got, ref) <= 1e-4
    # Without the window the later logits move far beyond the tolerance.
    calls = [b.attn.call for b in engine.model.blocks]
    for b in engine.model.blocks:
        b.attn.call = dataclasses.replace(b.attn.call, window=0)
    try:
        full = engine.logits(ids)
    finally:
        for b, call in zip(engine.model.blocks, calls):
            b.attn.call = call
    assert np.allclose(full[:512], got[:512], rtol=0, atol=1e-3 * np.abs(got).max())
    assert _rel(full[600:], ref[600:]) > 1e-2
