#!/usr/bin/env python3
"""Decode tok/s of cortiq types against llama.cpp types, side by side, in interleaved rounds.

Each pair is a cortiq CMF and a llama.cpp GGUF (e.g. the same weights at the same
bits/weight). For every round, cortiq decodes ``--tokens`` greedy tokens (the sweep's
``tg`` test: ``evals.speed.decode``, EOS ignored) and then llama.cpp evaluates the same
number of single-token steps from an empty cache (logits of the last token only; its
plain CPU kernels on the mapped file, or with ``--llama-repack`` the layouts it repacks
into RAM at load); the two alternate so a busy machine slows both alike. Reported: the
median tok/s of each, their ratio, and the load average before and after (the
machine is shared: quote medians and the load). Beside them, the weight bytes a decode
step reads (every matrix, the input embedding table left out unless it is also the
output matrix: a step reads one of its rows) and that figure times tok/s, which compares
types of different bits per weight: "per weight byte" is each pair's GB/s over the first
pair's.

    python benchmarks/decode_vs_llamacpp.py q8=smol-q8.cmf:smol-Q8_0.gguf q4_0=smol-q4_0.cmf:smol-Q4_0.gguf \
        [--tokens 64] [--rounds 5] [--threads 2] [--llama-repack] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


EMBED_NAMES = {"cmf": "model.embed_tokens.weight", "gguf": "token_embd.weight"}
OUTPUT_NAMES = {"cmf": "lm_head.weight", "gguf": "output.weight"}


def step_bytes(path: Path) -> int:
    """Weight bytes one decode step reads: every tensor's bytes, less an untied input embedding."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
        kind = "gguf"
    else:
        from formats.cmf import CmfFile
        from formats.quants import get_dtype

        with CmfFile(path) as f:
            sizes = {}
            for name in f.names():
                info = f.info(name)
                dt = get_dtype(info.dtype)
                if dt.matrix:
                    sizes[name] = sum(p.nbytes for p in dt.parts(tuple(info.shape)))
        kind = "cmf"
    total = sum(sizes.values())
    if OUTPUT_NAMES[kind] in sizes:
        total -= sizes.get(EMBED_NAMES[kind], 0)
    return total


def llama_decode(llm, ids: list[int]) -> float:
    """tok/s of single-token steps over ``ids`` from an empty cache."""
    llm.reset()
    llm.eval(ids[:1])
    t0 = time.perf_counter()
    for t in ids[1:]:
        llm.eval([t])
    return (len(ids) - 1) / (time.perf_counter() - t0)


def pair(name: str, cmf: Path, gguf: Path, tokens: int, rounds: int, threads: int, repack: bool = False) -> dict:
    import llama_cpp

    from cortiq_engine import Engine
    from evals.speed import decode, random_ids

    load0 = os.getloadavg()
    ours, theirs = [], []
    with Engine.load(cmf, threads=threads, ctx=tokens + 8) as eng:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=tokens + 8,
            n_threads=threads,
            n_threads_batch=threads,
            use_extra_bufts=repack,
            verbose=False,
        )
        ids = random_ids(eng.vocab_size, tokens + 1, seed=1)
        llama_decode(llm, ids[:5])  # warm-up (cortiq's decode warms itself up)
        for _ in range(rounds):
            ours.append(decode(eng, tokens, 1).tok_s[0])
            theirs.append(llama_decode(llm, ids))
        del llm
    a, b = statistics.median(ours), statistics.median(theirs)
    ours_bytes, theirs_bytes = step_bytes(cmf), step_bytes(gguf)
    return {
        "name": name,
        "cmf": str(cmf),
        "gguf": str(gguf),
        "tokens": tokens,
        "rounds": rounds,
        "threads": threads,
        "llama_repack": repack,
        "cortiq_tok_s": a,
        "llama_tok_s": b,
        "ratio": a / b,
        "cortiq_step_bytes": ours_bytes,
        "llama_step_bytes": theirs_bytes,
        "cortiq_gb_s": a * ours_bytes / 1e9,
        "llama_gb_s": b * theirs_bytes / 1e9,
        "cortiq_samples": ours,
        "llama_samples": theirs,
        "loadavg_before": load0[0],
        "loadavg_after": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="NAME=CMF:GGUF")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--llama-repack",
        action="store_true",
        help="let llama.cpp repack weights into its CPU layouts at load (its default in "
        "llama-cli; e.g. Q4_0 -> interleaved 8x8 blocks): the extra RAM copy cortiq's mmap avoids",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = []
    for spec in args.pairs:
        name, _, files = spec.partition("=")
        cmf, _, gguf = files.partition(":")
        r = pair(name, Path(cmf), Path(gguf), args.tokens, args.rounds, args.threads, args.llama_repack)
        out.append(r)
        r["cortiq_per_byte_vs_first"] = r["cortiq_gb_s"] / out[0]["cortiq_gb_s"]
        r["llama_per_byte_vs_first"] = r["llama_gb_s"] / out[0]["llama_gb_s"]
        if not args.json:
            print(
                f"{name:8s} cortiq {r['cortiq_tok_s']:7.1f} tok/s {r['cortiq_step_bytes'] / 2**20:7.1f} MiB/step "
                f"{r['cortiq_gb_s']:6.2f} GB/s ({r['cortiq_per_byte_vs_first']:.2f})  "
                f"llama.cpp {r['llama_tok_s']:7.1f} tok/s {r['llama_step_bytes'] / 2**20:7.1f} MiB/step "
                f"{r['llama_gb_s']:6.2f} GB/s ({r['llama_per_byte_vs_first']:.2f})  "
                f"ratio {r['ratio']:.2f}  (load {r['loadavg_before']:.1f} -> {r['loadavg_after']:.1f})",
                flush=True,
            )
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
