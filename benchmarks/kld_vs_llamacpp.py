#!/usr/bin/env python3
"""llama.cpp's quantizations scored against a cortiq saved reference, on the same tokens.

A ``.cref`` saved by ``cortiq ppl f32.cmf --mode chunks --save-ref ref.cref`` holds the
token ids, the chunk windows (BOS written over each chunk's first token, as
llama-perplexity does) and cortiq f32's distributions. This script feeds exactly those
token ids to llama.cpp (llama-cpp-python, ``logits_all``) for each GGUF, one chunk at a
time from an empty cache, and computes the same statistics ``cortiq ppl --ref`` prints.
An F32 GGUF of the same weights shows the floor (two engines, same numbers). With
``--quantize SRC.gguf`` it first makes Q8_0/Q4_0/Q4_K_M/IQ4_XS/Q3_K_S/... with llama.cpp's
quantizer (SRC may itself be quantized: llama.cpp dequantizes it first, as
``llama-quantize --allow-requantize``). ``--cmf NAME=PATH`` scores cortiq's own files
against the same reference (``cortiq ppl PATH --ref REF``), so both engines' types share
one table.

With ``--llama-perplexity BIN --text FILE --base-gguf SRC.gguf`` each GGUF is also scored
by llama.cpp's own tool on its own tokens of the text: ``llama-perplexity
--kl-divergence-base`` saves SRC's distributions once, then ``--kl-divergence`` scores
each GGUF against them (llama.cpp's chunks of ``--ctx`` tokens, at most ``--chunks``).

With ``--imatrix FILE`` (a ``cortiq imatrix`` file) it also scores llama.cpp's own
importance-weighted quantization: llama-cpp-python's ``llama_model_quantize`` takes an
imatrix only as a C++ map (not reachable from Python), so each tensor of llama.cpp's
plain file is re-quantized from the F32 GGUF in the same GGML type by llama.cpp's
library (``ggml_quantize_chunk``, which is what ``llama-quantize --imatrix`` calls per
tensor) with the imatrix entry of its input columns, and written over the plain
file's bytes (same types, same sizes, same layout): ``NAME+imatrix`` rows.

    python benchmarks/kld_vs_llamacpp.py REF.cref --gguf f32=F32.gguf --gguf q8_0=Q8.gguf ... [--json]
    python benchmarks/kld_vs_llamacpp.py REF.cref --quantize F32.gguf --types q8_0,q4_0,q4_k_m --out-dir DIR \
        [--imatrix train.imatrix.safetensors]
    python benchmarks/kld_vs_llamacpp.py REF.cref --quantize SRC.gguf --types iq4_xs,q3_k_s --out-dir DIR \
        --cmf iq4_xs=M-iq4_xs.cmf --cmf q3k=M-q3k.cmf \
        --llama-perplexity build/bin/llama-perplexity --text held.txt --base-gguf SRC.gguf

Bits/weight are exact (``gguf_bits``): 8 x tensor bytes / parameters over every
tensor, as llama.cpp's BPW and cortiq's ``benchmarks/quant_bits.py``; the file's
metadata (vocabulary, settings) is counted only in ``file_bits_per_weight``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # quant_bits, a sibling script

# llama_ftype values from llama.h
FTYPES = {
    "f32": 0,
    "q4_0": 2,
    "q8_0": 7,
    "q3_k_s": 11,
    "q3_k_m": 12,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_m": 17,
    "q6_k": 18,
    "iq4_nl": 25,
    "iq4_xs": 30,
}


def quantize(src: Path, dst: Path, quant: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    params.allow_requantize = True  # a quantized source is dequantized first; an F32 one is unaffected
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({quant}) failed with code {rc}")
    tmp.replace(dst)


def gguf_bpw(path: Path) -> tuple[float, int]:
    """(8 x tensor bytes / parameters, parameters): cortiq quant-sweep's bits/weight."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    params = sum(int(t.n_elements) for t in r.tensors)
    nbytes = sum(int(t.n_bytes) for t in r.tensors)
    return 8.0 * nbytes / params, params


def _ggml_quantize_chunk():
    import ctypes
    import os

    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    return fn


