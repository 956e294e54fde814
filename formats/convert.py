"""Checkpoint -> CMF, one tensor at a time.

The converter plans the whole conversion first (names, shapes, dtypes, all
checked against config.json, so bad input fails before a byte is written), then
streams each tensor from the memory-mapped source in row slices: decode to f32,
encode to its dtype, measure the error against the source, append to the output.
Peak memory stays near the largest encoded tensor, not the model. MTP draft layers
go to a sidecar ``OUT.mtp.cmf`` (or stay inline, or are dropped). Outputs appear
only when everything succeeded (see ``CmfWriter``).

From a GGUF, a tensor whose GGML block layout equals its CMF dtype's (Q8_0 -> q8,
Q4_1 -> q4) has its blocks copied bit for bit (a reshuffle into the planar parts, no
arithmetic); the others are dequantized from the GGUF's map slice by slice, as a
safetensors source is read (no temporary HF folder: ``gguf_import.GgufCheckpoint``).
``--quant keep`` gives each matrix its source's type where CMF has one
(F32/F16/BF16/Q8_0/Q4_1) and q8 otherwise (K-quants, Q5_0...: q8 is the CMF type
that holds them best). A CMF file is a source too: its tensors are re-encoded (or
copied, where the dtype stays), as ``llama-quantize`` does for GGUFs.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from formats.arch import ArchConfig, MtpConfig
from formats.arch_check import arch_from_config
from formats.cmf import FORMAT_MINOR, FORMAT_VERSION, MAGIC as CMF_MAGIC, CmfFile, CmfWriter, TensorInfo
from formats.errors import CortiqError
from formats.finite import check_finite, check_finite_parts
from formats.manifest import ArchFamily, Families, check_manifest
from formats.mtp_names import mtp_layer_count
from formats.imatrix import read_imatrix
from formats.policy import QuantPolicy
from formats.quants import DTYPES, DType, f32_to_bf16, get_dtype, rows_cols
from formats.safetensors_reader import FLOAT_DTYPES
from formats.sanitize import sanitize_checkpoint
from formats.staging import remove_stale
from formats.sidecar import ROLE_MODEL, ROLE_SIDECAR, backbone_identity, check_sidecar, sidecar_path
from formats.tokenizer_header import TOKENIZER_TENSOR, tokenizer_header

__all__ = [
    "CONVERTER_VERSION",
    "TOKENIZER_TENSOR",
    "MTP_MODES",
    "QuantPolicy",
    "ConvertReport",
    "DtypeStats",
    "convert_checkpoint",
    "sidecar_path",
    "check_sidecar",
    "fingerprint",
]

CONVERTER_VERSION = "0.1.0"
MTP_MODES = ("sidecar", "inline", "drop")
# Elements per streamed slice: bounds the f32 temporaries of one slice to a few MB.
SLICE_ELEMS = 1 << 20
# A one-part tensor up to this many encoded bytes is gathered whole and written behind the
# next tensor's encoding; a larger one streams to the file slice by slice.
GATHER_BYTES = 32 << 20
_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_LOSSLESS = {("f32", "F32"), ("f32", "F16"), ("f32", "BF16"), ("f16", "F16"), ("bf16", "BF16")}
KEEP = "keep"  # --quant keep: each matrix in its source type where CMF has one
# GGML types whose blocks are a CMF dtype's planar parts, interleaved: GGML type -> CMF dtype.
BLOCK_COPY = {dt.ggml_type: name for name, dt in DTYPES.items() if dt.ggml_type}
# Source type (safetensors or GGML) -> the CMF dtype that stores it exactly.
SOURCE_TO_CMF = {"F32": "f32", "F16": "f16", "BF16": "bf16", **BLOCK_COPY}
KEEP_FALLBACK = "q8"
# config.json keys that vary between exports of the same weights.
_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "_commit_hash")

ProgressFn = Callable[[str, int, int], None]  # (tensor name, source bytes done, source bytes total)


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
class TensorReport:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    rms_rel_error: float
    file: str  # "main" | "sidecar"


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
    source: str = ""
    tensors: list[TensorReport] = field(default_factory=list)
    unused_keep: list[str] = field(default_factory=list)
    block_copied: list[str] = field(default_factory=list)  # GGML blocks copied bit for bit

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / 1e6 / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "sidecar": str(self.sidecar) if self.sidecar else None,
            "source": self.source,
            "arch": self.arch.arch,
            "source_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "seconds": self.seconds,
            "mb_per_s": self.mb_per_s,
            "mtp_tensors": self.mtp_tensors,
            "fallbacks": self.fallbacks,
            "unused_keep": self.unused_keep,
            "block_copied": self.block_copied,
            "dtypes": {
                k: {"tensors": v.tensors, "params": v.params, "bytes": v.bytes, "rms_rel_error": v.rms_rel_error}
                for k, v in self.by_dtype.items()
            },
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "rms_rel_error": t.rms_rel_error,
                    "file": t.file,
                }
                for t in self.tensors
            ],
        }


# ------------------------------------------------------------------ plan


@dataclass(frozen=True)
class PlannedTensor:
    source: str
    name: str
    shape: tuple[int, ...]
    mtp: bool


def _plan(ck, arch: ArchConfig, family: ArchFamily, check_mtp: bool = True) -> list[PlannedTensor]:
    plan: list[PlannedTensor] = []
    for src in ck.names():
        if src.endswith("rotary_emb.inv_freq"):
            continue  # a cache, recomputed by the engine
        name, is_mtp = family.mtp_name(src, ck.config)
        if name is None:
            continue
        plan.append(PlannedTensor(src, name, tuple(ck.shape(src)), is_mtp))
    names = [p.name for p in plan]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise CortiqError(f"two checkpoint tensors map to {dup}")
    have = {p.name: p.shape for p in plan}
    if arch.tie_word_embeddings and "lm_head.weight" in have:
        # Some tied checkpoints still ship a copy of the embedding as lm_head.
        plan = [p for p in plan if p.name != "lm_head.weight"]
    if not arch.tie_word_embeddings and "lm_head.weight" not in have and "model.embed_tokens.weight" in have:
        arch.tie_word_embeddings = True  # no lm_head in the checkpoint: it is tied
    for p in plan:
        m = re.match(r"model\.layers\.(\d+)\.", p.name)
        if m and int(m.group(1)) >= arch.num_layers:
            raise CortiqError(
                f"checkpoint has tensor {p.source} but config.json says num_hidden_layers={arch.num_layers} "
                "(MTP layers need num_nextn_predict_layers)"
            )
        dt = ck.source_dtype(p.source)
        if dt not in FLOAT_DTYPES:
            raise CortiqError(f"tensor {p.source} has dtype {dt}; cortiq reads F32, F16 and BF16 checkpoints")
    mtp_layers = sorted({int(p.name.split(".")[3]) for p in plan if p.mtp})
    if check_mtp and mtp_layers and mtp_layers != list(range(len(mtp_layers))):
        raise CortiqError(f"MTP layers {mtp_layers} are not numbered 0..{len(mtp_layers) - 1}")
    check_manifest(family.manifest(arch, mtp_layers if check_mtp else []), have)
    return plan


def fingerprint(ck, plan: list[PlannedTensor]) -> str:
    """Identity of a backbone: its config, its trunk tensors' names and shapes, and a
    sample of their values (so two fine-tunes of one base differ). Independent of the
    output dtype and of whether the source was saved as f32 or bf16."""
    cfg = {k: v for k, v in ck.config.items() if k not in _VOLATILE_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for p in sorted((p for p in plan if not p.mtp), key=lambda p: p.name):
        h.update(f"{p.name}:{list(p.shape)};".encode())
        h.update(f32_to_bf16(ck.sample_f32(p.source)).tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ convert


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    families: Families,
    quant: str = "q8",
    keep: list[tuple[str, str]] | None = None,
    mtp: str = "sidecar",
    force: bool = False,
    progress: ProgressFn | None = None,
    imatrix: str | Path | None = None,
    allow_nonfinite: bool = False,
    threads: int | None = None,
) -> ConvertReport:
    """Convert an HF checkpoint folder, a hub repo id or a .gguf file into ``out``.

    ``families``: the architecture registry (``cortiq_engine.models.FAMILIES``; formats
    does not import the engine). The family of the checkpoint's ``model_type`` parses
    its config, names its tensors and gives the manifest they are checked against.
    ``imatrix`` (a ``cortiq imatrix`` file) weights the quantizers' error per column.
    A NaN or an infinity in a weight is an error naming the tensor, row and column
    (``formats.finite``), before anything is written, unless ``allow_nonfinite``.
    ``threads`` (default: every usable core) encode row slices side by side; the
    bytes written are the same for any count."""
    from formats.checkpoint import open_checkpoint

    if mtp not in MTP_MODES:
        raise CortiqError(f"unknown --mtp {mtp!r}; choose one of {', '.join(MTP_MODES)}")
    policy = QuantPolicy(
        KEEP_FALLBACK if quant == KEEP else quant,
        keep or [],
        imatrix=read_imatrix(imatrix) if imatrix is not None else None,
    )
    out = Path(out)
    _check_output(out, force, Path(src))
    run = _Run(policy, mtp, force, progress, quant == KEEP, allow_nonfinite)
    src_path = Path(src)
    with SliceEncoder(usable_cpus() if threads is None else threads) as encoder:
        if _is_cmf(src_path):
            return _convert_cmf(src_path, out, run, encoder)
        if _is_gguf(src_path):
            return _convert_gguf(src_path, out, families, run, encoder)
        ck = open_checkpoint(src)
        try:
            return _convert(ck, out, families, run, encoder, source_format="safetensors")
        finally:
            ck.close()


@dataclass(frozen=True)
class _Run:
    """The options of one conversion, as every source kind takes them."""

    policy: QuantPolicy
    mtp: str
    force: bool
    progress: ProgressFn | None
    keep_source: bool  # --quant keep
    allow_nonfinite: bool


def _check_output(out: Path, force: bool, src: Path) -> None:
    if _same_file(out, src) or (
        src.is_dir()
        and _same_file(out.parent, src)
        and (src / out.name).is_file()
        and out.name.endswith((".json", ".safetensors"))
    ):
        raise CortiqError(f"{out} is the source itself; choose another output file")
    if out.is_dir():
        raise CortiqError(f"{out} is a folder; give a file name such as model.cmf")
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    if not out.parent.is_dir():
        raise CortiqError(f"output folder {out.parent} does not exist")
    remove_stale(out)  # what a killed run on this output left behind


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def _is_cmf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(CMF_MAGIC)) == CMF_MAGIC


def _convert_gguf(path: Path, out: Path, families: Families, run: _Run, encoder: "SliceEncoder") -> ConvertReport:
    """GGUF -> CMF, tensor by tensor: each is dequantized from the map in row slices as
    the writer needs it (nothing staged on disk); blocks whose layout CMF shares are
    copied from the GGUF itself."""
    if not path.is_file():
        raise CortiqError(f"{path}: no such file")
    from formats.gguf_import import open_gguf_checkpoint

    ck, blocks = open_gguf_checkpoint(path, families)
    _trim_heap()  # what building the tokenizer freed, before the converter parses it again
    try:
        return _convert(ck, out, families, run, encoder, source_format="gguf", blocks=blocks)
    finally:
        ck.close()


def _convert_cmf(path: Path, out: Path, run: _Run, encoder: "SliceEncoder") -> ConvertReport:
    """CMF -> CMF with new dtypes (the ``llama-quantize`` workflow): tensors whose dtype
    stays are copied byte for byte, the others decoded to f32 and re-encoded, row slice
    by row slice. The header is kept, with the new quant settings and the source."""
    t0 = time.perf_counter()
    src = CmfFile(path)
    try:
        header = json.loads(json.dumps(src.header))  # a deep copy
        if header.get("role", ROLE_MODEL) != ROLE_MODEL or "arch" not in header:
            raise CortiqError(f"{path}: not a model file (role {header.get('role')!r}); convert its model instead")
        mtp = header.get("mtp") or {}
        if mtp.get("location") == "sidecar":
            raise CortiqError(
                f"{path}: re-quantizing a model with an MTP sidecar is not supported yet; convert the original checkpoint"
            )
        arch = ArchConfig.from_json(header["arch"])
        policy = mixed_for(run.policy, arch)
        tally = _Tally(sum(src.info(n).nbytes for n in src.names()), run.progress)
        header["quant"] = _quant_header(policy, run.keep_source)
        header["source"] = {
            **(header.get("source") or {}),
            "path": str(path.resolve()),
            "format": "cmf",
            "from": header.get("source"),
        }
        header["converter"] = {"name": "cortiq", "version": CONVERTER_VERSION}
        w = CmfWriter(out, header, force=run.force)
        try:
            with WriteBehind() as behind:
                for name in src.names():
                    info = src.info(name)
                    if not get_dtype(info.dtype).matrix:  # embedded files: bytes as they are
                        parts = [src.tensor_parts(name)["data"]]
                        behind.add(w, name, info.dtype, info.shape, parts, lambda new: None)
                        continue
                    kept = tally.keep_used(policy, name, info.shape)
                    if run.keep_source and kept is None:
                        dtype, fell = info.dtype, False
                    else:
                        dtype, fell = policy.choose(name, info.shape)
                    if fell:
                        tally.fallbacks.append(name)
                    err = [0.0, 0.0]
                    if dtype == info.dtype:
                        copy = src.tensor_parts(name)
                        if not run.allow_nonfinite:
                            check_finite_parts(name, copy)
                        parts = [copy[sp.name] for sp in get_dtype(dtype).parts(info.shape)]
                    else:
                        job = SliceJob(
                            name,
                            name,
                            get_dtype(dtype),
                            policy.importance(name, rows_cols(info.shape)[1]),
                            True,
                            run.allow_nonfinite,
                        )
                        parts = _reencode(src, info, job, err, encoder)

                    def written(new: TensorInfo, name=name, info=info, dtype=dtype, err=err) -> None:
                        if dtype == info.dtype:
                            tally.copied.append(name)
                        tally.advance(name, info.nbytes)
                        tally.record(dtype, name, info.shape, new.nbytes, err[0], err[1], "main")

                    behind.add(w, name, dtype, info.shape, parts, written)
                behind.sync()
            w.seal()
            w.publish()
        except BaseException:
            w.abort()
            raise
    finally:
        src.close()
    return tally.report(out, None, arch, time.perf_counter() - t0, 0, str(path.resolve()), policy)


def mixed_for(policy: QuantPolicy, arch: ArchConfig) -> QuantPolicy:
    """``policy`` with what the mixed presets read of the model: its layer count and how
    many query heads share a KV head."""
    return replace(policy, layers=arch.num_layers, gqa=arch.num_heads // max(arch.num_kv_heads, 1))


def _quant_header(policy: QuantPolicy, keep_source: bool) -> dict[str, Any]:
    return {"default": KEEP if keep_source else policy.quant, "keep": [f"{p}={d}" for p, d in policy.keep]}


def _reencode(src: CmfFile, info, job: "SliceJob", err: list[float], encoder: "SliceEncoder") -> list[np.ndarray]:
    """Decode ``info``'s tensor to f32 in row slices and encode it as ``job.dt``: its parts;
    ``err`` gets (sum of squared errors, sum of squared values) against the decoded source."""
    sdt = get_dtype(info.dtype)
    rows, cols = rows_cols(info.shape)
    parts = {k: v.reshape(rows, -1) for k, v in src.tensor_parts(info.name).items()}

    def decoded(max_elems: int) -> Iterator[np.ndarray]:
        step = max(1, max_elems // max(cols, 1))
        for r0 in range(0, rows, step):
            yield sdt.decode({k: v[r0 : r0 + step] for k, v in parts.items()}, (min(rows, r0 + step) - r0, cols))

    out = [np.empty(sp.shape, sp.dtype) for sp in job.dt.parts(info.shape)]
    for sl in encoder.encoded(job, decoded, SLICE_ELEMS, out):
        err[0] += sl.err_sq
        err[1] += sl.ref_sq
    return out


def _trim_heap() -> None:
    """Hand the heap that parsing the tokenizer freed back to the OS. glibc keeps freed
    heap memory for reuse, and the tensor phase (large arrays, mapped separately) never
    reuses it: a 262k-token vocabulary left ~340 MB resident for the whole run."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _source_identity(ck, plan: list[PlannedTensor], fp: str, source_format: str) -> dict[str, Any]:
    dtypes: dict[str, int] = {}
    for p in plan:
        dt = ck.source_dtype(p.source)
        dtypes[dt] = dtypes.get(dt, 0) + 1
    origin = ck.origin or str(ck.root)
    ident = {
        # A local path is recorded absolute; a hub repo id as given.
        "path": str(Path(origin).resolve()) if Path(origin).exists() else origin,
        "format": source_format,
        "model_type": ck.config.get("_wrapper_model_type") or ck.config.get("model_type"),
        "name_or_path": ck.config.get("_name_or_path"),
        "fingerprint": fp,
        "dtypes": dtypes,
        "parameters": int(sum(int(np.prod(p.shape)) for p in plan)),
    }
    if ck.root.parent.name == "snapshots":  # a hub cache folder is named for its commit
        ident["revision"] = ck.root.name
    return ident


