"""Gemma 3 (text): interleaved sliding-window (local) and global attention layers,
each kind with its own RoPE base; per-head q/k RMS norms; four (1 + w) RMS norms per
block (before and after attention, before and after the MLP); a GeGLU MLP with the
tanh-approximated GELU; embeddings scaled by sqrt(hidden); scores scaled by
``query_pre_attn_scalar``**-0.5; tied embeddings; an optional tanh cap on the logits.

Follows transformers' ``models/gemma3/modeling_gemma3.py`` (the oracle of the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.layers import Attention, RMSNorm, RoPE, Step
from cortiq_engine.model import Model
from cortiq_engine.models.llama import attention_weights
from cortiq_engine.weights import Weight, load_vector, load_weight


class GegluMLP:
    """down(act(gate(x)) * up(x)), act = tanh GELU (or SiLU if the config says so)."""

    def __init__(self, kernels, gate: Weight, up: Weight, down: Weight, act: str):
        self.ks = kernels
        self._gu = (gate, up)
        self._down = (down,)
        self._act = kernels.gelu_tanh_mul if act == "gelu_pytorch_tanh" else kernels.silu_mul

    def weights(self) -> list[Weight]:
        return [*self._gu, *self._down]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.ks.matmul(self._down, self._act(self.ks.matmul(self._gu, x)))


class SandwichBlock:
    """x += post_attn(attn(pre_attn(x))); x += post_ffn(mlp(pre_ffn(x))): each sublayer's
    output is normed before it joins the residual stream."""

    def __init__(self, norms: tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm], attn: Attention, mlp: GegluMLP):
        self.pre_attn, self.post_attn, self.pre_ffn, self.post_ffn = norms
        self.attn = attn
        self.mlp = mlp

    def make_cache(self, capacity: int):
        return self.attn.make_cache(capacity)

    def __call__(self, x: np.ndarray, cache, step: Step) -> None:
        x += self.post_attn(self.attn(self.pre_attn(x), cache, step))
        x += self.post_ffn(self.mlp(self.pre_ffn(x)))

    def weights(self) -> list[Weight]:
        return self.attn.weights() + self.mlp.weights()


@dataclass(frozen=True, eq=False)
class Gemma3Model(Model):
    """A ``Model`` whose embeddings are scaled and whose logits may be capped."""

    embed_scale: float = 1.0
    logit_softcap: float = 0.0

    def embed_ids(self, ids) -> np.ndarray:
        x = super().embed_ids(ids)
        x *= np.float32(self.embed_scale)  # transformers casts the scale to the weights' dtype (f32)
        return x

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        logits = super().lm_head(h)
        if self.logit_softcap:
            cap = np.float32(self.logit_softcap)
            logits /= cap
            np.tanh(logits, out=logits)
            logits *= cap
        return logits


def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.moe is not None or arch.linear_attn is not None or arch.sliding is not None:
        raise CortiqError(f"{cmf.path}: gemma3 with MoE, linear or split-geometry layers is not a Gemma 3 model")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported for gemma3")
    if arch.attn_logit_softcapping:
        raise CortiqError(f"{cmf.path}: attention logit soft-capping (Gemma 2 style) is not supported by the engine yet")
    if arch.rope_scaling and arch.rope_scaling.get("rope_type", arch.rope_scaling.get("type")) not in ("linear", "llama3"):
        raise CortiqError(f"{cmf.path}: rope scaling {arch.rope_scaling!r} is not supported for gemma3")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    h, eps = arch.hidden_size, arch.norm_eps
    # The global layers use rope_theta (and any scaling); the local ones their own base, unscaled.
    ropes = {
        LAYER_FULL: RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling),
        LAYER_SLIDING: RoPE(arch.rotary_dim, arch.rope_local_theta or arch.rope_theta, None),
    }
    scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5

    def norm(name: str) -> RMSNorm:
        return RMSNorm(kernels, load_vector(cmf, name, h), eps, "rms_one")

    blocks = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        attn = Attention(
            kernels,
            attention_weights(cmf, p, arch),  # adds 1 to the q/k norms (norm_style rms_one)
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            v_head_dim=arch.v_head_dim,
            rope=ropes[kind],
            norm_eps=eps,
            window=arch.sliding_window if kind == LAYER_SLIDING else 0,
            scale=scale,
        )
        mlp = GegluMLP(kernels, *(load_weight(cmf, f"{p}mlp.{x}_proj.weight") for x in ("gate", "up", "down")), arch.hidden_act)
        norms = tuple(
            norm(p + n)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                      "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        )
        blocks.append(SandwichBlock(norms, attn, mlp))
    embed = load_weight(cmf, "model.embed_tokens.weight")
    head = embed if (arch.tie_word_embeddings or "lm_head.weight" not in cmf) else load_weight(cmf, "lm_head.weight")
    return Gemma3Model(
        arch=arch,
        kernels=kernels,
        embed=embed,
        blocks=tuple(blocks),
        norm=RMSNorm(kernels, load_vector(cmf, "model.norm.weight", h), eps, "rms_one"),
        head=head,
        embed_scale=float(np.float32(h**0.5)),
        logit_softcap=arch.final_logit_softcapping,
    )
