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
    scoring: str = "softmax"  # softmax over all experts, then top-k


@dataclass
class LinearAttnConfig:
    """Gated DeltaNet geometry (Qwen3-Next / Qwen3.5 linear layers)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


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


# model_type -> parser. Architecture families register here.
PARSERS: dict[str, Callable[[dict[str, Any]], ArchConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}


def supported_model_types() -> list[str]:
    return sorted(PARSERS)


def from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    mt = cfg.get("model_type")
    if mt not in PARSERS:
        raise CortiqError(
            f"unsupported architecture {mt!r} (model_type in config.json); supported: {', '.join(supported_model_types())}"
        )
    arch = PARSERS[mt](cfg)
    if arch.hidden_act not in ("silu", "swish"):
        raise CortiqError(f"activation {arch.hidden_act!r} is not supported (supported: silu)")
    return arch
