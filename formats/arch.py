"""The normalized architecture every CMF header carries.

``from_hf_config`` is the one place that reads an HF ``config.json``; the engine
reads only ``ArchConfig``. Each supported ``model_type`` has a parser below; an
unknown one is an error naming the supported list.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from formats.errors import CortiqError

LAYER_FULL = "full"
LAYER_SLIDING = "sliding"
LAYER_LINEAR = "linear"
# Gated-MLP activations the engine has per family: SiLU (SwiGLU) everywhere, and
# tanh-approximated GELU (GeGLU) where the family file applies it.
ACTIVATIONS = ("silu", "swish")
FAMILY_ACTIVATIONS = {"gemma3": ("gelu_pytorch_tanh",)}


@dataclass
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    # Layers whose FFN is an MoE block (others are dense with intermediate_size).
    moe_layers: list[int] = field(default_factory=list)
    scoring: str = "softmax"  # "softmax": softmax over all experts, then top-k; "sigmoid": per-expert sigmoid (MiMo-V2)
    # Sigmoid routing (DeepSeek-V3 style, MiMo-V2): a learned bias added for the choice only,
    # experts split into n_group groups of which topk_group are eligible, weights scaled after.
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass
class LinearAttnConfig:
    """Gated DeltaNet geometry (Qwen3-Next / Qwen3.5 linear layers)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Qwen3-Next fuses q|k|v|z (and b|a) into in_proj_qkvz / in_proj_ba, grouped per key
    # head; Qwen3.5 keeps in_proj_qkv, in_proj_z, in_proj_b, in_proj_a separate.
    fused_projection: bool = True


@dataclass
class SlidingConfig:
    """Geometry of sliding-window layers when it differs from the full layers (MiMo-V2)."""

    window: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    sinks: bool = False
    rotary_dim: int = 0  # 0 = head_dim


@dataclass
class MtpConfig:
    num_layers: int
    style: str  # "deepseek" | "mimo" | "qwen3_next"


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
    norm_style: str = "rms"  # "rms": x*w ; "rms_one": x*(1+w) (Qwen3-Next)
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    attn_output_gate: bool = False
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    attention_sinks: bool = False
    attention_value_scale: float = 1.0  # MiMo-V2 multiplies V by a constant
    # Gemma 3: scores scaled by query_pre_attn_scalar**-0.5 (0 = head_dim**-0.5), the
    # sliding layers' own RoPE base (0 = rope_theta), tanh caps (0 = none).
    query_pre_attn_scalar: float = 0.0
    rope_local_theta: float = 0.0
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0
    moe: MoeConfig | None = None
    linear_attn: LinearAttnConfig | None = None
    sliding: SlidingConfig | None = None
    mtp: MtpConfig | None = None

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
        nested = {"moe": MoeConfig, "linear_attn": LinearAttnConfig, "sliding": SlidingConfig, "mtp": MtpConfig}
        for key, typ in nested.items():
            if d.get(key) is not None:
                d[key] = typ(**d[key])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ------------------------------------------------------------------ parsers

