"""Tiny random checkpoints with multi-token-prediction layers under each family's real names.

transformers builds the trunks (``tests.tiny.save_tiny``) but its models drop MTP
weights on save (deepseek_v3, qwen3_next and mimo_v2_flash all list them as
ignored), so the draft layers are written here directly with safetensors into a
second shard beside the trunk, named as the releases name them:

- ``deepseek``: ``model.layers.{N+k}.*`` (+ ``shared_head.norm``, and the per-layer
  ``embed_tokens`` / ``shared_head.head`` copies the converter drops),
  config ``num_nextn_predict_layers``;
- ``qwen3_next``: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.norm``, ``mtp.layers.0.*``, config ``mtp_num_hidden_layers``;
- ``mimo``: ``model.mtp.layers.{k}.*`` with ``pre_mlp_layernorm`` and
  ``self_attn.attention_sink_bias``, config ``num_nextn_predict_layers``.

``rig`` makes every draft layer predict a fixed function of its input token
(see ``rig_identity``), which the acceptance tests use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny import save_tiny


def _block(
    rng, cfg: dict[str, Any], p: str, scale: float, sinks: bool, qk_norm: bool, mimo: bool
) -> dict[str, np.ndarray]:
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    vd = hd
    if cfg.get("model_type") == "mimo_v2_flash":
        # MiMo's drafts take the sliding layers' geometry: twice the KV heads, narrower V.
        nkv, vd = 2 * nkv, cfg["v_head_dim"]
    inter = cfg["intermediate_size"]

    def mat(r, c):
        return (rng.standard_normal((r, c)) * scale).astype(np.float32)

    def vec(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        p + "input_layernorm.weight": vec(h),
        p + "self_attn.q_proj.weight": mat(nh * hd, h),
        p + "self_attn.k_proj.weight": mat(nkv * hd, h),
        p + "self_attn.v_proj.weight": mat(nkv * vd, h),
        p + "self_attn.o_proj.weight": mat(h, nh * vd),
        p + ("pre_mlp_layernorm.weight" if mimo else "post_attention_layernorm.weight"): vec(h),
        p + "mlp.gate_proj.weight": mat(inter, h),
        p + "mlp.up_proj.weight": mat(inter, h),
        p + "mlp.down_proj.weight": mat(h, inter),
    }
    if cfg.get("model_type") == "qwen2":  # Qwen2 drafts carry q/k/v biases like its trunk
        for x, n in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * vd)):
            t[p + f"self_attn.{x}_proj.bias"] = (rng.standard_normal(n) * 0.5).astype(np.float32)
    if qk_norm:
        t[p + "self_attn.q_norm.weight"] = vec(hd)
        t[p + "self_attn.k_norm.weight"] = vec(hd)
    if sinks:
        t[p + "self_attn.attention_sink_bias"] = rng.standard_normal(nh).astype(np.float32)
    return t


def mtp_tensors(
    family: str, cfg: dict[str, Any], n_layers: int, seed: int = 1, scale: float = 0.15
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    out: dict[str, np.ndarray] = {}

    def heads(p_e, p_h, p_proj, p_final):
        out[p_e] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        out[p_h] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        out[p_proj] = (rng.standard_normal((h, 2 * h)) * scale).astype(np.float32)
        out[p_final] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    if family == "deepseek":
        n_main = cfg["num_hidden_layers"]
        for k in range(n_layers):
            p = f"model.layers.{n_main + k}."
            heads(p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "shared_head.norm.weight")
            out.update(_block(rng, cfg, p, scale, False, False, False))
            # Releases repeat the trunk's embedding and head inside each MTP layer.
            out[p + "embed_tokens.weight"] = np.zeros((vocab, h), np.float32)
            out[p + "shared_head.head.weight"] = np.zeros((vocab, h), np.float32)
    elif family == "qwen3_next":
        assert n_layers == 1, "Qwen3-Next ships one MTP layer"
        heads("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight")
        out.update(_block(rng, cfg, "mtp.layers.0.", scale, False, True, False))
    elif family == "mimo":
        for k in range(n_layers):
            p = f"model.mtp.layers.{k}."
            heads(p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "final_layernorm.weight")
            out.update(_block(rng, cfg, p, scale, True, False, True))
    else:
        raise ValueError(family)
    return out


# The trunk each family's drafts sit on by default; ``trunk="mimo_v2_flash"`` gives MiMo
# drafts their real backbone (sliding geometry, sinks, V width; tests/arch_tiny.py).
TRUNKS = {"deepseek": "llama", "qwen3_next": "qwen3", "mimo": "llama"}


def save_tiny_mtp(
    family: str, folder: str | Path, n_layers: int = 1, seed: int = 0, trunk: str | None = None, **overrides: Any
) -> Path:
    """A trunk from ``tests.tiny`` plus ``n_layers`` MTP layers named as ``family`` names them."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    trunk = trunk or TRUNKS[family]
    if trunk == "qwen3_next":
        return _save_qwen3_next(folder, seed, **overrides)
    if trunk == "mimo_v2_flash":
        from tests import arch_tiny

        arch_tiny.save(arch_tiny.build(trunk, seed=seed, **overrides), folder)
    else:
        save_tiny(trunk, folder, seed=seed, **overrides)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers" if family != "qwen3_next" else "mtp_num_hidden_layers"] = n_layers
    cfg_path.write_text(json.dumps(cfg, indent=2))
    save_file(mtp_tensors(family, cfg, n_layers, seed=seed + 1), str(folder / "mtp.safetensors"))
    return folder


