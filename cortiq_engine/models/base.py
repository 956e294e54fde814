"""What every family file builds on (the part of mlx_lm's ``models/base.py`` we share).

- ``Family``: a family file read as one record (``Family.of_module``: the module is the
  family, as in mlx_lm, and ``FAMILY_NAMES`` lists the names it may define). The registry
  (``cortiq_engine.models``) collects them; the converter and the loader ask it for
  the parser, the tensor manifest, the name rules, the trunk and the draft layers
  (by default the pre-norm ones of ``blocks``), and what a header may ask for.
- config.json helpers every parser uses (``req``, ``dense_common``, ``layer_kinds``,
  ``sliding_layers``); the GGUF metadata checks several families share (``gguf_heads``).
- ``SETTINGS`` and ``refuse_header``: what a CMF header (untrusted) may ask of a family,
  one table; each family names the settings it computes and the rest are refused.
- manifest pieces: the tensors of an attention, an MLP, an MoE FFN, the trunk's ends
  and a draft layer's ends, with their shapes.
- ``DraftLayer`` and ``wrap_draft``: an MTP layer is a family block between the shared
  draft ends (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``).
- ``gemma_gguf``: the GGUF record Gemma 2 and 3 share.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from formats.arch import ACTIVATIONS, LAYER_FULL, LAYER_LINEAR, LAYER_SLIDING, ArchConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import SANDWICH_BLOCK_NAMES, GgufContext, GgufSpec, SentencePieceStyle
from formats.manifest import Manifest
from formats.mtp_names import MTP_PREFIX, mtp_layer_count
from formats.sanitize import NO_RULES, SanitizeRules
from cortiq_engine.cache import KVCache
from cortiq_engine.layers import ROPE_TYPES, RMSNorm, Step
from cortiq_engine.weights import Weight, load_vector, load_weight

Parser = Callable[[dict[str, Any]], ArchConfig]


# ------------------------------------------------------------------ the family record
@dataclass(frozen=True, eq=False)
class Family:
    """One architecture family, end to end.

    ``parsers``: config.json ``model_type`` -> ``ArchConfig`` (each sets ``arch`` to one of
    ``archs``, the names CMF headers carry; default: the family's ``name``). ``manifest(arch, mtp_layers)``: every tensor
    the family reads, trunk and draft layers. ``build(cmf, arch, kernels)``: the trunk
    ``Model`` (``model`` refuses a header first). ``draft_layer(cmf, k, arch, kernels)``:
    MTP layer ``k``, the one draft loader that decoding, the probe and mtp-train all use.
    The three default to the pre-norm pieces of ``blocks`` (``dense_manifest``,
    ``prenorm_model``, ``dense_draft_layer``), so a family names only its own.
    ``kinds`` / ``computes``: the layer kinds and the ``SETTINGS`` a header may ask for
    (``refuse_header``). ``sanitize``: the family's checkpoint-name rules. ``mtp_style``:
    its drafts' style when the family fixes it (None: the checkpoint's naming scheme says).
    """

    name: str
    parsers: Mapping[str, Parser]
    # None: the pre-norm default, set by __post_init__.
    manifest: Callable[[ArchConfig, Sequence[int]], Manifest] | None = None
    build: Callable[[CmfFile, ArchConfig, Any], Any] | None = None
    draft_layer: Callable[[CmfFile, int, ArchConfig, Any], "DraftLayer"] | None = None
    kinds: tuple[str, ...] = (LAYER_FULL, LAYER_SLIDING)
    computes: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()
    sanitize: SanitizeRules = NO_RULES
    activations: tuple[str, ...] = ACTIVATIONS
    mtp_style: str | None = None
    # llama.cpp GGUF architectures this family imports (formats.gguf_spec.GgufSpec).
    gguf: tuple[GgufSpec, ...] = ()
    # Name rules that depend on config.json (sizes of fused tensors to split); None: ``sanitize``.
    sanitize_for: Callable[[Mapping[str, Any]], SanitizeRules] | None = None

    def __post_init__(self) -> None:
        # Imported here: blocks builds on this module.
        from cortiq_engine.models import blocks

        defaults = {
            "archs": (self.name,),
            "manifest": blocks.dense_manifest,
            "build": blocks.prenorm_model,
            "draft_layer": blocks.dense_draft_layer,
        }
        for key, value in defaults.items():
            if not getattr(self, key):
                object.__setattr__(self, key, value)
        if unknown := set(self.computes) - SETTINGS.keys():
            raise ValueError(f"family {self.name} computes unknown settings {sorted(unknown)}")

    @classmethod
    def of_module(cls, module: ModuleType) -> "Family":
        """The family a module declares by the names of ``FAMILY_NAMES`` (its ``PARSERS``
        makes it one); the family's name is the module's."""
        values = {key: getattr(module, attr) for key, attr in FAMILY_NAMES.items() if hasattr(module, attr)}
        if isinstance(values.get("gguf"), GgufSpec):
            values["gguf"] = (values["gguf"],)
        return cls(name=module.__name__.rpartition(".")[2], **values)

    def model(self, cmf: CmfFile, arch: ArchConfig, kernels) -> Any:
        """The trunk ``Model`` of ``cmf``, once its header (untrusted) asks only for the
        layer kinds and settings the family computes."""
        refuse_header(cmf, arch, self.kinds, self.computes)
        return self.build(cmf, arch, kernels)

    def mtp_name(self, name: str, config: Mapping[str, Any]) -> tuple[str | None, bool]:
        """(the CMF name of checkpoint tensor ``name`` or None to drop it, is an MTP tensor)."""
        return mtp_normalize(name, config)

    def draft_style(self, sources: Iterable[str]) -> str:
        """The style recorded for draft layers whose checkpoint names are ``sources``."""
        return self.mtp_style or mtp_naming_scheme(sources)

    def rules_for(self, config: Mapping[str, Any]) -> SanitizeRules:
        """The checkpoint-name rules for a checkpoint with this config.json."""
        return self.sanitize_for(config) if self.sanitize_for is not None else self.sanitize

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.parsers)

    def parse(self, config: Mapping[str, Any]) -> ArchConfig:
        mt = config.get("model_type")
        if mt not in self.parsers:
            raise CortiqError(
                f"family {self.name} does not parse model_type {mt!r} (it parses {', '.join(self.parsers)})"
            )
        return self.parsers[mt](dict(config))


# A family file's names -> the ``Family`` fields they fill (lower case: functions).
FAMILY_NAMES = {
    "parsers": "PARSERS",
    "archs": "ARCHS",
    "manifest": "manifest",
    "build": "build",
    "draft_layer": "draft_layer",
    "kinds": "KINDS",
    "computes": "COMPUTES",
    "sanitize": "SANITIZE",
    "sanitize_for": "sanitize_for",
    "activations": "ACTIVATIONS",
    "mtp_style": "MTP_STYLE",
    "gguf": "GGUF",
}


# ------------------------------------------------------------------ checkpoint names
# DeepSeek-V3 and GLM-4.5 name their always-on experts ``mlp.shared_experts.*`` (one
# SwiGLU, the engine's ``mlp.shared_expert.*``); transformers fuses the routed ones.
SHARED_EXPERTS_RULES = SanitizeRules(
    renames=((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),),
    split_fused_experts=True,
)


# ------------------------------------------------------------------ MTP naming
# The releases' MTP naming schemes, each normalized to ``model.mtp.layers.{k}.*``:
# - trailing layers: ``model.layers.{num_hidden_layers + k}.*`` with ``num_nextn_predict_layers``
#   (DeepSeek-V3, GLM-4.5); the per-layer ``embed_tokens`` / ``shared_head.head`` copies
#   duplicate the trunk's and are dropped, ``shared_head.norm`` becomes ``final_layernorm``;
# - ``model.mtp.layers.{k}.*`` (MiMo-V2: its ``pre_mlp_layernorm`` and
#   ``self_attn.attention_sink_bias`` become ``post_attention_layernorm`` and ``self_attn.sinks``);
# - ``mtp.layers.{k}.*`` with ``mtp.fc`` (eh_proj), ``mtp.pre_fc_norm_embedding`` (enorm),
#   ``mtp.pre_fc_norm_hidden`` (hnorm), ``mtp.norm`` (final_layernorm) (Qwen3-Next / Qwen3.5).
# MiMo-V2 release names inside its MTP layers -> the names every other family uses.
_MIMO_ALIASES = {
    ".pre_mlp_layernorm.": ".post_attention_layernorm.",
    ".self_attn.attention_sink_bias": ".self_attn.sinks",
}


def _mimo_alias(name: str) -> str:
    for old, new in _MIMO_ALIASES.items():
        name = name.replace(old, new)
    return name


def mtp_normalize(name: str, config: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(CMF name or None to drop, is an MTP tensor)."""
    n_main = int(config.get("num_hidden_layers", 0))
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m and int(m.group(1)) >= n_main and mtp_layer_count(config):
        k = int(m.group(1)) - n_main
        rest = m.group(2)
        if rest.startswith("embed_tokens.") or rest.startswith("shared_head.head."):
            return None, True
        if rest.startswith("shared_head.norm."):
            rest = "final_layernorm." + rest[len("shared_head.norm.") :]
        return f"{MTP_PREFIX}{k}.{rest}", True
    if name.startswith(MTP_PREFIX):
        return _mimo_alias(name), True
    if name.startswith("mtp."):
        rest = name[len("mtp.") :]
        m = re.match(r"layers\.(\d+)\.(.*)", rest)
        if m:
            return f"{MTP_PREFIX}{m.group(1)}.{m.group(2)}", True
        # Qwen3-Next keeps one set of shared pieces around its single layer.
        renames = {
            "fc.": "eh_proj.",
            "pre_fc_norm_embedding.": "enorm.",
            "pre_fc_norm_hidden.": "hnorm.",
            "norm.": "final_layernorm.",
        }
        for old, new in renames.items():
            if rest.startswith(old):
                return f"{MTP_PREFIX}0.{new}{rest[len(old) :]}", True
        return f"{MTP_PREFIX}0.{rest}", True
    return name, False


