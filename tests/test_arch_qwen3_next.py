"""Qwen3-Next / Qwen3.5 hybrids: the Gated DeltaNet operators against transformers'
torch reference functions, whole-model logits against transformers, batched prefill
against one-at-a-time decode, and rollback of the linear state."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from formats.arch import LAYER_FULL, LAYER_LINEAR
from cortiq_engine.models import parse_config
from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from cortiq_engine import Engine, forward
from cortiq_engine.gated_deltanet import LinearAttnCache, causal_conv1d, gated_rms_norm, l2norm
from cortiq_engine.kernels.reference import gated_delta_rule
from tests import arch_tiny

FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for mt in FAMILIES:
        model = arch_tiny.build(mt)
        src = arch_tiny.save(model, root / mt)
        cmf = root / f"{mt}.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[mt] = (model, src, cmf)
    return out


# ------------------------------------------------------------------ operators vs torch
def _rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("fn", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_gated_delta_rule_matches_transformers(fn):
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    rng = np.random.default_rng(0)
    n, hk, hv, dk, dv = 37, 2, 4, 16, 8
    q, k = _rand(rng, n, hk, dk), _rand(rng, n, hk, dk)
    v = _rand(rng, n, hv, dv)
    g = -np.abs(_rand(rng, n, hv, scale=0.5))
    beta = 1 / (1 + np.exp(-_rand(rng, n, hv)))
    s0 = _rand(rng, hv, dk, dv, scale=0.3)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None]  # noqa: E731
    ref_o, ref_s = getattr(m, fn)(
        t(q),
        t(k),
        t(v),
        g=t(g),
        beta=t(beta),
        initial_state=t(s0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, s = gated_delta_rule(l2norm(q) * np.float32(dk**-0.5), l2norm(k), v, g, beta, s0)
    np.testing.assert_allclose(o, ref_o[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, ref_s[0].numpy(), rtol=1e-4, atol=1e-5)


def test_causal_conv1d_matches_transformers():
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    rng = np.random.default_rng(1)
    n, c, kern = 9, 12, 4
    x, w = _rand(rng, n, c), _rand(rng, c, kern)
    ref = m.causal_conv1d_fn(torch.from_numpy(x.T[None].copy()), torch.from_numpy(w), None, activation="silu")
    y, window = causal_conv1d(x, np.zeros((kern - 1, c), np.float32), w)
    np.testing.assert_allclose(y, ref[0].numpy().T, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(window, x[-(kern - 1) :])
    # One step with a state, as transformers' decode update does it.
    x1 = _rand(rng, 1, c)
    state = torch.from_numpy(np.concatenate([np.zeros((c, 1), np.float32), x[-(kern - 1) :].T], axis=1)[None].copy())
    ref1 = m.causal_conv1d_update(torch.from_numpy(x1.T[None].copy()), state, torch.from_numpy(w), None, "silu")
    y1, _ = causal_conv1d(x1, window, w)
    np.testing.assert_allclose(y1, ref1[0].numpy().T, rtol=1e-5, atol=1e-6)


def test_gated_rms_norm_matches_transformers():
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    rng = np.random.default_rng(2)
    o, z, w = _rand(rng, 6, 16), _rand(rng, 6, 16), _rand(rng, 16)
    mod = Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(w))
        ref = mod(torch.from_numpy(o), torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(gated_rms_norm(o, z, w, 1e-6), ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ whole models
def test_arch_parsed_from_config(checkpoints):
    arch = parse_config(json.loads((checkpoints["qwen3_next"][1] / "config.json").read_text()))
    assert arch.layer_types == [LAYER_LINEAR] * 3 + [LAYER_FULL]
    assert arch.norm_style == "rms_one" and arch.attn_output_gate and arch.qk_norm
    assert arch.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    assert arch.linear_attn.fused_projection and arch.moe.shared_expert_gate
    a5 = parse_config(json.loads((checkpoints["qwen3_5_text"][1] / "config.json").read_text()))
    assert not a5.linear_attn.fused_projection and a5.moe is None


@pytest.mark.parametrize("mt", FAMILIES)
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(checkpoints, mt, kernels):
    model, _, cmf = checkpoints[mt]
    ids = arch_tiny.sample_ids(48)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("mt", FAMILIES)
def test_prefill_equals_stepwise_decode(checkpoints, mt):
    _, _, cmf = checkpoints[mt]
    ids = arch_tiny.sample_ids(20, seed=3)
    with Engine.load(cmf, kernels="numpy") as eng:
        m = eng.model
        a = m.lm_head(m.final_norm(forward(eng.new_state(64), ids)))
        st = eng.new_state(64)
        b = np.concatenate([m.lm_head(m.final_norm(forward(st, [i]))) for i in ids])
    assert arch_tiny.rel_err(b, a) < 1e-5


# ------------------------------------------------------------------ rollback
def _hidden_after(eng, chunks):
    st = eng.new_state(128)
    h = None
    for c in chunks:
        h = forward(st, c)
    return st, h


@pytest.mark.parametrize("keep", [0, 1, 3, 4])
def test_truncate_then_continue_equals_never_run(checkpoints, keep):
    _, _, cmf = checkpoints["qwen3_next"]
    prompt, draft, cont = (
        arch_tiny.sample_ids(12, seed=4),
        arch_tiny.sample_ids(4, seed=5),
        arch_tiny.sample_ids(3, seed=6),
    )
    with Engine.load(cmf, kernels="numpy") as eng:
        st, _ = _hidden_after(eng, [prompt, draft])
        st.truncate(len(prompt) + keep)
        assert st.length == len(prompt) + keep and st.position == len(prompt) + keep
        got = forward(st, cont)
        _, want = _hidden_after(eng, [prompt, draft[:keep], cont] if keep else [prompt, cont])
        _, kept_all = _hidden_after(eng, [prompt, draft, cont])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if keep < len(draft):  # the check can fail: the rejected tokens do change the result
        assert np.abs(kept_all - want).max() > 1e-3


def test_truncate_restores_linear_state_exactly(checkpoints):
    _, _, cmf = checkpoints["qwen3_5_text"]
    with Engine.load(cmf, kernels="numpy") as eng:
        st, _ = _hidden_after(eng, [arch_tiny.sample_ids(6)])
        lin = [c for c in st.caches if isinstance(c, LinearAttnCache)]
        before = [(c.window.copy(), c.state.copy()) for c in lin]
        forward(st, arch_tiny.sample_ids(5, seed=9))
        st.truncate(6)
        for c, (w, s) in zip(lin, before):
            np.testing.assert_array_equal(c.window, w)
            np.testing.assert_array_equal(c.state, s)
        with pytest.raises(CortiqError, match="cannot roll back"):
            st.truncate(3)  # before the last forward call


# ------------------------------------------------------------------ the multimodal wrapper
def test_qwen3_5_wrapper_checkpoint(checkpoints, tmp_path):
    """Qwen3.5 releases nest the LM under text_config and model.language_model.*."""
    model, src, cmf = checkpoints["qwen3_5_text"]
    text_cfg = json.loads((src / "config.json").read_text())
    folder = tmp_path / "wrapped"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "text_config": text_cfg, "vision_config": {}})
    )
    (folder / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    t = load_file(str(src / "model.safetensors"))
    t = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in t.items()}
    t["model.visual.blocks.0.attn.qkv.weight"] = np.ones((8, 8), np.float32)
    save_file(t, str(folder / "model.safetensors"))
    out = tmp_path / "wrapped.cmf"
    convert_checkpoint(folder, out, quant="f32")
    with CmfFile(out) as f:
        assert not any("visual" in n or "language_model" in n for n in f.names())
        assert f.header["source"]["model_type"] == "qwen3_5"
    ids = arch_tiny.sample_ids(16)
    with Engine.load(out, kernels="numpy") as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 1e-4


def test_compiled_delta_rule_matches_reference():
    from cortiq_engine.kernels import get_kernels

    rng = np.random.default_rng(7)
    n, hk, hv, dk, dv = 23, 2, 6, 16, 12
    q, k = l2norm(_rand(rng, n, hk, dk)), l2norm(_rand(rng, n, hk, dk))
    v, g = _rand(rng, n, hv, dv), -np.abs(_rand(rng, n, hv))
    beta = 1 / (1 + np.exp(-_rand(rng, n, hv)))
    s0 = _rand(rng, hv, dk, dv, scale=0.3)
    o1, s1 = gated_delta_rule(q, k, v, g, beta, s0)
    o2, s2 = get_kernels("numba").delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o2, o1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-6)
    assert np.abs(s1 - s0).max() > 0.1  # the state did move


def test_truncate_with_compiled_kernels(checkpoints):
    _, _, cmf = checkpoints["qwen3_next"]
    prompt, draft, cont = (
        arch_tiny.sample_ids(10, seed=14),
        arch_tiny.sample_ids(4, seed=15),
        arch_tiny.sample_ids(2, seed=16),
    )
    with Engine.load(cmf, kernels="numba") as eng:
        st, _ = _hidden_after(eng, [prompt, draft])
        st.truncate(len(prompt) + 2)
        got = forward(st, cont)
        _, want = _hidden_after(eng, [prompt, draft[:2], cont])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ speculative decoding
class _NoLayer:
    """A stand-in draft layer: the rigged drafter below never runs it, only its cache."""

    def make_cache(self, capacity):
        from cortiq_engine.cache import KVCache

        return KVCache(1, 1, 1, capacity)


@pytest.mark.parametrize("mt", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize("accept", [0, 1, 2, 3])
def test_speculative_rollback_keeps_greedy_exact(checkpoints, mt, accept):
    """Drafts rigged to be right exactly ``accept`` of 3 times per round: every rejection
    rolls the linear states back, and the output must still be plain greedy decoding."""
    from cortiq_engine.mtp import DraftStack, make_drafter

    _, _, cmf = checkpoints[mt]
    prompt = arch_tiny.sample_ids(9, seed=21)
    with Engine.load(cmf) as eng:
        plain = eng.generate(prompt, max_tokens=16, ignore_eos=True).token_ids
        truth = prompt + plain + [0] * 8

        def rigged(t, ids, k):
            right = truth[t + 2 : t + 2 + k]
            return [tok if i < accept else (tok + 1) % 256 for i, tok in enumerate(right)]

        stack = DraftStack((_NoLayer(),) * 3, "test", "rigged")
        drafter = make_drafter(eng.model, stack, eng.ctx, depth=3, override=rigged)
        res = eng.generate(prompt, max_tokens=16, ignore_eos=True, speculative=drafter)
    assert res.token_ids == plain
    mtp = res.extra["mtp"]
    assert mtp["accepted"] > 0 if accept else mtp["accepted"] == 0


@pytest.mark.parametrize("quant, tol", [("q8", 0.05), ("q4", 0.25)])
def test_quantized_stays_close(checkpoints, tmp_path, quant, tol):
    model, src, _ = checkpoints["qwen3_next"]
    out = tmp_path / f"{quant}.cmf"
    convert_checkpoint(src, out, quant=quant)
    with CmfFile(out) as f:
        assert f.info("model.layers.0.linear_attn.conv1d.weight").dtype == "f32"
        assert f.info("model.layers.0.linear_attn.in_proj_qkvz.weight").dtype == quant
    ids = arch_tiny.sample_ids(30)
    with Engine.load(out) as eng:
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
    assert 1e-5 < err < tol  # quantized, so not exact; but close


def test_generation_with_eviction_keeps_going(checkpoints):
    """--evict: attention rows are dropped, the recurrent state is kept; lengths stay in step."""
    _, _, cmf = checkpoints["qwen3_next"]
    with Engine.load(cmf, ctx=16) as eng:
        res = eng.generate(arch_tiny.sample_ids(6), max_tokens=30, evict=True, ignore_eos=True)
        short = eng.generate(arch_tiny.sample_ids(6), max_tokens=30, ignore_eos=True)
    assert len(res.token_ids) == 30 and res.evictions >= 2
    assert short.finish_reason == "length" and len(short.token_ids) < 30
    assert res.token_ids[: len(short.token_ids)] == short.token_ids  # identical until the first eviction
