"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral) against transformers,
the router against hand-computed choices, and the expert grouping of a batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from formats.arch import MoeConfig
from cortiq_engine.models import parse_config
from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine import Engine, forward
from cortiq_engine.moe import MoE, route
from tests import arch_tiny

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (transformers model, HF folder, f32 CMF)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for mt in FAMILIES:
        model = arch_tiny.build(mt)
        src = arch_tiny.save(model, root / mt)
        cmf = root / f"{mt}.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[mt] = (model, src, cmf)
    return out


@pytest.mark.parametrize("mt", FAMILIES)
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(checkpoints, mt, kernels):
    model, _, cmf = checkpoints[mt]
    ids = arch_tiny.sample_ids(40)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


def test_arch_parsed_from_config(checkpoints):
    cfg = json.loads((checkpoints["qwen2_moe"][1] / "config.json").read_text())
    arch = parse_config(cfg)
    assert arch.moe.moe_layers == [0, 2]  # layer 1 is in mlp_only_layers
    assert arch.moe.shared_expert_gate and arch.moe.shared_expert_intermediate_size == 64
    assert arch.attention_bias
    mix = parse_config(json.loads((checkpoints["mixtral"][1] / "config.json").read_text()))
    assert mix.moe.norm_topk_prob and mix.moe.expert_intermediate_size == mix.intermediate_size


def test_mixtral_names_are_normalized(checkpoints):
    with CmfFile(checkpoints["mixtral"][2]) as f:
        names = set(f.names())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert not any("block_sparse_moe" in n for n in names)


# ------------------------------------------------------------------ routing
def _cfg(**kw) -> MoeConfig:
    base = dict(num_experts=4, top_k=2, expert_intermediate_size=8)
    return MoeConfig(**{**base, **kw})


def test_route_softmax_topk_by_hand():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]], np.float32))
    idx, w = route(logits, _cfg())
    assert idx.tolist() == [[1, 3]]
    np.testing.assert_allclose(w, [[0.4, 0.3]], rtol=1e-6)
    idx, w = route(logits, _cfg(norm_topk_prob=True))
    np.testing.assert_allclose(w, [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)


def test_route_ties_go_to_lower_index():
    idx, w = route(np.zeros((1, 4), np.float32), _cfg())
    assert idx.tolist() == [[0, 1]]
    idx, _ = route(np.array([[0.0, 1.0, 1.0, 1.0]], np.float32), _cfg())
    assert idx.tolist() == [[1, 2]]


def test_route_sigmoid_groups_against_transformers_router():
    import torch
    from transformers import AutoConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter

    cfg = AutoConfig.for_model(
        "mimo_v2_flash",
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = MiMoV2FlashTopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(32, 16, generator=g)
    logits, ref_w, ref_idx = router(x)
    mcfg = _cfg(
        num_experts=8,
        top_k=3,
        norm_topk_prob=True,
        scoring="sigmoid",
        score_bias=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    idx, w = route(logits.detach().numpy(), mcfg, router.e_score_correction_bias.numpy())
    # transformers returns the k unsorted; compare as sets with their weights.
    for r in range(32):
        ref = dict(zip(ref_idx[r].tolist(), ref_w[r].detach().tolist()))
        got = dict(zip(idx[r].tolist(), w[r].tolist()))
        assert set(ref) == set(got)
        for e in ref:
            assert got[e] == pytest.approx(ref[e], rel=1e-6)


# ------------------------------------------------------------------ grouping by expert
class _SpyKernels:
    """Numpy kernels that record which weight matrices each matmul reads."""

    def __init__(self):
        from cortiq_engine.kernels import NumpyKernels

        self.inner = NumpyKernels()
        self.calls: list[tuple[str, ...]] = []

    def matmul(self, ws, X):
        self.calls.append(tuple(w.name for w in ws))
        return self.inner.matmul(ws, X)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _spy_moe(cmf_path, layer: int = 0) -> tuple[MoE, _SpyKernels, CmfFile]:
    from formats.arch import ArchConfig
    from cortiq_engine.models.blocks import load_moe

    f = CmfFile(cmf_path)
    arch = ArchConfig.from_json(f.header["arch"])
    spy = _SpyKernels()
    moe = load_moe(f, arch, spy, f"model.layers.{layer}.")
    for e in moe.experts:
        e.ks = spy
    if moe.shared is not None:
        moe.shared.ks = spy
    return moe, spy, f


def test_batch_reads_each_chosen_expert_once(checkpoints):
    moe, spy, f = _spy_moe(checkpoints["qwen3_moe"][2])
    x = np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32)
    idx, _ = route(spy.inner.matmul((moe.router,), x), moe.cfg)
    usage = np.zeros(4, np.int64)
    out = moe(x, usage)
    expert_calls = [c for c in spy.calls if "experts" in c[0]]
    touched = [c[0].split(".")[5] for c in expert_calls if c[0].endswith("gate_proj.weight")]
    # One gate|up and one down matmul per chosen expert, never one per position.
    assert sorted(touched) == sorted({str(e) for e in idx.ravel()})
    assert len(expert_calls) == 2 * len(touched)
    assert usage.tolist() == np.bincount(idx.ravel(), minlength=4).tolist()
    # The grouped batch equals routing each row alone.
    rows = np.concatenate([moe(x[i : i + 1]) for i in range(24)])
    np.testing.assert_allclose(out, rows, rtol=1e-5, atol=1e-6)
    f.close()


def test_single_position_touches_only_its_experts(checkpoints):
    moe, spy, f = _spy_moe(checkpoints["qwen2_moe"][2])
    x = np.random.default_rng(2).standard_normal((1, 64)).astype(np.float32)
    idx, _ = route(spy.inner.matmul((moe.router,), x), moe.cfg)
    spy.calls.clear()
    moe(x)
    read = {n for c in spy.calls for n in c if ".experts." in n}
    assert {n.split(".")[5] for n in read} == {str(e) for e in idx[0]}
    assert any("shared_expert." in n for c in spy.calls for n in c)  # the shared expert always runs
    f.close()


def test_state_counts_expert_usage(checkpoints):
    _, _, cmf = checkpoints["qwen2_moe"]
    with Engine.load(cmf, kernels="numpy") as eng:
        st = eng.new_state(64)
        forward(st, arch_tiny.sample_ids(10))
        forward(st, [5])
    assert sorted(st.expert_usage) == [0, 2]  # the MoE layers only
    for counts in st.expert_usage.values():
        assert counts.sum() == 11 * 2 and counts.shape == (4,)


# ------------------------------------------------------------------ fused 3-D experts
def test_fused_3d_experts_are_split(checkpoints, tmp_path):
    model, src, cmf = checkpoints["qwen3_moe"]
    t = load_file(str(src / "model.safetensors"))
    fused = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = np.stack(
            [np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]) for e in range(4)]
        )
        down = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(4)])
        fused[p + "gate_up_proj"] = gate_up
        fused[p + "down_proj"] = down
    t.update(fused)
    folder = tmp_path / "fused"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    save_file(t, str(folder / "model.safetensors"))
    out = tmp_path / "fused.cmf"
    convert_checkpoint(folder, out, quant="f32")
    with CmfFile(out) as a, CmfFile(cmf) as b:
        for e in range(4):
            for part in ("gate", "up", "down"):
                name = f"model.layers.1.mlp.experts.{e}.{part}_proj.weight"
                np.testing.assert_array_equal(a.tensor_f32(name), b.tensor_f32(name))
    ids = arch_tiny.sample_ids(20)
    with Engine.load(out, kernels="numpy") as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 1e-4


