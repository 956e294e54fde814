"""GGUF file -> HF checkpoint folder (config.json, model.safetensors, tokenizer files),
or -> ``GgufCheckpoint``: the same checkpoint read straight from the GGUF's map, which
``cortiq convert FILE.gguf`` streams into a CMF without writing the folder.

``read_gguf`` parses and validates everything first (architecture, shapes, tensor
types, tokenizer) without writing; ``import_gguf`` then dequantizes one tensor at a
time into a streamed safetensors file inside a temporary folder beside OUT_DIR and
renames it into place, so a failure leaves nothing behind.

llama.cpp's converter interleaves the two rotary halves of every head in llama's
q_proj/k_proj rows (its RoPE rotates adjacent pairs, HF rotates halves); the import
puts those rows back in HF order. It stores Gemma's (1 + w) norm weights with the 1
added; the import subtracts it again (as transformers' GGUF loader does).

Tensors may be of any type gguf-py dequantizes (F32/F16/BF16, Q4_0..Q8_0, the K-quants
Q2_K..Q6_K, the IQ types it implements); any other is a one-line error naming the
tensor and its type.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from formats.errors import CortiqError
from formats.staging import hold, remove_stale
from formats.gguf_tokenizer import TokenizerFiles, build_tokenizer
from formats.safetensors_writer import SafetensorsStream

# Bump when the files written change, so caches keyed on it rebuild.
IMPORTER_VERSION = "3"
OUT_DTYPES = {"f32": ("F32", 4), "f16": ("F16", 2), "bf16": ("BF16", 2)}
ProgressFn = Callable[[str, int, int], None]  # (tensor name, params done, params total)

# GGUF architecture -> (HF model_type, HF class, llama.cpp permuted q/k rows for RoPE?)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
}
# Block tensor names that differ per architecture (Gemma's four norms per block).
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Architectures whose GGUF norm weights are stored as 1 + w (llama.cpp adds the 1).
_NORM_PLUS_ONE = ("gemma3",)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama-3.1 style scaling, folded back into rope_scaling


@dataclass(frozen=True)
class PlannedTensor:
    index: int  # position in reader.tensors
    source: str  # GGUF name
    name: str  # HF name
    shape: tuple[int, ...]  # HF (numpy) shape
    ggml_type: str
    unpermute_heads: int | None = None  # llama q/k: heads whose rotary rows to de-interleave
    offset: float = 0.0  # added after dequantizing (-1 for Gemma's stored 1 + w norms)


@dataclass
class GgufModel:
    """A parsed, validated GGUF: everything the writer needs, nothing written yet."""

    path: Path
    reader: Any  # formats.gguf_reader.GgufFile (gguf-py's GGUFReader interface)
    architecture: str
    name: str | None
    config: dict[str, Any]
    generation_config: dict[str, Any]
    tokenizer: TokenizerFiles
    tensors: list[PlannedTensor]
    warnings: list[str] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)


@dataclass
class ImportReport:
    output: Path
    source: Path
    architecture: str
    model_type: str
    name: str | None
    tensors: int
    params: int
    gguf_types: dict[str, int]
    dtype: str
    tied_embeddings: bool
    vocab_size: int
    merges: int
    special_tokens: int
    pre_tokenizer: str
    chat_template: bool
    source_bytes: int
    output_bytes: int
    seconds: float
    warnings: list[str]

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["output"], d["source"] = str(self.output), str(self.source)
        return d


# ------------------------------------------------------------------ reading

def _open_reader(path: Path):
    from formats.gguf_reader import GgufFile

    if not path.exists():
        raise CortiqError(f"{path}: no such file")
    if not path.is_file():
        raise CortiqError(f"{path}: not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CortiqError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return GgufFile(path)
    except CortiqError as e:
        raise CortiqError(f"{path}: {e}") from None
    except Exception as e:  # a parser boundary: any failure here means a malformed file
        detail = (str(e).strip().splitlines() or [""])[0]
        raise CortiqError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {detail})") from None


def _metadata(reader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except UnicodeDecodeError:
            raise CortiqError(f"GGUF metadata {key!r} is not valid UTF-8") from None
    return meta


def _scalar(meta: dict[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    v = meta.get(key, default)
    if v is None and required:
        raise CortiqError(f"GGUF metadata has no {key!r}")
    if isinstance(v, list):  # per-layer arrays: fine while every layer agrees
        if len(set(v)) != 1:
            raise CortiqError(f"GGUF {key} varies per layer ({sorted(set(v))}); not supported")
        v = v[0]
    return v


def _f32(v: Any) -> float:
    """A GGUF float32 as the decimal its author wrote (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(v)))


