"""The fused decode/verify step (``kernels/fused.py``): every row, cache row and counter
it leaves is the layer-by-layer path's, bit for bit, on the real SmolLM2 at q8 (int16
activations) and q4 (int8) and the real Gemma 3 (sandwich blocks, q/k norms, GeGLU, two
RoPEs, sliding layers); stacks it does not compute keep the layer-by-layer path."""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine import Engine
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.imatrix import RecordingKernels
from cortiq_engine.kernels import get_kernels
from cortiq_engine.model import forward
from tests.tiny import save_tiny


def _steps(engine: Engine, layerwise: bool) -> tuple[list[np.ndarray], object]:
    """A prefill, four decode steps, a 4-row verify rolled back to one row, a decode step
    and an eviction's aftermath: the hidden rows of each call and the final state."""
    state = engine.new_state(128)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(10, engine.model.vocab_size, 60)]
    outs = [forward(state, ids[:40], layerwise)]
    for t in ids[40:44]:
        outs.append(forward(state, [t], layerwise))
    outs.append(forward(state, ids[44:48], layerwise))
    state.truncate(state.length - 3)
    outs.append(forward(state, [ids[48]], layerwise))
    state.evict(20)
    outs.append(forward(state, ids[49:52], layerwise))
    return outs, state


# gemma3-q4km mixes dtypes inside one fused matmul (q5 q|k with a q8 v, q4k / q6k down): two
# kernel calls; an f16 cache takes its rows rounded inside the step, as the layers round them
@pytest.mark.parametrize(
    "model", ["smollm2-q8", "smollm2-q4", "gemma3-q8", "gemma3-q4km", "smollm2-q8-f16", "gemma3-q4km-f16"]
)
def test_fused_step_equals_the_layer_by_layer_path(smollm2_cmf, gemma3_cmf, model):
    family, quant, *kv = model.split("-")
    kv_cache = kv[0] if kv else "f32"
    engine = Engine.load((smollm2_cmf if family == "smollm2" else gemma3_cmf)(quant), threads=2, kv_cache=kv_cache)
    fused_stack = engine.model.fused
    assert fused_stack is not None, f"{family} {quant} is a stack the fused step computes"
    assert (fused_stack.nplans.max() > 1) == (quant == "q4km")
    fused, fs = _steps(engine, layerwise=False)
    plain, ps = _steps(engine, layerwise=True)
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert np.array_equal(a, b), (i, float(np.abs(a - b).max()))
    assert fs.length == ps.length == 23 and fs.position == ps.position
    for cf, cp in zip(fs.caches, ps.caches):
        # every token entered each cache once, at the same rows, with the same bits
        assert cf.writes == cp.writes == fs.forwarded == 52
        assert cf.keys.dtype == cp.keys.dtype == np.dtype(kv_cache.replace("f", "float"))
        assert np.array_equal(cf.keys[:, : cf.length], cp.keys[:, : cp.length])
        assert np.array_equal(cf.values[:, : cf.length], cp.values[:, : cp.length])
    # and the logits a sampler sees from them
    m = engine.model
    assert np.array_equal(m.lm_head(m.final_norm(fused[-1])), m.lm_head(m.final_norm(plain[-1])))


def test_fused_greedy_text_is_the_layer_by_layer_text(smollm2_cmf):
    engine = Engine.load(smollm2_cmf("q8"), threads=2)
    m = engine.model
    prompt = engine.tokenizer.encode("The capital of France is")

    def greedy(layerwise: bool) -> list[int]:
        state = engine.new_state(64)
        h = forward(state, prompt, layerwise)
        out = []
        for _ in range(12):
            out.append(int(np.argmax(m.lm_head(m.final_norm(h[-1:]))[0])))
            h = forward(state, out[-1:], layerwise)
        return out

    assert greedy(False) == greedy(True)


def test_stacks_the_fused_step_does_not_compute_keep_the_layers(smollm2_cmf, tmp_path):
    # q/k/v biases (Qwen2), the numpy kernels
    convert_checkpoint(save_tiny("qwen2", tmp_path / "hf"), tmp_path / "qwen2.cmf", quant="q8")
    assert Engine.load(tmp_path / "qwen2.cmf", threads=2).model.fused is None
    assert Engine.load(smollm2_cmf("q8"), threads=2, kernels="numpy").model.fused is None
    # imatrix's recorder sees every matmul: a chunk of <= 16 tokens must not bypass it
    recorder = RecordingKernels(get_kernels("numba"))
    assert Engine.load(smollm2_cmf("q8"), threads=2, kernels=recorder).model.fused is None
    state = Engine.load(smollm2_cmf("q8"), threads=2, kernels=recorder).new_state(16)
    recorder.take(0)  # what the loads' warm-ups recorded
    forward(state, [1, 2, 3])
    assert recorder.rows["model.layers.0.self_attn.q_proj.weight"] == 3


def test_fused_step_refuses_values_beyond_f16_and_counts_no_row(tmp_path):
    """A value an f16 cache would store as inf stops the fused step with the layers' one-line
    error, and no cache counts the step's rows (nor does the state advance)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from formats.errors import CortiqError

    hf = save_tiny("llama", tmp_path / "hf")
    (st,) = hf.glob("*.safetensors")
    tensors = load_file(st)
    v = "model.layers.1.self_attn.v_proj.weight"
    tensors[v] = tensors[v] * torch.tensor(1e6)  # layer 1's values pass f16's range
    save_file(tensors, st, metadata={"format": "pt"})
    convert_checkpoint(hf, tmp_path / "big.cmf", quant="q8")
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] >= 2
    # (the load's warm-up forward would meet the same rows: it is left out here)
    engine = Engine.load(tmp_path / "big.cmf", threads=2, kv_cache="f16", warmup=False)
    assert engine.model.fused is not None
    state = engine.new_state(16)
    with pytest.raises(CortiqError, match=r"exceeds f16's range \(65504\); use --kv-cache f32") as e:
        forward(state, [5])
    assert "\n" not in str(e.value)
    assert state.length == state.position == 0 and all(c.length == c.writes == 0 for c in state.caches)
    with pytest.raises(CortiqError, match="exceeds f16's range"):
        forward(state, [5], layerwise=True)  # the layers refuse the same row
    out = Engine.load(tmp_path / "big.cmf", threads=2, warmup=False)  # an f32 cache holds it
    assert np.isfinite(forward(out.new_state(16), [5])).all()