def test_q8_conversion_stays_close(checkpoints, tmp_path):
    model, src, _ = checkpoints["qwen2_moe"]
    out = tmp_path / "q8.cmf"
    rep = convert_checkpoint(src, out, quant="q8")
    assert rep.by_dtype["q8"].tensors > 0
    with CmfFile(out) as f:
        assert f.info("model.layers.0.mlp.gate.weight").dtype == "f32"  # routers stay exact
    ids = arch_tiny.sample_ids(30)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


def test_sanitize_names():
    from cortiq_engine.models import FAMILIES
    from formats.sanitize import rename, split_fused_experts

    moe = FAMILIES.for_model_type("mixtral").sanitize
    assert (
        rename("model.layers.3.block_sparse_moe.experts.7.w1.weight", moe)
        == "model.layers.3.mlp.experts.7.gate_proj.weight"
    )
    assert (
        rename("model.layers.3.block_sparse_moe.experts.7.w3.weight", moe)
        == "model.layers.3.mlp.experts.7.up_proj.weight"
    )
    assert (
        rename("model.layers.3.block_sparse_moe.experts.7.w2.weight", moe)
        == "model.layers.3.mlp.experts.7.down_proj.weight"
    )
    assert rename("model.layers.3.block_sparse_moe.gate.weight", moe) == "model.layers.3.mlp.gate.weight"
    qwen35 = FAMILIES.for_model_type("qwen3_5_text").sanitize
    assert rename("model.language_model.layers.0.linear_attn.A_log", qwen35) == "model.layers.0.linear_attn.A_log"
    mimo = FAMILIES.for_model_type("mimo_v2_flash").sanitize
    assert rename("model.layers.1.self_attn.attention_sink_bias", mimo) == "model.layers.1.self_attn.sinks"
    assert rename("model.visual.blocks.0.norm1.weight", qwen35) is None
    assert rename("mtp.layers.0.mlp.gate.weight", moe) == "mtp.layers.0.mlp.gate.weight"  # MTP names are mtp_names' job
    parts = split_fused_experts("model.language_model.layers.2.mlp.experts.gate_up_proj", (3, 8, 5))
    assert parts["model.layers.2.mlp.experts.1.up_proj.weight"].r0 == 12
    assert parts["model.layers.2.mlp.experts.1.up_proj.weight"].shape == (4, 5)
    down = split_fused_experts("model.layers.2.mlp.experts.down_proj.weight", (3, 5, 4))
    assert down["model.layers.2.mlp.experts.2.down_proj.weight"].r0 == 10 and len(down) == 3
    assert split_fused_experts("model.layers.2.mlp.experts.0.down_proj.weight", (5, 4)) == {}