def read_gguf(path: str | os.PathLike) -> GgufModel:
    """Open and validate ``path``; raises ``CortiqError`` on anything it cannot import."""
    path = Path(path)
    reader = _open_reader(path)
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CortiqError(f"{path}: truncated GGUF (tensor {t.name} runs past the end of the file)")
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CortiqError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise CortiqError(f"{path}: GGUF has no token_embd.weight")
    vocab, width = (int(d) for d in reversed(by_name["token_embd.weight"].shape.tolist()))
    try:
        tok = build_tokenizer(meta, vocab, arch)
        config = _hf_config(meta, arch, by_name, tok, vocab, width)
        plan = _plan_tensors(reader, arch, config)
        _check_shapes(plan, config)
        _check_types(reader, plan)
    except CortiqError as e:
        raise CortiqError(f"{path}: {e}") from None
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": config["eos_token_id"], "pad_token_id": tok.pad_token_id}
    return GgufModel(
        path=path,
        reader=reader,
        architecture=arch,
        name=meta.get("general.name"),
        config=config,
        generation_config={k: v for k, v in gen.items() if v is not None},
        tokenizer=tok,
        tensors=plan,
        warnings=list(tok.warnings),
    )


def _hf_config(
    meta: dict[str, Any], arch: str, by_name: dict[str, Any], tok: TokenizerFiles, vocab: int, width: int
) -> dict[str, Any]:
    """config.json from the ``{arch}.*`` metadata and which tensors exist."""
    model_type, hf_class, _ = ARCHITECTURES[arch]

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        return _scalar(meta, f"{arch}.{k}", default, required)

    if (key("expert_count") or 0) > 0:
        raise CortiqError("mixture-of-experts GGUFs are not supported")
    hidden = int(key("embedding_length", required=True))
    layers = int(key("block_count", required=True))
    heads = int(key("attention.head_count", required=True))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise CortiqError("GGUFs with different key and value head sizes are not supported")
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise CortiqError("partial rotary embeddings (rope.dimension_count < head size) are not supported")
    if width != hidden:
        raise CortiqError(f"token_embd.weight has width {width}, {arch}.embedding_length says {hidden}")
    eos = tok.eos_token_ids
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 4096)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": tok.pad_token_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    bias = [f"blk.0.attn_{p}.bias" in by_name for p in ("q", "k", "v", "output")]
    if model_type == "qwen2":  # q/k/v biases always, o_proj never
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    else:
        if any(bias) and not all(bias):
            raise CortiqError("GGUFs with biases on only some attention projections are not supported")
        config["attention_bias"] = all(bias)
        if model_type == "llama":
            config.update(mlp_bias=False, pretraining_tp=1)
        else:
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    scaling = _rope_scaling(meta, arch, by_name.get(_ROPE_FREQS), config["rope_theta"], head_dim)
    if model_type == "gemma3_text":
        return _gemma3_config(config, key, scaling)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _gemma3_config(config: dict[str, Any], key: Callable[..., Any], scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's config.json. What the GGUF does not store, llama.cpp hard-codes for
    gemma3 and so do we: every 6th layer global, a local RoPE base of 10000, and
    query_pre_attn_scalar = head_dim (the 27B model's hidden/heads differs; llama.cpp
    special-cases it by size, which a GGUF does not name, so it is refused below)."""
    layers, hd = config["num_hidden_layers"], config["head_dim"]
    for k in ("max_window_layers", "use_sliding_window", "mlp_bias", "pretraining_tp", "rope_theta"):
        config.pop(k, None)
    if config["hidden_size"] == 5376 and layers == 62:
        raise CortiqError("Gemma 3 27B GGUFs are not supported (their query scale is not stored in the file)")
    window = key("attention.sliding_window")
    if not window:
        raise CortiqError("gemma3 GGUF has no gemma3.attention.sliding_window")
    full = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 1_000_000.0))}
    if scaling is not None:
        if scaling.get("rope_type") != "linear":
            raise CortiqError(f"gemma3 GGUF rope scaling {scaling.get('rope_type')!r} is not supported (supported: linear)")
        full.update(scaling)
    config.update(
        architectures=["Gemma3ForCausalLM"],
        hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=hd,
        sliding_window=int(window),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=key("final_logit_softcapping"),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        attention_bias=bool(config.get("attention_bias", False)),
    )
    return config


def _plan_tensors(reader, arch: str, config: dict[str, Any]) -> list[PlannedTensor]:
    permuted = ARCHITECTURES[arch][2]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    norm_offset = -1.0 if arch in _NORM_PLUS_ONE else 0.0
    plan = []
    for i, t in enumerate(reader.tensors):
        if t.name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        name = _GLOBAL_NAMES.get(t.name)
        unpermute = None
        if name is None:
            m = _BLOCK_RE.fullmatch(t.name)
            if m is None or m.group(2) not in names:
                raise CortiqError(f"GGUF tensor {t.name!r} has no HF counterpart for architecture {arch!r}")
            layer, part, kind = m.groups()
            name = f"model.layers.{layer}.{names[part]}.{kind}"
            if permuted and part in ("attn_q", "attn_k"):
                unpermute = heads if part == "attn_q" else kv_heads
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        offset = norm_offset if t.name.endswith("norm.weight") else 0.0
        plan.append(PlannedTensor(i, t.name, name, shape, t.tensor_type.name, unpermute, offset))
    return plan


def _check_shapes(plan: list[PlannedTensor], cfg: dict[str, Any]) -> None:
    """Every tensor the HF model needs, at the shape config.json implies."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        want["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg["model_type"] in ("qwen3", "gemma3_text"):
            want[p + "self_attn.q_norm.weight"] = (hd,)
            want[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg["model_type"] == "gemma3_text":
            want[p + "pre_feedforward_layernorm.weight"] = (h,)
            want[p + "post_feedforward_layernorm.weight"] = (h,)
        if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
            for proj, n in (("q", q), ("k", kv), ("v", kv)):
                want[p + f"self_attn.{proj}_proj.bias"] = (n,)
            if cfg["model_type"] != "qwen2":
                want[p + "self_attn.o_proj.bias"] = (h,)
    have = {t.name: t for t in plan}
    for name, shape in want.items():
        if name not in have:
            raise CortiqError(f"GGUF is missing the tensor for {name}")
        if have[name].shape != shape:
            raise CortiqError(
                f"{have[name].source} has shape {list(have[name].shape)}, the metadata implies {list(shape)}"
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise CortiqError(f"GGUF tensor {have[extra[0]].source} does not fit the model ({len(extra)} such)")


def _check_types(reader, plan: list[PlannedTensor]) -> None:
    """Every tensor type must be one gguf-py can dequantize: try one row of each."""
    import gguf

    seen: set[str] = set()
    for p in plan:
        if p.ggml_type in seen:
            continue
        t = reader.tensors[p.index]
        try:
            gguf.quants.dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
        except NotImplementedError:
            raise CortiqError(f"GGUF tensor type {p.ggml_type} (in {p.source}) cannot be dequantized") from None
        seen.add(p.ggml_type)


def _rope_scaling(meta: dict[str, Any], arch: str, rope_freqs, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        import gguf

        freqs = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64).ravel()
        return _llama3_from_rope_freqs(freqs, theta, head_dim, orig)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise CortiqError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn, llama3 rope_freqs)")


def _llama3_from_rope_freqs(freqs: np.ndarray, theta: float, head_dim: int, orig: int | None) -> dict[str, Any]:
    """llama.cpp stores llama-3.1 RoPE scaling as per-frequency divisors; recover HF's
    four parameters. Only old/low and old/high matter to RoPE, so low is fixed at 1
    (Meta's value) unless the usual (8192, 1, 4) already fits."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freqs.shape != inv.shape:
        raise CortiqError(f"GGUF rope_freqs has {freqs.size} entries, expected {inv.size}")
    factor = float(freqs.max())
    x = inv / (2 * math.pi)  # 1 / wavelength
    candidates = [(float(orig or 8192), 1.0, 4.0)]
    # Blended band: 1/f = (1 - s)/factor + s with s = old*x/(high - low) - low/(high - low).
    s = (1 / freqs - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(freqs)
    band = (s > 1e-6) & (s < 1 - 1e-6)
    if band.sum() >= 2:
        a, b = np.polyfit(x[band], s[band], 1)
        if b < 0:
            high = 1 - 1 / b
            candidates.append((round(-a / b, 2), 1.0, round(high, 4)))
    for old, low, high in candidates:
        smooth = np.clip((old * x - low) / (high - low), 0.0, 1.0)
        want = 1.0 / ((1 - smooth) / factor + smooth)
        if np.allclose(freqs, want, rtol=1e-4, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(old) if float(old).is_integer() else old,
            }
    raise CortiqError("GGUF rope_freqs do not match llama-3 RoPE scaling; cannot express them in config.json")


# ------------------------------------------------------------------ tensors

def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head, GGUF row 2i+j is HF row j*half+i."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(model: GgufModel, p: PlannedTensor) -> np.ndarray:
    """The f32 HF tensor for one planned entry."""
    import gguf

    t = model.reader.tensors[p.index]
    x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(p.shape)
    if p.unpermute_heads:
        x = unpermute_rope_rows(x, p.unpermute_heads)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if p.offset:
        x = x + np.float32(p.offset)  # F32 tensors are read-only views of the map
    return x


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    from formats.quants import f32_to_bf16

    return f32_to_bf16(x)


# ------------------------------------------------------------------ writing

def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"


def import_gguf(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "f32",
    force: bool = False,
    progress: ProgressFn | None = None,
    model: GgufModel | None = None,
) -> ImportReport:
    """Write the HF checkpoint folder ``out_dir`` for the GGUF ``src`` (``model``: the
    already parsed ``read_gguf(src)``); see the module doc."""
    t0 = time.perf_counter()
    if dtype not in OUT_DTYPES:
        raise CortiqError(f"unknown --dtype {dtype!r}; choose one of {', '.join(OUT_DTYPES)}")
    src, out = Path(src), Path(out_dir)
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    if not out.parent.is_dir():
        raise CortiqError(f"output folder {out.parent} does not exist")
    if src.resolve() == out.resolve() or (out.exists() and src.resolve().is_relative_to(out.resolve())):
        raise CortiqError(f"{out} contains the input file; choose another output folder")
    model = model if model is not None else read_gguf(src)
    config = dict(model.config, torch_dtype={"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype])
    st_dtype, itemsize = OUT_DTYPES[dtype]
    total = model.params

    remove_stale(out)  # what a killed run on this output left behind
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    _held = hold(tmp)  # noqa: F841 - a later run removes tmp only once this process is gone
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        stream = SafetensorsStream(
            tmp / "model.safetensors", [(p.name, st_dtype, p.shape, itemsize) for p in model.tensors]
        )
        try:
            done = 0
            for p in model.tensors:
                stream.write(p.name, _encode(dequantized(model, p), dtype))
                done += math.prod(p.shape)
                if progress:
                    progress(p.name, done, total)
        finally:
            stream.close()
        assert stream.complete
        (tmp / "config.json").write_text(_dumps(config), encoding="utf-8")
        (tmp / "generation_config.json").write_text(_dumps(model.generation_config), encoding="utf-8")
        (tmp / "tokenizer.json").write_text(model.tokenizer.tokenizer_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(_dumps(model.tokenizer.tokenizer_config), encoding="utf-8")
        out_bytes = sum(f.stat().st_size for f in tmp.iterdir())
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ImportReport(
        output=out,
        source=src,
        architecture=model.architecture,
        model_type=config["model_type"],
        name=model.name,
        tensors=len(model.tensors),
        params=total,
        gguf_types=dict(Counter(p.ggml_type for p in model.tensors)),
        dtype=dtype,
        tied_embeddings=bool(config["tie_word_embeddings"]),
        vocab_size=model.tokenizer.vocab_size,
        merges=model.tokenizer.merges,
        special_tokens=model.tokenizer.special_tokens,
        pre_tokenizer=model.tokenizer.pre,
        chat_template="chat_template" in model.tokenizer.tokenizer_config,
        source_bytes=src.stat().st_size,
        output_bytes=out_bytes,
        seconds=time.perf_counter() - t0,
        warnings=model.warnings,
    )


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` onto ``out``; an old ``out`` is set aside until then."""
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / "x")
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old / "x", out)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ raw blocks

