"""Granite 3 (dense): a Llama trunk with four multipliers. Embeddings are scaled by
``embedding_multiplier``, each sublayer's output by ``residual_multiplier`` before it
joins the residual stream, attention scores by ``attention_multiplier`` (the score scale
itself, in place of head_dim**-0.5), and the logits are divided by ``logits_scaling``.
q/k/v/o biases when ``attention_bias``; the MLP has none (``mlp_bias`` is refused).

Follows transformers' ``models/granite/modeling_granite.py`` (the oracle of the tests).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from formats.arch import LAYER_FULL, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import dense_common


# ------------------------------------------------------------------ config.json
def _multiplier(cfg: dict[str, Any], key: str) -> float:
    """A Granite multiplier (default 1): a finite number > 0."""
    v = cfg.get(key, 1.0)
    v = 1.0 if v is None else v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise CortiqError(f"config.json {key} is {v!r}, expected a finite number > 0")
    return float(v)


def _granite(cfg: dict[str, Any]) -> ArchConfig:
    if cfg.get("mlp_bias"):
        raise CortiqError("config.json mlp_bias=true is not supported (the engine's gated MLP has no biases)")
    d = dense_common(cfg, "granite")
    d.update(
        attention_bias=bool(cfg.get("attention_bias", False)),
        embedding_scale=_multiplier(cfg, "embedding_multiplier"),
        residual_scale=_multiplier(cfg, "residual_multiplier"),
        # Granite always scales scores by attention_multiplier (default 1.0, not head_dim**-0.5).
        attention_scale=_multiplier(cfg, "attention_multiplier"),
        logits_scaling=_multiplier(cfg, "logits_scaling"),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ the trunk
def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if not arch.attention_scale:
        raise CortiqError(f"{cmf.path}: granite needs its attention_scale (attention_multiplier)")
    return blocks.prenorm_model(cmf, arch, kernels)


# ------------------------------------------------------------------ GGUF
# llama.cpp's names for the multipliers (convert_hf_to_gguf.py writes each only when it is
# set and non-zero); an absent one means what llama.cpp's granite graph does without it.
_GGUF_SCALES = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
    "attention_multiplier": "attention.scale",
}


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """Granite's config.json from a llama.cpp granite GGUF: the four multipliers. Without
    attention.scale llama.cpp scales scores by head_dim**-0.5; without the others it
    leaves the values unscaled (a multiplier of 1)."""
    base.gguf_heads(ctx, config)
    base.gguf_refuse_mlp_bias(ctx)
    hd = config["head_dim"]
    for field, key in _GGUF_SCALES.items():
        v = ctx.key(key, 0.0)
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float, np.integer, np.floating))
            or not math.isfinite(float(v))
        ):
            raise CortiqError(f"GGUF metadata granite.{key} is {str(v)[:40]!r}, expected a finite number")
        # A float32 in the file, written back as the decimal its author wrote (0.22, not 0.2199999988079071).
        v = float(str(np.float32(v)))
        config[field] = v if v else (hd**-0.5 if field == "attention_multiplier" else 1.0)
    config["mlp_bias"] = False


# Granite's converter is Llama's: q/k rows permuted for llama.cpp's interleaved RoPE.
GGUF = (GgufSpec("granite", "granite", "GraniteForCausalLM", permute_qk=True, config=_gguf_config),)


PARSERS = {"granite": _granite}
KINDS = (LAYER_FULL,)
COMPUTES = ("Granite's multipliers",)
