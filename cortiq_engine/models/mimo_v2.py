"""MiMo-V2-Flash: full-attention and sliding-window layers of different geometry.

Full layers: ``num_heads`` / ``num_kv_heads``, Q/K head ``head_dim``, V head
``v_head_dim``, RoPE with the full layers' theta on the first ``rotary_dim`` dims.
Sliding layers (``arch.sliding``): their own KV head count, theta and window,
and a learned sink logit per head. V is scaled by ``attention_value_scale`` in
both. The FFN is dense on the first layer(s) and a sigmoid-routed MoE elsewhere.
The three MTP draft layers live in the sidecar and are loaded by ``mtp``.
"""

from __future__ import annotations

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.layers import RoPE
from cortiq_engine.model import Model
from cortiq_engine.models.llama import attention_weights
from cortiq_engine.models.moe_family import ffn_block, head_and_norm
from cortiq_engine.sink_attention import SinkAttention
from cortiq_engine.weights import load_vector


def sliding_rope(arch: ArchConfig) -> RoPE:
    s = arch.sliding
    return RoPE(s.rotary_dim or s.head_dim, s.rope_theta)


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, kind: str, rope: RoPE) -> SinkAttention:
    """The attention of the block with prefix ``p``: ``kind`` picks the full or sliding geometry."""
    if kind == LAYER_SLIDING:
        s = arch.sliding
        nh, nkv, hd, vd, window, has_sinks = s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim, s.window, s.sinks
    else:
        nh, nkv, hd, vd, window = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.v_head_dim, 0
        has_sinks = arch.attention_sinks
    return SinkAttention(
        kernels,
        attention_weights(cmf, p, arch),
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        v_head_dim=vd,
        rope=rope,
        norm_eps=arch.norm_eps,
        window=window,
        sinks=load_vector(cmf, f"{p}self_attn.sinks", nh) if has_sinks else None,
        v_scale=arch.attention_value_scale,
    )


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad or (LAYER_SLIDING in arch.layer_types and arch.sliding is None):
        raise CortiqError(f"{cmf.path}: mimo_v2 header has layer types {bad or arch.layer_types} without their geometry")
    full_rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    swa_rope = sliding_rope(arch) if arch.sliding is not None else full_rope
    blocks = []
    for i, kind in enumerate(arch.layer_types):
        rope = swa_rope if kind == LAYER_SLIDING else full_rope
        attn = attention(cmf, arch, kernels, f"model.layers.{i}.", kind, rope)
        blocks.append(ffn_block(cmf, arch, kernels, i, attn))
    embed, head, norm = head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(blocks), norm=norm, head=head)
