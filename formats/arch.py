"""The normalized architecture every CMF header carries.

``ArchConfig`` is what the engine reads; the header stores it as JSON. Which
``config.json`` becomes which ``ArchConfig`` is each family's business: the parsers
live in ``cortiq_engine/models/<family>.py`` (``Family.parse``), validation in
``formats.arch_check``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from formats.errors import CortiqError

LAYER_FULL = "full"
LAYER_SLIDING = "sliding"
LAYER_LINEAR = "linear"
# The gated-MLP activation every family computes (SwiGLU); a family adds its own
# (e.g. the tanh GELU) in its ``Family.activations``.
ACTIVATIONS = ("silu", "swish")


@dataclass
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert
    # Layers whose FFN is an MoE block (others are dense with intermediate_size).
    moe_layers: list[int] = field(default_factory=list)
    scoring: str = "softmax"  # "softmax": softmax over all experts, then top-k; "sigmoid": per-expert sigmoid
    # Sigmoid routing: a learned bias added for the choice only,
    # experts split into n_group groups of which topk_group are eligible, weights scaled after.
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # A router bias added to the logits, biases on every expert's gate/up/down, and the
    # clamped SwiGLU: gate clamped above at swiglu_limit, up to +-swiglu_limit (0 = no clamp),
    # out = (up + 1) * gate * sigmoid(swiglu_alpha * gate) (swiglu_alpha 0 = silu(gate) * up).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0


@dataclass
class LinearAttnConfig:
    """Gated DeltaNet geometry (linear-attention layers)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Fused: q|k|v|z (and b|a) in in_proj_qkvz / in_proj_ba, grouped per key head;
    # separate: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a.
    fused_projection: bool = True


@dataclass
class SlidingConfig:
    """Geometry of sliding-window layers when it differs from the full layers."""

    window: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    sinks: bool = False
    rotary_dim: int = 0  # 0 = head_dim


@dataclass
class MlaConfig:
    """Multi-head latent attention (MLA): queries through an optional
    low-rank ``q_lora_rank`` bottleneck, keys and values from one ``kv_lora_rank`` latent
    plus a shared rotary key of ``qk_rope_head_dim``."""

    q_lora_rank: int  # 0 = q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint stores each rotary key/query part as interleaved pairs (x0, x1), (x2, x3), ...
    # (transformers' ``rope_interleave``).
    rope_interleave: bool = False


@dataclass
class MtpConfig:
    num_layers: int
    style: str  # the release naming scheme of the drafts (the family records it)


@dataclass
class ArchConfig:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0  # dims rotated per head (partial rotary); 0 = head_dim
    v_head_dim: int = 0  # 0 = head_dim
    norm_eps: float = 1e-6
    norm_style: str = "rms"  # "rms": x*w ; "rms_one": x*(1+w)
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    attn_output_gate: bool = False
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    attention_sinks: bool = False
    attention_value_scale: float = 1.0  # V multiplied by a constant
    # Scores scaled by query_pre_attn_scalar**-0.5 (0 = head_dim**-0.5), the
    # sliding layers' own RoPE base (0 = rope_theta), tanh caps (0 = none).
    query_pre_attn_scalar: float = 0.0
    rope_local_theta: float = 0.0
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0
    # Multipliers: embeddings times embedding_scale, each sublayer's output times
    # residual_scale before the add, scores times attention_scale (0 = the default scale),
    # logits divided by logits_scaling.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float = 0.0
    logits_scaling: float = 1.0
    no_rope_layers: list[int] = field(default_factory=list)  # layers whose attention has no RoPE
    moe: MoeConfig | None = None
    linear_attn: LinearAttnConfig | None = None
    sliding: SlidingConfig | None = None
    mtp: MtpConfig | None = None
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if not self.v_head_dim:
            self.v_head_dim = self.head_dim
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if not self.layer_types:
            self.layer_types = [LAYER_FULL] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise CortiqError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ArchConfig":
        d = dict(d)
        nested = {
            "moe": MoeConfig,
            "linear_attn": LinearAttnConfig,
            "sliding": SlidingConfig,
            "mtp": MtpConfig,
            "mla": MlaConfig,
        }
        for key, typ in nested.items():
            if d.get(key) is not None:
                d[key] = typ(**d[key])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
