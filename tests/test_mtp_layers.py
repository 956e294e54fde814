"""MTP draft layers: loading (sidecar, inline, every naming family), the checks that
refuse a sidecar cut from another backbone, and the incremental draft path against
a from-scratch numpy forward of the layer written out plainly here."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cortiq_engine import Engine, forward
from cortiq_engine.mtp import load_draft_stack, make_drafter
from formats.cmf import CmfFile, rewrite_header
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from tests.mtp_tiny import save_tiny_mtp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_layers")
    out = {}
    for name, family, n, trunk in (
        ("deepseek", "deepseek", 1, None),
        ("mimo", "mimo", 3, None),
        ("qwen3_next", "qwen3_next", 1, None),
        ("deepseek_qwen2", "deepseek", 2, "qwen2"),
    ):
        src = save_tiny_mtp(family, root / name, n_layers=n, trunk=trunk)
        path = root / f"{name}.cmf"
        convert_checkpoint(src, path, quant="f32")
        out[name] = (src, path)
    return root, out


# ------------------------------------------------------------------ numpy reference
def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def reference_draft_rows(cmf: CmfFile, k: int, arch, embed, toks, hidden):
    """Draft layer k over a whole sequence from scratch: rows j read (embed[toks[j]], hidden[j])
    at position j; causal attention (with sinks when present); returns pre-final-norm rows."""
    p = f"model.mtp.layers.{k}."
    T = lambda n: cmf.tensor_f32(p + n).astype(np.float64)  # noqa: E731
    n = len(toks)
    cat = np.concatenate([_rms(embed[toks], T("enorm.weight")), _rms(hidden, T("hnorm.weight"))], 1)
    u = cat @ T("eh_proj.weight").T
    x = _rms(u, T("input_layernorm.weight"))
    nh, nkv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q = (x @ T("self_attn.q_proj.weight").T).reshape(n, nh, hd)
    kk = (x @ T("self_attn.k_proj.weight").T).reshape(n, nkv, hd)
    v = (x @ T("self_attn.v_proj.weight").T).reshape(n, nkv, hd)
    if p + "self_attn.q_proj.bias" in cmf:  # Qwen2
        q = q + T("self_attn.q_proj.bias").reshape(nh, hd)
        kk = kk + T("self_attn.k_proj.bias").reshape(nkv, hd)
        v = v + T("self_attn.v_proj.bias").reshape(nkv, hd)
    if p + "self_attn.q_norm.weight" in cmf:
        q, kk = _rms(q, T("self_attn.q_norm.weight")), _rms(kk, T("self_attn.k_norm.weight"))
    pos = np.arange(n, dtype=np.float64)
    q, kk = _rope(q, pos, arch.rope_theta), _rope(kk, pos, arch.rope_theta)
    sinks = T("self_attn.sinks") if p + "self_attn.sinks" in cmf else None
    o = np.zeros((n, nh, hd))
    for h in range(nh):
        g = h // (nh // nkv)
        s = q[:, h] @ kk[:, g].T / np.sqrt(hd)
        s[np.triu_indices(n, 1)] = -np.inf
        if sinks is not None:
            s = np.concatenate([s, np.full((n, 1), sinks[h])], 1)
        pr = np.exp(s - s.max(1, keepdims=True))
        pr /= pr.sum(1, keepdims=True)
        o[:, h] = pr[:, :n] @ v[:, g]
    u = u + o.reshape(n, -1) @ T("self_attn.o_proj.weight").T
    y = _rms(u, T("post_attention_layernorm.weight"))
    g_, up = y @ T("mlp.gate_proj.weight").T, y @ T("mlp.up_proj.weight").T
    return u + (g_ / (1 + np.exp(-g_)) * up) @ T("mlp.down_proj.weight").T


@pytest.mark.parametrize("family", ["deepseek", "mimo", "qwen3_next", "deepseek_qwen2"])
def test_teacher_forced_drafts_match_from_scratch_reference(tiny, family):
    _, models = tiny
    eng = Engine.load(models[family][1], threads=1)
    stack = load_draft_stack(eng.cmf, eng.arch, eng.kernels)
    side = CmfFile(stack.source)
    rng = np.random.default_rng(3)
    ids = [int(i) for i in rng.integers(0, 256, size=30)]
    st = eng.new_state()
    hidden = forward(st, ids).astype(np.float64)
    embed = eng.cmf.tensor_f32("model.embed_tokens.weight").astype(np.float64)
    head = eng.cmf.tensor_f32("lm_head.weight").astype(np.float64)
    K = stack.num_layers
    d = make_drafter(eng.model, stack, eng.ctx, depth=K, chain="independent")
    d.note(0, hidden.astype(np.float32))
    got = [d.draft(t, ids, K) for t in range(len(ids) - K - 1)]
    for k in range(K):
        n = len(ids) - k - 1
        rows = reference_draft_rows(side, k, eng.arch, embed, ids[k + 1 : k + 1 + n], hidden[:n])
        logits = _rms(rows, side.tensor_f32(f"model.mtp.layers.{k}.final_layernorm.weight")) @ head.T
        # Compare where the reference's top choice is clear of float noise.
        top2 = np.sort(logits, 1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-3
        want = logits.argmax(1)
        for t in range(len(got)):
            if clear[t]:
                assert got[t][k] == want[t], (family, k, t)
        assert clear[: len(got)].sum() > len(got) // 2


def test_every_family_loads_with_its_geometry(tiny):
    _, models = tiny
    for family, n in (("deepseek", 1), ("mimo", 3), ("qwen3_next", 1)):
        eng = Engine.load(models[family][1], threads=1)
        stack = load_draft_stack(eng.cmf, eng.arch, eng.kernels)
        assert stack.num_layers == n and stack.style == family
        has_sinks = [l.block.attn.call.sinks is not None for l in stack.layers]
        assert has_sinks == [family == "mimo"] * n
        assert (stack.layers[0].block.attn.w.q_norm is not None) == (family == "qwen3_next")


def test_default_chain_and_depth(tiny):
    _, models = tiny
    eng = Engine.load(models["deepseek"][1], threads=1)
    stack = load_draft_stack(eng.cmf, eng.arch, eng.kernels)
    assert make_drafter(eng.model, stack, 64).depth == 1
    assert make_drafter(eng.model, stack, 64, depth=3).chain == "recursive"
    with pytest.raises(CortiqError, match="recursive"):
        make_drafter(eng.model, stack, 64, depth=2, chain="independent")


def test_inline_layers_are_found(tiny, tmp_path):
    _, models = tiny
    path = tmp_path / "inline.cmf"
    convert_checkpoint(models["mimo"][0], path, quant="q8", mtp="inline")
    eng = Engine.load(path, threads=1)
    stack = load_draft_stack(eng.cmf, eng.arch, eng.kernels)
    assert stack.source == "inline" and stack.num_layers == 3


def test_no_sidecar_is_none(tiny, tmp_path):
    _, models = tiny
    path = tmp_path / "plain.cmf"
    convert_checkpoint(models["deepseek"][0], path, quant="f32", mtp="drop")
    eng = Engine.load(path, threads=1)
    assert load_draft_stack(eng.cmf, eng.arch, eng.kernels) is None
    with pytest.raises(CortiqError, match="no such file"):
        load_draft_stack(eng.cmf, eng.arch, eng.kernels, path=tmp_path / "missing.mtp.cmf")


def _copy_pair(models, family, tmp_path, name):
    src = models[family][1]
    dst = tmp_path / f"{name}.cmf"
    shutil.copy(src, dst)
    shutil.copy(src.with_name(src.name[:-4] + ".mtp.cmf"), tmp_path / f"{name}.mtp.cmf")
    return dst


def test_sidecar_of_another_backbone_is_an_error(tiny, tmp_path):
    root, models = tiny
    other = save_tiny_mtp("deepseek", tmp_path / "other", n_layers=1, seed=5)
    convert_checkpoint(other, tmp_path / "other.cmf", quant="f32")
    main = _copy_pair(models, "deepseek", tmp_path, "main")
    shutil.copy(tmp_path / "other.mtp.cmf", tmp_path / "main.mtp.cmf")
    eng = Engine.load(main, threads=1)
    with pytest.raises(CortiqError, match="fingerprint.*--no-mtp"):
        load_draft_stack(eng.cmf, eng.arch, eng.kernels)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("vocab_size", 300, "vocab size"),
        ("hidden_size", 32, "hidden size"),
        ("arch", "qwen3", "arch"),
        ("num_heads", 8, "heads"),
    ],
)
def test_sidecar_geometry_mismatch_names_the_difference(tiny, tmp_path, field, value, message):
    _, models = tiny
    main = _copy_pair(models, "deepseek", tmp_path, "g")
    side = tmp_path / "g.mtp.cmf"
    with CmfFile(side) as f:
        h = f.header
    h["backbone"][field] = value
    rewrite_header(side, h)
    eng = Engine.load(main, threads=1)
    with pytest.raises(CortiqError, match=message):
        load_draft_stack(eng.cmf, eng.arch, eng.kernels)


def test_sidecar_layer_count_mismatch(tiny, tmp_path):
    _, models = tiny
    main = _copy_pair(models, "mimo", tmp_path, "n")
    side = tmp_path / "n.mtp.cmf"
    with CmfFile(side) as f:
        h = f.header
    h["mtp"]["num_layers"] = 2
    rewrite_header(side, h)
    eng = Engine.load(main, threads=1)
    with pytest.raises(CortiqError, match="MTP layer count 2 in its header, 3"):
        load_draft_stack(eng.cmf, eng.arch, eng.kernels)


def test_qwen3_next_draft_against_transformers_decoder_layer(tmp_path):
    """The Qwen3-Next draft block (gated attention, q/k norm, partial rotary, (1 + w) norms,
    MoE with a gated shared expert) against transformers' own ``Qwen3NextDecoderLayer``
    loaded with the draft weights; the backbone hidden rows come from the engine."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    src = save_tiny_mtp("qwen3_next", tmp_path / "src", n_layers=1, trunk="qwen3_next")
    path = tmp_path / "q.cmf"
    convert_checkpoint(src, path, quant="f32")
    eng = Engine.load(path, threads=1)
    stack = load_draft_stack(eng.cmf, eng.arch, eng.kernels)
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 256, size=24)]
    hidden = forward(eng.new_state(), ids)
    d = make_drafter(eng.model, stack, eng.ctx, depth=1)
    d.note(0, hidden)
    got = [d.draft(t, ids, 1)[0] for t in range(len(ids) - 2)]

    cfg = AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    full = cfg.layer_types.index("full_attention")
    w = {k: torch.from_numpy(v) for k, v in load_file(str(src / "mtp.safetensors")).items()}
    layer = qn.Qwen3NextDecoderLayer(cfg, full).eval()
    sd = {k[len("mtp.layers.0.") :]: v for k, v in w.items() if k.startswith("mtp.layers.0.")}
    # The module keeps its experts fused; the checkpoint names them one by one.
    E = cfg.num_experts
    ex = lambda e, x: sd.pop(f"mlp.experts.{e}.{x}_proj.weight")  # noqa: E731
    gate_up = [torch.cat([ex(e, "gate"), ex(e, "up")]) for e in range(E)]
    sd["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    sd["mlp.experts.down_proj"] = torch.stack([ex(e, "down") for e in range(E)])
    layer.load_state_dict(sd)
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = qn.Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[n].load_state_dict({"weight": w[f"mtp.{n}.weight"]})
    trunk = load_file(str(src / "model.safetensors"))
    embed = torch.from_numpy(trunk["model.embed_tokens.weight"])
    head = torch.from_numpy(trunk.get("lm_head.weight", trunk["model.embed_tokens.weight"]))
    n = len(ids) - 1
    with torch.no_grad():
        e = embed[torch.tensor(ids[1:])][None]
        h = torch.from_numpy(hidden[:n])[None]
        u = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1) @ w["mtp.fc.weight"].T
        pos = torch.arange(n)[None]
        pe = qn.Qwen3NextRotaryEmbedding(cfg)(u, pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(u, position_embeddings=pe, attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        logits = (norms["norm"](out) @ head.T)[0].numpy()
    top2 = np.sort(logits, 1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3
    want = logits.argmax(1)
    assert clear[: len(got)].sum() > len(got) // 2
    for t in range(len(got)):
        if clear[t]:
            assert got[t] == want[t], t
