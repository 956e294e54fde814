"""The Qwen3-Next hybrid family: Qwen3-Next (fused linear projections, MoE with a
gated shared expert), Qwen3.5 (split projections, dense MLP) and Qwen3.5-MoE.

Layers are Gated DeltaNet linear attention (``gated_deltanet``) or full attention
with an output gate (q_proj emits [query | gate] per head; the attention output is
multiplied by sigmoid(gate) before o_proj), per-head q/k RMS norm and partial
rotary. Every RMSNorm scales by (1 + w) except the gated norm inside the linear
layers.
"""

from __future__ import annotations

import numpy as np

from formats.arch import LAYER_FULL, LAYER_LINEAR, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.cache import KVCache
from cortiq_engine.gated_deltanet import GatedDeltaNet, LinearAttnWeights
from cortiq_engine.layers import Attention, RoPE, Step
from cortiq_engine.model import Model
from cortiq_engine.models.llama import attention_weights
from cortiq_engine.models.moe_family import ffn_block, head_and_norm
from cortiq_engine.weights import load_vector, load_weight


class GatedAttention(Attention):
    """Attention whose q_proj rows are [query(head_dim) | gate(head_dim)] per head."""

    q_factor = 2

    def __call__(self, x: np.ndarray, cache: KVCache, step: Step) -> np.ndarray:
        ks, n = self.ks, x.shape[0]
        qkv = ks.matmul(self._qkv, x)
        if self.w.qkv_bias is not None:
            qkv += self.w.qkv_bias
        nq, nk = 2 * self.nh * self.hd, self.nkv * self.hd
        qg = qkv[:, :nq].reshape(n, self.nh, 2 * self.hd)
        q = np.ascontiguousarray(qg[:, :, : self.hd])
        gate = qg[:, :, self.hd :].reshape(n, self.nh * self.hd)
        k = np.ascontiguousarray(qkv[:, nq : nq + nk]).reshape(n, self.nkv, self.hd)
        v = qkv[:, nq + nk :].reshape(n, self.nkv, self.vd)
        q = ks.rms_norm(q.reshape(n * self.nh, self.hd), self.w.q_norm, self.eps).reshape(n, self.nh, self.hd)
        k = ks.rms_norm(k.reshape(n * self.nkv, self.hd), self.w.k_norm, self.eps).reshape(n, self.nkv, self.hd)
        cos, sin = step.rope_tables(self.rope)
        ks.rope(q, cos, sin)
        ks.rope(k, cos, sin)
        start = cache.append(k, v)
        o = ks.attend(q, cache.keys, cache.values, start, self.window, self.scale).reshape(n, self.nh * self.vd)
        o = o * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
        out = ks.matmul(self._o, np.ascontiguousarray(o, dtype=np.float32))
        if self.w.o_bias is not None:
            out += self.w.o_bias
        return out


def _linear_attn(cmf: CmfFile, arch: ArchConfig, kernels, p: str) -> GatedDeltaNet:
    la = arch.linear_attn
    q = p + "linear_attn."
    names = ("in_proj_qkvz", "in_proj_ba") if la.fused_projection else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    conv = cmf.tensor_f32(q + "conv1d.weight").reshape(conv_dim, la.conv_kernel)
    w = LinearAttnWeights(
        in_proj=tuple(load_weight(cmf, f"{q}{nm}.weight") for nm in names),
        conv=np.ascontiguousarray(conv, dtype=np.float32),
        A_log=load_vector(cmf, q + "A_log", la.num_value_heads),
        dt_bias=load_vector(cmf, q + "dt_bias", la.num_value_heads),
        norm=load_vector(cmf, q + "norm.weight", la.value_head_dim),
        out_proj=load_weight(cmf, q + "out_proj.weight"),
    )
    return GatedDeltaNet(kernels, la, w, arch.norm_eps)


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if arch.linear_attn is None:
        raise CortiqError(f"{cmf.path}: {arch.arch} header has no linear_attn geometry")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_LINEAR)})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported for {arch.arch}")
    rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    blocks = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        if kind == LAYER_LINEAR:
            mixer = _linear_attn(cmf, arch, kernels, p)
        else:
            cls = GatedAttention if arch.attn_output_gate else Attention
            mixer = cls(
                kernels,
                attention_weights(cmf, p, arch),
                num_heads=arch.num_heads,
                num_kv_heads=arch.num_kv_heads,
                head_dim=arch.head_dim,
                v_head_dim=arch.v_head_dim,
                rope=rope,
                norm_eps=arch.norm_eps,
            )
        blocks.append(ffn_block(cmf, arch, kernels, i, mixer))
    embed, head, norm = head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(blocks), norm=norm, head=head)