def _req(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CortiqError(f"config.json has no {key!r} (model_type {cfg.get('model_type')!r})")
    return cfg[key]


def _dense_common(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    hidden = int(_req(cfg, "hidden_size"))
    heads = int(_req(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or hidden // heads
    rope_theta = cfg.get("rope_theta")
    rope_scaling = cfg.get("rope_scaling")
    # transformers >= 5 folds rope settings into rope_parameters.
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        rope_theta = rp.get("rope_theta", rope_theta)
        rtype = rp.get("rope_type", "default")
        if rtype not in (None, "default"):
            rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if isinstance(rope_scaling, dict):
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rtype in (None, "default"):
            rope_scaling = None
        elif rtype not in ("linear", "llama3"):
            raise CortiqError(f"rope scaling type {rtype!r} is not supported (supported: linear, llama3)")
    prf = cfg.get("partial_rotary_factor") or (rp.get("partial_rotary_factor") if isinstance(rp, dict) else None)
    return dict(
        arch=arch,
        hidden_size=hidden,
        num_layers=int(_req(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(_req(cfg, "intermediate_size")),
        vocab_size=int(_req(cfg, "vocab_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        rotary_dim=int(int(head_dim) * float(prf)) if prf else 0,
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        hidden_act=str(cfg.get("hidden_act") or "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _sliding_layers(cfg: dict[str, Any], n: int) -> tuple[list[str], int]:
    """Mistral/Qwen2-style sliding windows: every layer, or layers >= max_window_layers."""
    window = cfg.get("sliding_window") or 0
    use = cfg.get("use_sliding_window", True)
    if not window or not use:
        return [LAYER_FULL] * n, 0
    lt = cfg.get("layer_types")
    if lt:
        return [LAYER_SLIDING if t == "sliding_attention" else LAYER_FULL for t in lt], int(window)
    start = cfg.get("max_window_layers")
    if start is None:
        return [LAYER_SLIDING] * n, int(window)
    return [LAYER_SLIDING if i >= start else LAYER_FULL for i in range(n)], int(window)


def _llama(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "llama")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    return ArchConfig(**d)


def _mistral(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "mistral")
    d["layer_types"], d["sliding_window"] = _sliding_layers({**cfg, "max_window_layers": None}, d["num_layers"])
    return ArchConfig(**d)


def _qwen2(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "qwen2")
    d["attention_bias"] = True
    d["layer_types"], d["sliding_window"] = _sliding_layers(cfg, d["num_layers"])
    return ArchConfig(**d)


def _qwen3(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "qwen3")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["layer_types"], d["sliding_window"] = _sliding_layers(cfg, d["num_layers"])
    return ArchConfig(**d)


# ------------------------------------------------------------------ mixture of experts

def _sparse_layers(cfg: dict[str, Any], n: int) -> list[int]:
    """Qwen-MoE rule: layer i is sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _qwen_moe(cfg: dict[str, Any], n: int, shared: bool) -> MoeConfig | None:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0
    return MoeConfig(
        num_experts=experts,
        top_k=int(_req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(_req(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=shared_size > 0,
        moe_layers=_sparse_layers(cfg, n),
    )


def _qwen2_moe(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "qwen2_moe")
    d["attention_bias"] = bool(cfg.get("qkv_bias", True))
    d["layer_types"], d["sliding_window"] = _sliding_layers(cfg, d["num_layers"])
    d["moe"] = _qwen_moe(cfg, d["num_layers"], shared=True)
    return ArchConfig(**d)


def _qwen3_moe(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "qwen3_moe")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["layer_types"], d["sliding_window"] = _sliding_layers(cfg, d["num_layers"])
    d["moe"] = _qwen_moe(cfg, d["num_layers"], shared=False)
    return ArchConfig(**d)


def _mixtral(cfg: dict[str, Any]) -> ArchConfig:
    d = _dense_common(cfg, "mixtral")
    d["layer_types"], d["sliding_window"] = _sliding_layers({**cfg, "max_window_layers": None}, d["num_layers"])
    # Mixtral's experts are as wide as its intermediate_size; it always renormalizes the top-k.
    d["moe"] = MoeConfig(
        num_experts=int(_req(cfg, "num_local_experts")),
        top_k=int(_req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=d["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=list(range(d["num_layers"])),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ hybrid linear attention

def _hybrid_layer_types(cfg: dict[str, Any], n: int) -> list[str]:
    lt = cfg.get("layer_types")
    if not lt:
        interval = int(cfg.get("full_attention_interval") or 4)
        lt = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    kinds = {"linear_attention": LAYER_LINEAR, "full_attention": LAYER_FULL}
    bad = sorted({t for t in lt if t not in kinds})
    if bad:
        raise CortiqError(f"layer_types {bad} are not supported (supported: linear_attention, full_attention)")
    return [kinds[t] for t in lt]


def _linear_attn(cfg: dict[str, Any], fused: bool) -> LinearAttnConfig:
    la = LinearAttnConfig(
        num_key_heads=int(_req(cfg, "linear_num_key_heads")),
        num_value_heads=int(_req(cfg, "linear_num_value_heads")),
        key_head_dim=int(_req(cfg, "linear_key_head_dim")),
        value_head_dim=int(_req(cfg, "linear_value_head_dim")),
        conv_kernel=int(_req(cfg, "linear_conv_kernel_dim")),
        fused_projection=fused,
    )
    if la.num_value_heads % la.num_key_heads:
        raise CortiqError(
            f"linear_num_value_heads={la.num_value_heads} is not a multiple of linear_num_key_heads={la.num_key_heads}"
        )
    return la


def _qwen3_next_family(cfg: dict[str, Any], arch: str, fused: bool, moe: bool) -> ArchConfig:
    d = _dense_common(cfg, arch)
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["attn_output_gate"] = True
    d["norm_style"] = "rms_one"
    if not d["rotary_dim"]:
        d["rotary_dim"] = int(d["head_dim"] * 0.25)  # the family's default partial_rotary_factor
    d["layer_types"] = _hybrid_layer_types(cfg, d["num_layers"])
    d["linear_attn"] = _linear_attn(cfg, fused)
    d["moe"] = _qwen_moe(cfg, d["num_layers"], shared=True) if moe else None
    return ArchConfig(**d)


def _qwen3_next(cfg: dict[str, Any]) -> ArchConfig:
    return _qwen3_next_family(cfg, "qwen3_next", fused=True, moe=True)


def _qwen3_5(cfg: dict[str, Any]) -> ArchConfig:
    return _qwen3_next_family(cfg, "qwen3_5", fused=False, moe=False)


def _qwen3_5_moe(cfg: dict[str, Any]) -> ArchConfig:
    # Every layer is sparse and the top-k is always renormalized (no config keys for either).
    cfg = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return _qwen3_next_family(cfg, "qwen3_5_moe", fused=False, moe=True)


# ------------------------------------------------------------------ MiMo-V2

def _mimo_v2(cfg: dict[str, Any]) -> ArchConfig:
    """MiMo-V2-Flash: full + sliding-window layers of different geometry, sinks, sigmoid MoE.

    Reads transformers' ``mimo_v2_flash`` config and falls back to the release's own
    keys (``swa_*``, ``hybrid_layer_pattern``, ``moe_layer_freq``, ``sliding_window_size``).
    """
    n = int(_req(cfg, "num_hidden_layers"))
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
    d = _dense_common(flat, "mimo_v2")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["v_head_dim"] = int(cfg.get("v_head_dim") or d["head_dim"])
    d["attention_value_scale"] = float(cfg.get("attention_value_scale") or 1.0)
    lt = cfg.get("layer_types")
    if lt:
        d["layer_types"] = [LAYER_SLIDING if t == "sliding_attention" else LAYER_FULL for t in lt]
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
            top_k=int(_req(cfg, "num_experts_per_tok")),
            expert_intermediate_size=int(_req(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=sparse,
            scoring=scoring,
            score_bias=scoring == "sigmoid",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )
    return ArchConfig(**d)


# ------------------------------------------------------------------ Gemma 3

def _gemma3(cfg: dict[str, Any]) -> ArchConfig:
    """Gemma 3 text: every 6th layer global, the rest sliding with their own RoPE base;
    (1 + w) norms, q/k norms, GeGLU (tanh GELU), query_pre_attn_scalar, optional caps."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    full_rp = rp.get("full_attention") or {}
    local_rp = rp.get("sliding_attention") or {}
    flat = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    flat["rope_theta"] = full_rp.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    flat.setdefault("rope_scaling", None)
    if full_rp.get("rope_type", "default") not in (None, "default"):
        flat["rope_scaling"] = {k: v for k, v in full_rp.items() if k != "rope_theta"}
    flat["hidden_act"] = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    d = _dense_common(flat, "gemma3")
    n = d["num_layers"]
    lt = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(cfg.get("sliding_window_pattern") or 6) else "full_attention"
        for i in range(n)
    ]
    bad = sorted({t for t in lt if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise CortiqError(f"gemma3 layer_types {bad} are not supported (supported: sliding_attention, full_attention)")
    if cfg.get("use_bidirectional_attention"):
        raise CortiqError("gemma3 with use_bidirectional_attention is not supported (an encoder, not a causal LM)")
    d.update(
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        norm_style="rms_one",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_types=[LAYER_SLIDING if t == "sliding_attention" else LAYER_FULL for t in lt],
        sliding_window=int(cfg.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        rope_local_theta=float(local_rp.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
    )
    return ArchConfig(**d)


# model_type -> parser. Architecture families register here.
PARSERS: dict[str, Callable[[dict[str, Any]], ArchConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe_text": _qwen3_5_moe,
    "mimo_v2_flash": _mimo_v2,
    "gemma3_text": _gemma3,
}


def supported_model_types() -> list[str]:
    return sorted(PARSERS)


def from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    mt = cfg.get("model_type")
    if mt not in PARSERS:
        raise CortiqError(
            f"unsupported architecture {mt!r} (model_type in config.json); supported: {', '.join(supported_model_types())}"
        )
    try:
        arch = PARSERS[mt](cfg)
    except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as e:
        # config.json is untrusted: a wrong-typed or zero value is bad input, not a bug.
        raise CortiqError(f"config.json ({mt}): bad value ({type(e).__name__}: {str(e)[:160]})") from None
    allowed = ACTIVATIONS + FAMILY_ACTIVATIONS.get(arch.arch, ())
    if arch.hidden_act not in allowed:
        raise CortiqError(f"activation {arch.hidden_act!r} is not supported (supported: {', '.join(allowed)})")
    from formats.arch_check import validate_arch  # imports this module

    return validate_arch(arch, "config.json")
