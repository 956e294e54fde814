"""GPT-OSS (``GptOssForCausalLM``): pre-norm blocks whose attention alternates between a
sliding window and full causal attention (``layer_types``), with q/k/v/o biases, a
learned sink logit per head and YaRN RoPE; every FFN is a routed MoE whose router has a
bias (top-k of the logits, softmax over the k), whose experts have biases and a clamped
SwiGLU: gate clamped above at ``swiglu_limit``, up to +-``swiglu_limit``,
``out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)``.

Follows transformers' ``models/gpt_oss/modeling_gpt_oss.py`` (the oracle of the tests).

Checkpoint names: ``mlp.router`` -> ``mlp.gate``; the fused experts (``gate_up_proj``
[E, H, 2I] with gate/up interleaved along the last dim, ``down_proj`` [E, I, H], their
biases, or the release's MXFP4 ``*_blocks`` / ``*_scales``) become per-expert
``mlp.experts.E.{gate,up,down}_proj.{weight,bias}`` (``formats.sanitize.InterleavedExperts``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from formats.arch import LAYER_SLIDING, ArchConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Geometry, dense_common, req


# ------------------------------------------------------------------ config.json
def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    v = cfg.get(key)
    v = default if v is None else float(v)
    if not (math.isfinite(v) and v > 0):
        raise CortiqError(f"config.json {key} is {v}, expected a finite number > 0")
    return v


def _gpt_oss(cfg: dict[str, Any]) -> ArchConfig:
    """GPT-OSS: sliding/full layers, sinks, biased attention, YaRN, a biased router and
    biased experts with the clamped SwiGLU; an MXFP4 release's experts decode on convert."""
    q = cfg.get("quantization_config")
    if q is not None and not (isinstance(q, dict) and q.get("quant_method") == "mxfp4"):
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CortiqError(f"gpt_oss quantization_config quant_method {method!r} is not supported (supported: mxfp4)")
    d = dense_common(cfg, "gpt_oss")
    n = d["num_layers"]
    d["layer_types"] = base.layer_kinds(cfg.get("layer_types") or base.every_nth_full(n, 2), n)
    window = cfg.get("sliding_window")
    if LAYER_SLIDING in d["layer_types"] and not window:
        raise CortiqError("gpt_oss has sliding_attention layers but no sliding_window")
    d["sliding_window"] = int(window or 0) if LAYER_SLIDING in d["layer_types"] else 0
    d["attention_bias"] = bool(cfg.get("attention_bias", True))
    d["attention_sinks"] = True
    d["norm_eps"] = float(cfg.get("rms_norm_eps") or 1e-5)
    d["moe"] = MoeConfig(
        num_experts=int(req(cfg, "num_local_experts")),
        # the release's config.json also names it experts_per_token
        top_k=int(cfg.get("num_experts_per_tok") or req(cfg, "experts_per_token")),
        expert_intermediate_size=d["intermediate_size"],
        # top-k of the logits then softmax over the k == softmax, top-k, renormalized
        norm_topk_prob=True,
        moe_layers=list(range(n)),
        router_bias=True,
        expert_bias=True,
        swiglu_limit=_positive(cfg, "swiglu_limit", 7.0),
        swiglu_alpha=_positive(cfg, "swiglu_alpha", 1.702),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def _attention(arch: ArchConfig, p: str) -> Manifest:
    """Attention with sinks; its biases required with ``attention_bias`` (the release
    always has them: a file that lost them is refused)."""
    att = base.attention(p, arch.hidden_size, Geometry.full(arch), sinks=True)
    if arch.attention_bias:
        att.required.update(att.optional)
        att.optional.clear()
    return att


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Per layer: the two norms, biased attention with sinks, the biased MoE (every layer)."""
    trunk = blocks.prenorm_manifest(arch, lambda p, kind: _attention(arch, p))
    return trunk.update(blocks.draft_manifests(arch, mtp_layers, routed=True))


# ------------------------------------------------------------------ the trunk
def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    mc = arch.moe
    if mc is None or mc.moe_layers != list(range(arch.num_layers)) or not (mc.router_bias and mc.expert_bias):
        raise CortiqError(f"{cmf.path}: gpt_oss needs a biased MoE on every layer")
    if mc.scoring != "softmax" or not mc.norm_topk_prob or mc.shared_expert_intermediate_size:
        raise CortiqError(f"{cmf.path}: gpt_oss routes by softmax over the top-k without a shared expert")
    if not arch.attention_sinks:
        raise CortiqError(f"{cmf.path}: gpt_oss attention has learned sinks")
    return blocks.prenorm_model(cmf, arch, kernels)


# ------------------------------------------------------------------ GGUF
def _gguf_int(ctx: GgufContext, key: str, lo: int = 1) -> int:
    v = ctx.key(key, required=True)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CortiqError(f"GGUF metadata gpt-oss.{key} is {str(v)[:40]!r}, expected an integer >= {lo}")
    return int(v)


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """GPT-OSS's config.json from llama.cpp's ``gpt-oss.*`` keys: experts, their width
    (``expert_feed_forward_length``), the window (llama.cpp alternates sliding and full
    layers from the first, as transformers' default ``layer_types`` does) and YaRN, whose
    betas and ``truncate`` llama.cpp's converter does not write: GPT-OSS's fixed values."""
    config.update(
        num_local_experts=_gguf_int(ctx, "expert_count"),
        num_experts_per_tok=_gguf_int(ctx, "expert_used_count"),
        intermediate_size=_gguf_int(ctx, "expert_feed_forward_length"),
        sliding_window=_gguf_int(ctx, "attention.sliding_window"),
    )
    rs = config.get("rope_scaling")
    if rs is not None:
        if rs.get("rope_type") != "yarn":
            raise CortiqError(f"gpt-oss GGUF rope scaling {rs.get('rope_type')!r} is not supported (supported: yarn)")
        betas = {}
        for name, key, default in (("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0)):
            v = ctx.key(f"rope.scaling.{key}", default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CortiqError(f"GGUF metadata gpt-oss.rope.scaling.{key} is {str(v)[:40]!r}, expected a number > 0")
            betas[name] = float(v)
        rs.update(betas, truncate=False)


GGUF = GgufSpec(
    "gpt-oss",
    "gpt_oss",
    "GptOssForCausalLM",
    # llama.cpp's experts are stacked [experts, out, in] per projection, gate and up apart.
    block_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    },
    full_names={"attn_sinks": "self_attn.sinks"},  # attn_sinks.weight: the engine's self_attn.sinks
    config=_gguf_config,
)


PARSERS = {"gpt_oss": _gpt_oss}
draft_layer = blocks.routed_draft_layer
COMPUTES = ("routed experts", "attention sinks")
SANITIZE = SanitizeRules(
    renames=((r"\.mlp\.router\.", ".mlp.gate."),),
    interleaved_experts=True,
)