def mtp_naming_scheme(sources: Iterable[str]) -> str:
    """Which release scheme names the MTP tensors ``sources`` (checkpoint names): "mimo"
    (``model.mtp.layers.*``), "qwen3_next" (``mtp.*``) or "deepseek" (``model.layers.{N+k}``).
    The style recorded for a family whose ``Family.mtp_style`` does not fix it."""
    sources = list(sources)
    if any(s.startswith(MTP_PREFIX) for s in sources):
        return "mimo"
    if any(s.startswith("mtp.") for s in sources):
        return "qwen3_next"
    return "deepseek"


# ------------------------------------------------------------------ config.json
def req(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CortiqError(f"config.json has no {key!r} (model_type {cfg.get('model_type')!r})")
    return cfg[key]


def dense_common(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ``ArchConfig`` fields every transformer config spells the same way."""
    hidden = int(req(cfg, "hidden_size"))
    heads = int(req(cfg, "num_attention_heads"))
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
        elif rtype not in ROPE_TYPES:
            raise CortiqError(
                f"config.json rope scaling type {rtype!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
    prf = cfg.get("partial_rotary_factor") or (rp.get("partial_rotary_factor") if isinstance(rp, dict) else None)
    return dict(
        arch=arch,
        hidden_size=hidden,
        num_layers=int(req(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(req(cfg, "intermediate_size")),
        vocab_size=int(req(cfg, "vocab_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        rotary_dim=int(int(head_dim) * float(prf)) if prf else 0,
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        hidden_act=str(cfg.get("hidden_act") or "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


# config.json's layer type names, as the engine's layer kinds.
LAYER_TYPES = {"full_attention": LAYER_FULL, "sliding_attention": LAYER_SLIDING, "linear_attention": LAYER_LINEAR}


def layer_kinds(lt: Any, n: int, supported: Sequence[str] = ("sliding_attention", "full_attention")) -> list[str]:
    """config.json's ``layer_types`` ``lt`` as layer kinds; refused unless it names one of
    ``supported`` for each of the ``n`` layers."""
    if not isinstance(lt, list) or len(lt) != n or any(t not in supported for t in lt):
        raise CortiqError(
            f"config.json layer_types is {str(lt)[:60]}, expected one of {', '.join(supported)} for each of {n} layers"
        )
    return [LAYER_TYPES[t] for t in lt]


def every_nth_full(n: int, every: int, other: str = "sliding_attention") -> list[str]:
    """``layer_types`` with every ``every``-th layer full attention and the rest ``other``
    (the interleaving rule of Gemma, GPT-OSS and the Qwen3-Next hybrids)."""
    return ["full_attention" if (i + 1) % every == 0 else other for i in range(n)]


def sliding_layers(cfg: dict[str, Any], n: int) -> tuple[list[str], int]:
    """Mistral/Qwen2-style sliding windows: every layer, or layers >= max_window_layers."""
    window = cfg.get("sliding_window") or 0
    use = cfg.get("use_sliding_window", True)
    if not window or not use:
        return [LAYER_FULL] * n, 0
    lt = cfg.get("layer_types")
    if lt:
        return layer_kinds(lt, n), int(window)
    start = cfg.get("max_window_layers")
    if start is None:
        return [LAYER_SLIDING] * n, int(window)
    return [LAYER_SLIDING if i >= start else LAYER_FULL for i in range(n)], int(window)


def sparse_layers(cfg: dict[str, Any], n: int) -> list[int]:
    """Qwen-MoE rule: layer i is sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def qwen_moe(cfg: dict[str, Any], n: int, shared: bool) -> MoeConfig | None:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0
    return MoeConfig(
        num_experts=experts,
        top_k=int(req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(req(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=shared_size > 0,
        moe_layers=sparse_layers(cfg, n),
    )


# ------------------------------------------------------------------ what a header asks for
# The settings of an ``ArchConfig`` beyond a pre-norm block of full or sliding attention
# with plain (w) RMS norms, each with the test of whether a header asks for it.
SETTINGS: dict[str, Callable[[ArchConfig], bool]] = {
    "routed experts": lambda a: a.moe is not None,
    "linear attention": lambda a: a.linear_attn is not None,
    "split-geometry sliding layers": lambda a: a.sliding is not None,
    "latent attention": lambda a: a.mla is not None,
    "q/k norms": lambda a: a.qk_norm,
    "an attention output gate": lambda a: a.attn_output_gate,
    "attention sinks": lambda a: a.attention_sinks,
    "(1 + w) norms": lambda a: a.norm_style != "rms",
    "NoPE layers": lambda a: bool(a.no_rope_layers),
    "Granite's multipliers": lambda a: (
        bool(a.attention_scale) or (a.embedding_scale, a.residual_scale, a.logits_scaling) != (1.0, 1.0, 1.0)
    ),
    "query_pre_attn_scalar": lambda a: bool(a.query_pre_attn_scalar),
    "an attention soft-cap": lambda a: bool(a.attn_logit_softcapping),
    "a final soft-cap": lambda a: bool(a.final_logit_softcapping),
    "a local RoPE base": lambda a: bool(a.rope_local_theta),
}


def refuse_header(cmf: CmfFile, arch: ArchConfig, kinds: Iterable[str], computes: Iterable[str] = ()) -> None:
    """Refuse a header (it is untrusted) with layer types other than ``kinds`` or asking
    for a setting of ``SETTINGS`` the family does not compute (``computes``): such a
    file would otherwise run as a silently different model."""
    kinds, computes = tuple(kinds), frozenset(computes)
    if unknown := computes - SETTINGS.keys():
        raise ValueError(f"unknown settings {sorted(unknown)}")
    bad = sorted({t for t in arch.layer_types if t not in kinds})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported for {arch.arch}")
    asked = [name for name, is_set in SETTINGS.items() if name not in computes and is_set(arch)]
    if asked:
        raise CortiqError(f"{cmf.path}: the header asks for {', '.join(asked)}, which {arch.arch} does not compute")


# ------------------------------------------------------------------ GGUF checks
def gguf_heads(ctx: GgufContext, config: dict[str, Any], rotary: bool = True) -> None:
    """Refuse a GGUF whose value heads differ in size from its key heads (``head_dim``)
    and, with ``rotary``, one whose rotary width falls short of the head (families with
    partial rotary read ``rope.dimension_count`` themselves)."""
    hd = config["head_dim"]
    if gguf_size(ctx, "attention.value_length", hd) != hd:
        raise CortiqError("GGUFs with different key and value head sizes are not supported")
    if rotary and gguf_size(ctx, "rope.dimension_count", hd) != hd:
        raise CortiqError("partial rotary embeddings (rope.dimension_count < head size) are not supported")


def gguf_size(ctx: GgufContext, key: str, default: Any = None, required: bool = False) -> int:
    """``{arch}.{key}`` as a non-negative integer (``default`` when absent and not ``required``)."""
    v = ctx.key(key, default, required)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 0:
        raise CortiqError(f"GGUF metadata {ctx.arch}.{key} is {str(v)[:40]!r}, expected a non-negative integer")
    return int(v)


def gguf_attention_bias(ctx: GgufContext, parts: Sequence[str] = ("q", "k", "v", "output")) -> bool:
    """Whether the GGUF's attention projections ``parts`` have biases; refuses biases on
    only some of them."""
    bias = [f"blk.0.attn_{p}.bias" in ctx.tensors for p in parts]
    if any(bias) and not all(bias):
        raise CortiqError(
            f"GGUFs with biases on only some of the attention projections {'/'.join(parts)} are not supported"
        )
    return all(bias)


def gguf_refuse_mlp_bias(ctx: GgufContext) -> None:
    """The engine's dense gated MLP has no biases."""
    if any(f"blk.0.ffn_{p}.bias" in ctx.tensors for p in ("gate", "up", "down")):
        raise CortiqError(f"{ctx.arch} GGUFs with MLP biases are not supported (the engine's gated MLP has no biases)")


def gemma_gguf(
    arch: str,
    model_type: str,
    hf_class: str,
    config: Callable[[GgufContext, dict[str, Any]], None],
    chat_template: str | None = None,
) -> GgufSpec:
    """A Gemma GGUF (Gemma 2 and 3): four norms per block, which llama.cpp stores (with any
    q/k norms) as 1 + w; Gemma's SentencePiece vocabulary, whose turns end at <end_of_turn>."""
    return GgufSpec(
        arch,
        model_type,
        hf_class,
        block_names=SANDWICH_BLOCK_NAMES,
        norm_offset=-1.0,
        config=config,
        sentencepiece=SentencePieceStyle("GemmaTokenizer", chat_template, eog_texts=("<end_of_turn>",)),
    )


# ------------------------------------------------------------------ manifest pieces
@dataclass(frozen=True)
class Geometry:
    """One attention's head layout (the full layers', or MiMo's sliding layers'), its
    window (0: none) and whether it has a learned sink logit per head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int = 0
    sinks: bool = False

    def heads(self) -> dict[str, int]:
        """The head layout, as ``layers.Attention`` takes it (keyword arguments)."""
        return {k: getattr(self, k) for k in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim")}

    @classmethod
    def full(cls, arch: ArchConfig) -> "Geometry":
        """The full layers' heads (no window, no sinks)."""
        return cls(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.v_head_dim)

    @classmethod
    def of(cls, arch: ArchConfig, kind: str) -> "Geometry":
        """A ``kind`` layer's: sliding layers have their own heads, widths, window and
        sinks when ``arch.sliding`` gives them (MiMo-V2), else the full layers' heads."""
        s = arch.sliding if kind == LAYER_SLIDING else None
        if s is not None:
            return cls(s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim, s.window, s.sinks)
        window = arch.sliding_window if kind == LAYER_SLIDING else 0
        return cls(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.v_head_dim, window, arch.attention_sinks)


def trunk_ends(arch: ArchConfig) -> Manifest:
    """The embedding, the final norm and (untied) the lm_head."""
    h = arch.hidden_size
    m = Manifest({"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)})
    if not arch.tie_word_embeddings:
        m.required["lm_head.weight"] = (arch.vocab_size, h)
    return m


def norms(p: str, h: int, *names: str) -> Manifest:
    return Manifest({f"{p}{n}.weight": (h,) for n in names})


def attention(
    p: str,
    h: int,
    g: Geometry,
    *,
    gate: bool = False,
    sinks: bool | None = False,
    qk_norm: bool | None = False,
) -> Manifest:
    """q/k/v/o (q_proj doubled when it also emits an output gate), their optional biases;
    ``sinks`` / ``qk_norm``: True required, None read when present, False not read."""
    nh, nkv, d, v = g.num_heads, g.num_kv_heads, g.head_dim, g.v_head_dim
    q = p + "self_attn."
    qrows = nh * d * (2 if gate else 1)
    m = Manifest(
        {
            q + "q_proj.weight": (qrows, h),
            q + "k_proj.weight": (nkv * d, h),
            q + "v_proj.weight": (nkv * v, h),
            q + "o_proj.weight": (h, nh * v),
        },
        {
            q + "q_proj.bias": (qrows,),
            q + "k_proj.bias": (nkv * d,),
            q + "v_proj.bias": (nkv * v,),
            q + "o_proj.bias": (h,),
        },
    )
    for on, entries in (
        (sinks, {q + "sinks": (nh,)}),
        (qk_norm, {q + "q_norm.weight": (d,), q + "k_norm.weight": (d,)}),
    ):
        if on is None:
            m.optional.update(entries)
        elif on:
            m.required.update(entries)
    return m


def gated_mlp(p: str, h: int, inter: int | None) -> Manifest:
    """``{p}{gate,up,down}_proj.weight``; ``inter`` None: the width is the tensors' own."""
    return Manifest(
        {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h), p + "down_proj.weight": (h, inter)}
    )


def moe(arch: ArchConfig, p: str) -> Manifest:
    """A routed-experts FFN: router, per-expert gated MLPs, optional shared expert and bias."""
    mc, h = arch.moe, arch.hidden_size
    m = Manifest({p + "mlp.gate.weight": (mc.num_experts, h)})
    for e in range(mc.num_experts):
        m.update(gated_mlp(f"{p}mlp.experts.{e}.", h, mc.expert_intermediate_size))
    if mc.shared_expert_intermediate_size:
        m.update(gated_mlp(p + "mlp.shared_expert.", h, mc.shared_expert_intermediate_size))
    if mc.shared_expert_gate:
        m.required[p + "mlp.shared_expert_gate.weight"] = (1, h)
    if mc.score_bias:
        m.required[p + "mlp.gate.e_score_correction_bias"] = (mc.num_experts,)
    if mc.router_bias:
        m.required[p + "mlp.gate.bias"] = (mc.num_experts,)
    if mc.expert_bias:
        inter = mc.expert_intermediate_size
        for e in range(mc.num_experts):
            q = f"{p}mlp.experts.{e}."
            m.required.update(
                {q + "gate_proj.bias": (inter,), q + "up_proj.bias": (inter,), q + "down_proj.bias": (h,)}
            )
    return m


def ffn(arch: ArchConfig, p: str, layer: int) -> Manifest:
    """Layer ``layer``'s FFN: routed experts on ``arch.moe.moe_layers``, else the dense MLP."""
    if arch.moe is not None and layer in arch.moe.moe_layers:
        return moe(arch, p)
    return gated_mlp(p + "mlp.", arch.hidden_size, arch.intermediate_size)


def draft_ends(arch: ArchConfig, p: str) -> Manifest:
    """What every MTP layer has around its block."""
    h = arch.hidden_size
    m = norms(p, h, "enorm", "hnorm", "final_layernorm")
    m.required[p + "eh_proj.weight"] = (h, 2 * h)
    return m


# ------------------------------------------------------------------ draft layers
@dataclass(frozen=True, eq=False)
class DraftLayer:
    """One MTP layer: ``u = block(eh_proj · [enorm(embed(token)) ; hnorm(hidden)])``;
    the drafts are ``lm_head(final_norm(u))`` with the backbone's lm_head."""

    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Weight
    block: Any
    final_norm: RMSNorm

    def make_cache(self, capacity: int) -> KVCache:
        return self.block.make_cache(capacity)

    def __call__(self, kernels, emb: np.ndarray, hidden: np.ndarray, cache: KVCache, step: Step) -> np.ndarray:
        """(embedding rows, backbone hidden rows) -> the block's output rows (before final_layernorm)."""
        cat = np.concatenate([self.enorm(emb), self.hnorm(np.ascontiguousarray(hidden, dtype=np.float32))], axis=1)
        x = kernels.matmul((self.eh_proj,), cat)
        self.block(x, cache, step)
        return x

    def weights(self) -> list[Weight]:
        return [self.eh_proj, *self.block.weights()]


def draft_prefix(k: int) -> str:
    return f"{MTP_PREFIX}{k}."


def wrap_draft(cmf: CmfFile, k: int, arch: ArchConfig, kernels, block) -> DraftLayer:
    """MTP layer ``k``: the family's ``block`` between the shared draft ends."""
    p, h = draft_prefix(k), arch.hidden_size

    def norm(name: str) -> RMSNorm:
        return RMSNorm(kernels, load_vector(cmf, f"{p}{name}.weight", h), arch.norm_eps, arch.norm_style)

    eh = load_weight(cmf, p + "eh_proj.weight")
    if eh.shape != (h, 2 * h):
        raise CortiqError(f"{cmf.path}: tensor {eh.name} is {list(eh.shape)}, the backbone implies {[h, 2 * h]}")
    return DraftLayer(
        enorm=norm("enorm"), hnorm=norm("hnorm"), eh_proj=eh, block=block, final_norm=norm("final_layernorm")
    )


def load_sinks(cmf: CmfFile, name: str, heads: int) -> np.ndarray:
    """A draft layer's learned sink logits, refused when not finite."""
    sinks = load_vector(cmf, name, heads)
    if not np.isfinite(sinks).all():
        raise CortiqError(f"{cmf.path}: tensor {name} has non-finite values")
    return sinks
