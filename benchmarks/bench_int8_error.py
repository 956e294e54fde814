#!/usr/bin/env python3
"""The error integer activations add: decode-path logits of a quantized model, float vs integer kernels.

Decode and verify multiply q8/q4 weights by integer-quantized activations
(``cortiq_engine/kernels/qdot.py``; the default set uses int16 for q8 and int8 for
q4); prefill keeps float activations. This script runs a real text through the
decode path one token at a time (every matmul takes the small-batch kernels) with
``numba-float``, ``numba-i8`` and ``numba-i16``, and scores each against the f32
model's logits on the same tokens: mean KL(f32 || model), top-1 agreement, and the
ratio integer / float KL (the target: q8 within 1.2x).

    python benchmarks/bench_int8_error.py F32.cmf Q8.cmf [Q4.cmf ...] --tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cortiq_engine.engine import Engine  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "evals" / "data" / "alice.txt"


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def decode_logits(path: Path, kernels: str, ids: list[int]) -> np.ndarray:
    with Engine.load(path, kernels=kernels, threads=1) as eng:
        return np.concatenate([b for _, b in eng.iter_logits(ids, chunk=1, sub=1)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=Path, help="the f32 CMF")
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--offset", type=int, default=2000, help="character offset into alice.txt")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with Engine.load(a.reference, threads=1) as ref:
        ids = ref.tokenizer.encode(TEXT.read_text()[a.offset : a.offset + 8 * a.tokens])[: a.tokens]
        lp_ref = log_softmax(ref.logits(ids))
    p_ref = np.exp(lp_ref)
    rows = []
    for m in a.models:
        res = {"model": m.name}
        for ks in ("numba-float", "numba-i8", "numba-i16"):
            lp = log_softmax(decode_logits(m, ks, ids))
            kl = (p_ref * (lp_ref - lp)).sum(axis=1)
            res[ks] = {"mean_kl": float(kl.mean()), "top1": float((lp.argmax(1) == lp_ref.argmax(1)).mean())}
        for ks in ("numba-i8", "numba-i16"):
            res[ks]["kl_over_float"] = res[ks]["mean_kl"] / max(res["numba-float"]["mean_kl"], 1e-30)
        rows.append(res)
        if not a.json:
            f, i, w = res["numba-float"], res["numba-i8"], res["numba-i16"]
            print(
                f"{m.name:24s} float act: KL {f['mean_kl']:.6f} top1 {f['top1']:.3f} | "
                f"int8: KL {i['mean_kl']:.6f} top1 {i['top1']:.3f} ({i['kl_over_float']:.2f}x) | "
                f"int16: KL {w['mean_kl']:.6f} top1 {w['top1']:.3f} ({w['kl_over_float']:.2f}x)"
            )
    if a.json:
        print(json.dumps({"tokens": len(ids), "models": rows}, indent=2))


if __name__ == "__main__":
    main()
