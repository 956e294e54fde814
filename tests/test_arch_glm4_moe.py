"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``): partial rotary by halves, q/k/v biases,
optional q/k norm, sigmoid grouped routing with a correction bias, a shared expert
and dense first layers; logits and greedy tokens against transformers; the release's
DeepSeek-named MTP layer into the sidecar, its block against transformers'
``Glm4MoeDecoderLayer``, speculative decoding equal to greedy and ``mtp-probe``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cortiq_engine import Engine, SamplingConfig, SpeculativeConfig, forward
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.layers import Step
from cortiq_engine.models import FAMILIES, parse_config
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.sanitize import rename
from tests import arch_tiny
from tests.tiny import build_tiny

MT = "glm4_moe"
# GLM-4.5 (q/k norm) and GLM-4.5-Air (none); the second also widens the shared expert,
# keeps the unnormalized top-k weights and picks 2 of 4 groups.
VARIANTS = {
    "qk_norm": arch_tiny.CONFIGS[MT],
    "air": dict(
        arch_tiny.CONFIGS[MT],
        use_qk_norm=False,
        n_shared_experts=2,
        norm_topk_prob=False,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
    ),
}


def build(variant: str, seed: int = 0):
    """The transformers model; the routing bias randomized (the init leaves it at zero)."""
    import torch

    model = build_tiny(MT, seed=seed, **VARIANTS[variant])
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """variant -> (transformers model, HF folder, f32 CMF)."""
    root = tmp_path_factory.mktemp("glm4_moe")
    out = {}
    for v in VARIANTS:
        model = build(v)
        src = arch_tiny.save(model, root / v)
        cmf = root / f"{v}.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[v] = (model, src, cmf)
    return out


# ------------------------------------------------------------------ config
def test_arch_parsed_from_config(glm):
    arch = parse_config(json.loads((glm["qk_norm"][1] / "config.json").read_text()))
    assert arch.arch == "glm4_moe" and arch.qk_norm and arch.attention_bias
    assert (arch.head_dim, arch.rotary_dim, arch.norm_eps) == (16, 8, 1e-6)
    m = arch.moe
    assert (m.scoring, m.score_bias, m.n_group, m.topk_group, m.moe_layers) == ("sigmoid", True, 2, 1, [1, 2])
    assert (m.shared_expert_intermediate_size, m.shared_expert_gate, m.norm_topk_prob) == (32, False, True)
    assert m.routed_scaling_factor == 2.5
    air = parse_config(json.loads((glm["air"][1] / "config.json").read_text()))
    assert not air.qk_norm and air.moe.shared_expert_intermediate_size == 64 and not air.moe.norm_topk_prob