def cmf_name(gguf_name: str) -> str | None:
    """The CMF (HF) name of a GGUF weight, for its imatrix entry."""
    from formats.gguf_import import _BLOCK_RE
    from formats.gguf_spec import BLOCK_NAMES, GLOBAL_NAMES

    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def requantize_with_imatrix(f32: Path, like: Path, dst: Path, imatrix_path: Path) -> dict:
    """``like`` (llama.cpp's quantization of ``f32``) with every quantized tensor re-made from
    ``f32`` in its own GGML type by llama.cpp's ``ggml_quantize_chunk`` with the imatrix."""
    import shutil

    from gguf import GGMLQuantizationType as GT
    from gguf import GGUFReader

    from formats.imatrix import read_imatrix

    im = read_imatrix(imatrix_path)
    fn = _ggml_quantize_chunk()
    src = {t.name: t for t in GGUFReader(str(f32)).tensors}
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(like, tmp)
    weighted = plain = 0
    with open(tmp, "r+b") as out:
        for t in GGUFReader(str(like)).tensors:
            if t.tensor_type in (GT.F32, GT.F16, GT.BF16):
                continue
            x = np.ascontiguousarray(np.asarray(src[t.name].data, np.float32)).reshape(-1, int(t.shape[0]))
            rows, cols = x.shape
            name = cmf_name(t.name)
            imp = im.for_tensor(name, cols) if name is not None else None
            buf = np.zeros(int(t.n_bytes), np.uint8)
            imp_c = None if imp is None else np.ascontiguousarray(imp, np.float32)
            n = fn(
                int(t.tensor_type),
                x.ctypes.data,
                buf.ctypes.data,
                0,
                rows,
                cols,
                None if imp_c is None else imp_c.ctypes.data,
            )
            if n != buf.nbytes:
                raise RuntimeError(f"{t.name}: ggml_quantize_chunk wrote {n} bytes, expected {buf.nbytes}")
            out.seek(int(t.data_offset))
            out.write(buf.tobytes())
            weighted += imp is not None
            plain += imp is None
    tmp.replace(dst)
    return {"weighted_tensors": weighted, "unweighted_tensors": plain}


def score(path: Path, ref_path: Path, threads: int, batch: int) -> dict:
    import llama_cpp

    from evals.perplexity import PerplexityAccumulator, build_reports
    from evals.reference import SavedReference
    from evals.scoring import ScoredBlock

    ref = SavedReference(ref_path)
    windows = ref.windows()
    ctx = max(w.end - w.begin for w in windows)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=ctx,
        n_batch=min(batch, ctx),
        n_ubatch=min(batch, ctx),
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,  # else every core: the chunks are batches
        verbose=False,
    )
    if llm.n_vocab() != ref.file.vocab_size:
        raise SystemExit(f"{path}: vocabulary {llm.n_vocab()} != reference {ref.file.vocab_size}")
    tokens = ref.file.tokens
    acc = PerplexityAccumulator(1, saved_ref=True)
    t0 = time.perf_counter()
    for wi, w in enumerate(windows):
        chunk = tokens[w.begin : w.end].tolist()
        if w.bos is not None:
            chunk[0] = w.bos
        llm.reset()
        llm.eval(chunk)
        z = np.array(llm.scores[w.row_from : w.row_to], dtype=np.float32)
        y = tokens[w.targets]
        acc.add(ScoredBlock(wi, np.arange(w.targets.start, w.targets.stop), y, [z]), ref.next_rows(len(y)))
    seconds = time.perf_counter() - t0
    _, (c,) = build_reports(acc, ["reference", path.name], 0, ref.form)
    bpw, params = gguf_bpw(path)
    size = path.stat().st_size
    return {
        "gguf": str(path),
        "bits_per_weight": bpw,
        "params": params,
        "file_bytes": size,
        "file_bits_per_weight": 8.0 * size / params,
        "seconds": seconds,
        "reference_form": ref.form,
        **c.to_json(),
    }


