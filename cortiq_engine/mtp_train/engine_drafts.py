"""A sidecar's draft layers run by the engine's own layers and kernels (numpy or
numba, whatever the backbone uses), teacher-forced over whole windows.

This measures a written sidecar as the engine computes it (quantized weights
included) without the speculative decoder: the check that the file says what the
trainer trained, and the held-out acceptance the report quotes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.untrusted_json import section
from formats.sidecar import check_sidecar
from cortiq_engine.layers import Attention, AttentionWeights, Block, GatedMLP, RMSNorm, RoPE, Step
from cortiq_engine.weights import load_vector, load_weight


@dataclass(eq=False)
class EngineDraftLayer:
    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: object  # Weight
    block: Block
    final_norm: RMSNorm


def load_draft_layers(sidecar: str | Path, backbone) -> list[EngineDraftLayer]:
    """The draft layers of ``sidecar`` on the backbone's kernels; checks the sidecar first."""
    side = CmfFile(sidecar)
    check_sidecar(backbone.header, side.header)
    arch: ArchConfig = backbone.arch
    ks = backbone.model.kernels
    h, eps, style = arch.hidden_size, arch.norm_eps, arch.norm_style
    rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    n = section(side.header, "mtp").get("num_layers") or 0
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 64:
        raise CortiqError(f"{side.path}: header mtp.num_layers is {str(n)[:20]!r}, expected 0..64")
    if n < 1:
        raise CortiqError(f"{sidecar}: the sidecar header declares no MTP layers")
    layers = []
    for k in range(n):
        p = f"model.mtp.layers.{k}."
        vec = lambda name: load_vector(side, p + name, h)  # noqa: E731
        biases = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        q, kw, v, o = (load_weight(side, f"{p}self_attn.{x}_proj.weight") for x in "qkvo")
        qkv_bias = None
        if any(b in side for b in biases):
            qkv_bias = np.concatenate(
                [load_vector(side, b, w.rows) if b in side else np.zeros(w.rows, np.float32) for b, w in zip(biases, (q, kw, v))]
            )
        o_bias = load_vector(side, p + "self_attn.o_proj.bias", o.rows) if p + "self_attn.o_proj.bias" in side else None
        q_norm = k_norm = None
        if p + "self_attn.q_norm.weight" in side:
            q_norm = load_vector(side, p + "self_attn.q_norm.weight", arch.head_dim)
            k_norm = load_vector(side, p + "self_attn.k_norm.weight", arch.head_dim)
            if style == "rms_one":
                q_norm, k_norm = q_norm + 1.0, k_norm + 1.0
        attn = Attention(
            ks, AttentionWeights(q, kw, v, o, qkv_bias, o_bias, q_norm, k_norm),
            num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            v_head_dim=arch.v_head_dim, rope=rope, norm_eps=eps,
        )
        mlp = GatedMLP(ks, *(load_weight(side, f"{p}mlp.{x}_proj.weight") for x in ("gate", "up", "down")))
        block = Block(RMSNorm(ks, vec("input_layernorm.weight"), eps, style), attn,
                      RMSNorm(ks, vec("post_attention_layernorm.weight"), eps, style), mlp)
        layers.append(EngineDraftLayer(
            RMSNorm(ks, vec("enorm.weight"), eps, style), RMSNorm(ks, vec("hnorm.weight"), eps, style),
            load_weight(side, p + "eh_proj.weight"), block, RMSNorm(ks, vec("final_layernorm.weight"), eps, style),
        ))
    return layers


def layer_hidden(backbone, layer: EngineDraftLayer, emb: np.ndarray, hid: np.ndarray) -> np.ndarray:
    """Teacher-forced rows of one draft layer: emb, hid [n, H] -> final-normed [n, H]."""
    ks = backbone.model.kernels
    n = emb.shape[0]
    cat = np.ascontiguousarray(np.concatenate([layer.enorm(emb), layer.hnorm(hid)], axis=1), dtype=np.float32)
    x = np.ascontiguousarray(ks.matmul((layer.eh_proj,), cat), dtype=np.float32)
    cache = layer.block.make_cache(n)
    layer.block(x, cache, Step(np.arange(n, dtype=np.int64)))
    return layer.final_norm(x)


def engine_drafts(backbone, layers: list[EngineDraftLayer], tokens: np.ndarray, hidden: np.ndarray,
                  head_rows: int = 64) -> list[np.ndarray]:
    """Argmax drafts [W, T] per depth over the windows (tokens [W, T], hidden [W, T, H])."""
    w, t = tokens.shape
    out = [np.full((w, t), -1, np.int64) for _ in layers]
    for i in range(w):
        for k, layer in enumerate(layers):
            n = t - k - 1
            y = layer_hidden(backbone, layer, backbone.model.embed_ids(tokens[i, k + 1 : t]), hidden[i, :n])
            for r0 in range(0, n, head_rows):
                r1 = min(r0 + head_rows, n)
                out[k][i, r0:r1] = backbone.model.lm_head(y[r0:r1]).argmax(-1)
    return out
