"""MiMo-V2-Flash: hybrid full / sliding-window layers with sinks, V head width
different from Q/K, V scale, sigmoid-routed grouped MoE; logits against
transformers' ``mimo_v2_flash``; the MTP layers split into the sidecar."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from cortiq_engine.models import parse_config
from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from cortiq_engine import Engine, SpeculativeConfig, forward
from tests import arch_tiny

MT = "mimo_v2_flash"


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo")
    model = arch_tiny.build(MT)
    src = arch_tiny.save(model, root / "hf")
    cmf = root / "mimo.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    return model, src, cmf


def test_arch_parsed_from_config(mimo):
    arch = parse_config(json.loads((mimo[1] / "config.json").read_text()))
    assert arch.layer_types == [LAYER_FULL, LAYER_SLIDING, LAYER_SLIDING, LAYER_FULL]
    assert (arch.head_dim, arch.v_head_dim, arch.rotary_dim) == (24, 16, 8)  # int(24 * 0.334)
    s = arch.sliding
    assert (s.window, s.num_kv_heads, s.head_dim, s.v_head_dim, s.sinks) == (5, 4, 24, 16, True)
    assert s.rope_theta == 10000.0 and arch.rope_theta == 5_000_000.0
    assert arch.attention_value_scale == pytest.approx(0.707)
    m = arch.moe
    assert (m.scoring, m.n_group, m.topk_group, m.score_bias, m.moe_layers) == ("sigmoid", 2, 1, True, [1, 2, 3])


def test_release_style_config_keys():
    """The release's own config keys (swa_*, hybrid_layer_pattern, sliding_window_size)."""
    cfg = dict(
        model_type=MT,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        head_dim=24,
        v_head_dim=16,
        hybrid_layer_pattern=[0, 1, 1],
        sliding_window_size=128,
        swa_num_attention_heads=8,
        swa_num_key_value_heads=8,
        swa_head_dim=24,
        swa_v_head_dim=16,
        swa_rope_theta=10000,
        rope_theta=5000000,
        partial_rotary_factor=0.334,
        moe_layer_freq=[0, 1, 1],
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        layernorm_epsilon=1e-5,
        scoring_func="sigmoid",
        add_swa_attention_sink_bias=True,
    )
    arch = parse_config(cfg)
    assert arch.norm_eps == 1e-5 and arch.moe.scoring == "sigmoid" and arch.sliding.sinks
    assert arch.layer_types == [LAYER_FULL, LAYER_SLIDING, LAYER_SLIDING]
    assert arch.sliding.window == 129 and arch.sliding.num_kv_heads == 8
    assert arch.moe.moe_layers == [1, 2]


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(mimo, kernels):
    model, _, cmf = mimo
    ids = arch_tiny.sample_ids(40)  # far past the window of 5
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


def test_sinks_and_bias_matter(mimo, tmp_path):
    """The check can fail: zeroing the sinks or the routing bias changes the logits."""
    model, src, cmf = mimo
    from safetensors.numpy import load_file

    ids = arch_tiny.sample_ids(24)
    with Engine.load(cmf, kernels="numpy") as eng:
        base = eng.logits(ids)
    for key in ("self_attn.attention_sink_bias", "mlp.gate.e_score_correction_bias"):
        t = load_file(str(src / "model.safetensors"))
        t = {k: (np.zeros_like(v) if k.endswith(key) else v) for k, v in t.items()}
        folder = tmp_path / key.split(".")[-1]
        folder.mkdir()
        for name in ("config.json", "tokenizer.json"):
            (folder / name).write_bytes((src / name).read_bytes())
        save_file(t, str(folder / "model.safetensors"))
        out = folder / "m.cmf"
        convert_checkpoint(folder, out, quant="f32")
        with Engine.load(out, kernels="numpy") as eng:
            assert np.abs(eng.logits(ids) - base).max() > 1e-3


def test_sliding_cache_and_decode(mimo):
    _, _, cmf = mimo
    ids = arch_tiny.sample_ids(16, seed=2)
    with Engine.load(cmf, kernels="numpy") as eng:
        m = eng.model
        a = m.lm_head(m.final_norm(forward(eng.new_state(32), ids)))
        st = eng.new_state(32)
        b = np.concatenate([m.lm_head(m.final_norm(forward(st, [i]))) for i in ids])
        # Sliding layers cache their own KV head count and V width.
        assert st.caches[1].keys.shape[0] == 4 and st.caches[1].values.shape[2] == 16
        assert st.caches[0].keys.shape[0] == 2
    assert arch_tiny.rel_err(b, a) < 1e-5