def score_cmf(path: Path, ref_path: Path, threads: int, text: Path | None) -> dict:
    """cortiq's own quantization against the same reference: ``cortiq ppl PATH --ref REF -f TEXT``."""
    from quant_bits import cmf_bits

    # Absolute paths: the command runs from the repository, for its package.
    cmd = [sys.executable, "-m", "cortiq_cli.main", "ppl", str(path.resolve()), "--ref", str(ref_path.resolve())]
    if text is not None:  # the text the reference was saved on (it checks the text's sha256)
        cmd += ["-f", str(text.resolve())]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "--threads", str(threads), "--json"], capture_output=True, text=True, cwd=REPO, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{path}: cortiq ppl failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    (c,) = json.loads(proc.stdout)["comparisons"]
    b = cmf_bits(path)
    return {
        "cmf": str(path),
        "bits_per_weight": b["bits_per_weight"],
        "params": b["params"],
        "file_bytes": b["file_bytes"],
        "file_bits_per_weight": b["file_bits_per_weight"],
        "types": {k: v["params"] for k, v in b["by_type"].items()},
        "seconds": time.perf_counter() - t0,
        **c,
    }


def gguf_types(path: Path) -> dict[str, int]:
    """Parameters per GGML type of a GGUF's tensors (where a type fell back on a shape)."""
    from quant_bits import gguf_bits

    return {k: v["params"] for k, v in gguf_bits(path)["by_type"].items()}


# llama-perplexity's KL-divergence report lines, by the key they go to.
_LP_LINES = {
    "ppl_ratio": r"Mean\s+PPL\(Q\)/PPL\(base\)\s*:\s*([-\d.]+)",
    "kl_mean": r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([-\d.]+)",
    "kl_p99": r"99\.0%\s+KLD:\s*([-\d.]+)",
    "delta_p_rms": r"RMS Δp\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)\s*%",
    "top1_agreement": r"Same top p:\s*([-\d.]+)\s*±\s*([-\d.]+)\s*%",
}


def parse_llama_kld(text: str) -> dict:
    """The figures of a ``llama-perplexity --kl-divergence`` report (fractions, not percents)."""
    out: dict = {}
    for key, pat in _LP_LINES.items():
        m = re.search(pat, text)
        if m is None:
            continue
        v = float(m.group(1))
        if key == "kl_mean":
            out["kl_se"] = float(m.group(2))
        out[key] = v / 100 if key in ("delta_p_rms", "top1_agreement") else v
    m = re.search(r"calculating perplexity over (\d+) chunks", text)
    if m:
        out["chunks"] = int(m.group(1))
    return out


