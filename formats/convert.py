"""Checkpoint -> CMF, one tensor at a time.

The converter reads a tensor from the memory-mapped source, picks its dtype from
the policy, encodes it, measures the quantization error against the source, and
appends it to the output, so peak memory stays near the largest tensor. MTP draft
layers go to a sidecar ``OUT.mtp.cmf`` (or stay inline, or are dropped).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from formats.arch import ArchConfig, MtpConfig, from_hf_config
from formats.cmf import CmfWriter
from formats.errors import CortiqError
from formats.mtp_names import mtp_layer_count, normalize
from formats.quants import QUANT_CHOICES, get_dtype

CONVERTER_VERSION = "0.1.0"
TOKENIZER_TENSOR = "__tokenizer__/tokenizer.json"
MTP_MODES = ("sidecar", "inline", "drop")
_EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def sidecar_path(out: str | Path) -> Path:
    out = Path(out)
    stem = out.name[: -len(".cmf")] if out.name.endswith(".cmf") else out.name
    return out.with_name(f"{stem}.mtp.cmf")


@dataclass
class QuantPolicy:
    """Which dtype each tensor gets.

    1-D tensors (norms, biases, sinks) and anything that is not a matrix stay f32;
    ``keep`` patterns (fnmatch on the CMF name, first match wins) override the
    default; a quantized dtype that does not fit the shape falls back to f16.
    With ``q4`` the embeddings and lm_head default to q8, as llama.cpp keeps its
    output tensor at higher precision.
    """

    quant: str
    keep: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_CHOICES:
            raise CortiqError(f"unknown --quant {self.quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
        for pat, dt in self.keep:
            if dt not in QUANT_CHOICES:
                raise CortiqError(f"--keep {pat}={dt}: unknown dtype {dt!r}; choose one of {', '.join(QUANT_CHOICES)}")

    @staticmethod
    def parse_keep(specs: list[str]) -> list[tuple[str, str]]:
        out = []
        for s in specs:
            if "=" not in s:
                raise CortiqError(f"--keep {s!r}: expected PATTERN=DTYPE, e.g. 'lm_head.weight=q8'")
            pat, dt = s.rsplit("=", 1)
            out.append((pat.strip(), dt.strip()))
        return out

    def dtype_for(self, name: str, shape: tuple[int, ...]) -> str:
        if len(shape) < 2:
            return "f32"
        chosen = None
        for pat, dt in self.keep:
            if fnmatch.fnmatchcase(name, pat):
                chosen = dt
                break
        if chosen is None:
            chosen = self.quant
            if self.quant == "q4" and name in _EMBED_NAMES:
                chosen = "q8"
            # Routers and gates are tiny and decide discrete choices: keep them exact.
            if name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")) or len(shape) > 2:
                chosen = "f32"
        if not get_dtype(chosen).supports(shape):
            chosen = "f16"
        return chosen


@dataclass
class DtypeStats:
    tensors: int = 0
    params: int = 0
    bytes: int = 0
    err_sq: float = 0.0  # sum of squared errors
    ref_sq: float = 0.0  # sum of squared source values

    @property
    def rms_rel_error(self) -> float:
        return float(np.sqrt(self.err_sq / self.ref_sq)) if self.ref_sq > 0 else 0.0


@dataclass
class ConvertReport:
    output: Path
    sidecar: Path | None
    arch: ArchConfig
    by_dtype: dict[str, DtypeStats]
    source_bytes: int
    output_bytes: int
    seconds: float
    mtp_tensors: int
    fallbacks: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "sidecar": str(self.sidecar) if self.sidecar else None,
            "arch": self.arch.arch,
            "source_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "seconds": self.seconds,
            "mb_per_s": self.source_bytes / 1e6 / max(self.seconds, 1e-9),
            "mtp_tensors": self.mtp_tensors,
            "fallbacks": self.fallbacks,
            "dtypes": {
                k: {"tensors": v.tensors, "params": v.params, "bytes": v.bytes, "rms_rel_error": v.rms_rel_error}
                for k, v in self.by_dtype.items()
            },
        }


# ------------------------------------------------------------------ plan

@dataclass(frozen=True)
class PlannedTensor:
    source: str
    name: str
    shape: tuple[int, ...]
    mtp: bool


def _expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Shapes the engine relies on, checked before a byte is written."""
    h, hd, vd = arch.hidden_size, arch.head_dim, arch.v_head_dim
    exp: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        exp["lm_head.weight"] = (arch.vocab_size, h)
    for i, lt in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        exp[p + "input_layernorm.weight"] = (h,)
        if lt == "linear":
            continue
        nh, nkv, d, v = arch.num_heads, arch.num_kv_heads, hd, vd
        if lt == "sliding" and arch.sliding is not None:
            s = arch.sliding
            nh, nkv, d, v = s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim
        q_rows = nh * d * (2 if arch.attn_output_gate else 1)
        exp[p + "self_attn.q_proj.weight"] = (q_rows, h)
        exp[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        exp[p + "self_attn.v_proj.weight"] = (nkv * v, h)
        exp[p + "self_attn.o_proj.weight"] = (h, nh * v)
        if arch.moe is None or i not in arch.moe.moe_layers:
            exp[p + "mlp.gate_proj.weight"] = (arch.intermediate_size, h)
            exp[p + "mlp.up_proj.weight"] = (arch.intermediate_size, h)
            exp[p + "mlp.down_proj.weight"] = (h, arch.intermediate_size)
    return exp


def _plan(ck_names: list[str], shapes: Callable[[str], tuple[int, ...]], config: dict[str, Any], arch: ArchConfig) -> list[PlannedTensor]:
    plan = []
    for src in ck_names:
        if src.endswith("rotary_emb.inv_freq"):
            continue  # a cache, recomputed by the engine
        name, is_mtp = normalize(src, config)
        if name is None:
            continue
        plan.append(PlannedTensor(src, name, tuple(shapes(src)), is_mtp))
    have = {p.name: p.shape for p in plan}
    if arch.tie_word_embeddings and "lm_head.weight" in have:
        # Some tied checkpoints still ship a copy of the embedding as lm_head.
        plan = [p for p in plan if p.name != "lm_head.weight"]
    if not arch.tie_word_embeddings and "lm_head.weight" not in have and "model.embed_tokens.weight" in have:
        arch.tie_word_embeddings = True  # no lm_head in the checkpoint: it is tied
    for name, shape in _expected_shapes(arch).items():
        if name not in have:
            raise CortiqError(f"checkpoint is missing tensor {name}")
        if tuple(have[name]) != tuple(shape):
            raise CortiqError(f"tensor {name} has shape {list(have[name])}, config.json implies {list(shape)}")
    return plan


def fingerprint(config: dict[str, Any], plan: list[PlannedTensor]) -> str:
    """Identity of a backbone: its config and the names/shapes of its trunk tensors."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for p in plan:
        if not p.mtp:
            h.update(f"{p.name}:{p.shape}".encode())
    return h.hexdigest()[:16]


def _tokenizer_header(ck) -> tuple[dict[str, Any], bytes]:
    tok_json = ck.read_text("tokenizer.json")
    if tok_json is None:
        raise CortiqError(f"{ck.root}: missing tokenizer.json (cortiq embeds the tokenizer in the CMF file)")
    tcfg = ck.read_json("tokenizer_config.json") or {}
    gen = ck.read_json("generation_config.json") or {}
    vocab = json.loads(tok_json)
    added = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    model_vocab = (vocab.get("model") or {}).get("vocab") or {}

    def tid(tok: Any) -> int | None:
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok is None:
            return None
        if tok in added:
            return added[tok]
        if isinstance(model_vocab, dict):
            return model_vocab.get(tok)
        return None

    eos: list[int] = []
    for src in (gen.get("eos_token_id"), ck.config.get("eos_token_id"), tid(tcfg.get("eos_token"))):
        for e in src if isinstance(src, list) else [src]:
            if isinstance(e, int) and e not in eos:
                eos.append(e)
    bos = gen.get("bos_token_id", ck.config.get("bos_token_id"))
    if bos is None:
        bos = tid(tcfg.get("bos_token"))
    chat = tcfg.get("chat_template")
    if chat is None:
        chat = ck.read_text("chat_template.jinja")
    if isinstance(chat, list):  # named templates: keep the default
        chat = next((c["template"] for c in chat if c.get("name") == "default"), chat[0]["template"])
    header = {
        "tensor": TOKENIZER_TENSOR,
        "bos_token_id": bos,
        "eos_token_ids": eos,
        "pad_token_id": gen.get("pad_token_id", ck.config.get("pad_token_id")),
        "add_bos_token": bool(tcfg.get("add_bos_token", False)),
        "chat_template": chat,
        "bos_token": tcfg.get("bos_token") if isinstance(tcfg.get("bos_token"), str) else None,
        "eos_token": tcfg.get("eos_token") if isinstance(tcfg.get("eos_token"), str) else None,
    }
    return header, tok_json.encode("utf-8")


# ------------------------------------------------------------------ convert

ProgressFn = Callable[[str, int, int], None]  # (tensor name, bytes done, bytes total)


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    quant: str = "q8",
    keep: list[tuple[str, str]] | None = None,
    mtp: str = "sidecar",
    force: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Convert an HF checkpoint folder (or hub id) into ``out``; see the module doc."""
    from formats.checkpoint import open_checkpoint

    if mtp not in MTP_MODES:
        raise CortiqError(f"unknown --mtp {mtp!r}; choose one of {', '.join(MTP_MODES)}")
    policy = QuantPolicy(quant, keep or [])
    out = Path(out)
    ck = open_checkpoint(src)
    try:
        return _convert(ck, out, policy, mtp, force, progress)
    finally:
        ck.close()


def _convert(ck, out: Path, policy: QuantPolicy, mtp_mode: str, force: bool, progress: ProgressFn | None) -> ConvertReport:
    t0 = time.perf_counter()
    arch = from_hf_config(ck.config)
    plan = _plan(ck.names(), ck.shape, ck.config, arch)
    mtp_plan = [p for p in plan if p.mtp]
    n_mtp_layers = len({p.name.split(".")[3] for p in mtp_plan})
    if mtp_plan:
        arch.mtp = MtpConfig(num_layers=n_mtp_layers or mtp_layer_count(ck.config), style=_mtp_style(ck.config, plan))
    tok_header, tok_bytes = _tokenizer_header(ck)
    fp = fingerprint(ck.config, plan)
    side = sidecar_path(out) if (mtp_plan and mtp_mode == "sidecar") else None
    if side is not None and side.exists() and not force:
        raise CortiqError(f"{side} exists (use --force to overwrite)")
    header: dict[str, Any] = {
        "format": "cmf",
        "role": "model",
        "arch": arch.to_json(),
        "tokenizer": tok_header,
        "generation_config": ck.read_json("generation_config.json") or {},
        "source": {"path": str(ck.root), "model_type": ck.config.get("model_type"), "fingerprint": fp},
        "converter": {"name": "cortiq", "version": CONVERTER_VERSION},
        "quant": {"default": policy.quant, "keep": [f"{p}={d}" for p, d in policy.keep]},
        "calibration": {"temperature": None},
        "mtp": None,
    }
    if mtp_plan:
        header["mtp"] = {
            "num_layers": arch.mtp.num_layers,
            "style": arch.mtp.style,
            "location": mtp_mode if mtp_mode != "sidecar" else "sidecar",
            "sidecar": side.name if side else None,
        }
    main_plan = [p for p in plan if not p.mtp or mtp_mode == "inline"]
    side_plan = [p for p in plan if p.mtp] if side else []
    total = sum(int(np.prod(p.shape)) for p in main_plan + side_plan)
    done = 0
    stats: dict[str, DtypeStats] = {}
    fallbacks: list[str] = []
    source_bytes = 0

    def write_one(w: CmfWriter, p: PlannedTensor) -> None:
        nonlocal done, source_bytes
        x = ck.tensor(p.source)
        dt = policy.dtype_for(p.name, p.shape)
        if dt == "f16" and policy.quant in ("q8", "q4") and len(p.shape) == 2 and not any(
            fnmatch.fnmatchcase(p.name, pat) for pat, _ in policy.keep
        ):
            fallbacks.append(p.name)
        if not np.all(np.isfinite(x)):
            raise CortiqError(f"tensor {p.source} contains NaN or Inf")
        d = get_dtype(dt)
        parts = d.encode(x)
        info = w.add_encoded(p.name, dt, p.shape, parts)
        s = stats.setdefault(dt, DtypeStats())
        s.tensors += 1
        s.params += x.size
        s.bytes += info.nbytes
        source_bytes += x.size * np.dtype(_ST_ITEMSIZE.get(ck.source_dtype(p.source), "f4")).itemsize
        if dt != "f32":
            back = d.decode(d.named(parts, p.shape), p.shape)
            err = back.astype(np.float64) - x
            s.err_sq += float(np.dot(err.ravel(), err.ravel()))
            s.ref_sq += float(np.dot(x.ravel().astype(np.float64), x.ravel().astype(np.float64)))
        done += x.size
        if progress:
            progress(p.name, done, total)

    side_header = None
    if side:
        side_header = {
            "format": "cmf",
            "role": "mtp_sidecar",
            "arch": arch.to_json(),
            "mtp": header["mtp"],
            "backbone": _backbone_identity(arch, fp, out.name),
            "source": header["source"],
            "converter": header["converter"],
            "quant": header["quant"],
        }
    with CmfWriter(out, header, force=force) as w:
        w.add_bytes(TOKENIZER_TENSOR, tok_bytes)
        for p in main_plan:
            write_one(w, p)
        if side:
            with CmfWriter(side, side_header, force=force) as sw:
                for p in side_plan:
                    write_one(sw, p)
    out_bytes = out.stat().st_size + (side.stat().st_size if side else 0)
    return ConvertReport(
        output=out,
        sidecar=side,
        arch=arch,
        by_dtype=stats,
        source_bytes=source_bytes,
        output_bytes=out_bytes,
        seconds=time.perf_counter() - t0,
        mtp_tensors=len(mtp_plan),
        fallbacks=fallbacks,
    )


_ST_ITEMSIZE = {"F32": "f4", "F16": "f2", "BF16": "u2", "F64": "f8"}


def _mtp_style(config: dict[str, Any], plan: list[PlannedTensor]) -> str:
    mt = str(config.get("model_type", ""))
    if mt.startswith("mimo"):
        return "mimo"
    if mt.startswith("qwen3_next") or mt.startswith("qwen3_5") or any(p.source.startswith("mtp.") for p in plan):
        return "qwen3_next"
    return "deepseek"


def _backbone_identity(arch: ArchConfig, fp: str, main_name: str) -> dict[str, Any]:
    return {
        "file": main_name,
        "fingerprint": fp,
        "arch": arch.arch,
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
    }