# ------------------------------------------------------------------ MTP sidecar
def _mtp_tensors(cfg: dict, n_layers: int) -> dict[str, np.ndarray]:
    """MiMo's draft layers as the release names them: the sliding-window geometry."""
    rng = np.random.default_rng(5)
    h, nh, hd, vd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["v_head_dim"]
    nkv = 2 * cfg["num_key_value_heads"]
    inter = cfg["intermediate_size"]

    def mat(r, c):
        return (rng.standard_normal((r, c)) * 0.1).astype(np.float32)

    def vec(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {}
    for k in range(n_layers):
        p = f"model.mtp.layers.{k}."
        out.update(
            {
                p + "enorm.weight": vec(h),
                p + "hnorm.weight": vec(h),
                p + "eh_proj.weight": mat(h, 2 * h),
                p + "final_layernorm.weight": vec(h),
                p + "input_layernorm.weight": vec(h),
                p + "pre_mlp_layernorm.weight": vec(h),
                p + "self_attn.q_proj.weight": mat(nh * hd, h),
                p + "self_attn.k_proj.weight": mat(nkv * hd, h),
                p + "self_attn.v_proj.weight": mat(nkv * vd, h),
                p + "self_attn.o_proj.weight": mat(h, nh * vd),
                p + "self_attn.attention_sink_bias": rng.standard_normal(nh).astype(np.float32),
                p + "mlp.gate_proj.weight": mat(inter, h),
                p + "mlp.up_proj.weight": mat(inter, h),
                p + "mlp.down_proj.weight": mat(h, inter),
            }
        )
    return out


def test_mtp_layers_go_to_the_sidecar(mimo, tmp_path):
    _, src, _ = mimo
    folder = tmp_path / "with_mtp"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(_mtp_tensors(cfg, 3), str(folder / "mtp.safetensors"))
    out = tmp_path / "m.cmf"
    rep = convert_checkpoint(folder, out, quant="q8")
    assert rep.sidecar is not None and rep.mtp_tensors == 3 * 14
    with CmfFile(out) as main, CmfFile(rep.sidecar) as side:
        assert not any(".mtp." in n for n in main.names())
        names = set(side.names())
        assert "model.mtp.layers.2.self_attn.sinks" in names
        assert "model.mtp.layers.0.post_attention_layernorm.weight" in names
        # What the draft layers need of the backbone travels in both headers.
        for hdr in (main.header, side.header):
            arch = ArchConfig.from_json(hdr["arch"])
            assert arch.arch == "mimo_v2" and arch.mtp.num_layers == 3
            assert (arch.sliding.num_kv_heads, arch.sliding.head_dim, arch.sliding.v_head_dim) == (4, 24, 16)
            assert (
                arch.sliding.window == 5 and arch.sliding.sinks and arch.attention_value_scale == pytest.approx(0.707)
            )
        assert main.header["mtp"]["location"] == "sidecar"
    with Engine.load(out, kernels="numpy") as eng:  # the backbone runs without its drafts
        assert np.isfinite(eng.logits(arch_tiny.sample_ids(8))).all()


def test_mtp_layer_with_wrong_geometry_is_refused(mimo, tmp_path):
    _, src, _ = mimo
    folder = tmp_path / "bad_mtp"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    t = _mtp_tensors(cfg, 1)
    t["model.mtp.layers.0.self_attn.k_proj.weight"] = t["model.mtp.layers.0.self_attn.k_proj.weight"][:48]
    save_file(t, str(folder / "mtp.safetensors"))
    with pytest.raises(CortiqError, match="k_proj"):
        convert_checkpoint(folder, tmp_path / "bad.cmf", quant="f32")


def test_q8_stays_close(mimo, tmp_path):
    model, src, _ = mimo
    out = tmp_path / "q8.cmf"
    convert_checkpoint(src, out, quant="q8")
    ids = arch_tiny.sample_ids(30)
    with Engine.load(out) as eng:
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
    assert 1e-5 < err < 0.05


def test_speculative_with_the_mimo_sidecar_equals_greedy(mimo, tmp_path):
    """The MiMo backbone with its three draft layers (sliding geometry, sinks) from the
    sidecar decodes exactly the plain greedy tokens."""

    _, src, _ = mimo
    folder = tmp_path / "with_mtp"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(_mtp_tensors(cfg, 3), str(folder / "mtp.safetensors"))
    out = tmp_path / "m.cmf"
    convert_checkpoint(folder, out, quant="q8")
    with Engine.load(out, mtp=True) as eng:
        stack = eng.drafts
        assert stack is not None and stack.num_layers == 3 and stack.style == "mimo"
        prompt = arch_tiny.sample_ids(12, seed=3)
        plain = eng.generate(prompt, max_tokens=20, ignore_eos=True, speculative=False).token_ids
        # Speculative (the draft layers are loaded); threshold 0: the random draft layers are
        # unsure of everything, and the default adaptive depth would propose no drafts.
        res = eng.generate(prompt, max_tokens=20, ignore_eos=True, speculative=SpeculativeConfig(threshold=0))
    assert res.token_ids == plain
    assert res.extra["mtp"]["rounds"] > 0 and res.expert_usage
