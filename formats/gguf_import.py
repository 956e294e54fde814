"""GGUF file -> HF checkpoint folder (config.json, model.safetensors, tokenizer files),
or -> ``GgufCheckpoint``: the same checkpoint read straight from the GGUF's map, which
``cortiq convert FILE.gguf`` streams into a CMF without writing the folder.

``read_gguf`` parses and validates everything first (architecture, shapes, tensor
types, tokenizer) without writing; ``import_gguf`` then dequantizes one tensor at a
time into a streamed safetensors file inside a temporary folder beside OUT_DIR and
renames it into place, so a failure leaves nothing behind.

For some architectures llama.cpp's converter interleaves the two rotary halves of
every head in the q_proj/k_proj rows (its RoPE rotates adjacent pairs, HF rotates
halves); the import puts those rows back in HF order. Where it stores norm weights as
1 + w, the import subtracts the 1 again (as transformers' GGUF loader does). Which
applies is the family's ``GgufSpec``.

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

from formats.arch_check import MAX_EXPERTS, arch_from_config
from formats.errors import CortiqError
from formats.gguf_spec import GLOBAL_NAMES, GgufContext, GgufSpec
from formats.gguf_tokenizer import TokenizerFiles, build_tokenizer
from formats.manifest import Families, check_manifest, mtp_layer_indices
from formats.sanitize import sanitized_shapes
from formats.staging import hold, remove_stale
from formats.safetensors_writer import SafetensorsStream

# Bump when the files written change, so caches keyed on it rebuild.
IMPORTER_VERSION = "3"
OUT_DTYPES = {"f32": ("F32", 4), "f16": ("F16", 2), "bf16": ("BF16", 2)}
ProgressFn = Callable[[str, int, int], None]  # (tensor name, params done, params total)

_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_0-9]+(?:\.[a-z_0-9]+)?)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama-3.1 style scaling, folded back into rope_scaling


@dataclass(frozen=True)
class PlannedTensor:
    index: int  # position in reader.tensors
    source: str  # GGUF name
    name: str  # HF name
    shape: tuple[int, ...]  # HF (numpy) shape
    ggml_type: str
    unpermute_heads: int | None = None  # q/k: heads whose rotary rows to de-interleave
    offset: float = 0.0  # added after dequantizing (-1 for norms stored as 1 + w)
    row0: int = 0  # first row in the stored tensor's rows (one expert of a stacked [experts, rows, cols])


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


def read_gguf(path: str | os.PathLike, families: Families) -> GgufModel:
    """Open and validate ``path``; raises ``CortiqError`` on anything it cannot import.
    ``families``: the registry whose family files declare the GGUF architectures."""
    path = Path(path)
    reader = _open_reader(path)
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CortiqError(f"{path}: truncated GGUF (tensor {t.name} runs past the end of the file)")
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    try:
        family, spec = families.for_gguf_arch(arch)
    except CortiqError as e:
        raise CortiqError(f"{path}: {e}") from None
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise CortiqError(f"{path}: GGUF has no token_embd.weight")
    vocab, width = (int(d) for d in reversed(by_name["token_embd.weight"].shape.tolist()))
    try:
        tok = build_tokenizer(meta, vocab, spec.sentencepiece)
        config = _hf_config(meta, spec, by_name, tok, vocab, width)
        plan = _plan_tensors(reader, spec, config)
        _check_shapes(plan, config, families)
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
    meta: dict[str, Any], spec: GgufSpec, by_name: dict[str, Any], tok: TokenizerFiles, vocab: int, width: int
) -> dict[str, Any]:
    """config.json from the ``{arch}.*`` metadata every architecture writes alike, then
    the family's own fields (``spec.config``)."""
    arch = spec.arch

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        return _scalar(meta, f"{arch}.{k}", default, required)

    def array(k: str) -> list[Any] | None:
        v = meta.get(f"{arch}.{k}")
        return None if v is None else (list(v) if isinstance(v, list) else [v])

    hidden = _int(key("embedding_length", required=True), f"{arch}.embedding_length")
    layers = _int(key("block_count", required=True), f"{arch}.block_count")
    heads = _int(key("attention.head_count", required=True), f"{arch}.attention.head_count")
    head_dim = _int(key("attention.key_length", hidden // max(heads, 1)), f"{arch}.attention.key_length")
    if width != hidden:
        raise CortiqError(f"token_embd.weight has width {width}, {arch}.embedding_length says {hidden}")
    eos = tok.eos_token_ids
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _int(key("feed_forward_length", required=True), f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _int(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _int(key("context_length", 4096), f"{arch}.context_length"),
        "rms_norm_eps": _f32(
            _num(key("attention.layer_norm_rms_epsilon", required=True), f"{arch}.attention.layer_norm_rms_epsilon")
        ),
        "rope_theta": _f32(_num(key("rope.freq_base", 10000.0), f"{arch}.rope.freq_base")),
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
    config["attention_bias"] = all(bias)
    scaling = _rope_scaling(meta, arch, by_name.get(_ROPE_FREQS), config["rope_theta"], head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if spec.config is not None:
        ctx = GgufContext(
            arch=arch,
            meta=meta,
            tensors=frozenset(by_name),
            key=key,
            array=array,
            values=lambda name: _small_values(by_name, name),
        )
        try:
            spec.config(ctx, config)
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, OverflowError) as e:
            # GGUF metadata is untrusted: a retyped or out-of-range value is bad input, not a bug.
            raise CortiqError(f"GGUF {arch}.* metadata has a bad value ({type(e).__name__}: {str(e)[:160]})") from None
    return config


def _small_values(by_name: dict[str, Any], name: str) -> np.ndarray | None:
    """A folded-in tensor's values as f32 (None if absent); bounded, it becomes config.json."""
    import gguf

    t = by_name.get(name)
    if t is None:
        return None
    if int(t.n_elements) > 1 << 16:
        raise CortiqError(f"GGUF tensor {name} has {int(t.n_elements)} values, expected a small table")
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).ravel()


def _int(v: Any, key: str) -> int:
    """A GGUF integer field: an int (not a bool, a float or a string), in range."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) <= 1 << 40:
        raise CortiqError(f"GGUF metadata {key} is {str(v)[:40]!r}, expected a non-negative integer")
    return int(v)


def _num(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(float(v)):
        raise CortiqError(f"GGUF metadata {key} is {str(v)[:40]!r}, expected a finite number")
    return float(v)


def _plan_tensors(reader, spec: GgufSpec, config: dict[str, Any]) -> list[PlannedTensor]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = spec.names()
    plan = []
    for i, t in enumerate(reader.tensors):
        if t.name in spec.skip:
            continue  # folded into config.json (rope_freqs: config.rope_scaling)
        name = GLOBAL_NAMES.get(t.name)
        unpermute = None
        if name is None:
            m = _BLOCK_RE.fullmatch(t.name)
            if m is None or (m.group(2) not in names and m.group(2) not in spec.full_names):
                raise CortiqError(f"GGUF tensor {t.name!r} has no HF counterpart for architecture {spec.arch!r}")
            layer, part, kind = m.groups()
            if part in spec.full_names:
                name = f"model.layers.{layer}.{spec.full_names[part]}"
            else:
                name = f"model.layers.{layer}.{names[part]}.{kind}"
            if spec.permute_qk and part in ("attn_q", "attn_k"):
                unpermute = heads if part == "attn_q" else kv_heads
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        offset = spec.norm_offset if t.name.endswith("norm.weight") else 0.0
        if "{e}" in name:  # stacked experts [experts, rows, cols]: one planned tensor each
            if len(shape) not in (2, 3) or shape[0] > MAX_EXPERTS:
                raise CortiqError(f"GGUF tensor {t.name} has shape {list(shape)}, expected [experts, rows(, cols)]")
            rows = shape[1] if len(shape) == 3 else 1
            for e in range(shape[0]):
                plan.append(
                    PlannedTensor(i, t.name, name.format(e=e), shape[1:], t.tensor_type.name, None, offset, e * rows)
                )
            continue
        plan.append(PlannedTensor(i, t.name, name, shape, t.tensor_type.name, unpermute, offset))
    return plan


def _check_shapes(plan: list[PlannedTensor], cfg: dict[str, Any], families: Families) -> None:
    """The planned tensors are exactly what the family reads (its manifest, after its
    checkpoint-name rules, MTP layers included), at the shapes config.json implies: the
    converter's check, run before anything is written."""
    family, arch = arch_from_config(families, json.loads(json.dumps(cfg)))
    source = {p.name: p.source for p in plan}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in sanitized_shapes({p.name: p.shape for p in plan}, family.rules_for(cfg)).items():
        new, _ = family.mtp_name(name, cfg)
        if new is not None:
            shapes[new] = shape
            source.setdefault(new, source.get(name, name))
    if arch.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    manifest = family.manifest(arch, mtp_layer_indices(shapes))
    check_manifest(manifest, shapes, holder="GGUF", implied_by="the metadata")
    extra = sorted(set(shapes) - manifest.names())
    if extra:
        raise CortiqError(f"GGUF tensor {source.get(extra[0], extra[0])} does not fit the model ({len(extra)} such)")


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


def stored_rows(t, p: PlannedTensor) -> np.ndarray:
    """The planned tensor's rows as stored (a view of the map): [rows, stored bytes or
    values per row], from row ``p.row0`` of the GGUF tensor's rows."""
    n = math.prod(p.shape[:-1]) if len(p.shape) > 1 else 1
    data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
    return data[p.row0 : p.row0 + n]


def stored_row_count(t) -> int:
    return int(t.data.reshape(-1, t.data.shape[-1]).shape[0]) if t.data.ndim > 1 else 1


def dequantized(model: GgufModel, p: PlannedTensor) -> np.ndarray:
    """The f32 HF tensor for one planned entry."""
    import gguf

    t = model.reader.tensors[p.index]
    x = gguf.quants.dequantize(stored_rows(t, p), t.tensor_type).reshape(p.shape)
    if p.unpermute_heads:
        x = unpermute_rope_rows(x, p.unpermute_heads)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if p.offset:
        x = x + np.float32(p.offset)  # F32 tensors are read-only views of the map
    return x


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    from formats.quants import get_dtype

    return get_dtype(dtype).encode(x)[0].reshape(x.shape)


# ------------------------------------------------------------------ writing


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"


def import_gguf(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    families: Families,
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
    model = model if model is not None else read_gguf(src, families)
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
        out[p.name] = SourceBlocks(p.ggml_type, np.asarray(stored_rows(t, p)), p.unpermute_heads)
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

        if len(p.shape) < 2:  # a vector (a bias, a norm): one row, de-permuted whole
            return dequantized(self.model, p).reshape(1, -1)[rows]
        t = self.model.reader.tensors[p.index]
        n_rows = math.prod(p.shape[:-1])
        data = stored_rows(t, p)
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
                row_bytes = t.n_bytes // max(stored_row_count(t), 1)
                at = t.data_offset + p.row0 * row_bytes
                self.model.reader.release(at + r0 * row_bytes, at + r1 * row_bytes)
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


def open_gguf_checkpoint(src: str | os.PathLike, families: Families) -> tuple[GgufCheckpoint, dict[str, SourceBlocks]]:
    """The GGUF ``src`` as a checkpoint (see ``GgufCheckpoint``) and its ``source_blocks``."""
    model = read_gguf(src, families)
    return GgufCheckpoint(model), source_blocks(model)