@dataclass(frozen=True)
class SourceBlocks:
    """One tensor's GGML blocks as stored: uint8 [rows, bytes per row], a view of the map."""

    ggml_type: str
    data: np.ndarray
    unpermute_heads: int | None = None


def source_blocks(model: GgufModel) -> dict[str, SourceBlocks]:
    """HF name -> stored blocks, for the tensors whose values the import does not change
    beyond a row order (so a converter may copy their blocks instead of re-encoding)."""
    out = {}
    for p in model.tensors:
        if p.offset:
            continue
        t = model.reader.tensors[p.index]
        out[p.name] = SourceBlocks(p.ggml_type, np.asarray(t.data), p.unpermute_heads)
    return out


class GgufCheckpoint:
    """A parsed GGUF as the converter reads a checkpoint (``formats.checkpoint.Checkpoint``):
    the HF names, shapes and files ``import_gguf`` would write, with each tensor
    dequantized on demand, row slice by row slice, straight from the map. Nothing is
    written to disk; the values (and so the CMF made from them) are those of the
    imported f32 folder, element for element."""

    def __init__(self, model: GgufModel):
        self.model = model
        self.root = model.path
        self.origin = str(model.path)
        # Through JSON, as the folder's config.json would be read back.
        self.config: dict[str, Any] = json.loads(_dumps(dict(model.config, torch_dtype="float32")))
        self._plan = {p.name: p for p in model.tensors}
        self._files: dict[str, str] = {
            "config.json": _dumps(self.config),
            "generation_config.json": _dumps(model.generation_config),
            "tokenizer.json": model.tokenizer.tokenizer_json,
            "tokenizer_config.json": _dumps(model.tokenizer.tokenizer_config),
        }

    # --------------------------------------------------------------- tensors
    def names(self) -> list[str]:
        return list(self._plan)

    def _entry(self, name: str) -> PlannedTensor:
        if name not in self._plan:
            raise CortiqError(f"{self.root}: missing tensor {name}")
        return self._plan[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def source_dtype(self, name: str) -> str:
        """What the reads yield: f32, whatever the GGML type (``model.tensors`` has that)."""
        self._entry(name)
        return "F32"

    def _rows(self, p: PlannedTensor, rows: np.ndarray | slice) -> np.ndarray:
        """HF rows ``rows`` of ``p`` as f32 [n, cols]: dequantized, de-permuted, offset."""
        import gguf

        t = self.model.reader.tensors[p.index]
        n_rows = math.prod(p.shape[:-1]) if len(p.shape) > 1 else 1
        data = t.data.reshape(n_rows, -1)
        if p.unpermute_heads:
            rows = unpermute_rope_rows(np.arange(n_rows), p.unpermute_heads)[rows]
        x = gguf.quants.dequantize(data[rows], t.tensor_type)
        x = np.ascontiguousarray(x.reshape(x.shape[0], p.shape[-1] if p.shape else 1), dtype=np.float32)
        if p.offset:
            x = x + np.float32(p.offset)  # F32 tensors are read-only views of the map
        return x

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        """f32[rows, cols] slices in order, handing consumed pages back to the OS."""
        p = self._entry(name)
        t = self.model.reader.tensors[p.index]
        rows = math.prod(p.shape[:-1]) if len(p.shape) > 1 else 1
        cols = p.shape[-1] if p.shape else 1
        step = max(1, max_elems // max(cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            yield self._rows(p, slice(r0, r1))
            if not p.unpermute_heads:  # permuted rows come from all over the tensor
                row_bytes = t.n_bytes // max(rows, 1)
                self.model.reader.release(t.data_offset + r0 * row_bytes, t.data_offset + r1 * row_bytes)
        if p.unpermute_heads:
            self.release(name)

    def tensor(self, name: str) -> np.ndarray:
        p = self._entry(name)
        return self._rows(p, slice(None)).reshape(p.shape)

    def sample_f32(self, name: str, count: int = 64) -> np.ndarray:
        """``count`` evenly spaced elements of the f32 tensor (as ``HFCheckpoint.sample_f32``),
        dequantizing only the rows that hold them."""
        p = self._entry(name)
        size = math.prod(p.shape)
        if size == 0:
            return np.zeros(0, np.float32)
        cols = p.shape[-1] if p.shape else 1
        idx = np.linspace(0, size - 1, num=min(count, size)).astype(np.int64)
        rows, at = np.unique(idx // cols, return_inverse=True)
        vals = self._rows(p, rows)[at.reshape(-1), idx % cols]
        self.release(name)
        return vals

    def release(self, name: str) -> None:
        """Hand the mapped pages of one tensor back to the OS."""
        t = self.model.reader.tensors[self._entry(name).index]
        self.model.reader.release(t.data_offset, t.data_offset + t.n_bytes)

    def release_pages(self) -> None:
        self.model.reader.release()

    def close(self) -> None:
        pass  # the map goes with the model; views of it (block copies) may still be in use

    # --------------------------------------------------------------- files
    def read_text(self, name: str) -> str | None:
        return self._files.get(name)

    def read_json(self, name: str) -> dict[str, Any] | None:
        text = self._files.get(name)
        return None if text is None else json.loads(text)


def open_gguf_checkpoint(src: str | os.PathLike) -> tuple[GgufCheckpoint, dict[str, SourceBlocks]]:
    """The GGUF ``src`` as a checkpoint (see ``GgufCheckpoint``) and its ``source_blocks``."""
    model = read_gguf(src)
    return GgufCheckpoint(model), source_blocks(model)
