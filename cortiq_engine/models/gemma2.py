"""Gemma 2: alternating sliding-window (local) and global attention layers over one
RoPE; attention scores soft-capped (cap * tanh(score / cap), after the
``query_pre_attn_scalar``**-0.5 scaling and before the mask); four (1 + w) RMS norms
per block (before and after attention, before and after the MLP); a GeGLU MLP with
the tanh-approximated GELU; embeddings scaled by sqrt(hidden); tied embeddings; the
logits soft-capped. No q/k norms.

Follows transformers' ``models/gemma2/modeling_gemma2.py`` (the oracle of the tests).
"""

from __future__ import annotations

from typing import Any, Sequence


from formats.arch import LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext
from formats.manifest import Manifest
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Geometry, dense_common
from cortiq_engine.models.blocks import GELU_TANH


# ------------------------------------------------------------------ config.json
def _gemma2(cfg: dict[str, Any]) -> ArchConfig:
    """Gemma 2: layers alternate sliding / global (``layer_types``, or even layers sliding
    as transformers' default), (1 + w) norms, GeGLU (tanh GELU), query_pre_attn_scalar,
    attention and final soft-caps (null: none)."""
    flat = dict(cfg)
    flat["hidden_act"] = cfg.get("hidden_activation") or cfg.get("hidden_act") or GELU_TANH
    d = dense_common(flat, "gemma2")
    n = d["num_layers"]
    kinds = base.layer_kinds(cfg.get("layer_types") or base.every_nth_full(n, 2), n)
    if cfg.get("use_bidirectional_attention"):
        raise CortiqError("gemma2 with use_bidirectional_attention is not supported (an encoder, not a causal LM)")
    window = cfg.get("sliding_window")
    if LAYER_SLIDING in kinds and not window:
        raise CortiqError(f"gemma2 sliding_window is {window!r} but layer_types has sliding layers")
    d.update(
        attention_bias=bool(cfg.get("attention_bias", False)),
        norm_style="rms_one",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_types=kinds,
        sliding_window=int(window or 0),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Per layer: the four sandwich norms, attention (optional biases), the GeGLU MLP.
    Draft layers (none ship with Gemma 2) are pre-norm draft blocks."""

    def attention(p: str) -> Manifest:
        return base.attention(p, arch.hidden_size, Geometry.full(arch))

    return blocks.sandwich_manifest(arch, mtp_layers, attention)


# ------------------------------------------------------------------ the model
# What a Gemma 2 header may ask for (``base.SETTINGS``); the rest is refused.
COMPUTES = ("(1 + w) norms", "query_pre_attn_scalar", "an attention soft-cap", "a final soft-cap")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if LAYER_SLIDING in arch.layer_types and arch.sliding_window <= 0:
        raise CortiqError(f"{cmf.path}: gemma2 has sliding layers but no sliding_window")
    if arch.norm_style != "rms_one":
        raise CortiqError(f"{cmf.path}: gemma2 norms are (1 + w)")
    for i in range(arch.num_layers):
        blocks.refuse_mlp_bias(cmf, f"model.layers.{i}.")
    rope = blocks.rope(arch)  # one RoPE for both layer kinds

    def attention(p: str, kind: str):
        # Its soft-cap (arch.attn_logit_softcapping) and score scale (query_pre_attn_scalar)
        # come from arch through blocks.attention.
        return blocks.attention(cmf, arch, kernels, p, kind, rope)

    return blocks.sandwich_model(cmf, arch, kernels, attention, **blocks.gemma_trunk_options(arch))


# ------------------------------------------------------------------ GGUF
def _gguf_number(ctx: GgufContext, name: str, default: float) -> float:
    v = ctx.key(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise CortiqError(f"GGUF metadata gemma2.{name} is {str(v)[:40]!r}, expected a number > 0")
    return float(v)


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """Gemma 2's config.json. What the GGUF may leave out, llama.cpp hard-codes for
    gemma2 and so do we: even layers slide, a window of 4096 and caps of 50 (scores)
    and 30 (logits) when the file names none, and query_pre_attn_scalar = head_dim,
    except hidden / heads for the 27B model (46 layers), as llama.cpp picks it."""
    base.gguf_heads(ctx, config)
    layers, hd = config["num_hidden_layers"], config["head_dim"]
    window = ctx.key("attention.sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CortiqError(
            f"GGUF metadata gemma2.attention.sliding_window is {str(window)[:40]!r}, expected an integer >= 1"
        )
    config.update(
        hidden_activation=GELU_TANH,
        hidden_act=GELU_TANH,
        query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if layers == 46 else hd,
        sliding_window=window,
        layer_types=base.every_nth_full(layers, 2),
        attn_logit_softcapping=_gguf_number(ctx, "attn_logit_softcapping", 50.0),
        final_logit_softcapping=_gguf_number(ctx, "final_logit_softcapping", 30.0),
    )


GGUF = base.gemma_gguf("gemma2", "gemma2", "Gemma2ForCausalLM", _gguf_config)


PARSERS = {"gemma2": _gemma2}
ACTIVATIONS = blocks.GEGLU_ACTIVATIONS
