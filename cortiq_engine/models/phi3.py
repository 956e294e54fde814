"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): a Llama-shaped pre-norm decoder whose
checkpoints fuse q/k/v into ``self_attn.qkv_proj`` and gate/up into
``mlp.gate_up_proj``; LongRoPE (short factors while a call's last position is within
``original_max_position_embeddings``, long factors past it, cos/sin scaled by the
attention factor); partial rotary (Phi-4-mini rotates 3/4 of each head); a sliding
window on every layer when ``sliding_window`` is set; tied embeddings (Phi-4-mini).

Follows transformers' ``models/phi3/modeling_phi3.py`` (the oracle of the tests). The
fused tensors are split by rows at conversion (``sanitize_for``: the row counts come
from config.json), so the CMF file holds the engine's usual q/k/v and gate/up tensors
and the trunk is the shared pre-norm block.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from formats.arch import LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from formats.sanitize import SanitizeRules
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import dense_common, req

# transformers' Phi3Config maps the rope types of early Phi-3 releases to longrope.
_LONGROPE_ALIASES = ("longrope", "su", "yarn")
# Phi3Config's default when config.json does not name the pretraining length.
_ORIGINAL_MAX_POSITIONS = 4096


# ------------------------------------------------------------------ config.json
def _rope(cfg: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(rope_theta, partial_rotary_factor, rope_scaling) as Phi3Config reads them:
    ``rope_scaling`` before ``rope_parameters``, the dict's own theta and partial factor
    before the top-level ones, and for longrope the top-level
    ``original_max_position_embeddings`` (default 4096) over the dict's."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CortiqError(f"phi3 config.json rope_scaling is {str(params)[:60]!r}, expected an object")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return float(theta), float(prf), None
    if kind not in _LONGROPE_ALIASES:
        raise CortiqError(
            f"phi3 config.json rope_scaling type {kind!r} is not supported (supported: default, longrope)"
        )
    orig = cfg.get("original_max_position_embeddings", _ORIGINAL_MAX_POSITIONS)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise CortiqError(
            f"phi3 config.json original_max_position_embeddings is {str(orig)[:40]!r}, expected an integer >= 1"
        )
    scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": orig}
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            raise CortiqError(f"phi3 config.json rope_scaling.{key} is {str(v)[:60]!r}, expected a list of numbers")
        scaling[key] = [float(x) for x in v]
    for key in ("factor", "attention_factor"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    return float(theta), float(prf), scaling


def _phi3(cfg: dict[str, Any]) -> ArchConfig:
    theta, prf, scaling = _rope(cfg)
    flat = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    flat.update(rope_theta=theta, partial_rotary_factor=prf, rope_scaling=scaling)
    flat["rms_norm_eps"] = cfg.get("rms_norm_eps") or 1e-5  # Phi3Config's default
    d = dense_common(flat, "phi3")
    if not 0.0 < prf <= 1.0:
        raise CortiqError(f"phi3 config.json partial_rotary_factor is {prf}, expected a number in (0, 1]")
    if scaling is not None:
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != d["rotary_dim"] // 2:
                raise CortiqError(
                    f"phi3 config.json rope_scaling.{key} has {len(scaling[key])} entries, "
                    f"the rotary width {d['rotary_dim']} needs {d['rotary_dim'] // 2}"
                )
    # transformers masks every layer to the window whenever sliding_window is set.
    window = cfg.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise CortiqError(
                f"phi3 config.json sliding_window is {str(window)[:40]!r}, expected an integer >= 1 or null"
            )
        d["layer_types"], d["sliding_window"] = [LAYER_SLIDING] * d["num_layers"], window
    return ArchConfig(**d)


def sanitize_for(config: Mapping[str, Any]) -> SanitizeRules:
    """Split the fused projections: ``qkv_proj`` rows are [q | k | v] (Phi3Attention
    slices them in that order) and ``gate_up_proj`` rows are [gate | up] (Phi3MLP's
    ``chunk(2)``: the first half goes through the activation)."""
    cfg = dict(config)
    hidden, heads = int(req(cfg, "hidden_size")), int(req(cfg, "num_attention_heads"))
    hd = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    inter = int(req(cfg, "intermediate_size"))
    return SanitizeRules(
        split_rows=(
            (
                r"(.*\.self_attn)\.qkv_proj\.weight",
                ((r"\1.q_proj.weight", heads * hd), (r"\1.k_proj.weight", kv * hd), (r"\1.v_proj.weight", kv * hd)),
            ),
            (r"(.*\.mlp)\.gate_up_proj\.weight", ((r"\1.gate_proj.weight", inter), (r"\1.up_proj.weight", inter))),
        )
    )


# ------------------------------------------------------------------ the trunk
def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    kind = (arch.rope_scaling or {}).get("rope_type")
    if arch.rope_scaling is not None and kind != "longrope":
        raise CortiqError(f"{cmf.path}: rope scaling {kind!r} is not supported for phi3 (supported: longrope)")
    return blocks.prenorm_model(cmf, arch, kernels)


# ------------------------------------------------------------------ GGUF
# llama.cpp's LongRoPE factors: tensors, whose values config.json needs.
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """Phi-3's config.json from llama.cpp's ``phi3.*`` keys: the rotary width
    (``rope.dimension_count``, int(partial_rotary_factor * hidden) // heads), the
    pretraining length, the sliding window (0: none, as its converter writes for Phi-4)."""
    base.gguf_heads(ctx, config, rotary=False)
    hd = config["head_dim"]
    if config.pop("rope_scaling", None) is not None:
        raise CortiqError("phi3 GGUF rope scaling other than LongRoPE's factor tensors is not supported")
    long, short = (ctx.values(t) for t in _GGUF_ROPE_FACTORS)
    if (long is None) != (short is None):
        raise CortiqError("phi3 GGUF has only one of rope_factors_long / rope_factors_short")
    rot = ctx.key("rope.dimension_count", hd)
    if isinstance(rot, bool) or not isinstance(rot, int) or not 0 < rot <= hd or rot % 2:
        raise CortiqError(
            f"GGUF metadata phi3.rope.dimension_count is {str(rot)[:40]!r}, expected an even number 2..{hd}"
        )
    prf = rot / hd
    if int(hd * prf) != rot:
        raise CortiqError(
            f"phi3 GGUF rotary width {rot} of head size {hd} is not a partial_rotary_factor transformers reproduces"
        )
    window = ctx.key("attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise CortiqError(
            f"GGUF metadata phi3.attention.sliding_window is {str(window)[:40]!r}, expected an integer >= 0"
        )
    orig = ctx.key("rope.scaling.original_context_length")
    if orig is not None:
        config["original_max_position_embeddings"] = orig
    config.update(partial_rotary_factor=prf, sliding_window=window or None)
    if long is not None:
        if orig is None:
            raise CortiqError("phi3 GGUF has LongRoPE factors but no phi3.rope.scaling.original_context_length")
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": [float(np.float32(v)) for v in long],
            "short_factor": [float(np.float32(v)) for v in short],
        }


GGUF = GgufSpec(
    "phi3",
    "phi3",
    "Phi3ForCausalLM",
    # llama.cpp keeps both fused projections: attn_qkv [q | k | v], ffn_up [gate | up].
    block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    config=_gguf_config,
    skip=_GGUF_ROPE_FACTORS,  # folded into config.json's rope_scaling
)


PARSERS = {"phi3": _phi3}