def test_release_config_keys():
    """The release's config.json: top-level partial_rotary_factor and rope_theta, head_dim;
    without a partial_rotary_factor transformers rotates half of each head."""
    cfg = dict(
        model_type=MT,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=256,
        partial_rotary_factor=0.5,
        rope_theta=1000000,
        rope_scaling=None,
        first_k_dense_replace=3,
        n_routed_experts=16,
        num_experts_per_tok=8,
        moe_intermediate_size=16,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=1,
        rms_norm_eps=1e-5,
    )
    arch = parse_config(cfg)
    assert (arch.rotary_dim, arch.rope_theta, arch.moe.moe_layers) == (16, 1e6, [3])
    del cfg["partial_rotary_factor"], cfg["rms_norm_eps"]
    arch = parse_config(cfg)
    assert arch.rotary_dim == 16 and arch.norm_eps == 1e-5


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(first_k_dense_replace=4), "first_k_dense_replace"),
        (dict(num_experts_per_tok=5, n_group=2, topk_group=1), "num_experts_per_tok"),
        (dict(n_group=3), "n_group"),
        (dict(rope_scaling={"rope_type": "su", "factor": 2.0}), "rope"),
    ],
)
def test_unsupported_config_is_refused(change, field):
    cfg = dict(
        model_type=MT,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    with pytest.raises(CortiqError, match=field):
        parse_config({**cfg, **change})


def test_shared_experts_are_renamed():
    rules = FAMILIES.for_model_type(MT).sanitize
    assert (
        rename("model.layers.5.mlp.shared_experts.up_proj.weight", rules)
        == "model.layers.5.mlp.shared_expert.up_proj.weight"
    )


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(glm, variant, kernels):
    model, _, cmf = glm[variant]
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(glm, variant):
    import torch

    model, _, cmf = glm[variant]
    ids = arch_tiny.sample_ids(8, seed=3)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


def test_routing_bias_and_rotary_split_matter(glm, tmp_path):
    """The check can fail: zeroing the routing bias, or rotating all of each head, changes
    the logits."""
    _, src, cmf = glm["qk_norm"]
    ids = arch_tiny.sample_ids(24)
    with Engine.load(cmf, kernels="numpy") as eng:
        base = eng.logits(ids)
    folder = tmp_path / "nobias"
    shutil.copytree(src, folder)
    t = load_file(str(src / "model.safetensors"))
    t = {k: (np.zeros_like(v) if k.endswith("e_score_correction_bias") else v) for k, v in t.items()}
    save_file(t, str(folder / "model.safetensors"))
    full = tmp_path / "fullrot"
    shutil.copytree(src, full)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    (full / "config.json").write_text(json.dumps(cfg))
    for folder in (folder, full):
        out = folder / "m.cmf"
        convert_checkpoint(folder, out, quant="f32")
        with Engine.load(out, kernels="numpy") as eng:
            assert np.abs(eng.logits(ids) - base).max() > 1e-3


def test_q8_stays_close(glm, tmp_path):
    model, src, _ = glm["qk_norm"]
    out = tmp_path / "q8.cmf"
    rep = convert_checkpoint(src, out, quant="q8")
    assert rep.by_dtype["q8"].tensors > 0
    with CmfFile(out) as f:
        assert f.info("model.layers.1.mlp.gate.weight").dtype == "f32"  # routers stay exact
        assert "model.layers.1.mlp.shared_expert.down_proj.weight" in f.names()
    ids = arch_tiny.sample_ids(30)
    with Engine.load(out) as eng:
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
    assert 1e-5 < err < 0.05


def test_a_bias_transformers_ignores_is_refused(glm, tmp_path):
    """An o_proj bias (or q/k/v biases without attention_bias) would run as another model."""
    _, src, _ = glm["qk_norm"]
    folder = tmp_path / "obias"
    shutil.copytree(src, folder)
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
    save_file(t, str(folder / "model.safetensors"))
    out = tmp_path / "m.cmf"
    convert_checkpoint(folder, out, quant="f32")
    with pytest.raises(CortiqError, match="o_proj.bias"):
        Engine.load(out, kernels="numpy")


# ------------------------------------------------------------------ MTP
@pytest.fixture(scope="module")
def glm_mtp(glm, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe_mtp")
    src = arch_tiny.add_deepseek_mtp_layer(glm["qk_norm"][1], root / "hf")
    out = root / "m.cmf"
    rep = convert_checkpoint(src, out, quant="f32")
    return src, out, rep


def test_mtp_layer_goes_to_the_sidecar(glm_mtp):
    src, out, rep = glm_mtp
    assert rep.sidecar is not None
    with CmfFile(out) as main, CmfFile(rep.sidecar) as side:
        assert not any(".mtp." in n for n in main.names())
        names = set(side.names())
        p = "model.mtp.layers.0."
        for n in (
            "final_layernorm.weight",
            "eh_proj.weight",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_norm.weight",
        ):
            assert p + n in names, n
        assert not any("embed_tokens" in n or "shared_head" in n for n in names)
        assert side.header["arch"]["mtp"] == {"num_layers": 1, "style": "deepseek"}


def test_mtp_block_against_transformers_decoder_layer(glm_mtp):
    """The draft block (biases, q/k norm, partial rotary, routed FFN with the shared
    expert) against transformers' ``Glm4MoeDecoderLayer`` at the MTP layer's index,
    loaded with the draft weights; the backbone hidden rows come from the engine."""
    import torch
    from transformers import AutoConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as gm

    src, out, _ = glm_mtp
    ids = arch_tiny.sample_ids(20, seed=4)
    with Engine.load(out, kernels="numpy", mtp=True) as eng:
        hidden = forward(eng.new_state(32), ids)
        layer = eng.drafts.layers[0]
        k = len(ids) - 1
        emb = eng.model.embed_ids(ids[1:])
        u = layer(eng.kernels, emb, hidden[:k], layer.make_cache(32), Step(np.arange(k)))
        got = eng.model.lm_head(layer.final_norm(u))

    cfg = AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    n = cfg.num_hidden_layers
    w = {name: torch.from_numpy(v) for name, v in load_file(str(src / "mtp.safetensors")).items()}
    p = f"model.layers.{n}."
    sd = {name[len(p) :]: v for name, v in w.items() if name.startswith(p)}
    ex = lambda e, x: sd.pop(f"mlp.experts.{e}.{x}_proj.weight")  # noqa: E731
    E = cfg.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([ex(e, "gate"), ex(e, "up")]) for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([ex(e, "down") for e in range(E)])
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = gm.Glm4MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": sd.pop(f"{name}.weight")})
    eh = sd.pop("eh_proj.weight")
    head = sd.pop("shared_head.head.weight")
    sd.pop("embed_tokens.weight")
    block = gm.Glm4MoeDecoderLayer(cfg, n).eval()
    block.load_state_dict(sd)
    with torch.no_grad():
        x = torch.cat([norms["enorm"](torch.from_numpy(emb)), norms["hnorm"](torch.from_numpy(hidden[:k]))], -1) @ eh.T
        pos = torch.arange(k)[None]
        pe = gm.Glm4MoeRotaryEmbedding(cfg)(x[None], pos)
        mask = torch.full((k, k), float("-inf")).triu(1)[None, None]
        y = block(x[None], position_embeddings=pe, attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        want = (norms["shared_head.norm"](y[0]) @ head.T).numpy()
    assert arch_tiny.rel_err(got, want) < 1e-4


def test_speculative_with_the_glm_sidecar_equals_greedy(glm_mtp):
    _, out, _ = glm_mtp
    with Engine.load(out, mtp=True) as eng:
        stack = eng.drafts
        assert stack is not None and stack.num_layers == 1 and stack.style == "deepseek"
        prompt = arch_tiny.sample_ids(12, seed=3)
        plain = eng.generate(prompt, max_tokens=20, ignore_eos=True, speculative=False).token_ids
        # threshold 0: the random draft layer would otherwise propose nothing.
        for depth in (1, 3):
            res = eng.generate(
                prompt,
                max_tokens=20,
                ignore_eos=True,
                speculative=SpeculativeConfig(depth=depth, threshold=0, lookup=0),
            )
            assert res.token_ids == plain
            assert res.extra["mtp"]["rounds"] > 0 and res.expert_usage


@pytest.mark.parametrize("accept", [1, 3])
def test_accepted_drafts_keep_greedy_exact(glm_mtp, accept):
    """Drafts rigged to be right ``accept`` of 3 times per round: the MoE verify rows
    must give what single-token decoding gives, or the output would leave plain greedy."""
    from cortiq_engine.mtp import make_drafter

    _, out, _ = glm_mtp
    prompt = arch_tiny.sample_ids(9, seed=21)
    with Engine.load(out, mtp=True) as eng:
        plain = eng.generate(prompt, max_tokens=16, ignore_eos=True, speculative=False).token_ids
        truth = prompt + plain + [0] * 8

        def rigged(t, ids, k):
            right = truth[t + 2 : t + 2 + k]
            return [tok if i < accept else (tok + 1) % 256 for i, tok in enumerate(right)]

        drafter = make_drafter(eng.model, eng.drafts, eng.ctx, depth=3, chain="recursive", override=rigged)
        res = eng.generate(prompt, max_tokens=16, ignore_eos=True, speculative=drafter)
    assert res.token_ids == plain
    assert res.extra["mtp"]["accepted"] > 0


def test_mtp_probe_runs_on_the_sidecar(glm_mtp, tmp_path):
    from typer.testing import CliRunner

    from cortiq_cli.main import app

    _, out, _ = glm_mtp
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    r = CliRunner().invoke(
        app, ["mtp-probe", str(out), "--text", str(text), "--max-tokens", "40", "--json", "--threads", "1"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["draft_layers"] == 1 and doc["tokens"] == 40
    assert all(v["rounds"] > 0 for v in doc["variants"])


def test_mtp_layer_with_wrong_shape_is_refused(glm, tmp_path):
    folder = arch_tiny.add_deepseek_mtp_layer(glm["qk_norm"][1], tmp_path / "bad")
    t = load_file(str(folder / "mtp.safetensors"))
    t["model.layers.3.mlp.shared_experts.up_proj.weight"] = t["model.layers.3.mlp.shared_experts.up_proj.weight"][:16]
    save_file(t, str(folder / "mtp.safetensors"))
    with pytest.raises(CortiqError, match="shared_expert.up_proj"):
        convert_checkpoint(folder, tmp_path / "bad.cmf", quant="f32")


# ------------------------------------------------------------------ a tiny glm4moe GGUF
def write_glm4moe_gguf(folder, path, weight_type: str = "F32"):
    """What llama.cpp's converter (``Glm4MoeModel``) writes for the HF folder ``folder``
    (trunk and MTP shards): block_count counting the MTP layer, rope.dimension_count as the
    rotated width, the expert_* routing keys, each layer's experts stacked [experts, rows,
    cols], ``e_score_correction_bias`` as ``exp_probs_b.bias``, names from gguf-py's own
    tensor map; the router stays F32; the byte-level vocabulary of ``tests.tiny``. The
    tiny model's expert groups travel in DeepSeek's expert_group_* keys."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = json.loads((folder / "config.json").read_text())
    t: dict[str, np.ndarray] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        t.update(load_file(str(shard)))
    n_main, nextn = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    n_blocks = n_main + (nextn if any(k.startswith(f"model.layers.{n_main}.") for k in t) else 0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rp = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(n_blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_rope_dimension_count(int(hd * rp.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if n_blocks > n_main:
        w.add_nextn_predict_layers(nextn)
    if cfg["n_group"] > 1:  # the releases route ungrouped; DeepSeek's converter writes these keys
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n_blocks)
    for bid in range(n_blocks):
        p = f"model.layers.{bid}.mlp.experts."
        if p + "0.down_proj.weight" in t:
            for x in ("gate", "up", "down"):
                parts = [t.pop(f"{p}{e}.{x}_proj.weight") for e in range(cfg["n_routed_experts"])]
                t[f"{p}{x}_proj.weight"] = np.stack(parts)
    for name, x in t.items():
        x = x.astype(np.float32)
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gname = (
            "token_embd.weight"
            if name == "model.embed_tokens.weight"
            else tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        )
        assert gname is not None, name
        if weight_type != "F32" and x.ndim >= 2 and ".ffn_gate_inp." not in gname:
            qt = gguf.GGMLQuantizationType[weight_type]
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("weight_type,quant", [("F32", "f32"), ("Q8_0", "q8")])
def test_gguf_with_its_mtp_layer_matches_transformers(glm, glm_mtp, tmp_path, weight_type, quant):
    """A glm4moe GGUF as llama.cpp writes it (the MTP layer included) converts straight
    to the source model: stacked experts split, the routing bias and the rotated width
    read back; its MTP layer goes to the sidecar as the HF folder's does (F32: the same
    tensors bit for bit), and speculative decoding on it equals greedy."""
    model = glm["qk_norm"][0]
    src, hf_cmf, hf_rep = glm_mtp
    path = write_glm4moe_gguf(src, tmp_path / "g.gguf", weight_type)
    out = tmp_path / "g.cmf"
    rep = convert_checkpoint(path, out, quant=quant)
    assert rep.sidecar is not None
    ids = arch_tiny.sample_ids(24)
    with Engine.load(out, kernels="numpy") as eng:
        got_arch = eng.model.arch
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
    want = parse_config(json.loads(model.config.to_json_string()))
    assert got_arch.rotary_dim == want.rotary_dim and got_arch.moe == want.moe and got_arch.qk_norm
    assert err < (1e-4 if weight_type == "F32" else 0.05), err
    with CmfFile(rep.sidecar) as a, CmfFile(hf_rep.sidecar) as b:
        assert set(a.names()) == set(b.names())
        if weight_type == "F32":
            for n in b.names():
                assert np.array_equal(a.tensor_f32(n), b.tensor_f32(n)), n
    with Engine.load(out, mtp=True) as eng:
        assert eng.drafts is not None and eng.drafts.num_layers == 1
        prompt = arch_tiny.sample_ids(10, seed=3)
        plain = eng.generate(prompt, max_tokens=12, ignore_eos=True, speculative=False).token_ids
        res = eng.generate(prompt, max_tokens=12, ignore_eos=True, speculative=SpeculativeConfig(threshold=0, lookup=0))
    assert res.token_ids == plain and res.extra["mtp"]["rounds"] > 0


def test_gguf_softmax_gating_is_refused(glm, tmp_path):
    import gguf

    src = glm["qk_norm"][1]
    path = write_glm4moe_gguf(src, tmp_path / "g.gguf")
    r = gguf.GGUFReader(str(path))
    assert r.fields["glm4moe.expert_gating_func"].parts[-1][0] == 2
    # Rewrite the one value in place: softmax gating is not GLM's routing.
    field = r.fields["glm4moe.expert_gating_func"]
    data = np.memmap(path, mode="r+")
    off = int(field.parts[-1].ctypes.data - r.data.ctypes.data)
    data[off : off + 4] = np.array([1], np.uint32).view(np.uint8)
    data.flush()
    del data
    with pytest.raises(CortiqError, match="expert_gating_func"):
        convert_checkpoint(path, tmp_path / "g.cmf", quant="f32")


def test_import_gguf_writes_the_checkpoint_transformers_loads(glm, glm_mtp, tmp_path):
    """``import-gguf``'s folder carries the routing bias under transformers' own name
    (llama.cpp's exp_probs_b.bias), so transformers loads it with every weight set."""
    import torch
    import transformers

    from cortiq_engine.convert import import_gguf

    model = glm["qk_norm"][0]
    src = glm_mtp[0]
    import_gguf(write_glm4moe_gguf(src, tmp_path / "g.gguf"), tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = arch_tiny.sample_ids(24)
    assert arch_tiny.rel_err(arch_tiny.torch_logits(back, ids), arch_tiny.torch_logits(model, ids)) < 1e-5
