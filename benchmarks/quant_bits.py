#!/usr/bin/env python3
"""Exact bits per weight of CMF and GGUF files, counted the same way for both.

For each file: parameters (elements of every numeric tensor: weights, norms,
embeddings; CMF's embedded tokenizer/u8 blobs are not parameters), tensor bytes
(each tensor's own bytes: for CMF the sum of its planar parts without the 64-byte
alignment padding between parts, for GGUF ``n_bytes``), the padded CMF blob bytes, and
the whole file. bits/weight = 8 x tensor bytes / parameters (llama.cpp's BPW);
``file`` = 8 x file bytes / parameters (metadata, vocabulary and padding included).
A per-dtype breakdown shows where the bits go.

    python benchmarks/quant_bits.py smollm2-q4_0.cmf smollm2-Q4_0.gguf ... [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def cmf_bits(path: Path) -> dict:
    from formats.cmf import CmfFile
    from formats.quants import get_dtype

    params = tensor = padded = 0
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    with CmfFile(path) as f:
        for name in f.names():
            info = f.info(name)
            dt = get_dtype(info.dtype)
            if not dt.matrix:  # u8 blobs: embedded files, not parameters
                continue
            n = 1
            for s in info.shape:
                n *= int(s)
            own = sum(p.nbytes for p in dt.parts(tuple(info.shape)))
            params += n
            tensor += own
            padded += info.nbytes
            b = by[info.dtype]
            b[0] += 1
            b[1] += n
            b[2] += own
    return _summary(path, params, tensor, padded, by)


def gguf_bits(path: Path) -> dict:
    from gguf import GGUFReader

    params = tensor = 0
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in GGUFReader(str(path)).tensors:
        n, nb = int(t.n_elements), int(t.n_bytes)
        params += n
        tensor += nb
        b = by[t.tensor_type.name]
        b[0] += 1
        b[1] += n
        b[2] += nb
    return _summary(path, params, tensor, tensor, by)


def _summary(path: Path, params: int, tensor: int, padded: int, by: dict) -> dict:
    size = path.stat().st_size
    return {
        "file": str(path),
        "params": params,
        "tensor_bytes": tensor,
        "padded_tensor_bytes": padded,
        "file_bytes": size,
        "bits_per_weight": 8.0 * tensor / params,
        "padded_bits_per_weight": 8.0 * padded / params,
        "file_bits_per_weight": 8.0 * size / params,
        "by_type": {
            k: {"tensors": v[0], "params": v[1], "bytes": v[2], "bits_per_weight": 8.0 * v[2] / v[1]}
            for k, v in sorted(by.items())
        },
    }


def bits(path: Path) -> dict:
    return gguf_bits(path) if path.suffix == ".gguf" else cmf_bits(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help=".cmf or .gguf files")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = [bits(p) for p in args.files]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for r in out:
        mix = ", ".join(f"{k} {v['params'] / r['params']:.1%}" for k, v in r["by_type"].items())
        print(
            f"{Path(r['file']).name:28s} {r['bits_per_weight']:8.4f} b/w (padded {r['padded_bits_per_weight']:.4f}, "
            f"file {r['file_bits_per_weight']:.4f})  {r['params']:,} params  {r['tensor_bytes']:,} B  [{mix}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