def llama_perplexity_base(binary: Path, base: Path, text: Path, out: Path, ctx: int, chunks: int, threads: int) -> None:
    """``llama-perplexity --kl-divergence-base``: the base model's distributions on the text, saved once."""
    if out.is_file():
        return
    tmp = out.with_name(out.name + ".tmp")
    cmd = [str(binary), "-m", str(base), "-f", str(text), "-c", str(ctx), "-t", str(threads)]
    cmd += ["--kl-divergence-base", str(tmp)] + (["--chunks", str(chunks)] if chunks else [])
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not tmp.is_file():
        raise SystemExit(f"llama-perplexity base failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    os.replace(tmp, out)


def llama_perplexity_kld(binary: Path, path: Path, base_kld: Path, chunks: int, threads: int) -> dict:
    """``llama-perplexity --kl-divergence`` of ``path`` against the saved base (its tokens and ctx)."""
    cmd = [str(binary), "-m", str(path), "--kl-divergence-base", str(base_kld), "--kl-divergence"]
    cmd += ["-t", str(threads)] + (["--chunks", str(chunks)] if chunks else [])
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity on {path}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    r = parse_llama_kld(proc.stdout + proc.stderr)
    if "kl_mean" not in r:
        raise SystemExit(f"llama-perplexity on {path}: no KL-divergence figures in its output")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", type=Path, help="a .cref saved by cortiq ppl --mode chunks --save-ref")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH (repeatable)")
    ap.add_argument("--quantize", type=Path, default=None, help="an F32 GGUF to quantize with llama.cpp first")
    ap.add_argument("--types", default="q8_0,q4_0,q4_k_m", help=f"with --quantize: of {', '.join(FTYPES)}")
    ap.add_argument(
        "--out-dir", type=Path, default=Path("."), help="with --quantize: where the GGUFs go (kept, reused)"
    )
    ap.add_argument(
        "--imatrix",
        type=Path,
        default=None,
        help="with --quantize: also each type re-quantized by llama.cpp with this cortiq imatrix",
    )
    ap.add_argument("--imatrix-only", action="store_true", help="with --imatrix: score only the imatrix files")
    ap.add_argument("--cmf", action="append", default=[], help="NAME=PATH: a cortiq file scored the same way")
    ap.add_argument("--llama-perplexity", type=Path, default=None, help="llama.cpp's llama-perplexity binary")
    ap.add_argument(
        "--text",
        type=Path,
        default=None,
        help="the reference's text file (for --cmf, and what llama-perplexity scores)",
    )
    ap.add_argument("--base-gguf", type=Path, default=None, help="with --llama-perplexity: the reference GGUF")
    ap.add_argument("--ctx", type=int, default=512, help="with --llama-perplexity: tokens per chunk")
    ap.add_argument("--chunks", type=int, default=0, help="with --llama-perplexity: at most this many (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.llama_perplexity is not None and (args.text is None or args.base_gguf is None):
        ap.error("--llama-perplexity needs --text and --base-gguf")

    todo: list[tuple[str, Path]] = []
    for spec in args.gguf:
        name, _, p = spec.partition("=")
        todo.append((name, Path(p)))
    if args.quantize is not None:
        for q in args.types.split(","):
            dst = args.out_dir / f"{args.quantize.stem}-{q}.gguf"
            if not dst.exists():
                print(f"llama.cpp quantize -> {dst}", file=sys.stderr)
                quantize(args.quantize, dst, q, args.threads)
            if not (args.imatrix is not None and args.imatrix_only):
                todo.append((q, dst))
            if args.imatrix is not None and q != "q8_0":  # ggml's Q8_0 ignores an imatrix
                wdst = args.out_dir / f"{args.quantize.stem}-{q}-imatrix.gguf"
                if not wdst.exists():
                    print(f"llama.cpp quantize with {args.imatrix} -> {wdst}", file=sys.stderr)
                    print(requantize_with_imatrix(args.quantize, dst, wdst, args.imatrix), file=sys.stderr)
                todo.append((f"{q}+imatrix", wdst))
    base_kld = None
    if args.llama_perplexity is not None:
        base_kld = args.out_dir / f"{args.base_gguf.stem}-{args.text.stem}-c{args.ctx}-n{args.chunks}.kld"
        llama_perplexity_base(
            args.llama_perplexity, args.base_gguf, args.text, base_kld, args.ctx, args.chunks, args.threads
        )
    out = {}
    rows = [(name, p, "llama.cpp") for name, p in todo]
    rows += [(name, Path(p), "cortiq") for name, _, p in (spec.partition("=") for spec in args.cmf)]
    for name, p, engine in rows:
        if engine == "cortiq":
            r = score_cmf(p, args.ref, args.threads, args.text)
        else:
            r = score(p, args.ref, args.threads, args.batch)
            r["types"] = gguf_types(p)
            if base_kld is not None:
                r["llama_perplexity"] = llama_perplexity_kld(
                    args.llama_perplexity, p, base_kld, args.chunks, args.threads
                )
        r["engine"] = engine
        out[name] = r
        if not args.json:
            lp = r.get("llama_perplexity")
            lp_text = (
                f"  | llama-perplexity: KLD {lp['kl_mean']:.6f} ± {lp['kl_se']:.6f}  p99 {lp.get('kl_p99', 0):.5f}  "
                f"same top {100 * lp.get('top1_agreement', 0):.2f}%"
                if lp
                else ""
            )
            print(
                f"{name:10s} {engine:9s} {r['bits_per_weight']:7.4f} bpw  ppl ratio {r['ppl_ratio']:.4f}  "
                f"mean KLD {r['kl_mean']:.6f} ± {r['kl_se']:.6f}  p99 {r['kl_quantiles']['p99']:.5f}  "
                f"same top-1 {100 * r['top1_agreement']:.2f}%  RMS Δp {100 * r['delta_p_rms']:.3f}%  "
                f"({r['seconds']:.0f} s){lp_text}",
                flush=True,
            )
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
