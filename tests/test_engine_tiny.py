"""The engine against transformers on tiny random checkpoints of every supported family.

Oracle: transformers' f32 logits on the same checkpoint. The CMF is f32, so the
only differences are float summation order: max |diff| / max |logit| <= 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

FAMILIES = {
    "llama": {},
    "llama_bias_rope3": {
        "attention_bias": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"sliding_window": 8},  # window < prompt: the sliding mask is exercised
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # head_dim != hidden/heads
}


def _model_type(name: str) -> str:
    return name.split("_")[0]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """name -> (HF folder, f32 CMF path)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, kw in FAMILIES.items():
        src = save_tiny(_model_type(name), root / name, **kw)
        cmf = root / f"{name}.f32.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[name] = (src, cmf)
    return out


def _hf_logits(src, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)[None]).logits[0].numpy()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny_models, name, kernels):
    from cortiq_engine import Engine

    src, cmf = tiny_models[name]
    ids = np.random.default_rng(1).integers(0, 256, 48)
    ref = _hf_logits(src, ids)
    eng = Engine.load(cmf, kernels=kernels)
    got = eng.logits(ids)
    assert got.shape == ref.shape
    assert _rel(got[-1], ref[-1]) <= 1e-4
    assert _rel(got, ref) <= 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_incremental_forward_equals_one_pass(tiny_models, name):
    """Prefill chunks + single-token decode steps give the same rows as one pass."""
    from cortiq_engine import Engine, forward

    _, cmf = tiny_models[name]
    eng = Engine.load(cmf)
    ids = np.random.default_rng(2).integers(0, 256, 40)
    ref = eng.logits(ids)
    st = eng.new_state(64)
    rows = [forward(st, ids[:17]), forward(st, ids[17:30])]
    rows += [forward(st, ids[i : i + 1]) for i in range(30, 40)]
    got = eng.model.lm_head(eng.model.final_norm(np.concatenate(rows)))
    assert _rel(got, ref) <= 1e-5
    assert st.length == 40 and st.position == 40
    assert all(c.writes == 40 for c in st.caches)


def test_iter_logits_blocks_cover_every_row(tiny_models):
    from cortiq_engine import Engine

    _, cmf = tiny_models["llama"]
    eng = Engine.load(cmf)
    ids = np.random.default_rng(3).integers(0, 256, 45)
    ref = eng.logits(ids)
    seen = []
    for start, block in eng.iter_logits(ids, chunk=16, sub=5):
        assert block.shape[0] <= 5
        seen.append(start)
        np.testing.assert_allclose(block, ref[start : start + block.shape[0]], rtol=0, atol=1e-5 * np.abs(ref).max())
    assert seen == sorted(seen) and seen[0] == 0
    rows = np.concatenate([b for _, b in eng.iter_logits(ids, chunk=16, sub=5)])
    assert rows.shape == ref.shape
    # rows before ``first`` get no logits, the rest those of the whole sequence
    for first in (0, 7, 16, 30, 44):
        blocks = list(eng.iter_logits(ids, chunk=16, sub=5, first=first))
        assert blocks[0][0] == first and all(b.shape[0] <= 5 for _, b in blocks)
        tail = np.concatenate([b for _, b in blocks])
        np.testing.assert_allclose(tail, ref[first:], rtol=0, atol=1e-5 * np.abs(ref).max())
    assert list(eng.iter_logits(ids, first=45)) == []
    # the default output block: as many rows as LOGIT_BLOCK_BYTES holds, 16..128
    from cortiq_engine.engine import LOGIT_BLOCK_BYTES

    sizes = {b.shape[0] for _, b in eng.iter_logits(np.resize(ids, eng.ctx))}
    assert max(sizes) == max(16, min(128, LOGIT_BLOCK_BYTES // (4 * eng.vocab_size)))


def test_truncate_rolls_back_a_draft(tiny_models):
    """A rejected speculative token rolled back leaves the sequence as if never seen."""
    from cortiq_engine import Engine, forward

    _, cmf = tiny_models["qwen2"]
    eng = Engine.load(cmf)
    ids = np.random.default_rng(4).integers(0, 256, 20)
    ref = eng.logits(ids)
    st = eng.new_state(32)
    forward(st, ids[:18])
    forward(st, [7, 9])  # a wrong 2-token draft
    st.truncate(18)
    assert st.length == 18 and st.position == 18
    h = forward(st, ids[18:])
    got = eng.model.lm_head(eng.model.final_norm(h))
    assert _rel(got, ref[18:]) <= 1e-5


@pytest.mark.parametrize("quant", ["q8", "q4", "f16", "bf16"])
def test_quantized_fast_equals_reference(tmp_path, quant):
    """Numba kernels vs the numpy reference on the same quantized file, decode and prefill paths."""
    from cortiq_engine import Engine, forward

    src = save_tiny("llama", tmp_path / "m", hidden_size=96, intermediate_size=160)
    cmf = tmp_path / f"m.{quant}.cmf"
    convert_checkpoint(src, cmf, quant=quant)
    ids = np.random.default_rng(5).integers(0, 256, 40)
    out = {}
    tile_bits = 0
    for k in ("numba", "numba-float", "numpy"):
        eng = Engine.load(cmf, kernels=k)
        if k == "numba" and eng.kernels.amx_prefill:
            tile_bits = eng.kernels.tile_bits.get(quant, 0)
        st = eng.new_state(64)
        # n = 30 (dequantized tiles + BLAS), n = 3 (small-batch kernel), n = 1 (decode)
        h = np.concatenate(
            [forward(st, ids[:30]), forward(st, ids[30:33]), forward(st, ids[33:36])]
            + [forward(st, ids[i : i + 1]) for i in range(36, 40)]
        )
        out[k] = eng.model.lm_head(eng.model.final_norm(h))
    assert _rel(out["numba-float"], out["numpy"]) <= 1e-5
    # the default rounds decode/verify activations per block of 32 (kernels/qdot.py):
    # to int16 for q8, to int8 for q4 (1/127 of a block's maximum)
    assert _rel(out["numba"], out["numpy"]) <= (1e-2 if quant == "q4" else 1e-4)
    # prefill stays on float activations, but on integer tiles rounds them as the dtype's
    # decode does: int16 for q8, int8 for q4 (tests/test_amx.py)
    assert _rel(out["numba"][:30], out["numpy"][:30]) <= {0: 1e-5, 16: 1e-4, 8: 1e-2}[tile_bits]
