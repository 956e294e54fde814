#!/usr/bin/env python3
"""How exact is a compact saved reference? One pass over a text with a reference CMF and
one or more other CMFs: every model's KL statistics against the reference's full
distributions (what ``cortiq ppl REF A B`` reports) and against the compact form a
``.cref`` with ``--ref-top-k K`` would hold, for several K, plus each form's file size.

    python benchmarks/cref_error.py REF.cmf A.cmf [B.cmf ...] --ctx 512 --chunks 8 --forms 16,64,16+16,64+64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path, nargs="+", help="reference CMF first, then the models to compare")
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument(
        "--forms", default="16,64,256,16+16,32+32,64+64", help="K or K+M (top-K log-probabilities, M tail samples)"
    )
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    from cortiq_engine import Engine
    from evals.kl import compare_rows, ref_full, ref_topk
    from evals.scoring import iter_scored
    from evals.text_source import TextSpec, load_text
    from evals.tokens import chunk_bos, tokenize_for
    from evals.windows import chunk_windows
    from formats.cref import shapes

    ks = [tuple(int(x) for x in (f.split("+") + ["0"])[:2]) for f in args.forms.split(",")]
    engines = [Engine.load(p, threads=args.threads, ctx=args.ctx) for p in args.models]
    names = [p.name for p in args.models]
    text = load_text(TextSpec(path=str(args.text) if args.text else None)).text
    tokens = tokenize_for(engines, names, text)
    windows = chunk_windows(len(tokens), args.ctx, bos=chunk_bos(engines[0].tokenizer), max_chunks=args.chunks)
    V = int(engines[0].vocab_size)
    forms = ["full"] + [f"top-{k}+{m}" if m else f"top-{k}" for k, m in ks]
    acc: dict[str, dict[str, list[np.ndarray]]] = {n: {f: [] for f in forms} for n in names[1:]}
    same: dict[str, list[np.ndarray]] = {n: [] for n in names[1:]}
    for block in iter_scored(engines, tokens, windows, chunk=128):
        y = block.targets
        first = int(block.positions[0])
        refs = {"full": ref_full(block.logits[0], y)} | {
            (f"top-{k}+{m}" if m else f"top-{k}"): ref_topk(block.logits[0], y, k, m, first_row=first) for k, m in ks
        }
        for name, z in zip(names[1:], block.logits[1:]):
            for f, r in refs.items():
                st = compare_rows(r, z, y)
                acc[name][f].append(np.stack([st.kld, st.rkld]))
            same[name].append(st.same)
    rows = sum(w.n_scored for w in windows)

    def size(f: str) -> int:
        k, m = (0, 0) if f == "full" else tuple(int(x) for x in (f[4:].split("+") + ["0"])[:2])
        return 64 + sum(
            int(np.prod(s)) * (8 if n in ("nll", "windows") else 4)
            for n, s in shapes(rows, V, k, len(tokens), len(windows), m).items()
        )

    out = {
        "reference": names[0],
        "vocab": V,
        "tokens_scored": rows,
        "ctx": args.ctx,
        "chunks": len(windows),
        "bytes": {f: size(f) for f in forms},
        "models": {},
    }
    for name in names[1:]:
        res = {}
        full = np.concatenate(acc[name]["full"], axis=1)
        for f in forms:
            v = np.concatenate(acc[name][f], axis=1)
            res[f] = {
                "kl_mean": float(v[0].mean()),
                "kl_p99": float(np.quantile(v[0], 0.99)),
                "reverse_kl_mean": float(v[1].mean()),
                "kl_mean_rel_error": float(v[0].mean() / full[0].mean() - 1) if full[0].mean() > 0 else None,
                "reverse_kl_mean_rel_error": float(v[1].mean() / full[1].mean() - 1) if full[1].mean() > 0 else None,
                "kl_p99_rel_error": float(np.quantile(v[0], 0.99) / np.quantile(full[0], 0.99) - 1)
                if full[0].max() > 0
                else None,
                "kl_max_abs_error_per_token": float(np.abs(v[0] - full[0]).max()),
            }
        out["models"][name] = res
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
