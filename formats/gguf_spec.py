"""How a family's llama.cpp GGUF file maps onto its HF checkpoint: the record a family
file declares (``Family.gguf``) and ``formats.gguf_import`` follows.

The GGUF side is llama.cpp's: ``general.architecture``, ``{arch}.*`` metadata keys and
``blk.N.<part>.{weight,bias}`` tensor names (gguf-py's ``constants.TENSOR_NAMES``). The
importer reads what every architecture writes the same way (sizes, heads, RoPE base,
norm epsilon, the tokenizer) and asks the spec for the rest: which HF name each block
part has, whether llama.cpp permuted the q/k rows for its RoPE, whether it stored the
norms as 1 + w, which config.json fields the family adds (``config``), and how its
SentencePiece vocabulary is rebuilt. Nothing here names an architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# llama.cpp's block parts as most families store them -> the HF module under model.layers.N.
BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's parts of a block with four norms (before and after attention and the FFN),
# where its ffn_norm is the norm before the FFN, not after attention.
SANDWICH_BLOCK_NAMES: Mapping[str, str] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's routed-expert parts: the router, the stacked experts (``{e}``: one planned
# tensor per expert) and the shared experts (HF's plural name, which families rename).
MOE_BLOCK_NAMES: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# The sigmoid router's correction bias (a whole HF name: see ``GgufSpec.full_names``).
ROUTING_BIAS: Mapping[str, str] = {"exp_probs_b": "mlp.gate.e_score_correction_bias"}
# llama.cpp's nextn (MTP) layer parts -> the release names of a trailing MTP layer.
NEXTN_BLOCK_NAMES: Mapping[str, str] = {
    "nextn.eh_proj": "eh_proj",
    "nextn.enorm": "enorm",
    "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm",
    "nextn.shared_head_head": "shared_head.head",
    "nextn.embed_tokens": "embed_tokens",
}
# The tensors outside the blocks.
GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GgufContext:
    """What a family's ``config`` hook reads: ``key(name, default, required)`` gives the
    ``{arch}.name`` metadata value (a per-layer array only when every layer agrees),
    ``meta`` all metadata, ``tensors`` every tensor name of the file, ``array(name)`` a
    per-layer metadata array as a list, ``values(name)`` a (small) tensor's values as f32
    (RoPE factor tables that become config.json fields)."""

    arch: str
    meta: Mapping[str, Any]
    tensors: frozenset[str]
    key: Callable[..., Any]
    array: Callable[[str], list[Any] | None]
    values: Callable[[str], Any] = lambda name: None


@dataclass(frozen=True)
class SentencePieceStyle:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model == "llama"``) rebuilt with
    byte fallback; the tokenizer class, the chat template used when the file has none,
    and the tokens (by text) that end a turn besides EOS."""

    tokenizer_class: str
    chat_template: str | None = None
    eog_texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class GgufSpec:
    """One GGUF architecture of a family (see the module doc)."""

    arch: str  # general.architecture
    model_type: str  # the config.json model_type it becomes
    hf_class: str  # config.json architectures[0]
    block_names: Mapping[str, str] = field(default_factory=dict)  # added to / overriding BLOCK_NAMES
    # Block parts whose HF tensor name is not ``<module>.weight`` / ``.bias``: part -> the whole
    # name under model.layers.N (llama.cpp's exp_probs_b.bias is e_score_correction_bias).
    full_names: Mapping[str, str] = field(default_factory=dict)
    permute_qk: bool = False  # llama.cpp interleaved each head's rotary halves in q/k rows
    norm_offset: float = 0.0  # added to every *norm.weight (-1: the file stores 1 + w)
    # (ctx, config) -> None: the family's config.json fields, set in place after the common ones.
    config: Callable[[GgufContext, dict[str, Any]], None] | None = None
    sentencepiece: SentencePieceStyle | None = None  # None: byte-level BPE vocabularies only
    skip: tuple[str, ...] = ("rope_freqs.weight",)  # tensors folded into config.json, not weights

    def names(self) -> dict[str, str]:
        return {**BLOCK_NAMES, **self.block_names}