def write_random_sidecar(
    main: str | Path, out: str | Path, n_layers: int = 3, quant: str = "q8", seed: int = 0
) -> Path:
    """A sidecar of random MiMo-named draft layers for an existing backbone CMF (e.g. SmolLM2),
    with the backbone record ``formats.sidecar.check_sidecar`` expects."""
    from formats.cmf import CmfFile, CmfWriter
    from cortiq_engine.models.base import mtp_normalize as normalize
    from formats.sidecar import ROLE_SIDECAR, backbone_identity

    main, out = Path(main), Path(out)
    with CmfFile(main) as m:
        header = m.header
    a = header["arch"]
    cfg = dict(
        hidden_size=a["hidden_size"],
        num_attention_heads=a["num_heads"],
        num_key_value_heads=a["num_kv_heads"],
        head_dim=a["head_dim"],
        intermediate_size=a["intermediate_size"],
        vocab_size=a["vocab_size"],
    )
    mtp = {"num_layers": n_layers, "style": "mimo"}
    side_header = {
        "format": "cmf",
        "format_version": header.get("format_version"),
        "role": ROLE_SIDECAR,
        "arch": {**a, "mtp": mtp},
        "mtp": {**mtp, "location": "sidecar", "sidecar": out.name},
        "backbone": backbone_identity(header, main.name),
    }
    with CmfWriter(out, side_header, force=True) as w:
        for name, t in mtp_tensors("mimo", cfg, n_layers, seed=seed, scale=0.05).items():
            w.add(normalize(name, {})[0], quant if t.ndim == 2 else "f32", t)
    return out


def _save_qwen3_next(folder: Path, seed: int, **overrides: Any) -> Path:
    """A transformers ``qwen3_next`` trunk (tests/arch_tiny.py) with its one MTP layer, named
    as the release names it: the block is a full-attention trunk layer's tensors (gated
    attention, q/k norm, MoE with a shared expert, as transformers saves them) perturbed
    and moved under ``mtp.layers.0.``, plus ``mtp.fc`` and the ``mtp.*`` norms."""
    from safetensors.numpy import load_file, save_file

    from tests import arch_tiny

    arch_tiny.save(arch_tiny.build("qwen3_next", seed=seed, **overrides), folder)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    full = cfg["layer_types"].index("full_attention")
    trunk = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(seed + 1)
    src = f"model.layers.{full}."
    out = {}
    for name, t in trunk.items():
        if name.startswith(src):
            noise = 0.1 * float(np.std(t)) if t.ndim > 1 else 0.05
            out["mtp.layers.0." + name[len(src) :]] = (t + noise * rng.standard_normal(t.shape)).astype(t.dtype)
    h = cfg["hidden_size"]
    out["mtp.fc.weight"] = (rng.standard_normal((h, 2 * h)) * 0.1).astype(np.float32)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = (0.1 * rng.standard_normal(h)).astype(np.float32)  # (1 + w) norms
    cfg["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    save_file(out, str(folder / "mtp.safetensors"))
    return folder
