"""The engine on a real trained model (SmolLM2-135M, from tests/conftest.py fixtures).

Oracles: transformers on the same HF folder (logits to 1e-4 relative; greedy
tokens exactly), and the f32 CMF for the quantized files (teacher-forced top-1
agreement over 2,000 tokens of real English text).
"""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    import torch
    import transformers

    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def f32_engine(smollm2_cmf):
    from cortiq_engine import Engine

    return Engine.load(smollm2_cmf("f32"))


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_f32_logits_match_transformers(f32_engine, hf_model):
    import torch

    ids = f32_engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = f32_engine.logits(ids)
    assert _rel(got[-1], ref[-1]) <= 1e-4
    assert _rel(got, ref) <= 1e-4


def test_tokenizer_matches_transformers(f32_engine, smollm2_hf):
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    for text in [PROMPT, "naïve café — 12,345 ünïcödé 😀 tokens\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert f32_engine.tokenizer.encode(text) == hf_tok(text)["input_ids"]
        ids = f32_engine.tokenizer.encode(text)
        assert f32_engine.tokenizer.decode(ids) == hf_tok.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert f32_engine.tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_f32_greedy_64_tokens_equal_transformers(f32_engine, hf_model):
    import torch

    from cortiq_engine import SamplingConfig

    ids = f32_engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False, num_beams=1
        )[0, len(ids) :].tolist()
    res = f32_engine.generate(ids, SamplingConfig(temperature=0.0), max_tokens=64, ignore_eos=True)
    assert res.token_ids == ref


def _top1_agreement(engine, ref_top1: np.ndarray, ids: list[int]) -> float:
    got = np.concatenate([b.argmax(axis=1) for _, b in engine.iter_logits(ids, chunk=256, sub=64)])
    return float((got == ref_top1).mean())


@pytest.fixture(scope="module")
def english_ids(f32_engine, english_text):
    ids = f32_engine.tokenizer.encode(english_text)[:2000]
    assert len(ids) == 2000
    return ids


@pytest.fixture(scope="module")
def f32_top1(f32_engine, english_ids):
    return np.concatenate([b.argmax(axis=1) for _, b in f32_engine.iter_logits(english_ids, chunk=256, sub=64)])


@pytest.mark.slow
@pytest.mark.parametrize("quant,threshold", [("q8", 0.98), ("q4", 0.90)])
def test_quantized_top1_agreement(smollm2_cmf, english_ids, f32_top1, quant, threshold):
    from cortiq_engine import Engine

    eng = Engine.load(smollm2_cmf(quant))
    agree = _top1_agreement(eng, f32_top1, english_ids)
    print(f"{quant} top-1 agreement with f32 over {len(english_ids)} tokens: {agree:.4f}")
    assert agree >= threshold
