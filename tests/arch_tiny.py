"""Tiny random checkpoints of the MoE / hybrid families, and the oracle checks they share.

Each family's config overrides (``CONFIGS``) keep the models a few hundred KB while
exercising what differs: dense and MoE layers side by side, shared experts,
linear and full layers, sliding layers with sinks. ``build`` returns the
transformers model (the oracle), ``save`` writes it as an HF folder with the
byte-level tokenizer of ``tests.tiny``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny import build_tiny, write_byte_tokenizer

_LINEAR = dict(
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

CONFIGS: dict[str, dict[str, Any]] = {
    # Layer 1 stays dense (mlp_only_layers) to check the per-layer FFN choice.
    "qwen2_moe": dict(
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_next": dict(
        **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": dict(
        **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    "mimo_v2_flash": dict(
        num_hidden_layers=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        head_dim=24,
        v_head_dim=16,
        sliding_window=5,
    ),
    # Layers alternate sliding (window 6) and full; 2 * intermediate != hidden, both multiples
    # of 32 (MXFP4 blocks); a low swiglu_limit so the clamp bites.
    "gpt_oss": dict(
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        swiglu_limit=1.0,
    ),
}


def build(model_type: str, seed: int = 0, **extra: Any):
    """The transformers model of ``CONFIGS[model_type]``; MiMo's routing bias and sinks
    are randomized (the init leaves them near zero, where a test could not see them)."""
    import torch

    model = build_tiny(model_type, seed=seed, **{**CONFIGS[model_type], **extra})
    if model_type == "mimo_v2_flash":
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)
            for name, p in model.named_parameters():
                if name.endswith("self_attn.sinks"):
                    p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    return model


def save(model, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


def torch_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (the project's logit tolerance measure)."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def sample_ids(n: int = 40, seed: int = 0, vocab: int = 256) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, vocab, n)]


# GLM-4.5: a dense first layer, sigmoid routing over 2 groups, a shared expert, q/k norm,
# q/k/v biases, half of each head rotated.
CONFIGS["glm4_moe"] = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    attention_bias=True,
    use_qk_norm=True,
)


def add_deepseek_mtp_layer(src: str | Path, folder: str | Path, seed: int = 5) -> Path:
    """A copy of the HF folder ``src`` with one MTP layer named as DeepSeek-V3 and GLM-4.5
    ship it: ``model.layers.{N}.*`` holding the last trunk layer's tensors perturbed (its
    names as saved, so an MoE layer keeps its per-expert and shared-expert names), the
    draft ends ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and the per-layer
    ``embed_tokens`` / ``shared_head.head`` copies the converter drops."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    src, folder = Path(src), Path(folder)
    shutil.copytree(src, folder)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    trunk = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    last, p = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = {}
    for name, t in trunk.items():
        if name.startswith(last):
            noise = 0.3 * float(np.std(t)) if t.ndim > 1 else 0.1
            out[p + name[len(last) :]] = (t + noise * rng.standard_normal(t.shape)).astype(np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{p}{name}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    out[p + "eh_proj.weight"] = (rng.standard_normal((h, 2 * h)) * 0.1).astype(np.float32)
    out[p + "embed_tokens.weight"] = trunk["model.embed_tokens.weight"].copy()
    out[p + "shared_head.head.weight"] = trunk.get("lm_head.weight", trunk["model.embed_tokens.weight"]).copy()
    save_file(out, str(folder / "mtp.safetensors"))
    return folder


# Granite: every multiplier far from 1 (the score scale 30 against head_dim**-0.5 = 0.25),
# attention biases. SmolLM3: every second layer NoPE and sliding over 5 keys (its default
# pad id lies past the tiny vocabulary).
CONFIGS["granite"] = dict(
    num_hidden_layers=3,
    attention_bias=True,
    embedding_multiplier=6.0,
    residual_multiplier=0.3,
    attention_multiplier=30.0,
    logits_scaling=0.25,
    tie_word_embeddings=True,
)
CONFIGS["smollm3"] = dict(
    num_hidden_layers=4,
    no_rope_layer_interval=2,
    use_sliding_window=True,
    sliding_window=5,
    attention_bias=True,
    tie_word_embeddings=True,
    pad_token_id=None,
)


# llama.cpp's block part names for the HF modules of a Llama-shaped layer.
_LLAMA_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotary halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_style_gguf(
    model, path: str | Path, arch: str, floats: dict[str, float] | None = None, weight_type: str = "F32"
) -> Path:
    """The GGUF llama.cpp's converter writes for a Llama-lineage model (``LlamaModel``
    and its subclasses: q/k rows permuted, no output.weight when tied) of ``arch``, with
    the byte-level vocabulary of ``tests.tiny``; ``floats``: extra ``{arch}.*`` keys;
    ``weight_type``: the GGML type of the 2-D tensors (gguf-py quantizes)."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key, value in (floats or {}).items():
        w.add_float32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_LLAMA_GGUF_PARTS[module]}.{kind}"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
                x = llama_cpp_permute(x, heads)
        if weight_type != "F32" and x.ndim == 2:
            qt = gguf.GGMLQuantizationType[weight_type]
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# Phi-3: its fused qkv_proj / gate_up_proj, a sliding window of 5 (its default pad id lies
# past the tiny vocabulary).
CONFIGS["phi3"] = dict(pad_token_id=None, sliding_window=5)
