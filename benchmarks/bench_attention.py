"""Attention kernel timings: the LLVM IR loops (``kernels/attn_ir.py``) against numba's.

    python benchmarks/bench_attention.py [--heads 32 --kv-heads 4 --head-dim 64 --ctx 2048 --layers 22 --prefill 512]

For one decode row and a 4-row verify at ``--ctx`` keys: ``jit.attend`` with the IR
loops and with numba's loops, alternating, median of ``--reps`` calls; "hot" repeats
one layer's cache (it stays in L2/L3), "cold" cycles through ``--layers`` caches with
a pass over 60 MB between them, as a decode step's weights evict the caches. Then a
``--prefill`` token prompt (keys 0..prefill) three ways, alternating, on the current
thread count: the engine's kernel set (blocks of queries and keys, ``jit.attend_flash``),
the split-K loops of decode called directly (``jit.attend``, the prefill path before the
blocks) and the BLAS blocks (the path without the IR loops).
Prints one JSON line per figure; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: every usable core)")
    a = ap.parse_args()

    from cortiq_engine.threads import set_threads

    # as Engine.load does: numba's pool, and BLAS on one thread (its idle threads spin, and
    # took a core from the kernels measured after a BLAS call: 5.3 vs 3.0 ms a prefill)
    a.threads = set_threads(a.threads)

    from cortiq_engine.kernels import attn_ir, jit
    from cortiq_engine.kernels.fast import NumbaKernels

    rng = np.random.default_rng(0)
    cap = a.ctx + 64
    shape = (a.kv_heads, cap, a.head_dim)
    caches = [
        (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
        for _ in range(a.layers)
    ]
    evict = np.ones(60_000_000 // 4, np.float32)
    ir = attn_ir.AttentionLoops().addrs
    plain = np.zeros_like(ir)
    scale = np.float32(a.head_dim**-0.5)
    print(json.dumps({"loadavg": os.getloadavg(), "shape": vars(a), "ir_available": bool(ir.any())}))
    for n in (1, 4):
        q = rng.standard_normal((n, a.heads, a.head_dim)).astype(np.float32)
        out = np.empty_like(q)
        start = a.ctx - n
        for mode in ("hot", "cold"):
            times: dict[str, list[float]] = {"ir": [], "numba": []}
            reps = a.reps if mode == "hot" else max(3, a.reps // 40)
            for rep in range(reps + 1):
                for name, fns in (("ir", ir), ("numba", plain)):
                    if mode == "hot":
                        kc, vc = caches[0]
                        t = time.perf_counter()
                        jit.attend(q, kc, vc, start, 0, scale, None, out, fns)
                        dt = time.perf_counter() - t
                    else:
                        dt = 0.0
                        for layer, (kc, vc) in enumerate(caches):
                            if layer % 4 == 0:
                                evict[::16].sum()
                            t = time.perf_counter()
                            jit.attend(q, kc, vc, start, 0, scale, None, out, fns)
                            dt += time.perf_counter() - t
                        dt /= len(caches)
                    if rep:  # the first round compiles and warms
                        times[name].append(dt)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(
                json.dumps(
                    {
                        "rows": n,
                        "caches": mode,
                        "ir_ms": round(med["ir"], 4),
                        "numba_ms": round(med["numba"], 4),
                        "speedup": round(med["numba"] / med["ir"], 2),
                    }
                )
            )
    # a prefill: the kernel set (blocks), the split-K loops directly, the BLAS blocks
    n = a.prefill
    q = rng.standard_normal((n, a.heads, a.head_dim)).astype(np.float32)
    kc, vc = (rng.standard_normal((a.kv_heads, n, a.head_dim)).astype(np.float32) for _ in range(2))
    with_ir, without = NumbaKernels(), NumbaKernels(attn_loops=False)
    out = np.empty_like(q)
    ways = {
        "blocks": lambda: with_ir.attend(q, kc, vc, 0, 0, scale),
        "splitk": lambda: jit.attend(q, kc, vc, 0, 0, scale, None, out, ir),
        "blas": lambda: without.attend(q, kc, vc, 0, 0, scale),
    }
    times = {k: [] for k in ways}
    for rep in range(8):
        for name, run in ways.items():
            t = time.perf_counter()
            run()
            if rep:
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    macs = 2 * a.heads * a.head_dim * n * (n + 1) // 2
    print(
        json.dumps(
            {
                "prefill_rows": n,
                **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                "blocks_gmac_s": round(macs / med["blocks"] / 1e6, 1),
                "splitk_over_blocks": round(med["splitk"] / med["blocks"], 2),
                "blas_over_blocks": round(med["blas"] / med["blocks"], 2),
                "loadavg_end": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
