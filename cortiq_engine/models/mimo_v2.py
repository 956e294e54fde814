"""MiMo-V2-Flash: full-attention and sliding-window layers of different geometry.

Full layers: ``num_heads`` / ``num_kv_heads``, Q/K head ``head_dim``, V head
``v_head_dim``, RoPE with the full layers' theta on the first ``rotary_dim`` dims.
Sliding layers (``arch.sliding``): their own KV head count, theta and window,
and a learned sink logit per head. V is scaled by ``attention_value_scale`` in
both. The FFN is dense on the first layer(s) and a sigmoid-routed MoE elsewhere.
The three MTP draft layers (``draft_layer``) are sliding-window blocks of the
backbone's sliding geometry (its KV heads, window, theta, sinks, V width and scale)
over a dense MLP as wide as their tensors.

Checkpoint names: ``self_attn.attention_sink_bias`` -> ``self_attn.sinks``.
"""

from __future__ import annotations

from typing import Any, Sequence

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig, MoeConfig, SlidingConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.layers import RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import DraftLayer, Geometry, dense_common, draft_prefix, req


# ------------------------------------------------------------------ config.json
def _mimo_v2(cfg: dict[str, Any]) -> ArchConfig:
    """MiMo-V2-Flash: full + sliding-window layers of different geometry, sinks, sigmoid MoE.

    Reads transformers' ``mimo_v2_flash`` config and falls back to the release's own
    keys (``swa_*``, ``hybrid_layer_pattern``, ``moe_layer_freq``, ``sliding_window_size``).
    """
    n = int(req(cfg, "num_hidden_layers"))
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    full_rp = rp.get("full_attention") or {}
    swa_rp = rp.get("sliding_attention") or {}
    prf = float(full_rp.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.334)
    flat = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    flat["rope_theta"] = full_rp.get("rope_theta", cfg.get("rope_theta", 5_000_000.0))
    if full_rp.get("rope_type", "default") not in (None, "default"):
        raise CortiqError(f"rope type {full_rp.get('rope_type')!r} is not supported for mimo_v2_flash")
    flat["partial_rotary_factor"] = prf
    if flat.get("rms_norm_eps") is None and flat.get("layernorm_epsilon") is not None:
        flat["rms_norm_eps"] = flat["layernorm_epsilon"]  # the release's name for it
    d = dense_common(flat, "mimo_v2")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["v_head_dim"] = int(cfg.get("v_head_dim") or d["head_dim"])
    d["attention_value_scale"] = float(cfg.get("attention_value_scale") or 1.0)
    lt = cfg.get("layer_types")
    if lt:
        d["layer_types"] = base.layer_kinds(lt, n)
    elif cfg.get("hybrid_layer_pattern"):
        d["layer_types"] = [LAYER_SLIDING if int(t) else LAYER_FULL for t in cfg["hybrid_layer_pattern"]]
    else:
        d["layer_types"] = [LAYER_FULL if (i == 0 or not (i + 1) % 6) else LAYER_SLIDING for i in range(n)]
    if cfg.get("sliding_window_size") is not None:
        window = int(cfg["sliding_window_size"]) + 1  # the release counts the window without the query
    else:
        window = int(cfg.get("sliding_window") or 129)
    d["sliding_window"] = window
    swa_head = int(cfg.get("swa_head_dim") or d["head_dim"])
    swa_prf = float(swa_rp.get("partial_rotary_factor") or prf)
    d["sliding"] = SlidingConfig(
        window=window,
        num_heads=int(cfg.get("swa_num_attention_heads") or d["num_heads"]),
        # transformers' port doubles the KV heads of the sliding layers, as the release does.
        num_kv_heads=int(cfg.get("swa_num_key_value_heads") or 2 * d["num_kv_heads"]),
        head_dim=swa_head,
        v_head_dim=int(cfg.get("swa_v_head_dim") or d["v_head_dim"]),
        rope_theta=float(swa_rp.get("rope_theta", cfg.get("swa_rope_theta", 10_000.0))),
        sinks=bool(cfg.get("add_swa_attention_sink_bias", True)),
        rotary_dim=int(swa_head * swa_prf),
    )
    d["attention_sinks"] = bool(cfg.get("add_full_attention_sink_bias", False))
    mlt = cfg.get("mlp_layer_types")
    if mlt:
        sparse = [i for i, t in enumerate(mlt) if t == "sparse"]
    elif cfg.get("moe_layer_freq") is not None and isinstance(cfg["moe_layer_freq"], list):
        sparse = [i for i, f in enumerate(cfg["moe_layer_freq"]) if int(f)]
    else:
        sparse = list(range(1, n))
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if experts and sparse:
        if cfg.get("n_shared_experts"):
            raise CortiqError("mimo_v2_flash with shared experts is not supported")
        scoring = str(cfg.get("scoring_func") or "sigmoid")
        if scoring not in ("sigmoid", "softmax"):
            raise CortiqError(f"MoE scoring_func {scoring!r} is not supported (supported: sigmoid, softmax)")
        d["moe"] = MoeConfig(
            num_experts=experts,
            top_k=int(req(cfg, "num_experts_per_tok")),
            expert_intermediate_size=int(req(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=sparse,
            scoring=scoring,
            score_bias=scoring == "sigmoid",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def _draft_kind(arch: ArchConfig) -> str:
    return LAYER_SLIDING if arch.sliding is not None else LAYER_FULL


def _attention(arch: ArchConfig, p: str, kind: str) -> Manifest:
    """The attention of a ``kind`` layer: its own geometry and sinks (``Geometry.of``)."""
    g = Geometry.of(arch, kind)
    return base.attention(p, arch.hidden_size, g, sinks=g.sinks, qk_norm=arch.qk_norm)


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    def attention(p: str, kind: str) -> Manifest:
        return _attention(arch, p, kind)

    trunk = blocks.prenorm_manifest(arch, attention)
    return trunk.update(blocks.draft_manifests(arch, mtp_layers, attention=attention, kind=_draft_kind(arch)))


# ------------------------------------------------------------------ the trunk
def _ropes(arch: ArchConfig) -> dict[str, RoPE]:
    """Each layer kind's rotary embedding: the sliding layers' own base and width."""
    full = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    s = arch.sliding
    return {LAYER_FULL: full, LAYER_SLIDING: full if s is None else RoPE(s.rotary_dim or s.head_dim, s.rope_theta)}


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if LAYER_SLIDING in arch.layer_types and arch.sliding is None:
        raise CortiqError(f"{cmf.path}: mimo_v2 header has sliding layers without their geometry")
    return blocks.prenorm_model(cmf, arch, kernels, ropes=_ropes(arch))


# ------------------------------------------------------------------ draft layers
def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    p, kind = draft_prefix(k), _draft_kind(arch)
    g = Geometry.of(arch, kind)
    if g.sinks:
        base.load_sinks(cmf, f"{p}self_attn.sinks", g.num_heads)  # refuses non-finite sinks
    attn = blocks.attention(cmf, arch, kernels, p, kind, _ropes(arch)[kind])
    return blocks.prenorm_draft(cmf, k, arch, kernels, attn, blocks.gated_mlp(cmf, kernels, p + "mlp."))


PARSERS = {"mimo_v2_flash": _mimo_v2}
COMPUTES = ("routed experts", "split-geometry sliding layers", "attention sinks", "q/k norms")
SANITIZE = SanitizeRules(
    renames=((r"\.self_attn\.attention_sink_bias$", ".self_attn.sinks"),), split_fused_experts=True
)
MTP_STYLE = "mimo"