@dataclass
class _Tally:
    """What a conversion reports, tensor by tensor, and its progress."""

    total: int  # source bytes
    progress: ProgressFn | None
    done: int = 0
    stats: dict[str, DtypeStats] = field(default_factory=dict)
    tensors: list[TensorReport] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    used_keep: set[str] = field(default_factory=set)
    copied: list[str] = field(default_factory=list)  # tensors whose blocks were copied bit for bit

    def keep_used(self, policy: QuantPolicy, name: str, shape: tuple[int, ...]) -> tuple[str, str] | None:
        """The --keep rule matching ``name`` (None if none), noted as used when it applies."""
        kept = policy.matching_keep(name)
        if kept is not None and len(shape) >= 2:
            self.used_keep.add(kept[0])
        return kept

    def advance(self, name: str, nbytes: int) -> None:
        self.done += nbytes
        if self.progress:
            self.progress(name, self.done, self.total)

    def record(
        self, dtype: str, name: str, shape: tuple[int, ...], nbytes: int, err_sq: float, ref_sq: float, file: str
    ) -> None:
        rows, cols = rows_cols(shape)
        s = self.stats.setdefault(dtype, DtypeStats())
        s.tensors += 1
        s.params += rows * cols
        s.bytes += nbytes
        s.err_sq += err_sq
        s.ref_sq += ref_sq
        rel = float(np.sqrt(err_sq / ref_sq)) if ref_sq > 0 else 0.0
        self.tensors.append(TensorReport(name, dtype, tuple(shape), nbytes, rel, file))

    def report(
        self,
        out: Path,
        sidecar: Path | None,
        arch: ArchConfig,
        seconds: float,
        mtp_tensors: int,
        source: str,
        policy: QuantPolicy,
    ) -> ConvertReport:
        return ConvertReport(
            output=out,
            sidecar=sidecar,
            arch=arch,
            by_dtype=self.stats,
            source_bytes=self.done,
            output_bytes=out.stat().st_size + (sidecar.stat().st_size if sidecar else 0),
            seconds=seconds,
            mtp_tensors=mtp_tensors,
            fallbacks=self.fallbacks,
            source=source,
            tensors=self.tensors,
            unused_keep=[f"{p}={d}" for p, d in policy.keep if p not in self.used_keep],
            block_copied=self.copied,
        )


