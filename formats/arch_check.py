"""Validation of an ``ArchConfig``: every field's type and range, and the relations
between fields the kernels assume (heads x head_dim, rotary_dim <= head_dim, KV
heads dividing heads, finite positive rope values).

It runs on a CMF header at load (``model_arch``) and on config.json at convert
time (``arch_from_config``), so a file or checkpoint that passes can not make a
kernel index past an array. Both take the architecture family (from the registry
the caller passes in, ``formats.manifest.Families``): it parses the config, names
the activations its blocks compute, and its manifest is what the tensor shapes
are checked against (``formats.manifest.check_manifest``).
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from formats.arch import (
    LAYER_FULL,
    LAYER_LINEAR,
    LAYER_SLIDING,
    ArchConfig,
    LinearAttnConfig,
    MlaConfig,
    MoeConfig,
    MtpConfig,
    SlidingConfig,
)
from formats.errors import CortiqError
from formats.manifest import ArchFamily, Families, check_manifest, mtp_layer_indices

# Any one dimension above this is a corrupt or hostile header, not a model
# (the largest real vocabularies and FFNs are ~2^18; 2^24 leaves room).
MAX_DIM = 1 << 24
MAX_LAYERS = 4096
MAX_POSITIONS = 1 << 26
MAX_EXPERTS = 4096
_LAYER_KINDS = (LAYER_FULL, LAYER_SLIDING, LAYER_LINEAR)
_NESTED = {
    "MoeConfig": MoeConfig,
    "LinearAttnConfig": LinearAttnConfig,
    "SlidingConfig": SlidingConfig,
    "MtpConfig": MtpConfig,
    "MlaConfig": MlaConfig,
}


def _type_ok(value: Any, ann: str) -> bool:
    """Does ``value`` (from JSON) fit the dataclass annotation string ``ann``?"""
    ann = ann.replace(" ", "")
    if ann.endswith("|None"):
        return value is None or _type_ok(value, ann[: -len("|None")])
    if ann == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if ann == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ann == "bool":
        return isinstance(value, bool)
    if ann == "str":
        return isinstance(value, str)
    if ann.startswith("list["):
        inner = ann[len("list[") : -1]
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if ann.startswith("dict["):
        return isinstance(value, dict)
    if ann in _NESTED:
        return is_dataclass(value) or isinstance(value, dict)
    return True  # a field type this checker does not know (a newer family's): its parser owns it


def _check_types(obj: Any, where: str) -> None:
    for f in fields(obj):
        v = getattr(obj, f.name)
        ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if not _type_ok(v, ann):
            raise CortiqError(f"{where}.{f.name} is {_show(v)}, expected {ann.replace(' ', '')}")
        if is_dataclass(v):
            _check_types(v, f"{where}.{f.name}")


def _show(v: Any) -> str:
    s = repr(v)
    return (s[:40] + "...") if len(s) > 40 else s


def _int_range(where: str, name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise CortiqError(f"{where}.{name} is {v}, expected {lo}..{hi}")


def _positive(where: str, name: str, v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise CortiqError(f"{where}.{name} is {v}, expected a finite number > 0")


def _theta(where: str, name: str, v: float) -> None:
    # Below 1 the rotary frequencies overflow f32; real bases are 1e4..1e8.
    if not (math.isfinite(v) and 1.0 < v <= 1e12):
        raise CortiqError(f"{where}.{name} is {v}, expected a rotary base in (1, 1e12]")


def _heads(where: str, heads: int, kv: int, head_dim: int, rotary: int) -> None:
    if heads % kv:
        raise CortiqError(f"{where}: num_kv_heads={kv} does not divide num_heads={heads}")
    if rotary > head_dim:
        raise CortiqError(f"{where}: rotary_dim={rotary} exceeds head_dim={head_dim}")
    if rotary % 2:
        raise CortiqError(f"{where}: rotary_dim={rotary} is odd (rotary pairs need an even count)")


def validate_arch(arch: ArchConfig, where: str = "arch", activations: tuple[str, ...] | None = None) -> ArchConfig:
    """Raise one CortiqError naming the first bad field; returns ``arch`` unchanged.
    ``activations``: the ones its family computes (None: not checked here)."""
    _check_types(arch, where)
    w = where
    for name in (
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "v_head_dim",
        "intermediate_size",
        "vocab_size",
    ):
        _int_range(w, name, getattr(arch, name), 1, MAX_DIM)
    _int_range(w, "num_layers", arch.num_layers, 1, MAX_LAYERS)
    _int_range(w, "max_position_embeddings", arch.max_position_embeddings, 1, MAX_POSITIONS)
    _int_range(w, "rotary_dim", arch.rotary_dim, 0, MAX_DIM)
    _int_range(w, "sliding_window", arch.sliding_window, 0, MAX_POSITIONS)
    _int_range(w, "num_kv_heads", arch.num_kv_heads, 1, arch.num_heads)
    _heads(w, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rotary_dim)
    _theta(w, "rope_theta", arch.rope_theta)
    _positive(w, "norm_eps", arch.norm_eps)
    if arch.norm_eps >= 1:
        raise CortiqError(f"{w}.norm_eps is {arch.norm_eps}, expected < 1")
    _positive(w, "attention_value_scale", arch.attention_value_scale)
    if arch.norm_style not in ("rms", "rms_one"):
        raise CortiqError(f"{w}.norm_style is {_show(arch.norm_style)}, expected 'rms' or 'rms_one'")
    if activations is not None and arch.hidden_act not in activations:
        raise CortiqError(f"{w}.hidden_act {arch.hidden_act!r} is not supported (supported: {', '.join(activations)})")
    if len(arch.layer_types) != arch.num_layers:
        raise CortiqError(f"{w}.layer_types has {len(arch.layer_types)} entries for {arch.num_layers} layers")
    bad = sorted({t for t in arch.layer_types if t not in _LAYER_KINDS})
    if bad:
        raise CortiqError(f"{w}.layer_types has unknown kinds {[_show(b) for b in bad]}")
    if LAYER_SLIDING in arch.layer_types and arch.sliding_window < 1 and arch.sliding is None:
        raise CortiqError(f"{w}: sliding layers with sliding_window={arch.sliding_window}")
    if LAYER_LINEAR in arch.layer_types and arch.linear_attn is None:
        raise CortiqError(f"{w}: linear-attention layers without a linear_attn section")
    _rope_scaling(w, arch.rope_scaling)
    if arch.moe is not None:
        _moe(f"{w}.moe", arch.moe, arch.num_layers)
    if arch.linear_attn is not None:
        la = arch.linear_attn
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            _int_range(f"{w}.linear_attn", name, getattr(la, name), 1, MAX_DIM)
        if la.num_value_heads % la.num_key_heads:
            raise CortiqError(
                f"{w}.linear_attn: num_key_heads={la.num_key_heads} does not divide num_value_heads={la.num_value_heads}"
            )
    if arch.sliding is not None:
        s, ws = arch.sliding, f"{w}.sliding"
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            _int_range(ws, name, getattr(s, name), 1, MAX_DIM)
        _int_range(ws, "window", s.window, 1, MAX_POSITIONS)
        _int_range(ws, "rotary_dim", s.rotary_dim, 0, MAX_DIM)
        _heads(ws, s.num_heads, s.num_kv_heads, s.head_dim, s.rotary_dim or s.head_dim)
        _theta(ws, "rope_theta", s.rope_theta)
    if arch.mtp is not None:
        _int_range(f"{w}.mtp", "num_layers", arch.mtp.num_layers, 0, 64)
        if not (
            0 < len(arch.mtp.style) <= 32 and arch.mtp.style.replace("_", "").isalnum() and arch.mtp.style.isascii()
        ):
            raise CortiqError(f"{w}.mtp.style is {_show(arch.mtp.style)}, expected a short identifier")
    for name in ("embedding_scale", "residual_scale", "logits_scaling"):
        _positive(w, name, getattr(arch, name))
    for name in (
        "attention_scale",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "rope_local_theta",
    ):
        v = getattr(arch, name)
        if not (math.isfinite(v) and v >= 0):
            raise CortiqError(f"{w}.{name} is {v}, expected a finite number >= 0")
    bad = [i for i in arch.no_rope_layers if not 0 <= i < arch.num_layers]
    if bad or len(set(arch.no_rope_layers)) != len(arch.no_rope_layers):
        raise CortiqError(
            f"{w}.no_rope_layers {_show(arch.no_rope_layers)} is not a set of layer indices 0..{arch.num_layers - 1}"
        )
    if arch.mla is not None:
        m, wm = arch.mla, f"{w}.mla"
        _int_range(wm, "q_lora_rank", m.q_lora_rank, 0, MAX_DIM)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _int_range(wm, name, getattr(m, name), 1, MAX_DIM)
        if m.qk_rope_head_dim % 2:
            raise CortiqError(f"{wm}.qk_rope_head_dim={m.qk_rope_head_dim} is odd (rotary pairs need an even count)")
    return arch


_ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "dynamic")
_ROPE_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)
_ROPE_NEEDS_ORIGINAL = ("yarn", "longrope")


def _rope_scaling(w: str, rs: dict[str, Any] | None) -> None:
    """Every rope_scaling field the rotary tables read: its type, a finite positive value,
    a bounded size (longrope's factor lists: one finite positive number per rotary pair)."""
    if rs is None:
        return
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in _ROPE_TYPES:
        raise CortiqError(f"{w}.rope_scaling type {_show(kind)} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    for key in _ROPE_NUMBERS:
        if key not in rs or rs[key] is None:
            continue
        v = rs[key]
        if not _type_ok(v, "float"):
            raise CortiqError(f"{w}.rope_scaling.{key} is {_show(v)}, expected a finite number")
        _positive(f"{w}.rope_scaling", key, float(v))
        if float(v) > 1e9:
            raise CortiqError(f"{w}.rope_scaling.{key} is {v}, expected at most 1e9")
    if kind in _ROPE_NEEDS_ORIGINAL and "original_max_position_embeddings" not in rs:
        raise CortiqError(f"{w}.rope_scaling ({kind}) has no original_max_position_embeddings")
    if kind in ("linear", "dynamic") and "factor" not in rs:
        raise CortiqError(f"{w}.rope_scaling ({kind}) has no factor")
    if kind == "llama3" and float(rs.get("high_freq_factor", 4.0)) == float(rs.get("low_freq_factor", 1.0)):
        raise CortiqError(f"{w}.rope_scaling: high_freq_factor equals low_freq_factor")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            v = rs.get(key)
            if not (isinstance(v, list) and 0 < len(v) <= MAX_DIM and all(_type_ok(x, "float") and x > 0 for x in v)):
                raise CortiqError(f"{w}.rope_scaling.{key} is {_show(v)}, expected a list of finite numbers > 0")
    if "truncate" in rs and not isinstance(rs["truncate"], bool):
        raise CortiqError(f"{w}.rope_scaling.truncate is {_show(rs['truncate'])}, expected true or false")


def _moe(w: str, m: MoeConfig, n_layers: int) -> None:
    _int_range(w, "num_experts", m.num_experts, 1, MAX_EXPERTS)
    _int_range(w, "top_k", m.top_k, 1, m.num_experts)
    _int_range(w, "expert_intermediate_size", m.expert_intermediate_size, 1, MAX_DIM)
    _int_range(w, "shared_expert_intermediate_size", m.shared_expert_intermediate_size, 0, MAX_DIM)
    _int_range(w, "n_group", m.n_group, 1, m.num_experts)
    _int_range(w, "topk_group", m.topk_group, 1, m.n_group)
    if m.num_experts % m.n_group:
        raise CortiqError(f"{w}: n_group={m.n_group} does not divide num_experts={m.num_experts}")
    _positive(w, "routed_scaling_factor", m.routed_scaling_factor)
    if m.scoring not in ("softmax", "sigmoid"):
        raise CortiqError(f"{w}.scoring is {_show(m.scoring)}, expected softmax or sigmoid")
    for name in ("swiglu_limit", "swiglu_alpha"):
        v = getattr(m, name)
        if not (math.isfinite(v) and 0 <= v <= 1e6):
            raise CortiqError(f"{w}.{name} is {v}, expected a finite number in [0, 1e6]")
    bad = [i for i in m.moe_layers if not 0 <= i < n_layers]
    if bad or len(set(m.moe_layers)) != len(m.moe_layers):
        raise CortiqError(f"{w}.moe_layers {_show(m.moe_layers)} is not a set of layer indices 0..{n_layers - 1}")


def arch_from_header(header: dict[str, Any], where: str) -> ArchConfig:
    """The validated ``ArchConfig`` of a CMF header (``where``: the file, for messages)."""
    d = header.get("arch")
    if not isinstance(d, dict):
        raise CortiqError(f"{where}: the header has no arch section")
    for key in ("moe", "linear_attn", "sliding", "mtp"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise CortiqError(f"{where}: arch.{key} is {_show(d[key])}, expected an object")
    n = d.get("num_layers")
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_LAYERS):
        raise CortiqError(f"{where}: arch.num_layers is {_show(n)}, expected 1..{MAX_LAYERS}")
    try:
        arch = ArchConfig.from_json(d)
    except CortiqError as e:
        raise CortiqError(f"{where}: bad arch header ({e})") from None
    except (TypeError, ValueError) as e:
        raise CortiqError(f"{where}: bad arch header ({str(e)[:200]})") from None
    try:
        return validate_arch(arch)
    except CortiqError as e:
        raise CortiqError(f"{where}: {e}") from None


def arch_from_config(families: Families, cfg: dict[str, Any]) -> tuple[ArchFamily, ArchConfig]:
    """The family of a config.json (by its ``model_type``) and the validated ``ArchConfig``
    it parses the config into."""
    mt = cfg.get("model_type")
    family = families.for_model_type(mt)
    try:
        arch = family.parse(cfg)
    except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as e:
        # config.json is untrusted: a wrong-typed or zero value is bad input, not a bug.
        raise CortiqError(f"config.json ({mt}): bad value ({type(e).__name__}: {str(e)[:160]})") from None
    if arch.hidden_act not in family.activations:
        raise CortiqError(
            f"activation {arch.hidden_act!r} is not supported (supported: {', '.join(family.activations)})"
        )
    return family, validate_arch(arch, "config.json", family.activations)


def model_arch(cmf: Any, families: Families, trunk: bool = True) -> ArchConfig:
    """The validated ``ArchConfig`` of an open CMF model file (or, ``trunk=False``, of an
    MTP sidecar), checked against its family's manifest of the tensors the file holds."""
    where = str(cmf.path)
    arch = arch_from_header(cmf.header, where)
    try:
        family = families.for_arch(arch.arch)
        validate_arch(arch, "arch", family.activations)
    except CortiqError as e:
        raise CortiqError(f"{where}: {e}") from None
    shapes = {name: info.shape for name, info in cmf.tensors.items()}
    mtp = mtp_layer_indices(shapes)
    if mtp != list(range(len(mtp))):
        raise CortiqError(f"{where}: MTP layers {mtp[:8]} are not numbered 0..{len(mtp) - 1}")
    check_manifest(family.manifest(arch, mtp), shapes, holder=where, implied_by="its arch header", trunk=trunk)
    return arch