# ------------------------------------------------------------------ slices on all cores


def usable_cpus() -> int:
    """Cores this process may run on (taskset / cgroup cpusets narrow it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SliceJob:
    """How every row slice of one tensor is encoded."""

    source: str  # the source's name, for errors
    name: str  # the CMF name, for the --keep hint
    dt: DType
    importance: np.ndarray | None
    measure: bool  # sum the encoding's squared error (a lossless pair has none)
    allow_nonfinite: bool


@dataclass(frozen=True)
class EncodedSlice:
    r0: int
    rows: int
    size: int  # elements
    parts: list[np.ndarray] | None  # None once copied into the caller's whole parts
    err_sq: float
    ref_sq: float


def encode_slice(job: SliceJob, r0: int, x: np.ndarray, out: list[np.ndarray] | None = None) -> EncodedSlice:
    """Check, encode and measure the f32 rows ``x`` (rows ``r0``... of the tensor); with
    ``out`` (the tensor's whole parts) the encoded rows go straight into it."""
    rows = x.shape[0]
    # A dtype that measures as it encodes also finds a NaN or an infinity (its sum of
    # squared values is then not finite): ``x`` is read once, and checked only then.
    measured = job.measure and job.dt.measures_nonfinite
    if not job.allow_nonfinite and not measured:
        check_finite(job.source, x, r0)
    into = None if out is None else [buf.reshape(rows_cols(buf.shape)[0], -1)[r0 : r0 + rows] for buf in out]
    if job.measure:
        enc, e, ref = job.dt.encode_measured(x, job.importance, into)
        if not job.allow_nonfinite and not np.isfinite(ref):
            check_finite(job.source, x, r0)  # names the first NaN or infinity
    else:
        enc = job.dt.encode(x, job.importance)
        e, ref = 0.0, 0.0
        if into is not None:
            for buf, part in zip(into, enc):
                buf[...] = part.reshape(buf.shape)
    if job.allow_nonfinite and not np.isfinite(ref):
        e = ref = 0.0  # a kept NaN or infinity has no error to measure
    if not np.isfinite(e):
        raise CortiqError(
            f"tensor {job.source} does not fit {job.dt.name} (values up to {float(np.abs(x).max()):.4g}); "
            f"use --keep '{job.name}=bf16' or --quant bf16"
        )
    return EncodedSlice(r0, rows, x.size, None if out is not None else enc, e, ref)


class SliceEncoder:
    """Encodes a tensor's row slices on ``threads`` threads, handing them back in order.

    The compiled quantizers release the GIL, so each thread runs one slice's whole
    pipeline (finite check, encode, error, copy into the tensor's parts). The source
    is read in batches of two slices per thread, and the next batch is read only when
    every slice of this one is done: a reader hands a batch's mapped pages back to the
    OS when it moves on, and a slice read after that would fault them in again for the
    rest of the run. Slices are encoded independently, so the bytes are the same for
    any thread count.
    """

    def __init__(self, threads: int):
        if threads < 1:
            raise CortiqError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self.batch = 1 if threads == 1 else 2 * threads
        self._pool: ThreadPoolExecutor | None = None

    def _start(self) -> ThreadPoolExecutor | None:
        """The pool, started at the first tensor: numba's threading layer then loads
        after the tokenizer's and the planning's memory went back to the OS, not on top."""
        if self._pool is None and self.threads > 1:
            from numba import set_num_threads

            from formats.quant_kernels import parallel_calls_safe

            if not parallel_calls_safe():
                self.threads, self.batch = 1, 1
                return None
            # One numba thread per worker: the workers are the parallelism.
            self._pool = ThreadPoolExecutor(self.threads, "cortiq-encode", initializer=set_num_threads, initargs=(1,))
        return self._pool

    def __enter__(self) -> "SliceEncoder":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def encoded(
        self,
        job: SliceJob,
        read: Callable[[int], Iterable[np.ndarray]],
        slice_elems: int,
        out: list[np.ndarray] | None = None,
    ) -> Iterator[EncodedSlice]:
        """``encode_slice`` of every row slice of about ``slice_elems`` elements, in order;
        ``read(max_elems)`` iterates the tensor's f32 rows in blocks of at most that many."""
        pool = self._start()
        r0 = 0
        for block in read(slice_elems * self.batch):
            rows = block.shape[0]
            step = max(1, slice_elems // max(block[:1].size, 1))
            starts = range(0, rows, step)
            if pool is None:
                yield from (encode_slice(job, r0 + a, block[a : a + step], out) for a in starts)
            else:
                futures = [pool.submit(encode_slice, job, r0 + a, block[a : a + step], out) for a in starts]
                try:
                    done = [f.result() for f in futures]
                finally:
                    wait(futures)  # nothing reads the block or writes ``out`` once this returns
                yield from done
            r0 += rows


class WriteBehind:
    """Appends encoded tensors to their files on a thread of its own, so that tensor N is
    written (and its CRC summed) while the tensors after it are encoded.

    ``add`` lets a tensor wait behind the one being written only while the waiting ones
    come to ``GATHER_BYTES`` at most; else it first collects the oldest. Memory so holds
    the tensor being encoded and either one encoded tensor or a few small ones: a write
    slower than the next encoding (a large tensor after small ones) does not stop the
    encoders. The writes run one after another in the order given, so the bytes are
    those of writing in turn; each ``then`` runs on the caller's thread, in order, with
    the tensor's directory entry, and a failed write raises from a later ``add`` or
    ``sync``.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, "cortiq-write")
        self._pending: deque[tuple[Future, Callable[[TensorInfo], None], int]] = deque()

    def add(
        self,
        w: CmfWriter,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        parts: list[np.ndarray],
        then: Callable[[TensorInfo], None],
    ) -> None:
        nbytes = sum(int(p.nbytes) for p in parts)
        while self._pending and sum(p[2] for p in self._pending) + nbytes > GATHER_BYTES:
            self._collect()
        self._pending.append((self._pool.submit(w.add_encoded, name, dtype, shape, parts), then, nbytes))

    def _collect(self) -> None:
        fut, then, _ = self._pending.popleft()
        then(fut.result())

    def sync(self) -> None:
        """Wait for every tensor added; each file is then whole up to its last ``add``."""
        while self._pending:
            self._collect()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, *exc) -> None:
        # On an error too, the writes in flight end before anyone closes their files.
        wait([p[0] for p in self._pending])
        self._pending.clear()
        self._pool.shutdown(wait=True)


class _Streamer:
    """Encodes one planned tensor slice by slice into a writer, keeping the tally."""

    def __init__(
        self,
        ck,
        run: _Run,
        policy: QuantPolicy,
        tally: _Tally,
        encoder: SliceEncoder,
        behind: WriteBehind,
        blocks: dict[str, Any] | None = None,
    ):
        self.ck, self.run, self.policy, self.tally, self.encoder = ck, run, policy, tally, encoder
        self.behind = behind
        self.blocks = blocks or {}  # HF name -> formats.gguf_import.SourceBlocks

    def _source_type(self, p: PlannedTensor) -> str:
        b = self.blocks.get(p.source)
        return b.ggml_type if b is not None else self.ck.source_dtype(p.source)

    def choose(self, p: PlannedTensor) -> tuple[str, bool]:
        kept = self.tally.keep_used(self.policy, p.name, p.shape)
        if self.run.keep_source and kept is None and len(p.shape) >= 2:
            dtype = SOURCE_TO_CMF.get(self._source_type(p), KEEP_FALLBACK)
            if get_dtype(dtype).supports(p.shape):
                return dtype, False
        return self.policy.choose(p.name, p.shape)

    def write(self, w: CmfWriter, p: PlannedTensor, file: str) -> None:
        dtype, fell_back = self.choose(p)
        if fell_back:
            self.tally.fallbacks.append(p.name)
        dt = get_dtype(dtype)
        src_dtype = self.ck.source_dtype(p.source)
        itemsize = _ST_ITEMSIZE[src_dtype]
        b = self.blocks.get(p.source)
        if b is not None and BLOCK_COPY.get(b.ggml_type) == dtype and len(p.shape) == 2:
            parts = ggml_block_parts(b, p.shape)
            if not self.run.allow_nonfinite:
                check_finite_parts(p.source, {sp.name: a for sp, a in zip(dt.parts(p.shape), parts)})

            def copied(info: TensorInfo) -> None:
                self.ck.release_pages()  # the blocks read from the source's map
                self.tally.copied.append(p.name)
                self.tally.advance(p.name, int(np.prod(p.shape)) * itemsize)
                self.tally.record(dtype, p.name, p.shape, info.nbytes, 0.0, 0.0, file)

            self.behind.add(w, p.name, dtype, p.shape, parts, copied)
            return
        rows, cols = rows_cols(p.shape)
        job = SliceJob(
            p.source,
            p.name,
            dt,
            self.policy.importance(p.name, cols),
            (dtype, src_dtype) not in _LOSSLESS,
            self.run.allow_nonfinite,
        )
        err = [0.0, 0.0]

        def encoded(out: list[np.ndarray] | None) -> Iterator[EncodedSlice]:
            read = partial(self.ck.iter_f32_rows, p.source)
            for sl in self.encoder.encoded(job, read, SLICE_ELEMS, out):
                err[0] += sl.err_sq
                err[1] += sl.ref_sq
                yield sl
                self.tally.advance(p.name, sl.size * itemsize)

        def written(info: TensorInfo) -> None:
            if rows * cols == 0:
                self.tally.advance(p.name, 0)
            self.tally.record(dtype, p.name, p.shape, info.nbytes, err[0], err[1], file)

        layout = dt.parts(p.shape)
        if len(layout) == 1 and layout[0].nbytes > GATHER_BYTES:
            # One large part: the bytes stream straight to the file.
            self.behind.sync()
            written(w.add_encoded(p.name, dtype, p.shape, [(sl.parts[0] for sl in encoded(None))]))
        else:
            # Gather each part whole (planar parts: smaller than the source), written
            # while the next tensor is encoded.
            bufs = [np.empty(sp.shape, sp.dtype) for sp in layout]
            for _ in encoded(bufs):
                pass
            self.behind.add(w, p.name, dtype, p.shape, bufs, written)


def ggml_block_parts(b, shape: tuple[int, ...]) -> list[np.ndarray]:
    """A tensor's interleaved GGML blocks -> the planar parts of its CMF dtype, byte for
    byte (``DType.from_ggml``). Rows move whole (the q/k row order llama.cpp permuted)."""
    from formats.gguf_import import unpermute_rope_rows

    rows, cols = shape
    dt = get_dtype(BLOCK_COPY[b.ggml_type])
    blk = np.asarray(b.data, dtype=np.uint8).reshape(rows, cols // dt.block, dt.block_bytes)
    if b.unpermute_heads:
        blk = unpermute_rope_rows(blk, b.unpermute_heads)
    return dt.from_ggml(blk)


def _convert(
    ck,
    out: Path,
    families: Families,
    run: _Run,
    encoder: SliceEncoder,
    source_format: str,
    blocks: dict[str, Any] | None = None,
) -> ConvertReport:
    t0 = time.perf_counter()
    family, arch = arch_from_config(families, ck.config)
    policy = mixed_for(run.policy, arch)
    mtp_mode = run.mtp
    ck = sanitize_checkpoint(ck, family.rules_for(ck.config))  # the exporter's names -> the engine's
    plan = _plan(ck, arch, family, check_mtp=mtp_mode != "drop")
    mtp_plan = [p for p in plan if p.mtp]
    if mtp_plan:
        n_layers = len({p.name.split(".")[3] for p in mtp_plan}) or mtp_layer_count(ck.config)
        style = family.draft_style(p.source for p in mtp_plan)
        arch.mtp = MtpConfig(num_layers=n_layers, style=style)
    tok_header, tok_bytes = tokenizer_header(ck)
    fp = fingerprint(ck, plan)
    ck.release_pages()  # sampling faulted in pages all over the source
    _trim_heap()
    side = sidecar_path(out) if (mtp_plan and mtp_mode == "sidecar") else None
    if side is not None and side.exists() and not run.force:
        raise CortiqError(f"{side} exists (use --force to overwrite)")
    header: dict[str, Any] = {
        "format": "cmf",
        "format_version": f"{FORMAT_VERSION}.{FORMAT_MINOR}",
        "role": ROLE_MODEL,
        "arch": arch.to_json(),
        "tokenizer": tok_header,
        "generation_config": ck.read_json("generation_config.json") or {},
        "source": _source_identity(ck, plan, fp, source_format),
        "converter": {"name": "cortiq", "version": CONVERTER_VERSION},
        "quant": _quant_header(policy, run.keep_source),
        "calibration": {"temperature": None},
        "mtp": None,
    }
    if mtp_plan:
        header["mtp"] = {
            "num_layers": arch.mtp.num_layers,
            "style": arch.mtp.style,
            "location": mtp_mode,
            "sidecar": side.name if side else None,
        }
    main_plan = [p for p in plan if not p.mtp or mtp_mode == "inline"]
    side_plan = mtp_plan if side else []
    total = sum(int(np.prod(p.shape)) * _ST_ITEMSIZE[ck.source_dtype(p.source)] for p in main_plan + side_plan)
    tally = _Tally(total, run.progress)
    behind = WriteBehind()
    streamer = _Streamer(ck, run, policy, tally, encoder, behind, blocks)

    main_w = CmfWriter(out, header, force=run.force)
    side_w: CmfWriter | None = None
    side_published = False
    try:
        with behind:
            main_w.add_bytes(TOKENIZER_TENSOR, tok_bytes)
            for p in main_plan:
                streamer.write(main_w, p, "main")
            if side:
                side_header = {
                    "format": "cmf",
                    "format_version": header["format_version"],
                    "role": ROLE_SIDECAR,
                    "arch": header["arch"],
                    "mtp": header["mtp"],
                    "backbone": backbone_identity(header, out.name),
                    "source": header["source"],
                    "converter": header["converter"],
                    "quant": header["quant"],
                }
                side_w = CmfWriter(side, side_header, force=run.force)
                for p in side_plan:
                    streamer.write(side_w, p, "sidecar")
            behind.sync()
        # Both files complete on disk before either becomes visible.
        main_w.seal()
        if side_w:
            side_w.seal()
            side_w.publish()
            side_published = True
        main_w.publish()
    except BaseException:
        main_w.abort()
        if side_w:
            side_w.abort()
            if side_published:
                side.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    return tally.report(out, side, arch, seconds, len(mtp_plan), header["source"]["path"], policy)
